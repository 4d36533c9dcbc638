"""`PretrainedSource`: fill each rank's shards straight from a Hugging Face model directory.

Each rank reads, from `model.safetensors` or the shards named by `model.safetensors.index.json`,
only the bytes that its own shard of each unit covers (a range of a flattened row-major tensor is one
range of the file), around the page cache into a reused host buffer in the file's dtype ([Note: one-pass
load] in sequential.py), then cast or copied into the shard on its device; nothing is mapped, and a node's
host memory peak is about one copy of the model in total (its ranks' shards), not one per rank. A directory
with `pytorch_model*.bin` files only is read through their mappings instead ([Note: .bin weights] in torch_bin.py).

[Note: read ahead]
A unit's shard is fresh memory, and writing it the first time (the cast of the file's bf16 into fp32 masters) costs
on the VMs measured about what reading its bytes does (0.4-0.9 s per GB of fp32). Read and cast one after the
other, unit by unit, the load took their sum; a unit is mostly one 64 MiB read, too small for the read pipeline
of `_read_direct` to overlap anything. Told every unit in advance (`prepare`, by the engine, in the order it
builds them), the source reads the next units' ranges on threads into host memory of the files' dtypes while the
caller casts the present one into its shard. Two units are read at once (`AHEAD`, each with its own `Staging`
buffer, a third holding the unit being cast): with one reader the disk idles between units (each unit's last
span copied out, the next unit's first read not yet issued; 0.84B on 2 ranks: 0.89 GB/s where plain reads of the
same bytes run at 1.02). A `fill` out of that order reads its unit itself and drops the plan.

[Note: names in the files]
The files name each weight as the model class that saved them does. As transformers' `from_pretrained`, a weight is
also found under the model's `base_model_prefix` added or taken away: a `LlamaModel`'s files load into a
`LlamaForCausalLM` and the other way round, a causal LM's into `AutoModelForSequenceClassification`; under a PEFT
wrapper (`base_model.model.` before the name, `.base_layer` inside a wrapped layer) as the wrapped model's. A
parameter the files lack is refused while it is on the meta device; one that holds values (a head outside the base
model or a LoRA adapter that `hf_zero.from_pretrained` initialized, or one the caller built) fills its shards from
them. With `ignore_mismatched_sizes=True`, as under transformers, a weight the files hold in another shape is
initialized anew instead and marked (`NOT_FROM_FILES`) so that it is not read. Where transformers stores a
model's weights under other names or in other shapes than its modules have (its checkpoint conversions), the names
are the files' keys as transformers renames them, and a weight it builds from several tensors is built by its rules
([Note: converted weights] in checkpoint/conversions.py).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
from torch import nn

from ..engine.layout import FlatLayout
from ..engine.wrap import UnitSpec
from .reader import FileCache, hf_weight_map
from .sequential import RangeReads, keep_one_bounce_pair, stored_tensors
from .torch_bin import BinWeights, is_bin

PEFT_ROOT = "base_model.model."  # where a PEFT model keeps the model it wraps ([Note: names in the files])
_MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.[^.]+\.")  # PEFT's trained copy of a module, per adapter: its
# weights are the original's (`.original_module.`), read from the files under the original's names
NOT_FROM_FILES = "_hf_zero_not_from_files"  # set on a parameter the files hold in another shape, initialized anew
_Unit = tuple[FlatLayout, tuple[nn.Parameter, ...], int]  # what `fill` is asked for: layout, params, shard rank


def trained_copy(name: str) -> bool:
    """Whether `name` is a weight of PEFT's trained copy of a module (`modules_to_save`, [Note: names in the files])."""
    return _MODULES_TO_SAVE.search(name) is not None


def files_dtype(directory: str | os.PathLike[str]) -> torch.dtype:
    """The dtype of the first floating-point tensor of a model directory's first file, as transformers'
    `from_pretrained(dtype="auto")` takes it where the config names none (else the first tensor's; float32 for
    none)."""
    weight_map = hf_weight_map(Path(directory))
    first = min(weight_map.values())
    if is_bin(first):
        dtypes = BinWeights(Path(directory)).dtypes(first)
    else:
        dtypes = [stored.dtype for _, stored in sorted(stored_tensors(Path(directory) / first).items())]  # keys() order
    floating = [d for d in dtypes if d.is_floating_point and "float8_" not in str(d)]
    return (floating or dtypes or [torch.float32])[0]


def saved_4bit_config(directory: Path) -> dict | None:
    """The `quantization_config` of a directory saved by transformers with bitsandbytes' 4-bit weights (QLoRA's base,
    its packed codes stored as they are used: [Note: quantized load] in integrations/quantized_load.py), or None."""
    try:
        quantization = json.loads((directory / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    four_bit = isinstance(quantization, dict) and quantization.get("quant_method") == "bitsandbytes"
    return quantization if four_bit and quantization.get("load_in_4bit") else None


def refuse_quantized(directory: Path, model: nn.Module | None = None) -> None:
    """`ValueError` for a directory whose weights are stored quantized (`quantization_config` in its config.json:
    FP8 checkpoints, GPTQ, AWQ, bitsandbytes...): its files hold fp8 or integer codes and their scales, which
    transformers' loader dequantizes or hands to a quantizer; read as they are they would be taken for the
    weights themselves. Bitsandbytes' 4-bit codes read into a model built with 4-bit layers (`hf_zero.from_pretrained`
    builds it so) are taken as they are ([Note: quantized load])."""
    has_4bit = model is not None and any(hasattr(p, "quant_state") for p in model.parameters())
    if has_4bit and saved_4bit_config(directory) is not None:
        return
    config_file = directory / "config.json"
    if not config_file.is_file():
        return
    try:
        quantization = json.loads(config_file.read_text()).get("quantization_config")
    except (ValueError, AttributeError):
        return  # not ours to judge: the config's own reader reports it
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise ValueError(
            f"{directory} holds quantized weights (quantization_config, quant_method {method!r} in its config.json): "
            "hf_zero reads the files' tensors as they are stored and would take the quantized codes for the "
            "weights. Load the model with transformers' from_pretrained (which dequantizes it or applies its "
            "quantizer) and pass it to hf_zero.initialize, or save a dequantized copy with save_pretrained and "
            "load that."
        )


class Built(Protocol):
    """A model weight built from several of the files' tensors ([Note: converted weights])."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def build(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The whole weight, from the files' tensors read by `read(file key)`."""
        ...


@dataclass(frozen=True)
class FileNames:
    """How the model names the files' tensors ([Note: names in the files]): `renamed` maps a name the model has to
    the file key holding it; `built` the names of weights built from several tensors to how."""

    renamed: dict[str, str]
    built: dict[str, Built]


# the file keys and a meta tensor of each (shape, dtype) -> the model's names for them
Conversions = Callable[[list[str], Callable[[str], torch.Tensor]], FileNames]


class _Staged(NamedTuple):
    """One piece of a unit read: elements `[start, end)` of the flat layout, in host memory of the file's dtype."""

    start: int
    end: int
    values: torch.Tensor


def _pieces(layout: FlatLayout, shard_rank: int) -> list[tuple[int, int, int]]:
    """`(slot index, start, end)` of what lies in this shard, in the layout's order."""
    return sorted(layout.local_pieces(shard_rank), key=lambda piece: piece[1])


class Staging:
    """Host memory reused unit after unit for the bytes read before their cast into a shard: memory touched once,
    where a fresh buffer per unit costs its first touch again each time (about what its read costs, on the VMs
    measured).

    Example:

    ```python
    >>> staging = Staging()
    >>> into = staging.take(4096, torch.bfloat16)   # read into, then cast from; then, for the next unit:
    >>> staging.reset()
    ```
    """

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._used = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """`numel` elements of `dtype`, valid until `reset` (a larger buffer replaces one too small)."""
        start = -(-self._used // 64) * 64  # aligned for any dtype
        nbytes = numel * dtype.itemsize
        if start + nbytes > self._buffer.numel():
            self._buffer = torch.empty(max(nbytes, 2 * self._buffer.numel()), dtype=torch.uint8)
            start = 0  # views taken earlier keep the old buffer alive
        self._used = start + nbytes
        return self._buffer[start : start + nbytes].view(dtype)

    def reset(self) -> None:
        """Every tensor taken so far is done with: the memory is taken again from its start."""
        self._used = 0


_SAMPLE = 1 << 16  # bytes of each weight file's start and end that `PretrainedSource.fingerprint` reads
AHEAD = 2  # [Note: read ahead] units read at once while the caller casts another


class PretrainedSource:
    """A `ShardSource` reading a `save_pretrained` directory by byte range."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        model: nn.Module,
        conversions: Conversions | None = None,
        *,
        names_only: bool = False,
    ) -> None:
        """`names_only`: asked only which weights the files hold and their shapes (building the model), never to
        fill a shard: a directory of 4-bit codes is then not refused ([Note: quantized load])."""
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"No model directory at {self.directory}.")
        if not names_only:
            refuse_quantized(self.directory, model)
        self.weight_map = hf_weight_map(self.directory)
        self._bins = BinWeights(self.directory)  # [Note: .bin weights], where the directory has those
        names = conversions(list(self.weight_map), self._meta) if conversions is not None else None
        self._renamed = names.renamed if names is not None else {key: key for key in self.weight_map}
        self._built = names.built if names is not None else {}  # [Note: converted weights]
        self._staging = tuple(Staging() for _ in range(AHEAD + 1))  # the files' bytes before their cast, in turn
        self._plan: list[_Unit] = []  # [Note: read ahead] the units still to fill, in order
        self._filled = 0  # how many of the planned units were filled
        self._ahead: dict[int, Future[list[_Staged]]] = {}  # the reads under way, by planned unit
        self._reader: ThreadPoolExecutor | None = None
        self._names: dict[int, list[str]] = {}  # id(param) -> every name it has (tied aliases)
        self._params: dict[str, nn.Parameter] = {}  # name -> param
        for name, p in model.named_parameters(remove_duplicate=False):
            self._names.setdefault(id(p), []).append(name)
            self._params[name] = p
        self._prefix = f"{getattr(model, 'base_model_prefix', '') or ''}."  # [Note: names in the files]
        self.error: Exception | None = None  # [Note: read errors] the first read that failed
        self.bytes_read = 0  # the bytes of this rank's shards filled so far (in the files' dtypes)

    def fingerprint(self) -> int:
        """[Note: the same model on every rank] A digest of the weight files' sizes and of their first and last
        `_SAMPLE` bytes (the header and the first tensor's values, the last tensor's values), in name order: equal
        for byte-identical copies on different nodes, different for another checkpoint of the same architecture
        (its values differ), without reading the weights."""
        digest = hashlib.blake2b(digest_size=7)
        for name in sorted(set(self.weight_map.values())):
            path = self.directory / name
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                digest.update(f"{name}:{size};".encode())
                digest.update(f.read(_SAMPLE))
                f.seek(max(0, size - _SAMPLE))
                digest.update(f.read(_SAMPLE))
        return int.from_bytes(digest.digest(), "little")

    def _key(self, param: nn.Parameter, name: str) -> str | None:
        """The name the files hold `param` under, as the model names it (any of its tied names, with or without the
        base model's prefix): a key of `_renamed` or `_built`; None for one initialized anew (`NOT_FROM_FILES`)."""
        if getattr(param, NOT_FROM_FILES, False):
            return None
        for candidate in self._names.get(id(param), [name]):
            original = _MODULES_TO_SAVE.sub(".original_module.", candidate)  # PEFT's trained copy of a module: the
            if original != candidate and original in self._params:  # original's weight, by any of its names (tied)
                return self._key(self._params[original], original)
            for key in self._spellings(candidate):
                if key in self._renamed or key in self._built:
                    return key
        return None

    def _spellings(self, name: str) -> tuple[str, ...]:
        """`name` as the files may spell it: as is (and as the model under a PEFT wrapper names it), then with the
        base model's prefix taken away or added."""
        names = [name]
        if name.startswith(PEFT_ROOT):  # a PEFT model's name for a weight of the model it wraps (in a wrapped layer,
            # or the frozen original of a module it trains a copy of, `modules_to_save`)
            names.append(name[len(PEFT_ROOT) :].replace(".base_layer.", ".").replace(".original_module.", "."))
        spellings = []
        for n in names:
            spellings.append(n)
            if self._prefix != ".":  # the model names a base model
                spellings.append(n[len(self._prefix) :] if n.startswith(self._prefix) else self._prefix + n)
        return tuple(dict.fromkeys(spellings))

    def differ(self, first: str, second: str) -> bool:
        """Whether the files hold weights under both of the model's names `first` and `second`, with different values
        (a tied pair the files keep apart, [Note: names in the files]); compared piece by piece."""
        a = next((k for k in self._spellings(first) if k in self._renamed or k in self._built), None)
        b = next((k for k in self._spellings(second) if k in self._renamed or k in self._built), None)
        if a is None or b is None or self._renamed.get(a, a) == self._renamed.get(b, b):
            return False
        pieces_a, pieces_b = self._pieces_of(a), self._pieces_of(b)
        return any(
            x is None or y is None or x.dtype != y.dtype or not torch.equal(x, y)
            for x, y in itertools.zip_longest(pieces_a, pieces_b)
        )

    def _pieces_of(self, name: str, numel: int = 1 << 24) -> Iterator[torch.Tensor]:
        """The weight the model calls `name`, flattened, in pieces of at most `numel` elements (whole rows)."""
        built = self._built.get(name)
        if built is not None:
            yield built.build(self._read_whole).reshape(-1)
            return
        key = self._renamed[name]
        file = self.weight_map[key]
        if is_bin(file):
            flat = self._bins.tensor(file, key).reshape(-1)
            yield from (flat[i : i + numel] for i in range(0, flat.numel(), numel))
            return
        with FileCache(self.directory) as cache:
            stored = cache.get(file).get_slice(key)
            shape = stored.get_shape()
            if len(shape) <= 1:
                yield stored[:].reshape(-1)
                return
            rows = max(1, numel // max(1, math.prod(shape[1:])))
            for i in range(0, shape[0], rows):
                yield stored[i : i + rows].reshape(-1)

    def missing(self, model: nn.Module) -> list[str]:
        """The names of the model's parameters the files hold no weight for (a tied one once)."""
        return [name for name, p in model.named_parameters() if self._key(p, name) is None]

    def mismatched(self, model: nn.Module) -> list[tuple[str, list[int], list[int]]]:
        """`(name, shape in the files, shape in the model)` of each parameter the files hold in another shape."""
        found = []
        with FileCache(self.directory) as cache:
            for name, p in model.named_parameters():
                key = self._key(p, name)
                if key is not None and self._shape(cache, key) != list(p.shape):
                    found.append((name, self._shape(cache, key), list(p.shape)))
        return found

    def check(self, specs: list[UnitSpec]) -> None:
        """Raise `ValueError` when a parameter is missing from the files or has another shape there."""
        missing, wrong = [], []
        with FileCache(self.directory) as cache:
            for spec in specs:
                for name, p in zip(spec.param_names, spec.params):
                    key = self._key(p, name)
                    if key is None:
                        if p.is_meta:  # a parameter holding values fills its shards from them
                            missing.append(name)
                        continue
                    shape = self._shape(cache, key)
                    if shape != list(p.shape):
                        wrong.append(f"{name}: file {shape} vs model {list(p.shape)}")
        if missing:
            raise ValueError(
                f"{self.directory} lacks {len(missing)} weight(s) of this model, e.g. {missing[:5]}: it holds another "
                "model, or was saved incompletely."
            )
        if wrong:
            raise ValueError(
                f"{self.directory} holds weights of other shapes than this model: {wrong[:5]}. To initialize those "
                "anew (a head of another number of labels), as transformers does, pass ignore_mismatched_sizes=True "
                "to hf_zero.from_pretrained."
            )

    def prepare(self, units: list[tuple[FlatLayout, tuple[nn.Parameter, ...], int]]) -> None:
        """The units `fill` will be asked for, in order, as `(layout, params, shard_rank)`: the first one's reads
        start now, each next one's while the one before is cast into its shard ([Note: read ahead])."""
        self._close()
        self._plan, self._filled = list(units), 0
        if self._plan:
            self._reader = ThreadPoolExecutor(max_workers=AHEAD, thread_name_prefix="hf_zero-pretrained")
            for k in range(min(AHEAD, len(self._plan))):
                self._read_ahead(self._reader, k)

    def _read_ahead(self, reader: ThreadPoolExecutor, k: int) -> None:
        """Start reading planned unit `k` into its staging buffer (the one unit `k - AHEAD - 1` was cast from)."""
        self._ahead[k] = reader.submit(self._read_unit, *self._plan[k], self._staging[k % (AHEAD + 1)])

    def fill(self, layout: FlatLayout, params: tuple[nn.Parameter, ...], shard_rank: int, out: torch.Tensor) -> None:
        """[Note: read errors] A read that fails (an I/O error on this node's copy) does not raise here, amid the
        engine's construction, where the other ranks would wait for this one in its next collective: it is kept in
        `error`, this and every later shard are zeroed, and `initialize` raises it on every rank once the engine is
        built."""
        if self.error is None:
            try:
                return self._fill(layout, params, shard_rank, out)
            except Exception as e:  # noqa: BLE001 - whatever the type, every rank raises it (after the engine)
                self.error = e
                self._close()
        out.zero_()

    def _fill(self, layout: FlatLayout, params: tuple[nn.Parameter, ...], shard_rank: int, out: torch.Tensor) -> None:
        lo, hi = layout.shard_range(shard_rank)
        covered = lo  # only the padding between and after the pieces is zeroed: the copies write the rest (a
        for _, start, end in _pieces(layout, shard_rank):  # fresh shard's first touch is its costliest write)
            out[covered - lo : max(covered, start) - lo].zero_()
            covered = max(covered, end)
        out[covered - lo : hi - lo].zero_()
        for start, end, staged in self._staged(layout, params, shard_rank):
            out[start - lo : end - lo].copy_(staged)  # the cast, beside the next unit's reads
            self.bytes_read += staged.nbytes

    def _staged(self, layout: FlatLayout, params: tuple[nn.Parameter, ...], shard_rank: int) -> list[_Staged]:
        """This unit's ranges read: by the thread when it is the planned next one (whose successor's reads start
        now), else here, the plan dropped."""
        k = self._filled
        planned = k < len(self._plan) and self._plan[k][0] is layout and self._plan[k][2] == shard_rank
        if not planned or k not in self._ahead or self._reader is None:
            self._close()
            return self._read_unit(layout, params, shard_rank, self._staging[0])
        try:
            staged = self._ahead.pop(k).result()
        except BaseException:
            self._close()
            raise
        self._filled = k + 1
        if k + AHEAD < len(self._plan):
            self._read_ahead(self._reader, k + AHEAD)
        elif k + 1 == len(self._plan):
            self._close()
        return staged

    def _read_unit(
        self, layout: FlatLayout, params: tuple[nn.Parameter, ...], shard_rank: int, staging: Staging
    ) -> list[_Staged]:
        """Read this rank's ranges of one unit into `staging`, in the files' dtypes, each with its place."""
        staging.reset()  # the unit read into it before was cast into its shard already
        reads = RangeReads(self.directory, direct=True)  # read once: around the page cache
        staged = []
        for index, start, end in _pieces(layout, shard_rank):
            slot = layout.slots[index]
            key = self._key(params[index], slot.name)
            if key is None:
                if params[index].is_meta:
                    raise ValueError(f"{self.directory} lacks the weight {slot.name}.")
                own = params[index].detach().reshape(-1)[start - slot.offset : end - slot.offset]
                into = staging.take(end - start, own.dtype)
                into.copy_(own)  # [Note: names in the files] a parameter that holds values
                staged.append(_Staged(start, end, into))
                continue
            built = self._built.get(key)
            if built is not None:  # [Note: converted weights] built whole, this rank's range copied out
                whole = built.build(self._read_whole).reshape(-1)[start - slot.offset : end - slot.offset]
                into = staging.take(end - start, whole.dtype)
                into.copy_(whole)
                staged.append(_Staged(start, end, into))
                continue
            key = self._renamed[key]
            file = self.weight_map[key]
            if is_bin(file):  # [Note: .bin weights] copied out of the file's mapping
                mapped = self._bins.flat_range(file, key, start - slot.offset, end - slot.offset)
                into = staging.take(end - start, mapped.dtype)
                into.copy_(mapped)
            else:
                into = staging.take(end - start, reads.stored(file, key).dtype)
                reads.add(key, [[file, 0, math.prod(slot.shape)]], start - slot.offset, end - slot.offset, into)
            staged.append(_Staged(start, end, into))
        for file in list(reads.wants):
            reads.read(file)
        return staged

    def _close(self) -> None:
        """Drop the plan; a read under way finishes first (its buffer may be reused next)."""
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
            self._bins.close()  # the planned reads are done or dropped: no mapping is kept past them
            keep_one_bounce_pair()  # [Note: bounce] in sequential.py: the second reader's buffers
        self._plan, self._ahead, self._reader = [], {}, None

    def load_buffers(self, model: nn.Module) -> None:
        """Copy the persistent buffers that the files hold (most causal LMs have none). A non-persistent one (RoPE's
        `inv_freq`) is the model's own, as under transformers' `from_pretrained`: a copy some tool left in the files
        (stale, or rounded to the files' dtype) is not read."""
        persistent = set(model.state_dict(keep_vars=True))
        with FileCache(self.directory) as cache, torch.no_grad():
            for name, buf in model.named_buffers():
                if name not in persistent:
                    continue
                found = next((k for k in self._spellings(name) if k in self._renamed), None)
                if found is not None:
                    key = self._renamed[found]
                    file = self.weight_map[key]
                    buf.copy_(self._bins.tensor(file, key) if is_bin(file) else cache.get(file).get_tensor(key))
        self._bins.close()

    def _shape(self, cache: FileCache, name: str) -> list[int]:
        """The shape of the weight the model calls `name`: from its file's header (safetensors), its mapping (`.bin`)
        or its converter's rules ([Note: converted weights])."""
        built = self._built.get(name)
        if built is not None:
            return list(built.shape)
        key = self._renamed[name]
        file = self.weight_map[key]
        if is_bin(file):
            return list(self._bins.tensor(file, key).shape)
        return list(cache.get(file).get_slice(key).get_shape())

    def _meta(self, key: str) -> torch.Tensor:
        """A meta tensor of the files' tensor `key`: its shape and dtype, nothing read but the header."""
        file = self.weight_map[key]
        if is_bin(file):
            return torch.empty_like(self._bins.tensor(file, key), device="meta")
        stored = RangeReads(self.directory).stored(file, key)
        return torch.empty(stored.shape, dtype=stored.dtype, device="meta")

    def _read_whole(self, key: str) -> torch.Tensor:
        """The files' tensor `key`, whole (through the page cache: every rank holding a piece of a weight built
        from it reads it, [Note: converted weights])."""
        file = self.weight_map[key]
        if is_bin(file):
            return self._bins.tensor(file, key)
        with FileCache(self.directory) as cache:
            return cache.get(file).get_tensor(key)
