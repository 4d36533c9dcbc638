"""Leaving the process: what `initialize` arranges so that a script that returns normally exits 0.

[Note: clean exit]
A script that trained with hf_zero, did its work and returned must exit 0, on gloo and NCCL, with or
without `torch.distributed.destroy_process_group()`. Two things can abort it during interpreter
finalization ("terminate called without an active exception", SIGABRT):

- hf_zero's own asynchronous work: a reduction or a prefetched gather still in flight when the script
  returned (a pass stopped early, a forward with no backward), whose tensors a backend thread still holds.
- torch's own race (pytorch/pytorch#179291, seen with plain DDP too): a gloo worker thread drops its last
  reference to a finished collective just after completing it; when that reference is the last one to a
  tensor with a Python owner and the interpreter is already being torn down, releasing it needs the GIL.

`initialize` registers, once per process, an exit handler that runs while the interpreter is whole (and
before torch's own teardown: it is registered after the process group was made). For every engine still
alive it waits for the collectives the engine issued and has not waited for (bounded: a rank whose peers
are gone does not hang its exit), drops the transient buffers, and collects garbage, so no tensor with a
Python owner is left in a backend's hands. Then, if a gloo group was used, it lets the worker threads pass
the point where they drop their last references (one short pause). It issues no collective (the ranks may
no longer be in step) and never raises: a failure is logged and the exit goes on.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
import weakref
from typing import Protocol

logger = logging.getLogger(__name__)

SETTLE_TIMEOUT_S = 30.0  # the longest the handler waits for one engine's outstanding work
WORKER_PAUSE_S = 0.05  # time for gloo's worker threads to drop the references to finished work


class Settling(Protocol):
    """What the exit handler asks of an engine (`ZeroEngine` is one)."""

    @property
    def uses_host_backend(self) -> bool: ...

    def finish_in_flight(self, timeout_s: float) -> bool: ...


_live: weakref.WeakSet[Settling] = weakref.WeakSet()
_registered = False


def track(engine: Settling) -> None:
    """Have `engine`'s outstanding work finished at exit; registers the exit handler on the first call
    (idempotent: one handler per process however many engines are made).

    Example:

    ```python
    >>> track(engine)  # done by ZeroEngine itself; nothing for a user to call
    ```
    """
    global _registered
    _live.add(engine)
    if not _registered:
        atexit.register(finish_at_exit)
        _registered = True


def finish_at_exit() -> None:
    """The exit handler ([Note: clean exit]): finish every live engine's outstanding work, release it, and let
    gloo's worker threads drop their last references. Never raises."""
    pause = False
    for engine in list(_live):
        try:
            pause = pause or engine.uses_host_backend
            if not engine.finish_in_flight(SETTLE_TIMEOUT_S):
                logger.warning("hf_zero: some collectives were still unfinished at exit after %ss", SETTLE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - an exit handler must not raise
            logger.warning("hf_zero: finishing outstanding work at exit failed: %s", e)
    gc.collect()
    if pause:
        time.sleep(WORKER_PAUSE_S)
