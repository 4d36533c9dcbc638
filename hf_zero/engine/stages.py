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

The residencies are objects each `Unit` holds and asks (residency.py); callers never test the stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from .collectives import BulkCollectives, CommGroup, hybrid_groups
from .residency import FreedGrads, GradResidency, KeptGrads, ParamResidency, PersistentParams, ShardedParams


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
    timeout_s: float | None = None,
    collectives: BulkCollectives = "auto",
    offload_params: bool = False,
    casts_params: bool = False,
) -> StagePlan:
    """The `StagePlan` of `stage` over the process group `world`.

    With `shard_group_size`, stages 1-3 shard within groups of that many consecutive ranks and
    replicate across groups (hybrid sharding); the world size must be a multiple of it.
    `collectives` says how the shard group's all-gathers and reduce-scatters travel
    (see `CommGroup.using`). `offload_params`: stage 3 keeps the parameters on the host between uses, so it
    gathers even over a shard group of one; so does `casts_params` (mixed precision: each use casts the masters).

    Example:

    ```python
    >>> plan = plan_for_stage(3, CommGroup.world())  # two ranks or more
    >>> plan.params.uses_gather, plan.grads.keeps_unsharded
    (True, False)
    ```
    """
    single = CommGroup.single()
    if stage == 0:
        return StagePlan(0, single, world, PersistentParams(), KeptGrads())
    shard, replicate = world, single
    if shard_group_size is not None and shard_group_size != world.size:
        shard, replicate = hybrid_groups(world, shard_group_size, timeout_s)
    # [Note: a shard group of one] stage 3 over a group of one has nothing to shard: every "gather" would copy
    # the whole unit from its only shard. In one dtype its parameters stay whole and readable between steps, as with
    # the stock Trainer. Unless offload_params keeps them on the host (each use copies them to the device), or mixed
    # precision computes in another dtype than the masters': a whole copy in bf16 beside the fp32 masters would cost
    # 2 bytes per parameter at every moment (14 GB at 7B on one GPU), where FSDP2 casts each unit as it is used and
    # frees it. There each use casts the unit's masters, as stage 3 over several ranks gathers them.
    gathers = stage == 3 and (shard.size > 1 or offload_params or casts_params)
    return StagePlan(
        stage,
        shard.using(collectives),
        replicate,
        ShardedParams() if gathers else PersistentParams(),
        KeptGrads() if stage == 1 else FreedGrads(),
    )
