"""`SafetensorsSource`: fill each rank's shards straight from a Hugging Face model directory.

Each rank reads, from `model.safetensors` or the shards named by `model.safetensors.index.json`,
only the bytes that its own shard of each unit covers (a range of a flattened row-major tensor is one
range of the file), with `pread` straight into the shard ([Note: one-pass load] in sequential.py;
through a host buffer where the file's dtype or the shard's device differs), so nothing is mapped and
a node's host memory peak is about one copy of the model in total (its ranks' shards), not one per rank.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn

from ..engine.layout import FlatLayout
from ..engine.wrap import UnitSpec
from .reader import FileCache, hf_weight_map
from .sequential import RangeReads, Staging


class SafetensorsSource:
    """A `ShardSource` reading a `save_pretrained` directory by byte range."""

    def __init__(self, directory: str | os.PathLike[str], model: nn.Module) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"No model directory at {self.directory}.")
        self.weight_map = hf_weight_map(self.directory)
        self._staging = Staging()  # a file's dtype read before the cast into the shard, one unit at a time
        self._names: dict[int, list[str]] = {}  # id(param) -> every name it has (tied aliases)
        for name, p in model.named_parameters(remove_duplicate=False):
            self._names.setdefault(id(p), []).append(name)

    def _key(self, param: nn.Parameter, name: str) -> str | None:
        for candidate in self._names.get(id(param), [name]):
            if candidate in self.weight_map:
                return candidate
        return None

    def check(self, specs: list[UnitSpec]) -> None:
        """Raise `ValueError` when a parameter is missing from the files or has another shape there."""
        missing, wrong = [], []
        with FileCache(self.directory) as cache:
            for spec in specs:
                for name, p in zip(spec.param_names, spec.params):
                    key = self._key(p, name)
                    if key is None:
                        missing.append(name)
                        continue
                    shape = list(cache.get(self.weight_map[key]).get_slice(key).get_shape())
                    if shape != list(p.shape):
                        wrong.append(f"{name}: file {shape} vs model {list(p.shape)}")
        if missing:
            raise ValueError(
                f"{self.directory} lacks {len(missing)} weight(s) of this model, e.g. {missing[:5]}: it holds another "
                "model, or was saved incompletely."
            )
        if wrong:
            raise ValueError(f"{self.directory} holds weights of other shapes than this model: {wrong[:5]}.")

    def fill(self, layout: FlatLayout, params: tuple[nn.Parameter, ...], shard_rank: int, out: torch.Tensor) -> None:
        lo, hi = layout.shard_range(shard_rank)
        pieces = sorted(layout.local_pieces(shard_rank), key=lambda piece: piece[1])
        covered = lo  # only the padding between and after the pieces is zeroed: the reads write the rest (a
        for _, start, end in pieces:  # fresh shard's first touch is its costliest write on the VMs measured)
            out[covered - lo : max(covered, start) - lo].zero_()
            covered = max(covered, end)
        out[covered - lo : hi - lo].zero_()
        self._staging.reset()  # the previous unit's reads are cast into its shard already
        reads = RangeReads(self.directory, direct=True, staging=self._staging)  # read once: around the page cache
        for index, start, end in pieces:
            slot = layout.slots[index]
            key = self._key(params[index], slot.name)
            if key is None:
                raise ValueError(f"{self.directory} lacks the weight {slot.name}.")
            numel = math.prod(slot.shape)
            reads.add(
                key,
                [[self.weight_map[key], 0, numel]],
                start - slot.offset,
                end - slot.offset,
                out[start - lo : end - lo],
            )
        for file in list(reads.wants):
            reads.read(file)

    def load_buffers(self, model: nn.Module) -> None:
        """Copy persistent buffers that the files hold (most causal LMs have none)."""
        with FileCache(self.directory) as cache, torch.no_grad():
            for name, buf in model.named_buffers():
                if name in self.weight_map:
                    buf.copy_(cache.get(self.weight_map[name]).get_tensor(name))
