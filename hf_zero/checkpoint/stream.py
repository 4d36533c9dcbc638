"""Safetensors files written from the tensors where they live, in bounded pieces.

[Note: streamed save]
A save writes no copy of the state. The header is computed from the shapes alone, then each
tensor's bytes are written in order from where they are: a host tensor's own memory (no copy), a
device tensor copied to the host `PIECE_NUMEL` elements at a time, offloaded state read from its
file into one reused buffer; they pass through the file's aligned write buffer to the disk
([Note: direct writes] in direct.py). The checksum the manifest records is computed on the way. Memory
during a save is the training memory plus one piece and the write buffer (`safetensors.torch.save_file`
would build every tensor's bytes in memory first). The files are ordinary safetensors files (any reader
loads them).

[Note: file layout]
A `from_pretrained` directory names some tensors otherwise than the model does: transformers 5 writes the layout
the model's checkpoints have always had and converts it on load (GPT-NeoX's head is `embed_out` in its files;
Mixtral's fused experts `mlp.experts.gate_up_proj`, of shape `(experts, 2 * inner, hidden)`, are stored as one
`block_sparse_moe.experts.{e}.w1.weight` and `.w3.weight` per expert). Where the model's tensor is such a run of
stored tensors lying one after the other in its row-major bytes (expert 0's w1 then w3, expert 1's, ...), its
entry keeps its bytes and pieces as they are and lists those names and shapes as its `parts`: the header
describes consecutive ranges of the same bytes, so writing the transformers layout costs no copy and streams as
any tensor. The layout comes from transformers' own rules ([Note: converted weights] in
checkpoint/conversions.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..dtypes import AT_ONCE_NUMEL
from ..dtypes import SAFETENSORS_NAMES as DTYPE_NAMES
from .direct import DirectSink

PIECE_NUMEL = AT_ONCE_NUMEL  # elements copied to the host at a time (16 MiB of fp32)


Parts = tuple[tuple[str, tuple[int, ...]], ...]  # the names and shapes a tensor's bytes are stored under, in order
FileLayout = Mapping[
    str, Parts
]  # a tensor's name -> its parts, where the files name it otherwise ([Note: file layout])


@dataclass(frozen=True)
class Entry:
    """One tensor of a streamed file: its name, dtype, shape, and the contiguous host tensors whose bytes,
    in order, are its bytes (`pieces()` is called once, while the file is written). `parts`: the names and shapes
    its bytes are stored under instead, one after the other ([Note: file layout]); by default its own."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: Callable[[], Iterable[torch.Tensor]]
    parts: Parts = ()

    @property
    def stored(self) -> Parts:
        """The names and shapes the file holds this tensor's bytes under, in order."""
        return self.parts or ((self.name, self.shape),)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def layout_to_json(layout: FileLayout) -> dict[str, list[list[Any]]]:
    """A layout as the manifest records it ([Note: checkpoint layout] in format.py)."""
    return {name: [[stored, list(shape)] for stored, shape in parts] for name, parts in layout.items()}


def layout_from_json(raw: Mapping[str, list[list[Any]]]) -> FileLayout:
    """The layout a manifest records."""
    return {
        name: tuple((str(stored), tuple(int(n) for n in shape)) for stored, shape in parts)
        for name, parts in raw.items()
    }


def host_pieces(*tensors: torch.Tensor) -> Callable[[], Iterator[torch.Tensor]]:
    """The pieces of `tensors` joined end to end: host tensors as they are (no copy), others copied to
    the host `PIECE_NUMEL` elements at a time.

    Example:

    ```python
    >>> entry = Entry("w", torch.float32, (8,), host_pieces(torch.ones(3), torch.zeros(5)))
    ```
    """

    def pieces() -> Iterator[torch.Tensor]:
        for t in tensors:
            flat = t.detach().reshape(-1)
            if flat.device.type == "cpu" and flat.is_contiguous():
                yield flat
                continue
            for a in range(0, flat.numel(), PIECE_NUMEL):
                yield flat[a : a + PIECE_NUMEL].to("cpu")

    return pieces


def write_streamed(path: Path, entries: list[Entry], metadata: dict[str, str] | None = None) -> str:
    """Write a safetensors file of `entries` at `path` in bounded pieces; returns its checksum (`"xxh3_128:hex"`).

    Example:

    ```python
    >>> digest = write_streamed(Path("w.safetensors"), [Entry("w", torch.float32, (4,), host_pieces(torch.ones(4)))])
    ```
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for e in entries:
        if e.dtype not in DTYPE_NAMES:
            raise TypeError(f"hf_zero cannot store {e.name} of dtype {e.dtype} in a safetensors file.")
        if sum(math.prod(shape) for _, shape in e.stored) * e.dtype.itemsize != e.nbytes:
            raise RuntimeError(f"hf_zero: the parts {e.stored} of {e.name} do not tile its shape {e.shape}")
        for name, shape in e.stored:  # [Note: file layout] consecutive ranges of the same bytes
            nbytes = math.prod(shape) * e.dtype.itemsize
            header[name] = {
                "dtype": DTYPE_NAMES[e.dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes

    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with DirectSink(path) as sink:  # [Note: direct writes]
        sink.write_bytes(len(raw).to_bytes(8, "little") + raw)
        for e in entries:
            written = 0
            for piece in e.pieces():
                sink.write_tensor(piece)
                written += piece.numel() * piece.element_size()
            if written != e.nbytes:
                raise RuntimeError(f"hf_zero: {e.name} gave {written} bytes for a tensor of {e.nbytes}")
    return sink.checksum()
