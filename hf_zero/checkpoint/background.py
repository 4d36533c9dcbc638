"""Asynchronous saves: the shards are snapshotted at the call and written while training goes on.

[Note: asynchronous save]
`save_checkpoint(..., async_save=True)` returns an `AsyncSave` handle as soon as the state is safe from
the training that follows:

1. At the call (every rank, in step): the previous asynchronous save is waited for (its error, if it
   failed, raises here), the reductions in flight land, and every tensor the rank writes is copied to
   host memory (pinned when the compute device is an accelerator): the *snapshot*. With
   `snapshot_budget_bytes`, at most that many bytes are copied (the last entries of the rank's files);
   the entries before them are written straight from the training tensors while the call waits, so the
   host memory a save adds is bounded by the budget (plus one piece in transit: [Note: streamed save]).
   The manifest is built here too (learning rates, loss scale, metadata as they are at the call).
2. In a background thread per rank: the rank's files are written and checksummed into the staging folder;
   the ranks agree on success and rank 0 writes the manifest and swaps the folder into place, exactly as a
   synchronous save ([Note: atomic save]). These collectives run on a process group of their own (gloo,
   made once at the first asynchronous save), never on the training's, so they cannot interleave with the
   training's collectives.
3. `wait()` joins the thread and raises the save's error on every rank (the ranks agreed on it in step 2);
   `done()` asks without blocking. A crash during the background write leaves the previous checkpoint whole.

The result is the checkpoint a synchronous save at the call would have written, byte for byte.

One save at a time runs on the save group: `chain` starts a save once the one in flight has finished, and its
`wait()` raises that one's failure. The Trainer chains a checkpoint's model weights after its sharded state
(`save_pretrained_async` in consolidate.py: the owned tensors are exchanged and copied at the call).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ..engine.collectives import CommGroup
from ..engine.facade import EngineFacade, facade_of
from .stream import Entry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileJob:
    """One file a rank writes: its name, its entries in order, and the header stored in its metadata."""

    name: str
    entries: list[Entry]
    header: dict[str, object]


class AsyncSave:
    """The handle of an asynchronous `save_checkpoint` ([Note: asynchronous save]).

    Example:

    ```python
    >>> handle = hf_zero.save_checkpoint("ckpt/step-1000", model, optimizer, async_save=True)
    >>> ...  # training goes on
    >>> handle.wait()  # the checkpoint is committed (or its error raises, on every rank)
    PosixPath('ckpt/step-1000')
    ```
    """

    def __init__(self, target: Path, work: Callable[[], object], after: AsyncSave | None = None) -> None:
        self.target = target
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work, after), name="hf_zero-save", daemon=False)
        self._thread.start()

    def _run(self, work: Callable[[], object], after: AsyncSave | None) -> None:
        _yield_cpu()
        try:
            if after is not None:  # one save at a time on the save group; its failure is this one's (every rank's)
                after.wait()
            work()
        except BaseException as e:  # noqa: BLE001 - handed to wait() on this rank
            self._error = e

    def done(self) -> bool:
        """Whether the save has finished (committed or failed); never blocks."""
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until the save is committed and return its directory; raise its error if it failed (every rank
        raises: the ranks agreed on the outcome)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.target


def _yield_cpu() -> None:
    """Give the calling (writer) thread the lowest scheduling priority, so it runs in the time training leaves
    idle rather than beside it (Linux schedules threads as tasks: a thread has a priority of its own; elsewhere
    nothing changes)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


@dataclass(frozen=True)
class Snapshot:
    """The files of an asynchronous save as its writer takes them: `jobs`, whose entries that fit in the budget
    are host copies (`host_bytes` in all) and the rest live; `consumed` is set once the writer has read every live
    entry (at once when there is none): the caller waits for it before training goes on."""

    jobs: list[FileJob]
    consumed: threading.Event
    host_bytes: int
    live_bytes: int


def snapshot(jobs: list[FileJob], budget_bytes: int | None, pin: bool) -> Snapshot:
    """`jobs` with the entries that fit in `budget_bytes` (all of them for None), counted from the last, copied to
    host memory now; the entries before them stay live."""
    flat = [(j, e) for j, job in enumerate(jobs) for e, _ in enumerate(job.entries)]
    room = budget_bytes if budget_bytes is not None else None
    copied: set[tuple[int, int]] = set()
    for j, e in reversed(flat):
        n = jobs[j].entries[e].nbytes
        if room is not None and n > room:
            break
        copied.add((j, e))
        room = None if room is None else room - n
    live = [key for key in flat if key not in copied]
    consumed = threading.Event()
    if not live:
        consumed.set()
    out = []
    for j, job in enumerate(jobs):
        entries = []
        for e, entry in enumerate(job.entries):
            if (j, e) in copied:
                entries.append(replace(entry, pieces=frozen(entry.pieces(), pin)))
            elif (j, e) == live[-1]:
                entries.append(replace(entry, pieces=_signalling(entry.pieces, consumed)))
            else:
                entries.append(entry)
        out.append(replace(job, entries=entries))
    held = sum(jobs[j].entries[e].nbytes for j, e in copied)
    return Snapshot(out, consumed, held, sum(jobs[j].entries[e].nbytes for j, e in live))


def frozen(pieces: Iterable[torch.Tensor], pin: bool) -> Callable[[], Iterator[torch.Tensor]]:
    """Host copies of `pieces` made now (the source may be training memory, or a reused read buffer)."""
    copies = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin).copy_(p) for p in pieces]
    return lambda: iter(copies)


def _signalling(
    pieces: Callable[[], Iterable[torch.Tensor]], event: threading.Event
) -> Callable[[], Iterator[torch.Tensor]]:
    def gen() -> Iterator[torch.Tensor]:
        try:
            yield from pieces()
        finally:
            event.set()

    return gen


def checkpoint_group(engine: EngineFacade) -> CommGroup:
    """The gloo group asynchronous saves agree on: the engine's, made at `initialize` (`host_side_group`)."""
    return engine.save_group


_pending: dict[int, tuple[int, AsyncSave]] = {}  # `_key` of the save group -> (its engine's key, the save in flight)


def _key(engine: EngineFacade) -> int:
    """The saves of engines over the same ranks share one save group ([Note: groups made once] in collectives): a
    save of one and a save of another must not agree on it at the same time, or their collectives would pair with
    each other's (a model made while another's save was still written: a sweep, a notebook, TRL's reference
    model). So each save waits for the save in flight on its group, whichever engine started it; another engine's
    failure is its owner's to raise (`wait()` on its handle, `wait_for_saves` on its model) and is logged here."""
    group = engine.save_group
    return id(group.pg) if group.pg is not None else engine.key


def finish_previous(engine: EngineFacade) -> None:
    """Wait for the previous asynchronous save on `engine`'s save group (the next save starts after it); its error
    raises here."""
    entry = _pending.pop(_key(engine), None)
    if entry is None:
        return
    owner, previous = entry
    if owner == engine.key:
        previous.wait()
        return
    try:  # another model's save on the same ranks: waited for, its error left to its owner
        previous.wait()
    except Exception as e:  # noqa: BLE001 - logged; the owner's wait() raises it
        logger.warning("hf_zero: another model's asynchronous save to %s failed: %s", previous.target, e)


def chain(engine: EngineFacade, target: Path, work: Callable[[], object]) -> AsyncSave:
    """Start `work` in the background once `engine`'s save in flight (if any) has finished, and make it the one
    the next save waits for: its `wait()` raises the earlier save's error too."""
    previous = _pending.get(_key(engine))
    handle = AsyncSave(target, work, after=previous[1] if previous is not None else None)
    _pending[_key(engine)] = (engine.key, handle)
    return handle


def pending_save(engine: EngineFacade) -> AsyncSave | None:
    """The asynchronous save still being written on `engine`'s save group, or None."""
    entry = _pending.get(_key(engine))
    return entry[1] if entry is not None and not entry[1].done() else None


def wait_for_saves(model: nn.Module) -> None:
    """Wait until the asynchronous save of a sharded model ([Note: asynchronous save]) is committed; its error
    raises here, on every rank. Nothing to do when none is being written.

    Example:

    ```python
    >>> hf_zero.save_checkpoint("ckpt", model, optimizer, async_save=True)
    >>> hf_zero.wait_for_saves(model)
    ```
    """
    finish_previous(facade_of(model))
