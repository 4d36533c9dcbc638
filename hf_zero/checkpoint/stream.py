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
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .direct import DirectSink

PIECE_NUMEL = 1 << 22  # elements copied to the host at a time (16 MiB of fp32)

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


@dataclass(frozen=True)
class Entry:
    """One tensor of a streamed file: its name, dtype, shape, and the contiguous host tensors whose bytes,
    in order, are its bytes (`pieces()` is called once, while the file is written)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: Callable[[], Iterable[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


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
        header[e.name] = {
            "dtype": DTYPE_NAMES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
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
