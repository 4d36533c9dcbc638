"""Preemption: a scheduler's SIGTERM (or SIGUSR1) becomes a complete checkpoint and a documented exit.

[Note: preemption]
SLURM and Kubernetes preempt a job by sending SIGTERM (SLURM's `--signal` can send SIGUSR1 ahead of it) and
killing it after a grace period. With `--zero_save_on_preemption`, `ZeroTrainer.train` installs handlers for
both signals that only record that one arrived. At the end of every optimizer step the ranks agree (one
small all-reduce of that record: a signal that reached only some ranks counts for all, and every rank
decides at the same step); once any rank has one, the Trainer saves `checkpoint-N` of that step (the
sharded state, trainer state, scheduler and RNG, as a periodic save) and stops. `train` then waits until the
checkpoint is committed and raises `SystemExit(PREEMPTED_EXIT_CODE)`: the process exits with 75
(`EX_TEMPFAIL`, "try again"), so a launcher can requeue it, and `train(resume_from_checkpoint=True)` in the
requeued job continues from that step exactly. The previous handlers are restored when training ends.

[Note: preemption marker]
A launcher does not pass 75 on: `torchrun` (and so `accelerate launch`) exits 1 when a rank exits non-zero. So
before the exit, once the checkpoint is committed, the main process writes `OUTPUT_DIR/hf_zero_preempted.json`
(`{"step": N, "checkpoint": "checkpoint-N", "exit_code": 75}`, atomically); the next `train()` of that output
directory removes it. `hf-zero preemptible OUTPUT_DIR -- LAUNCH COMMAND...` runs the launcher and exits 75 when
the job left the marker (it removes a stale one first), else with the launcher's own code: what a Slurm batch
script requeues on (`examples/slurm/train_clm.sbatch`).

[Note: quick exit]
The grace period a scheduler gives after its signal covers the save and the exit together, and a process that
imported torch and transformers' Trainer would spend 2-3 s leaving: its finalization runs the garbage
collector over every object the imports made, once per module cleared. So once the ranks agree on a
preemption, an exit handler moves every live object to the collector's permanent generation (`gc.freeze`)
just before the interpreter finalizes: the exit takes about 0.5 s (`benchmarks/preempt_grace.py` measures
it). Objects are still freed by reference counting and the other exit handlers (loggers, trackers) run as
before; what is skipped is only the search for cycles of garbage in a process that is about to be gone.
`hf-zero preemptible` itself leaves with `os._exit`.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from transformers import TrainerCallback

from ..checkpoint.format import write_bytes_atomically
from ..engine.collectives import CommGroup, max_ints

logger = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, the job may be retried
MARKER = "hf_zero_preempted.json"  # [Note: preemption marker], in the output directory
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class SignalRecorder:
    """Records SIGTERM / SIGUSR1 instead of dying on them, and tells the ranks, together, whether any got one
    ([Note: preemption]).

    Example:

    ```python
    >>> recorder = SignalRecorder()
    >>> recorder.install()
    >>> if recorder.agreed():  # a collective: every rank calls it at the same point of its loop
    ...     ...  # save, then exit with PREEMPTED_EXIT_CODE
    >>> recorder.restore()
    ```
    """

    def __init__(self) -> None:
        self.received: int | None = None  # the signal this rank got, if any
        self._previous: dict[int, Any] = {}
        self._exit_prepared = False

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("hf_zero's preemption handling needs the main thread (signal handlers live there).")
        for sig in SIGNALS:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._record)

    def agreed(self) -> bool:
        """Whether any rank got a signal (one small all-reduce; every rank gets the same answer)."""
        (anyone,) = max_ints([int(self.received is not None)], CommGroup.world())
        if anyone and not self._exit_prepared:
            atexit.register(gc.freeze)  # [Note: quick exit]: this process is on its way out
            self._exit_prepared = True
        return bool(anyone)

    def restore(self) -> None:
        """Put the signal handlers that were there before `install` back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def write_marker(output_dir: str, step: int) -> Path:
    """Leave the preemption marker in `output_dir` (call once checkpoint-`step` is committed)."""
    path = Path(output_dir) / MARKER
    record = {"step": step, "checkpoint": f"checkpoint-{step}", "exit_code": PREEMPTED_EXIT_CODE}
    write_bytes_atomically(path, (json.dumps(record) + "\n").encode())
    return path


def clear_marker(output_dir: str) -> None:
    """Remove the marker a previous, preempted launch left (this one resumes it)."""
    (Path(output_dir) / MARKER).unlink(missing_ok=True)


class PreemptionCallback(TrainerCallback):
    """Turns SIGTERM / SIGUSR1 into a checkpoint at a step every rank agrees on ([Note: preemption]).

    Example:

    ```python
    >>> args = hf_zero.ZeroTrainingArguments(output_dir="out", zero_stage=3, zero_save_on_preemption=True)
    >>> hf_zero.ZeroTrainer(model=model, args=args, train_dataset=data).train()  # SystemExit(75) on SIGTERM
    ```
    """

    def __init__(self) -> None:
        self.signals = SignalRecorder()
        self.preempted_at: int | None = None  # the step every rank stopped at

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.signals.install()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.preempted_at is None and self.signals.agreed():
            self.preempted_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
            logger.warning(
                "hf_zero: preemption signal received (on this rank: %s); saving checkpoint-%d and stopping",
                self.signals.received,
                state.global_step,
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.restore()

    def restore(self) -> None:
        self.signals.restore()
