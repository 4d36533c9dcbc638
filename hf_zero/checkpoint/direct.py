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
and the file truncated to its length. The same 192 MB cost 0.008 s of system time that way. The checksum of
the bytes ([Note: checksums] in format.py) is computed from the aligned buffer while it is hot in cache.

[Note: pipelined sink]
Copying a buffer's bytes in, hashing them and writing them one after the other made a save run at about half
the disk's speed (with SHA-256, at 1.4 GB/s on one core here; the disk writes at 0.5-1.5 GB/s). A sink has two
aligned buffers: while the caller fills one, a flush thread writes the other and, on a second thread, hashes
it (both only read the buffer; `os.write` releases the GIL). A buffer is hashed in order, each
hash joined before the next flush starts, so the digest is that of the file's bytes. A flush's error is
raised by the next call into the sink; `close` and `abandon` wait for the flush in flight first.

Where the filesystem refuses
`O_DIRECT` (tmpfs, some network filesystems: `EINVAL` at open or at a write) or the platform has none, the
same bytes go through the page cache; the file is identical. Durability is the caller's: it fsyncs the
file before renaming it ([Note: atomic files] in format.py).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

import torch

from .format import Digest

BLOCK = 4096  # O_DIRECT's alignment: a multiple of every block device's logical block size in use
BUFFER_BYTES = 64 << 20  # each aligned buffer of a sink (one write: 16 requests of 4 MiB; 16 MiB saved as fast here)
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


class DirectSink:
    """Writes a file's bytes in order, around the page cache where it can ([Note: direct writes]), and hashes them.

    Example:

    ```python
    >>> with DirectSink(Path("shard.safetensors")) as sink:
    ...     sink.write_bytes(b"header")
    ...     sink.write_tensor(torch.ones(1024))
    >>> sink.checksum(), sink.direct
    ('xxh3_128:9d4f...', True)
    ```
    """

    def __init__(self, path: Path, buffer_bytes: int = BUFFER_BYTES) -> None:
        if buffer_bytes <= 0 or buffer_bytes % BLOCK:
            raise ValueError(f"DirectSink's buffer_bytes must be a positive multiple of {BLOCK}; got {buffer_bytes}.")
        self.path = path
        self._fd, self.direct = _open(path)
        # [Note: pipelined sink] two page-aligned buffers (anonymous maps are): one filled, one being flushed
        self._memories = [mmap.mmap(-1, buffer_bytes), mmap.mmap(-1, buffer_bytes)]
        self._buffers = [torch.frombuffer(m, dtype=torch.uint8) for m in self._memories]
        self._current = 0  # the buffer being filled
        self._fill = 0
        self._written = 0  # bytes of the file on disk (a multiple of BLOCK until the end)
        self._digest = Digest()
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hf_zero-sink")
        self._flushing: Future[None] | None = None

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
            buffer = self._buffers[self._current]
            take = min(n - at, buffer.numel() - self._fill)
            buffer[self._fill : self._fill + take].copy_(source[at : at + take])
            self._fill += take
            at += take
            if self._fill == buffer.numel():
                self._flush(self._fill)

    def checksum(self) -> str:
        """The checksum of every byte written, `"algorithm:hex"` ([Note: checksums]; call after `close`)."""
        return self._digest.value()

    def close(self) -> None:
        """Write what is buffered (the last block padded, the file truncated to its length) and close the file."""
        if self._fd < 0:
            return
        try:
            self._wait()  # the flush in flight counts in `_written`
            length = self._written + self._fill
            if self._fill:
                self._flush(-(-self._fill // BLOCK) * BLOCK if self.direct else self._fill)
            self._wait()
            if self._written != length:
                os.ftruncate(self._fd, length)
        finally:
            self._shut()

    def abandon(self) -> None:
        """Close the file without writing what is buffered (a failed write; the caller removes the file)."""
        if self._fd >= 0:
            try:
                self._wait()
            except OSError:
                pass  # the write that failed is what the caller is abandoning the file for
            finally:
                self._shut()

    def __enter__(self) -> DirectSink:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        else:
            self.abandon()

    def _shut(self) -> None:
        self._threads.shutdown(wait=True)
        os.close(self._fd)
        self._fd = -1

    def _wait(self) -> None:
        """Wait for the flush in flight, raising its error."""
        if self._flushing is not None:
            flushing, self._flushing = self._flushing, None
            flushing.result()

    def _flush(self, nbytes: int) -> None:
        """Hand the current buffer's first `nbytes` (zeros past the buffered ones) to the flush thread, after the
        previous flush finished, and fill the other buffer meanwhile ([Note: pipelined sink])."""
        buffer, memory, fill = self._buffers[self._current], self._memories[self._current], self._fill
        if nbytes > fill:
            buffer[fill:nbytes].zero_()
        self._wait()
        self._flushing = self._threads.submit(self._write_out, memory, fill, nbytes)
        self._current, self._fill = 1 - self._current, 0

    def _write_out(self, memory: mmap.mmap, fill: int, nbytes: int) -> None:
        """On the flush thread: hash the buffered bytes on the other thread while writing them here."""
        view = memoryview(memory)
        try:
            hashing = self._threads.submit(self._digest.update, view[:fill])
            try:
                done = 0
                while done < nbytes:
                    done += self._write(view[done:nbytes])
                self._written += nbytes
            finally:
                hashing.result()
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
