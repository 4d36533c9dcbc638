"""Checkpoint files written around the page cache.

[Note: direct writes]
A checkpoint's bytes are written once and not read again by the process that writes them. Through the
page cache every byte first costs the writing thread kernel time (pages allocated, charged and copied:
0.46 s of system time for 192 MB on the 2-core machine these numbers come from), then takes host memory
until kernel threads, running at full priority whatever the writer's own, flush it. For a background save
that kernel time is taken from the training it was meant to stay out of the way of.

`DirectSink` writes with `O_DIRECT` where the filesystem takes it: the bytes are copied (by torch, without
the GIL) into a page-aligned buffer and written from there straight to the device, every write a whole
number of `BLOCK`s at a `BLOCK`-aligned offset, as `O_DIRECT` requires; the last block is padded with zeros
and the file truncated to its length. The same 192 MB cost 0.008 s of system time that way. The SHA-256 of
the bytes is computed from the aligned buffer while it is hot in cache. Where the filesystem refuses
`O_DIRECT` (tmpfs, some network filesystems: `EINVAL` at open or at a write) or the platform has none, the
same bytes go through the page cache; the file is identical. Durability is the caller's: it fsyncs the
file before renaming it ([Note: atomic files] in format.py).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
from pathlib import Path
from types import TracebackType

import torch

BLOCK = 4096  # O_DIRECT's alignment: a multiple of every block device's logical block size in use
BUFFER_BYTES = 16 << 20  # the aligned buffer a sink writes from (a multiple of BLOCK)
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


class DirectSink:
    """Writes a file's bytes in order, around the page cache where it can ([Note: direct writes]), and hashes them.

    Example:

    ```python
    >>> with DirectSink(Path("shard.safetensors")) as sink:
    ...     sink.write_bytes(b"header")
    ...     sink.write_tensor(torch.ones(1024))
    >>> sink.hexdigest(), sink.direct
    ('9d4f...', True)
    ```
    """

    def __init__(self, path: Path, buffer_bytes: int = BUFFER_BYTES) -> None:
        if buffer_bytes <= 0 or buffer_bytes % BLOCK:
            raise ValueError(f"DirectSink's buffer_bytes must be a positive multiple of {BLOCK}; got {buffer_bytes}.")
        self.path = path
        self._fd, self.direct = _open(path)
        self._memory = mmap.mmap(-1, buffer_bytes)  # anonymous maps are page-aligned
        self._buffer = torch.frombuffer(self._memory, dtype=torch.uint8)
        self._fill = 0
        self._written = 0  # bytes of the file on disk (a multiple of BLOCK until the end)
        self._digest = hashlib.sha256()

    def write_bytes(self, data: bytes) -> None:
        """Append `data` (small: a header)."""
        if data:
            self.write_tensor(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def write_tensor(self, tensor: torch.Tensor) -> None:
        """Append the bytes of a contiguous tensor (any device, any dtype)."""
        source = tensor.detach().reshape(-1).view(torch.uint8) if tensor.numel() else None
        if source is None:
            return
        at, n = 0, source.numel()
        while at < n:
            take = min(n - at, self._buffer.numel() - self._fill)
            self._buffer[self._fill : self._fill + take].copy_(source[at : at + take])
            self._fill += take
            at += take
            if self._fill == self._buffer.numel():
                self._flush(self._fill)

    def hexdigest(self) -> str:
        """The SHA-256 of every byte written (call after `close`)."""
        return self._digest.hexdigest()

    def close(self) -> None:
        """Write what is buffered (the last block padded, the file truncated to its length) and close the file."""
        if self._fd < 0:
            return
        try:
            length = self._written + self._fill
            if self._fill:
                self._flush(-(-self._fill // BLOCK) * BLOCK if self.direct else self._fill)
            if self._written != length:
                os.ftruncate(self._fd, length)
        finally:
            os.close(self._fd)
            self._fd = -1

    def abandon(self) -> None:
        """Close the file without writing what is buffered (a failed write; the caller removes the file)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> DirectSink:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        else:
            self.abandon()

    def _flush(self, nbytes: int) -> None:
        """Hash the buffered bytes and write the first `nbytes` of the buffer (zeros past the buffered ones)."""
        view = memoryview(self._memory)
        try:
            self._digest.update(view[: self._fill])
            if nbytes > self._fill:
                self._buffer[self._fill : nbytes].zero_()
            done = 0
            while done < nbytes:
                done += self._write(view[done:nbytes])
            self._written += nbytes
            self._fill = 0
        finally:
            view.release()

    def _write(self, data: memoryview) -> int:
        try:
            wrote = os.write(self._fd, data)
        except OSError as e:
            if not (self.direct and e.errno == errno.EINVAL):
                raise
            self._buffered()  # the filesystem opened the file for O_DIRECT but refuses its writes
            wrote = os.write(self._fd, data)
        if self.direct and wrote % BLOCK:
            self._buffered()  # a short write left an unaligned offset: the rest goes through the page cache
        return wrote

    def _buffered(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~O_DIRECT)
        self.direct = False


def _open(path: Path) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if O_DIRECT:
        try:
            return os.open(path, flags | O_DIRECT, 0o666), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o666), False
