"""Reading checkpoint files once, front to back: the wanted byte ranges straight into their tensors, the
file's checksum from the same bytes.

[Note: one-pass load]
A load used to read every byte twice: once to check the files' checksums, then again (through `safe_open`'s
page-by-page mapping) into the shards and into freshly allocated optimizer state. On a checkpoint larger than
the page cache beside the model's own memory (0.84B: a 10 GB checkpoint beside 12 GB of model states on a
24 GB machine) the second pass met the disk again, and the load ran at 0.28 of the disk's read speed.

`RangeReads` plans, before anything is read, which byte range of which file lands in which tensor (from each
file's safetensors header); `read` then streams one file in order with `pread` into the planned tensors
themselves (the bytes between them into two scratch buffers, only when the file is being checked) while a
second thread hashes each range in file order, so the checksum is that of the file and costs no second read.
Where the filesystem takes it, `RangeReads(direct=True)` reads around the page cache (`O_DIRECT`, whole aligned
64 MiB spans into two aligned buffers made once per process, one read by a thread while the other is hashed
and copied into its tensors): a byte read once should not first take a page of the cache, which on the VMs
measured costs as much as the read (buffered, the one-pass load ran at 0.33 of the disk's O_DIRECT speed).

What a load's pass fills: the optimizer state being loaded (the optimizer's own state tensors, or fresh ones not
yet handed over; cleared if the load fails), its small entries (`step`) into fresh host tensors (`add_whole`:
read with the file's bytes, not through a mapping, whose page faults on a cold cache cost ~10 ms each), then
the live master shards, from the model files, once a copy of them is held ([Note: master backup] in backup.py):
a damaged file is found after they changed, and puts them back.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..dtypes import SAFETENSORS_NAMES as DTYPE_NAMES
from .direct import BLOCK, O_DIRECT
from .format import Digest

READ_BYTES = 64 << 20  # one pread, and one hashed range, at most
_BOUNCE: list[tuple[mmap.mmap, mmap.mmap]] = []  # free pairs of aligned buffers for direct reads ([Note: bounce])
_BOUNCE_LOCK = threading.Lock()
_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}  # safetensors' names, as the writer uses them


@dataclass(frozen=True)
class Stored:
    """Where one tensor's bytes lie in a safetensors file."""

    dtype: torch.dtype
    numel: int
    begin: int  # absolute byte offset of its first element
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Want:
    """Bytes `[start, end)` of a file, to land in `into` (a contiguous uint8 tensor of `end - start` bytes)."""

    start: int
    end: int
    into: torch.Tensor
    cast: tuple[torch.Tensor, torch.Tensor] | None = None  # (destination, `into` typed): copied once it is read


def stored_tensors(path: Path) -> dict[str, Stored]:
    """Every tensor of a safetensors file, from its header alone."""
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            size = os.fstat(f.fileno()).st_size
            if length <= 0 or length > size - 8:
                raise ValueError(f"a header length of {length} bytes")
            header = json.loads(f.read(length))
        base = 8 + length
        out = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(n) for n in info["shape"])
            numel = 1
            for n in shape:
                numel *= n
            begin, end = info["data_offsets"]
            if end - begin != numel * dtype.itemsize:
                raise ValueError(f"{key} spans {end - begin} bytes for {numel} elements of {dtype}")
            if base + end > size:
                raise ValueError(f"{key} ends at byte {base + end}, past the end of the file: it is truncated")
            out[key] = Stored(dtype, numel, base + begin, shape)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"Cannot read {path}: {e}. The file is damaged or not a safetensors file.") from e
    return out


class RangeReads:
    """Ranges of tensors to read from a checkpoint's files, planned first, then read file by file ([Note: one-pass
    load]).

    Example:

    ```python
    >>> reads = RangeReads(Path("ckpt"))
    >>> reads.add("w::exp_avg", [["optim-rank00000-of-00002.safetensors", 0, 4096]], 0, 1024, out)
    >>> reads.read("optim-rank00000-of-00002.safetensors", Digest())   # fills `out`, returns the file's checksum
    'xxh3_128:...'
    ```
    """

    def __init__(self, directory: Path, direct: bool = False) -> None:
        self.directory = directory
        self.direct = direct  # around the page cache where the filesystem takes it (bytes read once)
        self.wants: dict[str, list[Want]] = {}
        self._headers: dict[str, dict[str, Stored]] = {}

    def _header(self, file: str) -> dict[str, Stored]:
        header = self._headers.get(file)
        if header is None:
            header = self._headers[file] = stored_tensors(self.directory / file)
        return header

    def stored(self, file: str, key: str) -> Stored:
        """Where `key`'s bytes lie in `file` (from its header, read once)."""
        header = self._header(file)
        if key not in header:
            raise ValueError(f"{self.directory / file} lacks {key}; the checkpoint is damaged.")
        return header[key]

    def add_whole(self, key: str, files: list[str]) -> torch.Tensor:
        """Plan the whole tensor `key`, from the first of `files` that holds it, into a fresh host tensor of its
        shape and dtype, returned (filled when `read` reads that file). Files read already for other tensors
        come first: a small tensor must not bring a whole file into the pass."""
        for file in sorted(files, key=lambda f: f not in self.wants):
            where = self._header(file).get(key)
            if where is not None:
                out = torch.empty(where.shape, dtype=where.dtype)
                self.add(key, [[file, 0, where.numel]], 0, where.numel, out.view(-1))
                return out
        raise ValueError(f"No file of the checkpoint holds the optimizer state {key}; the checkpoint is damaged.")

    def add(self, key: str, stored: list[list[Any]], start: int, end: int, out: torch.Tensor) -> None:
        """Plan elements `[start, end)` of the flattened `key`, kept as 1D pieces `[[file, s, e], ...]`, into `out`
        (1D, contiguous, `end - start` elements); as `reader.read_pieces`, but read later by `read`."""
        filled = 0
        for file, s, e in stored:
            lo, hi = max(s, start), min(e, end)
            if lo >= hi:
                continue
            where = self.stored(file, key)
            if where.numel != e - s:
                raise ValueError(f"{self.directory / file} holds {where.numel} elements of {key}, its index {e - s}.")
            size = where.dtype.itemsize
            dest = out.detach()[lo - start : hi - start]
            if where.dtype != out.dtype or dest.device.type != "cpu":  # read on the host, then copied
                fresh = torch.empty(hi - lo, dtype=where.dtype)
                cast: tuple[torch.Tensor, torch.Tensor] | None = (dest, fresh)
                dest = fresh
            else:
                cast = None
            first = where.begin + (lo - s) * size
            want = Want(first, first + (hi - lo) * size, dest.view(torch.uint8), cast)
            self.wants.setdefault(file, []).append(want)
            filled += hi - lo
        if filled != end - start:
            raise ValueError(
                f"The checkpoint covers only {filled} of elements [{start}, {end}) of {key}; its files are incomplete."
            )

    def read(self, file: str, digest: Digest | None = None) -> str | None:
        """Read the planned ranges of `file` into their tensors; with `digest`, the whole file goes through it, in
        order, and its value is returned."""
        wants = sorted(self.wants.pop(file, []), key=lambda w: w.start)
        for a, b in zip(wants, wants[1:]):
            if b.start < a.end:
                raise RuntimeError(f"hf_zero: two reads overlap in {file} at byte {b.start}")
        path = self.directory / file
        cast: set[int] = set()

        def complete(want: Want) -> None:  # another dtype, or a device's memory: as soon as its bytes are in
            if want.cast is not None and id(want) not in cast:
                want.cast[0].copy_(want.cast[1])
                cast.add(id(want))

        if not (self.direct and O_DIRECT and _read_direct(path, wants, digest, complete)):
            _read_in_order(path, wants, digest)
        for want in wants:
            complete(want)
        return None if digest is None else digest.value()


def _read_in_order(path: Path, wants: list[Want], digest: Digest | None) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if wants and wants[-1].end > size:
            raise ValueError(f"{path} ends at byte {size}, before the tensors its header lists: it is truncated.")
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zero-checksum") as hasher:
            scratch = _Scratch(fd, hasher, digest) if digest is not None else None
            hashed: list[Future[None]] = []
            at = 0
            for want in wants:
                if scratch is not None:
                    scratch.through(at, want.start)
                view = want.into.numpy().data
                for lo in range(0, len(view), READ_BYTES):
                    span = view[lo : lo + READ_BYTES]
                    _pread_into(fd, span, want.start + lo, path)
                    if digest is not None:
                        hashed.append(hasher.submit(digest.update, span))
                hashed = _unfinished(hashed)
                at = want.end
            if scratch is not None:
                scratch.through(at, size)
                scratch.wait()
            for f in hashed:
                f.result()
    finally:
        os.close(fd)


@contextlib.contextmanager
def _bounce_pair() -> Iterator[tuple[mmap.mmap, mmap.mmap]]:
    """[Note: bounce]
    A direct read goes through two aligned READ_BYTES buffers (one read by a thread while the other is hashed and
    copied out), made once and kept: fresh memory each time would cost its first touch again. Each read running at
    once takes a pair of its own (`PretrainedSource` reads two units at once), so a second pair is made the first
    time two overlap; `keep_one_bounce_pair` gives the spare ones back once such a load is done."""
    with _BOUNCE_LOCK:
        pair = _BOUNCE.pop() if _BOUNCE else None
    if pair is None:
        pair = (mmap.mmap(-1, READ_BYTES), mmap.mmap(-1, READ_BYTES))
    try:
        yield pair
    finally:
        with _BOUNCE_LOCK:
            _BOUNCE.append(pair)


def keep_one_bounce_pair() -> None:
    """[Note: bounce] close every kept pair of direct-read buffers but one."""
    with _BOUNCE_LOCK:
        spare, _BOUNCE[1:] = _BOUNCE[1:], []
    for pair in spare:
        for buffer in pair:
            buffer.close()


def _read_direct(path: Path, wants: list[Want], digest: Digest | None, complete: Callable[[Want], None]) -> bool:
    """Read `wants` (sorted) with O_DIRECT, through the aligned buffers, and with `digest` the whole file through
    it, calling `complete` on each want once its last byte is in (while the next span is being read); False,
    with nothing read, where the filesystem refuses O_DIRECT."""
    try:
        fd = os.open(path, os.O_RDONLY | O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        size = os.fstat(fd).st_size
        if wants and wants[-1].end > size:
            raise ValueError(f"{path} ends at byte {size}, before the tensors its header lists: it is truncated.")
        spans = _aligned_reads([(0, size)] if digest is not None else [(w.start, w.end) for w in wants])
        with _bounce_pair() as bounce, ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zero-read") as reader:
            buffers = [torch.frombuffer(m, dtype=torch.uint8) for m in bounce]
            pending = reader.submit(_pread_direct, fd, bounce[0], *spans[0]) if spans else None
            try:
                got = pending.result() if pending is not None else 0
            except OSError as e:  # a filesystem that opens with O_DIRECT but refuses its reads
                if e.errno == errno.EINVAL:
                    return False
                raise
            first = 0  # the first want not yet filled completely
            for k, (offset, _) in enumerate(spans):
                if k:
                    got = pending.result() if pending is not None else 0
                if k + 1 < len(spans):
                    pending = reader.submit(_pread_direct, fd, bounce[(k + 1) % 2], *spans[k + 1])
                end = min(offset + got, size)
                if digest is not None:
                    digest.update(memoryview(bounce[k % 2])[: end - offset])
                buffer = buffers[k % 2]
                while first < len(wants) and wants[first].end <= offset:
                    first += 1
                for want in wants[first:]:
                    if want.start >= end:
                        break
                    lo, hi = max(want.start, offset), min(want.end, end)
                    want.into[lo - want.start : hi - want.start].copy_(buffer[lo - offset : hi - offset])
                    if hi == want.end:
                        complete(want)
    finally:
        os.close(fd)
    return True


def _aligned_reads(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) reads of at most READ_BYTES, BLOCK-aligned, covering the byte `spans` (sorted)."""
    reads: list[tuple[int, int]] = []
    covered = 0
    for start, end in spans:
        at = max(start // BLOCK * BLOCK, covered)
        while at < end:
            n = min(READ_BYTES, -(-(end - at) // BLOCK) * BLOCK)
            reads.append((at, n))
            at += n
        covered = max(covered, at)
    return reads


def _pread_direct(fd: int, buffer: mmap.mmap, offset: int, length: int) -> int:
    """Bytes read at `offset` into `buffer` (fewer than `length` only at the end of the file)."""
    view = memoryview(buffer)
    got = 0
    while got < length:
        n = os.preadv(fd, [view[got:length]], offset + got)
        if n <= 0:
            break
        got += n
    return got


def _unfinished(hashing: list[Future[None]]) -> list[Future[None]]:
    """The hashes still running; a failed one raises here, early."""
    out = []
    for f in hashing:
        if f.done():
            f.result()
        else:
            out.append(f)
    return out


class _Scratch:
    """Two buffers for the bytes no tensor wants, hashed in turn while the other is filled."""

    def __init__(self, fd: int, hasher: ThreadPoolExecutor, digest: Digest) -> None:
        self.fd, self.hasher, self.digest = fd, hasher, digest
        self.buffers = [bytearray(0), bytearray(0)]
        self.hashing: list[Future[None] | None] = [None, None]
        self.turn = 0

    def through(self, start: int, end: int) -> None:
        while start < end:
            i = self.turn % 2
            self.turn += 1
            pending = self.hashing[i]
            if pending is not None:
                pending.result()
            n = min(READ_BYTES, end - start)
            if len(self.buffers[i]) < n:
                self.buffers[i] = bytearray(min(READ_BYTES, max(n, 1 << 20)))
            view = memoryview(self.buffers[i])[:n]
            _pread_into(self.fd, view, start, None)
            self.hashing[i] = self.hasher.submit(self.digest.update, view)
            start += n

    def wait(self) -> None:
        for pending in self.hashing:
            if pending is not None:
                pending.result()


def _pread_into(fd: int, view: memoryview, offset: int, path: Path | None) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise ValueError(f"{path or 'a checkpoint file'} ended at byte {offset + got}: it is truncated.")
        got += n
