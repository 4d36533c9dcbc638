"""A process group and the facts of its backend, fixed once when the group is made.

A `CommGroup` of size 1 is a real path, not a special case of the callers: its collectives are local
copies (or nothing), so stage 0 ("shard over a group of one, replicate over the world") and
single-process runs use the same code as the sharded stages.

The backend is asked once, when the group is made (`CommGroup.world`, `hybrid_groups`): its name,
whether its collectives run in issue order on a device stream (`stream_ordered`: NCCL, XCCL) and the
kind of device it communicates on (`comm_device`: the rank's GPU for NCCL, the host for gloo). Issued
work is a `Pending`, whose `wait()` must be called before the output is read; on CUDA + NCCL the work
runs on the communicator's stream and `wait()` makes the current stream wait on it, on gloo it runs on
gloo's own threads.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.distributed as dist

BulkCollectives = Literal["auto", "native", "composed"]


@dataclass(frozen=True)
class CommGroup:
    """A process group with its size and this process's rank in it (`pg=None` for a group of one)."""

    pg: dist.ProcessGroup | None
    rank: int
    size: int
    composed: bool = False  # bulk collectives composed of broadcasts / all-reduce ([Note: composed collectives])
    backend: str = ""  # the backend's name, asked once when the group is made ("" for a group of one)

    @staticmethod
    def of(pg: dist.ProcessGroup, rank: int, size: int) -> CommGroup:
        """The group over `pg`, with its backend asked once."""
        return CommGroup(pg=pg, rank=rank, size=size, backend=str(dist.get_backend(pg)).lower())

    @property
    def stream_ordered(self) -> bool:
        """Whether the group's collectives run in issue order on a device stream (NCCL, XCCL): a later
        collective of the group runs after an earlier one without any wait by the host or by the compute
        stream. On gloo, completion is a host-side fact, observed by polling. torch's fake group plays the device
        backend of the process's accelerator (`comm_kind`)."""
        return "nccl" in self.backend or "xccl" in self.backend or (self.backend == "fake" and self.comm_kind != "cpu")

    @property
    def comm_kind(self) -> str:
        """The kind of device the backend communicates on: "cuda" (NCCL), "xpu" (XCCL) or "cpu" (gloo). torch's fake
        group (one process playing rank r of N, benchmarks/rank_of_n.py: nothing moves) takes the kind of the
        process's accelerator, so that the rank runs the device backend's code path; the host where it has none."""
        if self.backend == "fake":
            accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            return accelerator.type if accelerator is not None and accelerator.type in ("cuda", "xpu") else "cpu"
        return "cuda" if "nccl" in self.backend else "xpu" if "xccl" in self.backend else "cpu"

    def global_rank_of(self, group_rank: int) -> int:
        """The global rank of this group's rank `group_rank` (the group of one: this process's own)."""
        if self.pg is None:
            return dist.get_rank() if dist.is_initialized() else 0
        return dist.get_global_rank(self.pg, group_rank)

    @staticmethod
    def single() -> CommGroup:
        """The group made of this process alone: its collectives cost nothing."""
        return CommGroup(pg=None, rank=0, size=1)

    @staticmethod
    def world() -> CommGroup:
        """The default process group, or a group of one when `torch.distributed` is not initialized."""
        if not (dist.is_available() and dist.is_initialized()):
            return CommGroup.single()
        pg = dist.group.WORLD
        if pg is None:
            raise RuntimeError(
                f"[rank {dist.get_rank()}] hf_zero: torch.distributed is initialized without a world group"
            )
        return CommGroup.of(pg, dist.get_rank(pg), dist.get_world_size(pg))

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def using(self, bulk: BulkCollectives) -> CommGroup:
        """This group with its all-gather and reduce-scatter carried as `bulk` says: `"native"` (the
        backend's collectives), `"composed"` (broadcasts / an all-reduce) or `"auto"` (composed on
        gloo, native elsewhere). See [Note: composed collectives]."""
        if bulk not in ("auto", "native", "composed"):
            raise ValueError(f"bulk collectives must be 'auto', 'native' or 'composed'; got {bulk!r}.")
        composed = bulk == "composed" or (bulk == "auto" and self.backend == "gloo")
        return replace(self, composed=composed and self.size > 1)


@dataclass
class Pending:
    """Issued communication; `wait()` blocks (or orders streams) until its output is ready, then runs
    `then` (the local step that completes it, e.g. summing received rows)."""

    work: dist.Work | list[dist.Work] | None = None
    then: Callable[[], object] | None = None

    @property
    def works(self) -> list[dist.Work]:
        w = self.work
        return w if isinstance(w, list) else [w] if w is not None else []

    @staticmethod
    def join(*pendings: Pending, then: Callable[[], object] | None = None) -> Pending:
        """One `Pending` for several issued collectives, finished by their own completion steps (in order),
        then by `then`."""
        steps = [p.then for p in pendings if p.then is not None] + ([then] if then is not None else [])
        if not steps:
            return Pending([w for p in pendings for w in p.works])

        def finish() -> None:
            for step in steps:
                step()

        return Pending([w for p in pendings for w in p.works], finish)

    def and_then(self, step: Callable[[], object]) -> Pending:
        """Add a completion step after the ones already there (e.g. a copy out of a staging buffer)."""
        first = self.then
        self.then = step if first is None else (lambda: (first(), step()))
        return self

    def settle(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` for the issued collectives, without the completion steps (a pass being
        abandoned, the process leaving); True when they all finished. Never raises."""
        ok = True
        for w in self.works:
            try:
                w.wait(datetime.timedelta(seconds=timeout_s))
            except Exception:  # noqa: BLE001 - timed out or failed: reported as False
                ok = False
        return ok

    def done(self) -> bool:
        """Whether every issued collective has completed (a query: it neither blocks nor syncs)."""
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        works, self.work = self.work, None
        for w in works if isinstance(works, list) else [works] if works is not None else []:
            w.wait()
        then, self.then = self.then, None
        if then is not None:
            then()


_FALLBACK_TIMEOUT_S = 600.0  # where the default group's own cannot be read


def group_timeout(timeout_s: float | None) -> datetime.timedelta:
    """The timeout of a group hf_zero creates: `timeout_s` (`ZeroConfig.group_timeout_s`) or, for None, the default
    process group's own (what the launcher set: the Trainer's `--ddp_timeout`, Accelerate's
    `InitProcessGroupKwargs(timeout=...)`), so that hf_zero's groups wait as long as the job's others."""
    if timeout_s is not None:
        return datetime.timedelta(seconds=timeout_s)
    try:
        world = dist.group.WORLD
        backend = world._get_backend(torch.device("cuda" if dist.get_backend() == "nccl" else "cpu"))  # type: ignore[union-attr]
        timeout = backend.options._timeout
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout
    except (AttributeError, RuntimeError, ValueError):
        pass
    return datetime.timedelta(seconds=_FALLBACK_TIMEOUT_S)


def hybrid_groups(world: CommGroup, group_size: int, timeout_s: float | None) -> tuple[CommGroup, CommGroup]:
    """This rank's shard group (`group_size` consecutive ranks) and replicate group (the ranks at the
    same position in every shard group). Every rank creates every group, in the same order."""
    if world.size % group_size:
        raise ValueError(
            f"ZeroConfig.shard_group_size ({group_size}) must divide the world size ({world.size}); use the "
            "number of ranks per node."
        )
    timeout = group_timeout(timeout_s)
    n_groups = world.size // group_size
    rank = world.rank
    shard = replicate = None
    for g in range(n_groups):
        ranks = list(range(g * group_size, (g + 1) * group_size))
        pg = group_over(ranks, timeout)
        if rank in ranks:
            shard = CommGroup.of(pg, ranks.index(rank), group_size)
    for i in range(group_size):
        ranks = [g * group_size + i for g in range(n_groups)]
        pg = group_over(ranks, timeout)
        if rank in ranks:
            replicate = CommGroup.of(pg, ranks.index(rank), n_groups)
    if shard is None or replicate is None:
        raise RuntimeError(f"[rank {rank}] hf_zero: rank not in its own hybrid groups")
    return shard, replicate


def sequence_group(world: CommGroup, size: int, timeout_s: float | None) -> CommGroup:
    """This rank's sequence-parallel group: `size` consecutive ranks, which train on the same samples, each on
    its own part of every sequence ([Note: sequence parallelism]). Every rank creates every group, in order."""
    if size == 1:
        return CommGroup.single()
    timeout = group_timeout(timeout_s)
    mine = None
    for g in range(world.size // size):
        ranks = list(range(g * size, (g + 1) * size))
        pg = group_over(ranks, timeout)
        if world.rank in ranks:
            mine = CommGroup.of(pg, ranks.index(world.rank), size)
    if mine is None:
        raise RuntimeError(f"[rank {world.rank}] hf_zero: rank not in its own sequence-parallel group")
    return mine


_GROUPS: dict[tuple[tuple[int, ...], datetime.timedelta, str | None], tuple[object, dist.ProcessGroup]] = {}


def group_over(ranks: list[int], timeout: datetime.timedelta, backend: str | None = None) -> dist.ProcessGroup:
    """[Note: groups made once]
    A process group over `ranks` (global ranks), made the first time every rank asks for it and reused by every
    engine after, while the default group lives: each gloo group holds a socket loop and two threads per process
    and is never freed before `destroy_process_group`, so a process that makes many engines (a sweep, a notebook,
    a reference model beside the policy) would pile them up (600 groups and 1800 threads per rank in a fuzzer run,
    each collective slower). Every rank asks for the same groups in the same order, so every rank hits or makes
    each one alike; sharing a group between engines is as sharing the default one."""
    world = dist.distributed_c10d._get_default_group()
    key = (tuple(ranks), timeout, backend)
    made = _GROUPS.get(key)
    if made is None or made[0] is not world:
        made = _GROUPS[key] = (world, dist.new_group(ranks, timeout=timeout, backend=backend))
    return made[1]


def host_side_group(world: CommGroup, timeout_s: float | None) -> CommGroup:
    """A gloo group over `world`'s ranks, for collectives a background thread issues (asynchronous saves agree on
    it), made once per set of ranks, with the engine's group timeout. A collective the first time: `initialize`
    makes it on every rank, so no group is created later, when a rank's death would leave the others waiting in
    the creation ([Note: clean exit])."""
    if world.size == 1:
        return CommGroup.single()
    if world.backend == "fake":  # torch's fake process group (one process playing a rank: nothing moves)
        return world
    ranks = [world.global_rank_of(r) for r in range(world.size)]
    return CommGroup.of(group_over(ranks, group_timeout(timeout_s), "gloo"), world.rank, world.size)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def issue_after(first: Pending, issue: Callable[[], Pending], group: CommGroup) -> Pending:
    """Issue the collective `issue()` once `first` (a collective of `group`) is complete.

    Where collectives are stream-ordered on CUDA, neither the host nor the compute stream waits: a
    side stream waits for `first` and `issue()` is called with it current, so the second
    collective's stream queues behind the first (the hybrid all-reduce behind its reduce-scatter)
    while the compute stream runs on; `issue()` must return an asynchronous `Pending`, whose
    `wait()` later orders the compute stream after it. Elsewhere (gloo, or a completion step to
    run) `first` is waited for by the host first.
    """
    device = comm_device(group)
    if first.then is not None or not group.stream_ordered or device.type != "cuda":
        first.wait()
        return issue()
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))  # the inputs were written on the compute stream
    with torch.cuda.stream(side):
        first.wait()  # the side stream, not the compute stream, waits for the first collective
        return issue()


def bound_device(group: CommGroup) -> torch.device | None:
    """The device the process group was bound to (`init_process_group(device_id=...)`), if any."""
    pg = group.pg if group.pg is not None else (dist.group.WORLD if dist.is_initialized() else None)
    device = getattr(pg, "bound_device_id", None) if pg is not None else None
    return device if isinstance(device, torch.device) else None


def comm_device(group: CommGroup) -> torch.device:
    """The device a group's backend communicates on: this rank's current GPU for NCCL (XCCL: its XPU), the host
    for gloo. The kind is fixed with the group; the index is the current device, which `initialize` makes the
    rank's own before the first collective."""
    kind = group.comm_kind
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, getattr(torch, kind).current_device())
