"""Reading ranges of flattened parameters from safetensors files, lazily and by byte range.

Both the sharded checkpoint (1D pieces per rank) and Hugging Face files (whole tensors in
`model*.safetensors`) are read through `safe_open(...).get_slice`, which maps the file and
copies only the rows asked for; a range of a flattened N-d tensor is read as the rows it spans.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .torch_bin import bin_weight_map


class FileCache:
    """Open safetensors handles, one per file, closed together."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._handles: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        handle = self._handles.get(name)
        if handle is None:
            path = self.directory / name
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError) as e:
                raise ValueError(f"Cannot read {path}: {e}. The file is damaged or not a safetensors file.") from e
            self._handles[name] = handle
        return handle

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> FileCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_flat_range(handle: Any, key: str, shape: list[int], start: int, end: int) -> torch.Tensor:
    """Elements `[start, end)` of the flattened tensor `key` (stored with `shape`), reading only the rows needed."""
    sl = handle.get_slice(key)
    if len(shape) <= 1:
        return sl[start:end].reshape(-1)
    row = math.prod(shape[1:])
    first, last = start // row, (end - 1) // row + 1
    rows = sl[first:last].reshape(-1)
    offset = start - first * row
    return rows[offset : offset + (end - start)]


def read_pieces(cache: FileCache, key: str, stored: list[list[Any]], start: int, end: int, out: torch.Tensor) -> None:
    """Fill `out` (1D, `end - start` elements) from the stored 1D pieces `[[file, s, e], ...]` of a parameter."""
    filled = 0
    for file, s, e in stored:
        lo, hi = max(s, start), min(e, end)
        if lo >= hi:
            continue
        piece = cache.get(file).get_slice(key)[lo - s : hi - s]
        out[lo - start : hi - start].copy_(piece.reshape(-1))
        filled += hi - lo
    if filled != end - start:
        raise ValueError(
            f"The checkpoint covers only {filled} of elements [{start}, {end}) of {key}; its files are incomplete."
        )


def hf_weight_map(directory: Path) -> dict[str, str]:
    """`{tensor name: file}` of a Hugging Face model directory (single file or sharded with an index), in the order
    transformers' `from_pretrained` looks for them: `model.safetensors`, then the index, then `pytorch_model*.bin`
    ([Note: .bin weights] in torch_bin.py). A directory saved sharded and then as one file keeps the stale index
    (transformers' `save_pretrained` does not remove it), so the single file must come first."""
    single = directory / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt", device="cpu") as f:
            return {k: "model.safetensors" for k in f.keys()}
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    from_bin = bin_weight_map(directory)
    if from_bin is not None:
        return from_bin
    raise FileNotFoundError(
        f"{directory} has no weights: neither model.safetensors, model.safetensors.index.json, pytorch_model.bin nor "
        "pytorch_model.bin.index.json. Point it at a directory written by save_pretrained."
    )
