"""Checkpoint files read front to back side by side, each a few reads ahead on its own thread, through its checksum.

[Note: streamed consolidation]
A consolidation reads every model file (checksum included) and writes the output once; on a fast volume the time
is the disk's only if the reads, the casts and the writes overlap and no byte is read twice or lands in fresh
memory (checking the files first, then assembling each parameter from the page cache and writing the output at
the end ran at 0.55 of the disk beside it, 0.84B in bf16).

Every rank's model file holds its pieces of the parameters in the engine's order, and all files agree on that
order, so the parameters can be written in an order in which every file is read once, front to back
(`stream_order`). Each file is a `FileStream`: a thread reads its next aligned span (`O_DIRECT` where the
filesystem takes it: a byte read once should not first take a page of the cache) and hashes it while the caller
casts the present span's bytes (into memory reused for every cast) and copies them into the output file's
write buffer, which a flush thread of its own writes ([Note: pipelined sink] in direct.py). Reading, casting and
writing overlap; nothing but the spans read and the sink's buffers is held, whatever the model's size. A checksum
that does not match is found once the files are read to their ends, after the output was written under
temporary names: those are removed, and an earlier consolidation in the same directory is left as it was.

Each stream holds `READ_AHEAD + 1` spans (the files are taken in turn, a parameter's piece at a time, so each
reads ahead while the others are consumed); with many files (a checkpoint of many ranks, every parameter split
across all of them) the spans shrink to keep the streams' memory at `STREAMS_BYTES`, and past `MAX_STREAMS`
files the consolidation reads through the page cache as before.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .direct import BLOCK, O_DIRECT
from .format import Digest
from .sequential import Stored

STREAMS_BYTES = 512 << 20  # all streams' spans together, at most
STREAM_READ = 32 << 20  # one read of a stream
READ_AHEAD = 3  # spans each stream reads ahead: the files are taken in turn, a parameter's piece at a time
MAX_STREAMS = 32  # files read side by side; more read through the page cache


class FileStream:
    """One file read in order, `ahead` spans ahead on a thread, every byte through `digest`; ranges handed out as
    views of the spans read.

    Example:

    ```python
    >>> with FileStream(Path("model-rank00000-of-00002.safetensors"), Digest()) as stream:
    ...     for view in stream.views(4096, 1 << 20):   # bytes [4096, 4096 + 1 MiB), in order
    ...         out.copy_(view)
    ...     checksum = stream.finish()
    ```
    """

    def __init__(
        self, path: Path, digest: Digest | None, read_bytes: int = STREAM_READ, ahead: int = READ_AHEAD
    ) -> None:
        if read_bytes <= 0 or read_bytes % BLOCK:
            raise ValueError(f"FileStream's read_bytes must be a positive multiple of {BLOCK}; got {read_bytes}.")
        self.path, self.digest, self.read_bytes = path, digest, read_bytes
        self._fd, self.direct = _open(path)
        self.size = os.fstat(self._fd).st_size
        # a ring of page-aligned buffers (as O_DIRECT wants): span k in buffer k % len; `ahead` spans read ahead
        self._memories = [mmap.mmap(-1, read_bytes) for _ in range(ahead + 1)]
        self._buffers = [torch.frombuffer(m, dtype=torch.uint8) for m in self._memories]
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zero-stream")
        self._at, self._got = 0, 0  # the present span's offset and bytes (none yet); span k is at k * read_bytes
        self._pending: deque[Future[int]] = deque()
        self._asked = 0  # the offset of the next span to ask the thread for
        for _ in range(ahead):
            self._ask()

    def views(self, start: int, nbytes: int) -> Iterator[torch.Tensor]:
        """Bytes `[start, start + nbytes)` as uint8 views of the spans read, in order; each is valid until the next is
        asked for. Ranges must come in file order (`start` at or past the present span)."""
        if start < self._at:
            raise RuntimeError(f"hf_zero: {self.path} was asked for byte {start}, behind its stream at {self._at}")
        end = start + nbytes
        if end > self.size:
            raise ValueError(f"{self.path} ends at byte {self.size}, before the tensors its header lists: truncated.")
        while start < end:
            while start >= self._at + self._got:
                self._next()
            stop = min(end, self._at + self._got)
            yield self._buffers[self._at // self.read_bytes % len(self._buffers)][start - self._at : stop - self._at]
            start = stop

    def finish(self) -> str | None:
        """Read (and hash) the rest of the file; its checksum (None without a digest)."""
        while self._at + self._got < self.size:
            self._next()
        self.close()
        return None if self.digest is None else self.digest.value()

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            for pending in self._pending:
                pending.cancel()
            for pending in self._pending:
                if not pending.cancelled():
                    try:
                        pending.result()
                    except (OSError, ValueError):
                        pass  # a read the caller no longer waits for
        finally:
            self._pending.clear()
            self._thread.shutdown(wait=True)
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> FileStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _next(self) -> None:
        """Make the next span the present one, and ask for one more into the buffer the present one leaves (whose
        views the caller is done with)."""
        if not self._pending:
            raise ValueError(f"{self.path} ended at byte {self._at + self._got}: it is truncated.")
        got = self._pending.popleft().result()
        self._at, self._got = self._at + self._got, got
        self._ask()

    def _ask(self) -> None:
        if self._asked < self.size:
            self._pending.append(self._thread.submit(self._read_at, self._asked))
            self._asked += self.read_bytes

    def _read_at(self, offset: int) -> int:
        """On the stream's thread: the span at `offset` into its buffer, then hashed (spans are read in order)."""
        want = min(self.read_bytes, self.size - offset)
        view = memoryview(self._memories[offset // self.read_bytes % len(self._memories)])
        try:
            length = min(self.read_bytes, -(-want // BLOCK) * BLOCK)  # O_DIRECT reads whole blocks
            got = 0
            while got < length:
                n = self._preadv(view[got:length], offset + got)
                if n <= 0:
                    break
                got += n
            if got < want:
                raise ValueError(f"{self.path} ended at byte {offset + got}: it is truncated.")
            if self.digest is not None:
                self.digest.update(view[:want])
        finally:
            view.release()
        return want

    def _preadv(self, view: memoryview, offset: int) -> int:
        try:
            return os.preadv(self._fd, [view], offset)
        except OSError as e:
            if not (self.direct and e.errno == errno.EINVAL):
                raise
            self.direct = False  # opened for O_DIRECT, but its reads are refused: through the page cache
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_RDONLY)
            return os.preadv(self._fd, [view], offset)


def _open(path: Path) -> tuple[int, bool]:
    if O_DIRECT:
        try:
            return os.open(path, os.O_RDONLY | O_DIRECT), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, os.O_RDONLY), False


def read_bytes_for(files: int) -> int:
    """The span each of `files` streams read side by side reads at once: their spans within `STREAMS_BYTES`."""
    share = STREAMS_BYTES // max(1, (READ_AHEAD + 1) * files)
    return max(BLOCK, min(STREAM_READ, share // BLOCK * BLOCK))


def stream_order(pieces: dict[str, list[tuple[str, Stored]]]) -> list[str] | None:
    """An order of the tensors in which every file is read front to back: `pieces` maps each tensor to the files
    holding its pieces and where; None when the files disagree on the order (no such order exists)."""
    placed: dict[str, list[tuple[int, str]]] = {}
    for name, held in pieces.items():
        for file, where in held:
            placed.setdefault(file, []).append((where.begin, name))
    queues = {file: deque(name for _, name in sorted(names)) for file, names in placed.items()}
    waiting = {name: len(held) for name, held in pieces.items()}  # files whose head it is not yet
    ready = deque(name for name, count in waiting.items() if count == 0)
    for queue in queues.values():
        _arrive(queue, waiting, ready)
    order: list[str] = []
    while ready:
        name = ready.popleft()
        order.append(name)
        for file, _ in pieces[name]:
            queues[file].popleft()
            _arrive(queues[file], waiting, ready)
    return order if len(order) == len(pieces) else None


def _arrive(queue: deque[str], waiting: dict[str, int], ready: deque[str]) -> None:
    """The tensor now at the head of `queue` is one file nearer to being read."""
    if queue:
        waiting[queue[0]] -= 1
        if waiting[queue[0]] == 0:
            ready.append(queue[0])
