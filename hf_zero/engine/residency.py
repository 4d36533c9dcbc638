"""Where a unit's parameters and unsharded gradients live between uses: the two choices a stage makes.

Each is an object a `Unit` holds and asks (`stages.py` picks them once per engine), never a flag its
callers test:

- `PersistentParams` (stages 0-2): the parameters are whole on every rank at every moment; nothing to
  gather, prefetch, keep for a backward or free. `ShardedParams` (stage 3): a unit is gathered just
  before its forward and its backward, and freed after each.
- `KeptGrads` (stages 0-1): the unsharded gradient buffer lives across backwards, zeroed after each
  reduction. `FreedGrads` (stages 2-3): it lives from the unit's backward to the end of its reduction.
"""

from __future__ import annotations

from typing import Protocol

from .flat import FlatPart
from .grads import UnitReduction


class _Resident(Protocol):
    """What a residency moves: a `Unit` (its guarded verbs)."""

    def unshard(self) -> None: ...

    def clear_grad_buffer(self) -> None: ...

    def let_go_of_grads(self) -> None: ...

    def reshard(self) -> None: ...

    def release_reduced(self, reduction: UnitReduction) -> None: ...


class PersistentParams:
    """Stages 0-2: every unit's unsharded parameters stay allocated; nothing to gather or free."""

    keeps_whole = True  # the parameters are whole on every rank at every moment (the parts never free them)
    uses_gather = False  # a forward issues no gather, so ranks may run different numbers of forwards (generate)
    prefetches = False  # nothing to gather ahead
    keeps_last_unit_for_backward = False  # nothing to keep: nothing is freed after the forward

    def before_compute(self, unit: _Resident) -> None:
        """Nothing to gather."""

    def after_forward(self, unit: _Resident) -> None:
        """Nothing to free."""

    def after_backward(self, unit: _Resident) -> None:
        """Nothing to free."""

    def release(self, unit: _Resident) -> None:
        """Free `unit` if it is gathered: never, at these stages."""


class ShardedParams:
    """Stage 3: a unit is gathered just before its forward and its backward, and freed after each."""

    keeps_whole = False
    uses_gather = True  # every forward gathers: all ranks must run the same forwards
    prefetches = True  # gather the next units while one computes ([Note: prefetch] in hooks.py)
    keeps_last_unit_for_backward = True  # the forward's last unit is the backward's first: not freed between

    def before_compute(self, unit: _Resident) -> None:
        unit.unshard()

    def after_forward(self, unit: _Resident) -> None:
        unit.reshard()

    def after_backward(self, unit: _Resident) -> None:
        unit.reshard()

    def release(self, unit: _Resident) -> None:
        """Free `unit` if it is gathered (a pinned one stays: [Note: unit lifecycle])."""
        unit.reshard()


ParamResidency = PersistentParams | ShardedParams


class KeptGrads:
    """Stages 0-1: a unit's unsharded gradient buffer lives across backwards; each reduction reads it and it is
    zeroed for the next accumulation (reused, never reallocated)."""

    keeps_unsharded = True

    def after_issue(self, unit: _Resident) -> None:
        """A reduction of `unit`'s buffer was issued: the unit keeps the buffer."""

    def after_reduction(self, unit: _Resident, reduction: UnitReduction) -> None:
        """The reduction landed in the shard: zero the buffer for the next backward."""
        unit.clear_grad_buffer()

    def drop(self, part: FlatPart) -> None:
        """`zero_grad`: the kept buffer stays (it is zeroed after each reduction)."""


class FreedGrads:
    """Stages 2-3: a unit's unsharded gradients live from its backward to the end of their reduction."""

    keeps_unsharded = False

    def after_issue(self, unit: _Resident) -> None:
        """The reduction holds the buffer until its wait; the unit lets go of it now."""
        unit.let_go_of_grads()

    def after_reduction(self, unit: _Resident, reduction: UnitReduction) -> None:
        """The reduction landed in the shard: its buffers go back to the pool."""
        unit.release_reduced(reduction)

    def drop(self, part: FlatPart) -> None:
        """`zero_grad`: any unsharded gradients left (an abandoned pass) go."""
        part.grads.drop_buffer()


GradResidency = KeptGrads | FreedGrads
