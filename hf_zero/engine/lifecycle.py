"""The states of a unit and of a training iteration, and the only moves between them.

[Note: unit lifecycle]
Two states describe a unit at any time:

- its *storage* state (`ShardState`, held by each `FlatPart` part, moved only by `prefetch`
  (SHARDED -> GATHERING), `ensure_unsharded` (-> UNSHARDED) and `reshard` (-> SHARDED)): SHARDED
  (only this rank's shard holds memory; the modules hold stand-ins), GATHERING (an all-gather
  into the unsharded buffer is in flight), UNSHARDED (the parameters are whole and registered in
  the modules). Units of stages 0-2 are always UNSHARDED, and their `reshard` raises. The state is
  the truth: `is_unsharded` reads it, never the storage's byte count; the raw `gather` behind the
  transitions raises unless the unit is SHARDED. Illegal calls raise with the rank and the unit;
- its *backward* state in the current iteration (`Phase`, owned by `UnitHooks` in a `UnitRun`):
  IDLE -> IN_BACKWARD (pre_backward: gathered, `.grad` views attached) -> REDUCING
  (post_backward: its gradients handed to a reduction, or dropped for a frozen unit) -> IDLE (the
  end of the backward pass). `UnitRun.begin_backward` and `end_backward` are the only moves and
  refuse illegal ones with the rank in the message.

A unit's backward ends on a unit-level signal that is the same on every rank: the gradient of its
forward inputs ([Note: backward end] in hooks.py), never on which of its parameters got gradients
(data-dependent: an expert that no token of this rank reached). Beside them, `TrainingState` says
where the whole iteration is (IDLE, FORWARD, BACKWARD).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ShardState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


class Phase(enum.Enum):
    IDLE = "idle"
    IN_BACKWARD = "in_backward"
    REDUCING = "reducing"


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass
class UnitRun:
    """One unit's backward state in the current iteration ([Note: unit lifecycle])."""

    name: str
    rank: int
    phase: Phase = Phase.IDLE
    expected_signals: int = 0  # forwards run outside backward whose grad-requiring inputs carry the end signal
    signals: int = 0  # end signals received in this backward

    def begin_backward(self) -> bool:
        """IDLE -> IN_BACKWARD; False (nothing to do) when the unit's backward already began."""
        if self.phase is not Phase.IDLE:
            return False
        self.phase = Phase.IN_BACKWARD
        return True

    def end_backward(self) -> bool:
        """IN_BACKWARD -> REDUCING; False when it already ended."""
        if self.phase is Phase.REDUCING:
            return False
        if self.phase is not Phase.IN_BACKWARD:
            raise RuntimeError(
                f"[rank {self.rank}] hf_zero: unit '{self.name}' ends a backward it never began ({self.phase.value})"
            )
        self.phase = Phase.REDUCING
        return True

    def signal(self) -> bool:
        """Count one end signal; True when the unit's backward is through: every forward that carried
        the signal has delivered it (at least one, for a forward that only ran inside backward)."""
        self.signals += 1
        return self.signals >= max(self.expected_signals, 1)

    def reset(self) -> None:
        """The end of a backward pass: every unit back to IDLE, forward counts forgotten."""
        self.phase = Phase.IDLE
        self.expected_signals = self.signals = 0
