"""`Pass`: the running pass (a forward and its backward), and the only verbs that move its `PassState`.

[Note: pass state]
`PassState` ([Note: unit lifecycle] in lifecycle.py) says where the whole iteration is. The hooks move it only
through `Pass`'s verbs, each checking where it may run; an illegal move raises with the rank:

| verb           | moves                     | nothing to do in | raises in         |
|----------------|---------------------------|------------------|-------------------|
| begin_forward  | IDLE -> FORWARD           |                  | FORWARD, BACKWARD |
| end_forward    | FORWARD -> IDLE           | IDLE             | BACKWARD          |
| begin_backward | IDLE, FORWARD -> BACKWARD |                  | BACKWARD          |

(The hooks reset a pass an exception interrupted before its next forward begins.)

A pass ends by being replaced with a new one (`UnitHooks` makes it at the final callback, or at `reset`).

[Note: recomputation]
Activation checkpointing runs a unit's forward again inside its backward: HF's
`gradient_checkpointing_enable` inside the block's `forward` (the block's own hooks stay outside),
torch's `checkpoint_wrapper` / `checkpoint(layer, ...)` around the block's `__call__` (its hooks run
again). A forward inside a backward (`torch._C._current_graph_task_id() != -1`) gathers what it
needs and nothing more: no forward prefetch (the next unit's backward already ran), no reshard
after it (the unit's backward follows at once) and no new end signal counted (a non-reentrant
recomputation's graph is never backpropagated; a reentrant one's is, and its signal is the only
one the unit gets, as its first forward ran without grad). So a unit is gathered at most twice per
step. `UnitHooks.reset()` discards the iteration state after an exception interrupted a backward pass; the
root's pre_forward calls it when it finds one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .lifecycle import PassState, illegal_call

if TYPE_CHECKING:
    from .collectives import GatheredFlags
    from .grads import UnitReduction
    from .unit import Unit


@dataclass
class Pass:
    """The running pass: what is in flight, forgotten when the pass ends ([Note: pass state])."""

    rank: int = 0  # for the errors of an illegal move
    pending: list[tuple[Unit, UnitReduction]] = field(default_factory=list)  # issued reductions, not yet waited
    finished: list[Unit] = field(default_factory=list)  # units reduced since the last wait_reductions
    gated: Unit | None = None  # [Note: reduction-gated prefetch] the running unit, whose prefetch is deferred
    ran: dict[int, Unit] = field(default_factory=dict)  # inner units whose forward ran (outside backward) this pass
    versions: dict[int, tuple[int, ...]] = field(default_factory=dict)  # [Note: changed in forward] at the gather
    changed: dict[int, list[str]] = field(default_factory=dict)  # [Note: changed in forward] by unit, since then
    units_check: GatheredFlags | None = None  # [Note: units run on some ranks]: issued after the forward, not waited
    ran_anywhere: list[Unit] | None = None  # [Note: units run on some ranks]: set when the ranks disagree
    deferred: bool = False  # every post_backward waits for the final callback, in unit order
    create_graph: bool = False  # [Note: double backward] this backward builds a graph of its own
    called_directly: set[int] = field(default_factory=set)  # [Note: direct calls] in hooks.py: units whose backward
    # ends in the final callback, a module of theirs having run with grad outside their forward
    _state: PassState = PassState.IDLE

    @property
    def state(self) -> PassState:
        return self._state

    @property
    def idle(self) -> bool:
        return self._state is PassState.IDLE

    @property
    def in_backward(self) -> bool:
        return self._state is PassState.BACKWARD

    def note_changes(self, unit: Unit) -> list[str]:
        """[Note: changed in forward] at a gathered unit's post-forward: the parameters its forward changed in
        place, kept for the units check (with grad)."""
        versions = self.versions.pop(id(unit), None)
        changed = unit.changed_since(versions) if versions is not None else []
        if changed and torch.is_grad_enabled():
            self.changed.setdefault(id(unit), []).extend(changed)
        return changed

    def _illegal(self, verb: str) -> RuntimeError:
        return illegal_call(self.rank, verb, "the pass", self._state.value)

    def begin_forward(self) -> None:
        """IDLE -> FORWARD, at the root's pre-forward."""
        if self._state is not PassState.IDLE:
            raise self._illegal("begin_forward")
        self._state = PassState.FORWARD

    def end_forward(self) -> None:
        """FORWARD -> IDLE, at the root's post-forward (nothing to do in IDLE)."""
        if self._state is PassState.BACKWARD:
            raise self._illegal("end_forward")
        self._state = PassState.IDLE

    def begin_backward(self) -> None:
        """IDLE / FORWARD -> BACKWARD, at the first unit's pre-backward of a backward pass."""
        if self._state is PassState.BACKWARD:
            raise self._illegal("begin_backward")
        self._state = PassState.BACKWARD


def in_backward() -> bool:
    """Whether this runs inside an autograd backward pass (a recomputation, [Note: recomputation])."""
    return torch._C._current_graph_task_id() != -1
