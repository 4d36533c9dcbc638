"""`MasterBackup`: the master shards as they were before a load reads into them, put back if the load fails.

[Note: master backup]
`load_checkpoint` reads the model files once, straight into the live master shards, with their checksums from
the same bytes ([Note: one-pass load] in sequential.py): checking them first would read them twice, and on the
VMs measured a page of the cache costs about what its read does. Reading once means a damaged model file is
found after some masters have changed, so the masters are copied first and copied back when any rank fails: a
failed load still leaves the weights as they were.

The copy is made where it costs no memory beyond the training step's peak: into a gradient shard's memory kept
across `zero_grad` (pinned host shards beside an accelerator) while it holds no gradient, else into fresh
memory of the master's size, which the released gradient shards leave room for. Host copies run on a thread
beside the pass's first files (the optimizer state, read first), which are I/O-bound; the masters are read into
only after `wait`.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..engine.flat import FlatPart


class MasterBackup:
    """A copy of every part's in-memory master shard, taken on a thread, restorable until released.

    Example:

    ```python
    >>> backup = MasterBackup(engine.parts)
    >>> backup.wait()               # before anything writes into the masters
    >>> ...                         # reads into the masters; on failure:
    >>> backup.restore()
    >>> backup.release()
    ```
    """

    def __init__(self, parts: Sequence[FlatPart]) -> None:
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (master, copy)
        for part in parts:
            master = part.store.read()  # the live shard (a `MemoryMaster`)
            spare = part.grads.spare_shard_memory()
            if spare is not None and spare.numel() == master.numel() and spare.dtype == master.dtype:
                copy = spare
            else:
                copy = torch.empty_like(master)
            self._pairs.append((master, copy))
        host = [(c, m) for m, c in self._pairs if m.device.type == "cpu"]
        with torch.no_grad():  # an accelerator's copies are queued on its stream, ahead of the reads into them
            for copy, master in ((c, m) for m, c in self._pairs if m.device.type != "cpu"):
                copy.copy_(master)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zero-backup")
        self._done: Future[None] = self._pool.submit(_copy_all, host)

    def wait(self) -> None:
        """Block until the copy is complete (raises what the copy raised)."""
        self._done.result()

    def restore(self) -> None:
        """Put every master back as it was when the backup was taken."""
        self.wait()
        _copy_all(self._pairs)

    def release(self) -> None:
        """Let the copies go (their memory returns; borrowed gradient memory is the gradients' again)."""
        self._done.result()
        self._pool.shutdown(wait=True)
        self._pairs = []


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`into.copy_(source)` for each `(into, source)`."""
    with torch.no_grad():
        for into, source in pairs:
            into.copy_(source)
