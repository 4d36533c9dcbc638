"""Streaming writer of the Hugging Face `from_pretrained` weight layout.

Tensors are added one at a time; when the open shard would grow past `max_shard_size` it is
written and freed, so the writer's memory is bounded by about one shard. `close()` gives the
shards their final names (`model.safetensors`, or `model-0000k-of-0000N.safetensors` plus
`model.safetensors.index.json`, exactly as `save_pretrained` names them), removes weight files
of an earlier save that this one does not overwrite, and writes the index last.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from .format import fsync_file, write_bytes_atomically
from .stream import Entry, FileLayout, host_pieces, write_streamed

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
WEIGHT_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
INDEX_FILE = "model.safetensors.index.json"


def parse_size(size: int | str, name: str = "max_shard_size") -> int:
    """Bytes in `5GB`, `500MB`, `2GiB` or an int (HF's convention: GB = 10**9, GiB = 2**30).

    Example:

    ```python
    >>> parse_size("5GB"), parse_size("1MiB"), parse_size(1024)
    (5000000000, 1048576, 1024)
    ```
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
        if not match or match.group(2).upper() not in _UNITS:
            raise ValueError(f"{name} must look like '5GB', '500MB' or '2GiB'; got {size!r}.")
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value <= 0:
        raise ValueError(f"{name} must be positive; got {size!r}.")
    return value


def shard_groups(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """The indices of tensors of `sizes` bytes, in order, grouped into output files as `HFShardWriter.add` groups
    them: a file is closed when the next tensor would take it past `max_bytes` (a larger tensor gets one alone)."""
    groups: list[list[int]] = []
    open_bytes = 0
    for i, size in enumerate(sizes):
        if not groups or (groups[-1] and open_bytes + size > max_bytes):
            groups.append([])
            open_bytes = 0
        groups[-1].append(i)
        open_bytes += size
    return groups


def make_directory(directory: Path) -> None:
    """Create the output directory `directory` (and its parents); `ValueError` where a file is at that path."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} is a file; a from_pretrained directory is written there. Pass a directory path.")
    directory.mkdir(parents=True, exist_ok=True)


class HFShardWriter:
    """Writes tensors into `from_pretrained`-style safetensors shards, one shard in memory at a time."""

    def __init__(
        self,
        output_dir: Path,
        max_shard_size: int | str = "5GB",
        dtype: torch.dtype | None = None,
        layout: FileLayout | Callable[[], FileLayout] | None = None,
    ) -> None:
        self.output_dir = output_dir
        self.max_bytes = parse_size(max_shard_size)
        self.dtype = dtype
        self._layout = layout  # [Note: file layout] names stored otherwise than the model's; a callable is asked
        # at the first write (an offline consolidation learns it beside its reads: importing transformers costs s)
        make_directory(output_dir)
        self._open: dict[str, torch.Tensor] = {}
        self._open_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []  # temporary shard files and their tensor names
        self.total_bytes = 0
        self.total_parameters = 0

    @property
    def layout(self) -> FileLayout:
        """[Note: file layout] the names the files store tensors under where they differ from the model's."""
        if callable(self._layout):
            self._layout = self._layout()
        return self._layout or {}

    @property
    def open_bytes(self) -> int:
        return self._open_bytes

    def add(self, name: str, tensor: torch.Tensor, *, is_parameter: bool = True, keep: bool = False) -> bool:
        """Queue one tensor (cast to the output dtype when floating, unless `keep`: [Note: parameters kept in their
        own dtype] in engine/unit.py); True when a shard was flushed."""
        if self.dtype is not None and tensor.is_floating_point() and not keep:
            tensor = tensor.to(self.dtype)
        tensor = tensor.detach().to("cpu").contiguous()
        size = tensor.numel() * tensor.element_size()
        flushed = False
        if self._open and self._open_bytes + size > self.max_bytes:
            self.flush()
            flushed = True
        self._open[name] = tensor
        self._open_bytes += size
        self.total_bytes += size
        if is_parameter:
            self.total_parameters += tensor.numel()
        return flushed

    def flush(self) -> None:
        if not self._open:
            return
        entries = [Entry(name, t.dtype, tuple(t.shape), host_pieces(t)) for name, t in self._open.items()]
        self._open, self._open_bytes = {}, 0
        self._write(entries)

    def write_file(self, entries: list[Entry], parameters: int) -> None:
        """Write `entries` (in the output dtype already) as one shard of their own, their bytes streamed from their
        pieces ([Note: streamed consolidation] in streams.py); `parameters`: the elements of theirs that are
        parameters. The tensors queued by `add` are written first."""
        self.flush()
        self.total_bytes += sum(e.nbytes for e in entries)
        self.total_parameters += parameters
        self._write(entries)

    def _write(self, entries: list[Entry]) -> None:
        path = self.output_dir / f".hf_zero-shard-{len(self._written):05d}.partial"
        self._written.append((path, []))  # removed by `abort` from here on, written or not
        laid_out = [Entry(e.name, e.dtype, e.shape, e.pieces, e.parts or self.layout.get(e.name, ())) for e in entries]
        write_streamed(path, laid_out, {"format": "pt"})  # [Note: direct writes]
        fsync_file(path)
        self._written[-1] = (path, [stored for e in laid_out for stored, _ in e.stored])

    def close(self) -> list[str]:
        """Name the shards, drop stale weight files, write the index (if sharded); returns the file names."""
        self.flush()
        n = len(self._written)
        names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        for old in self.output_dir.iterdir():
            if (WEIGHT_FILE.match(old.name) and old.name not in names) or old.name == INDEX_FILE:
                old.unlink()
        weight_map: dict[str, str] = {}
        for (tmp, tensor_names), final in zip(self._written, names):
            os.replace(tmp, self.output_dir / final)
            weight_map.update({t: final for t in tensor_names})
        if n > 1:
            index = {
                "metadata": {"total_parameters": self.total_parameters, "total_size": self.total_bytes},
                "weight_map": dict(sorted(weight_map.items())),
            }
            write_bytes_atomically(
                self.output_dir / INDEX_FILE, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
            )
        return names

    def abort(self) -> None:
        """Remove the temporary shard files of a failed write."""
        for tmp, _ in self._written:
            tmp.unlink(missing_ok=True)
        self._written.clear()
        self._open.clear()
