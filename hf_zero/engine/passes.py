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

One `Pass` lives as long as the hooks. A pass ends with `renew` (at the final callback, at `reset`, at `settle`):
its facts (what ran, the reductions in flight, the gate, the units check, deferral, the direct call) go; the facts
of the accumulation across passes stay, each moved by its own verbs: whether reductions run (`no_sync`, [Note:
accumulation] in engine.py), whether a pass since the last reduction skipped its own (`unsynced`), whether reduced
gradients reached the shards since the last `zero_grad` (`has_grads`), whether `.grad` holds stand-ins ([Note:
resting gradients]), and how many forwards of the root run ([Note: forward called directly] in model.py).

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
from torch import nn

from .lifecycle import PassState, illegal_call

if TYPE_CHECKING:
    from .collectives import GatheredFlags
    from .grads import GradReduction, UnitReduction
    from .unit import Unit


@dataclass
class Pass:
    """The running pass: what is in flight, forgotten when the pass ends, and the accumulation across passes ([Note:
    pass state]). Its facts change only through the verbs below; the hooks and the engine read them through the
    properties."""

    rank: int = 0  # for the errors of an illegal move
    _pending: list[tuple[Unit, UnitReduction]] = field(default_factory=list)  # issued reductions, not yet waited
    _finished: list[Unit] = field(default_factory=list)  # units reduced since the last wait_reductions
    _gated: Unit | None = None  # [Note: reduction-gated prefetch] the running unit, whose prefetch is deferred
    _ran: dict[int, Unit] = field(default_factory=dict)  # inner units whose forward ran (outside backward) this pass
    _check_in_flight: GatheredFlags | None = (
        None  # [Note: units run on some ranks]: issued after the forward, not waited
    )
    _ran_anywhere: list[Unit] | None = None  # [Note: units run on some ranks]: set when the ranks disagree
    _deferred: bool = False  # every post_backward waits for the final callback, in unit order
    _create_graph: bool = False  # [Note: double backward] this backward builds a graph of its own
    _called_directly: set[int] = field(default_factory=set)  # [Note: direct calls] in hooks.py: units whose backward
    # ends in the final callback, a module of theirs having run with grad outside their forward
    _direct_call: nn.Module | None = None  # [Note: direct calls] the root's module whose direct call runs
    _state: PassState = PassState.IDLE
    # Across passes (kept by `renew`):
    _root_calls: int = 0  # [Note: forward called directly] in model.py: the root's forwards running in its __call__
    _reduces: bool = True  # False inside no_sync() where it defers: keep unsharded gradients, reduce nothing
    _in_no_sync: bool = False  # inside no_sync(): DDP's gradient sync is off (and the buffers' broadcast not due)
    _unsynced: bool = False  # [Note: accumulation] a pass since the last reduction skipped its reductions
    _has_grads: bool = False  # some reduced gradient reached the shards since the last zero_grad
    _grads_resting: bool = False  # [Note: resting gradients] some `.grad` holds a stand-in

    def renew(self) -> None:
        """The pass ended (its final callback) or is forgotten: its own facts go, the accumulation's stay."""
        self._pending, self._finished, self._gated = [], [], None
        self._ran, self._check_in_flight, self._ran_anywhere = {}, None, None
        self._deferred = self._create_graph = False
        self._called_directly, self._direct_call = set(), None
        self._state = PassState.IDLE

    # ---- across passes ----------------------------------------------------------------------
    @property
    def reduces(self) -> bool:
        """Whether a backward reduces its gradients (not inside a `no_sync` that defers them)."""
        return self._reduces

    @property
    def in_no_sync(self) -> bool:
        return self._in_no_sync

    @property
    def unsynced(self) -> bool:
        """[Note: accumulation] whether a backward since the last reduction skipped its reductions."""
        return self._unsynced

    @property
    def has_grads(self) -> bool:
        """Whether some reduced gradient reached the shards since the last `zero_grad`."""
        return self._has_grads

    @property
    def grads_resting(self) -> bool:
        """[Note: resting gradients] whether some `.grad` holds a stand-in."""
        return self._grads_resting

    def enter_no_sync(self, defer: bool) -> tuple[bool, bool]:
        """Inside `no_sync()` (`defer`: its backwards reduce nothing); returns what `leave_no_sync` restores."""
        previous = (self._in_no_sync, self._reduces)
        self._in_no_sync, self._reduces = True, not defer
        return previous

    def leave_no_sync(self, previous: tuple[bool, bool]) -> None:
        self._in_no_sync, self._reduces = previous

    def backward_done(self) -> None:
        """[Note: accumulation] at the final callback: whether this backward left its reductions for a later one."""
        self._unsynced = not self._reduces

    def grads_reduced(self) -> None:
        self._has_grads = True

    def grads_zeroed(self) -> None:
        self._has_grads = False

    def grads_rested(self) -> None:
        self._grads_resting = True

    def wake_grads(self) -> bool:
        """Whether the gradients were resting (they are awake now)."""
        resting, self._grads_resting = self._grads_resting, False
        return resting

    # ---- this pass --------------------------------------------------------------------------

    @property
    def state(self) -> PassState:
        return self._state

    @property
    def idle(self) -> bool:
        return self._state is PassState.IDLE

    @property
    def in_backward(self) -> bool:
        return self._state is PassState.BACKWARD

    @property
    def deferred(self) -> bool:
        return self._deferred

    @property
    def create_graph(self) -> bool:
        return self._create_graph

    @property
    def gated(self) -> Unit | None:
        return self._gated

    @property
    def ran_anywhere(self) -> list[Unit]:
        """[Note: units run on some ranks] the units that ran on some rank, when the ranks disagree; else empty."""
        return self._ran_anywhere or []

    @property
    def ranks_disagree(self) -> bool:
        return self._ran_anywhere is not None

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def reductions_done(self) -> bool:
        """Whether every issued reduction has completed (a query that never blocks)."""
        return all(r.pending.done() for _, rs in self._pending for r in rs)

    def pending_reductions(self) -> list[GradReduction]:
        return [r for _, reductions in self._pending for r in reductions]

    def was_called_directly(self, unit: Unit) -> bool:
        return id(unit) in self._called_directly

    @property
    def in_root_forward(self) -> bool:
        """Whether the root's forward runs, inside its `__call__` ([Note: forward called directly] in model.py)."""
        return self._root_calls > 0

    def enter_root(self, recompute: bool) -> None:
        """The root's pre-forward: a forward begins (`recompute`: one more runs inside a backward's recomputation)."""
        self._root_calls = self._root_calls + 1 if recompute else 1

    def leave_root(self) -> None:
        """The root's post-forward."""
        self._root_calls = max(0, self._root_calls - 1)

    def ran_forward(self, unit: Unit) -> None:
        """An inner unit's forward ran with grad (outside backward)."""
        self._ran[id(unit)] = unit

    def begin_direct_call(self, unit: Unit, module: nn.Module) -> None:
        """[Note: direct calls] `module` of `unit` is called outside its forward (with grad: the unit's backward ends
        in the final callback)."""
        self._direct_call = module
        if torch.is_grad_enabled():
            self._called_directly.add(id(unit))

    def end_direct_call(self, module: nn.Module) -> bool:
        """[Note: direct calls] whether `module`'s call was the direct call that runs (which then ends)."""
        if self._direct_call is not module:
            return False
        self._direct_call = None
        return True

    def gate(self, unit: Unit) -> None:
        """[Note: reduction-gated prefetch] defer `unit`'s backward prefetch until the reductions are done."""
        self._gated = unit

    def open_gate(self) -> Unit | None:
        """The unit whose prefetch was deferred (if any), the gate open again."""
        unit, self._gated = self._gated, None
        return unit

    def issue(self, unit: Unit, reduction: UnitReduction) -> None:
        self._pending.append((unit, reduction))

    def oldest(self) -> tuple[Unit, UnitReduction]:
        """The earliest issued reduction, no longer pending here (the caller waits for it)."""
        return self._pending.pop(0)

    def reduced(self, unit: Unit) -> None:
        self._finished.append(unit)

    def take_reduced(self) -> list[Unit]:
        """The units reduced since the last call."""
        finished, self._finished = self._finished, []
        return finished

    def begin_backward_pass(self, create_graph: bool, graph_built: bool) -> None:
        """[Note: double backward] the backward's first hook: whether it builds a graph; a backward through a graph
        an earlier one built, or one whose units ran on some ranks only, defers every reduction."""
        self._create_graph = create_graph
        if (not create_graph and graph_built) or self._ran_anywhere is not None:
            self._deferred = True

    def ran(self, unit: Unit) -> bool:
        """[Note: units run on some ranks] whether `unit`'s forward ran with grad (outside backward) this pass."""
        return id(unit) in self._ran

    @property
    def units_check_in_flight(self) -> bool:
        """[Note: units run on some ranks] whether a forward's units check was issued and not yet acted on."""
        return self._check_in_flight is not None

    def issue_units_check(self, check: GatheredFlags) -> None:
        self._check_in_flight = check

    def take_units_check(self) -> GatheredFlags | None:
        check, self._check_in_flight = self._check_in_flight, None
        return check

    def ranks_ran(self, units: list[Unit]) -> None:
        """[Note: units run on some ranks] the ranks disagree: `units` ran on some; every reduction not yet issued
        waits for the final callback."""
        self._ran_anywhere = units
        if self.in_backward:
            self._deferred = True

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
