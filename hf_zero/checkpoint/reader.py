"""Reading ranges of flattened parameters from safetensors files, lazily and by byte range.

[Note: range reads]
Both the sharded checkpoint (1D pieces per rank) and Hugging Face files (whole tensors in
`model*.safetensors`) are read by byte range: a safetensors file stores each tensor row-major and whole, so
elements `[start, end)` of a flattened tensor are one contiguous run of bytes, read with `os.preadv` straight
into the destination's memory (or into one staging tensor when the destination is on an accelerator or of
another dtype). Through `safe_open(...).get_slice` the same bytes were mapped page by page and copied twice:
0.93 GB/s from a cold 0.48B checkpoint on a disk that reads at 1.1-2.4 GB/s. Each file's header is parsed
once per `FileCache` and every range is checked against it and the file's size, so a damaged file is a clear
`ValueError`, never a short read.

[Note: verified as read]
A checkpoint's files are hashed from the bytes the load reads, not in a pass of their own: at 0.84B the
checkpoint (10 GB) does not stay in the page cache beside the model, so a verification pass before the load
made every byte come from the disk twice. A tracked file (`FileCache(track=...)`) feeds each range read, in
file order, to a SHA-256 on a thread of its own (the bytes stay referenced until hashed); bytes the load skips
are read for the hash as it passes them, and the tail at the end. A file read out of order (a checkpoint
loaded on another world size) is hashed whole at the end instead. `load_checkpoint` compares the digests
after reading, before returning, and raises on every rank on a mismatch.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .format import sha256_of

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class _FileDigest:
    """The SHA-256 of one file, computed from the ranges read of it ([Note: verified as read])."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd, self._size = fd, size
        self._sha = hashlib.sha256()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zero-verify")
        self._to = 0  # bytes [0, _to) are hashed or queued
        self.in_order = True

    def add(self, offset: int, data: memoryview) -> None:
        """Bytes at `offset` that a read just brought in."""
        if not self.in_order or offset < self._to:
            self.in_order = False
            return
        self._upto(offset)
        self._thread.submit(self._sha.update, data)
        self._to = offset + len(data)

    def _upto(self, offset: int, chunk: int = 16 << 20) -> None:
        """Hash what lies between the last read and `offset` (headers, entries the load does not read)."""
        while self._to < offset:
            n = min(chunk, offset - self._to)
            self._thread.submit(self._sha.update, os.pread(self._fd, n, self._to))
            self._to += n

    def stop(self) -> None:
        """Let the hashing thread finish what is queued (the file is being closed; no digest is asked for)."""
        self._thread.shutdown(wait=True)

    def hexdigest(self, path: Path) -> str:
        """The digest of the whole file (what was not read is read now)."""
        if self.in_order:
            self._upto(self._size)
        self._thread.shutdown(wait=True)
        return self._sha.hexdigest() if self.in_order else sha256_of(path)


class _RangeFile:
    """One open safetensors file read by byte range ([Note: range reads])."""

    def __init__(self, path: Path, track: bool = False) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(self.fd).st_size
            head = os.pread(self.fd, 8, 0)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or 8 + n > self.size:
                raise ValueError("its header length is out of the file's bounds")
            self.header: dict[str, Any] = json.loads(os.pread(self.fd, n, 8))
            self.data_start = 8 + n
            ends = [v["data_offsets"][1] for k, v in self.header.items() if k != "__metadata__"]
            if self.data_start + max(ends, default=0) > self.size:
                raise ValueError(f"its tensors end past its {self.size} bytes: it is truncated")
        except (ValueError, OSError, KeyError, TypeError, IndexError) as e:
            os.close(self.fd)
            raise ValueError(f"Cannot read {path}: {e}. The file is damaged or not a safetensors file.") from e
        self.digest = _FileDigest(self.fd, self.size) if track else None

    def dtype(self, key: str) -> torch.dtype:
        """The stored dtype of tensor `key`."""
        entry = self.header.get(key)
        dtype = _DTYPES.get(str(entry.get("dtype"))) if isinstance(entry, dict) else None
        if dtype is None:
            raise ValueError(f"{self.path} holds no readable tensor {key}; the file is damaged or of another model.")
        return dtype

    def read_into(self, key: str, start: int, out: torch.Tensor) -> None:
        """Elements `[start, start + out.numel())` of the flattened tensor `key` into `out` (1D, any device)."""
        dtype = self.dtype(key)
        begin, end = self.header[key]["data_offsets"]
        first = self.data_start + begin + start * dtype.itemsize
        nbytes = out.numel() * dtype.itemsize
        if start < 0 or first + nbytes > self.data_start + end or self.data_start + end > self.size:
            raise ValueError(f"{self.path}: elements [{start}, {start + out.numel()}) of {key} lie outside the file.")
        direct = out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()
        target = out if direct else torch.empty(out.numel(), dtype=dtype)
        view = target.view(torch.uint8).numpy().data if nbytes else memoryview(b"")
        done = 0
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:]], first + done)
            if got <= 0:
                raise ValueError(f"{self.path} ended while reading {key}; the file is truncated.")
            done += got
        if self.digest is not None and nbytes:
            self.digest.add(first, view[:nbytes])
        if not direct:
            out.copy_(target)

    def close(self) -> None:
        if self.digest is not None:
            self.digest.stop()
        os.close(self.fd)


class FileCache:
    """Open safetensors files, one per name (a `safe_open` handle, or a range reader), closed together.

    Args:
        directory (`Path`): where the files are.
        track (`Iterable[str]`, *optional*): files whose SHA-256 is computed from the reads ([Note: verified as
            read]); `digests()` returns them.
    """

    def __init__(self, directory: Path, track: Iterable[str] = ()) -> None:
        self.directory = directory
        self._handles: dict[str, Any] = {}
        self._ranges: dict[str, _RangeFile] = {}
        self._track = set(track)

    def ranges(self, name: str) -> _RangeFile:
        """The range reader of file `name` ([Note: range reads])."""
        reader = self._ranges.get(name)
        if reader is None:
            reader = self._ranges[name] = _RangeFile(self.directory / name, track=name in self._track)
        return reader

    def digests(self) -> dict[str, str]:
        """The SHA-256 of every tracked file: from the reads where they came in order, else read whole now."""
        out = {}
        for name in sorted(self._track):
            reader = self._ranges.get(name)
            digest = reader.digest if reader is not None else None
            out[name] = digest.hexdigest(reader.path) if digest and reader else sha256_of(self.directory / name)
        return out

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
        for reader in self._ranges.values():
            reader.close()
        self._ranges.clear()

    def __enter__(self) -> FileCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_flat_range(cache: FileCache, file: str, key: str, start: int, end: int) -> torch.Tensor:
    """Elements `[start, end)` of the flattened tensor `key` in `file`: a new 1D tensor of its stored dtype."""
    reader = cache.ranges(file)
    out = torch.empty(end - start, dtype=reader.dtype(key))
    reader.read_into(key, start, out)
    return out


def read_pieces(cache: FileCache, key: str, stored: list[list[Any]], start: int, end: int, out: torch.Tensor) -> None:
    """Fill `out` (1D, `end - start` elements) from the stored 1D pieces `[[file, s, e], ...]` of a parameter."""
    filled = 0
    for file, s, e in stored:
        lo, hi = max(s, start), min(e, end)
        if lo >= hi:
            continue
        cache.ranges(file).read_into(key, lo - s, out[lo - start : hi - start])
        filled += hi - lo
    if filled != end - start:
        raise ValueError(
            f"The checkpoint covers only {filled} of elements [{start}, {end}) of {key}; its files are incomplete."
        )


def hf_weight_map(directory: Path) -> dict[str, str]:
    """`{tensor name: file}` of a Hugging Face model directory (single file or sharded with an index)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = directory / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt", device="cpu") as f:
            return {k: "model.safetensors" for k in f.keys()}
    raise FileNotFoundError(
        f"{directory} has neither model.safetensors nor model.safetensors.index.json; hf_zero loads safetensors "
        "weights only (convert .bin files with save_pretrained(safe_serialization=True))."
    )
