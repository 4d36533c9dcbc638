"""What differs between ZeRO stages 0-3, chosen once per engine.

Every stage runs the same machinery (flat units, reduce-scatter of gradients into fp32 shards,
an optimizer that updates only this rank's shards, `publish_master` after the step). They
differ in three choices, each an object or a value picked here and nowhere else:

| stage | shard group | replicate group | parameters (`ParamResidency`) | unsharded gradients (`GradResidency`) |
|-------|-------------|-----------------|-------------------------------|-------------------------------------|
| 0     | this rank   | the world       | persistent                    | kept (reused)       |
| 1     | the world   | this rank       | persistent                    | kept (reused)       |
| 2     | the world   | this rank       | persistent                    | freed after reduce  |
| 3     | the world   | this rank       | gathered per use, then freed  | freed after reduce  |

Stage 0 is "shard over a group of one and replicate over the world": its reduction is an
all-reduce and every rank updates everything, i.e. plain data parallelism.

Callers ask the parameter residency what they need (`gathers`: whether uses gather, so whether to
prefetch, keep a unit for its backward or run generation in step; `release(units)`: free what is
gathered) rather than testing the stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from .collectives import BulkCollectives, CommGroup, hybrid_groups
from .flat import FlatPart, GradReduction
from .unit import Unit


class PersistentParams:
    """Stages 0-2: every unit's unsharded parameters stay allocated; nothing to gather or free."""

    persistent = True  # the parameters are whole on every rank at every moment
    gathers = False  # no forward or backward gathers (so nothing to prefetch, nothing to keep for backward)

    def before_compute(self, unit: Unit) -> None:
        pass

    def after_forward(self, unit: Unit) -> None:
        pass

    def after_backward(self, unit: Unit) -> None:
        pass

    def release(self, units: list[FlatPart] | list[Unit]) -> None:
        """Free whatever of `units` is gathered: nothing is, at these stages."""


class ShardedParams:
    """Stage 3: a unit is gathered just before its forward and its backward, and freed after each."""

    persistent = False
    gathers = True  # each use gathers: prefetch ahead, keep the last forward unit for its backward

    def before_compute(self, unit: Unit) -> None:
        unit.ensure_unsharded()

    def after_forward(self, unit: Unit) -> None:
        unit.reshard()

    def after_backward(self, unit: Unit) -> None:
        unit.reshard()

    def release(self, units: list[FlatPart] | list[Unit]) -> None:
        """Free every gathered unit of `units` (pinned ones stay: [Note: unit lifecycle])."""
        for unit in units:
            unit.reshard()


ParamResidency = PersistentParams | ShardedParams


class KeptGrads:
    """Stages 0-1: a unit's unsharded gradient buffer lives across backwards; each reduction reads it and it is
    zeroed for the next accumulation (reused, never reallocated)."""

    keeps_unsharded = True

    def after_issue(self, unit: Unit) -> None:
        """A reduction of `unit`'s buffer was issued: the unit keeps the buffer."""

    def after_reduction(self, unit: Unit, reduction: GradReduction) -> None:
        """The reduction landed in the shard: zero the buffer for the next backward."""
        if unit.unsharded_grad is not None:
            unit.unsharded_grad.zero_()

    def drop(self, unit: FlatPart) -> None:
        """`zero_grad`: the kept buffer stays (it is zeroed after each reduction)."""


class FreedGrads:
    """Stages 2-3: a unit's unsharded gradients live from its backward to the end of their reduction."""

    keeps_unsharded = False

    def after_issue(self, unit: Unit) -> None:
        """The reduction holds the buffer until its wait; the unit lets go of it now."""
        unit.unsharded_grad = None

    def after_reduction(self, unit: Unit, reduction: GradReduction) -> None:
        """The reduction landed in the shard: its buffers go back to the pool."""
        unit.release_reduced(reduction)

    def drop(self, unit: FlatPart) -> None:
        """`zero_grad`: any unsharded gradients left (an abandoned pass) go."""
        unit.unsharded_grad = None


GradResidency = KeptGrads | FreedGrads


@dataclass(frozen=True)
class StagePlan:
    """The choices of one stage (see the table in this module's docstring)."""

    stage: int
    shard_group: CommGroup
    replicate_group: CommGroup
    params: ParamResidency
    grads: GradResidency  # whether the unsharded gradient buffer lives across backwards (stages 0-1)

    @property
    def data_parallel_size(self) -> int:
        return self.shard_group.size * self.replicate_group.size


def plan_for_stage(
    stage: int,
    world: CommGroup,
    shard_group_size: int | None = None,
    timeout_s: float = 600.0,
    collectives: BulkCollectives = "auto",
) -> StagePlan:
    """The `StagePlan` of `stage` over the process group `world`.

    With `shard_group_size`, stages 1-3 shard within groups of that many consecutive ranks and
    replicate across groups (hybrid sharding); the world size must be a multiple of it.
    `collectives` says how the shard group's all-gathers and reduce-scatters travel
    (see `CommGroup.using`).

    Example:

    ```python
    >>> plan = plan_for_stage(3, CommGroup.world())
    >>> plan.params.gathers, plan.grads.keeps_unsharded
    (True, False)
    ```
    """
    single = CommGroup.single()
    if stage == 0:
        return StagePlan(0, single, world, PersistentParams(), KeptGrads())
    shard, replicate = world, single
    if shard_group_size is not None and shard_group_size != world.size:
        shard, replicate = hybrid_groups(world, shard_group_size, timeout_s)
    return StagePlan(
        stage,
        shard.using(collectives),
        replicate,
        ShardedParams() if stage == 3 else PersistentParams(),
        KeptGrads() if stage == 1 else FreedGrads(),
    )
