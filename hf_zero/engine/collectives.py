"""Every collective the engine issues, as plain functions over a `CommGroup`.

A `CommGroup` of size 1 is a real path, not a special case of the callers: its collectives
are local copies (or nothing), so stage 0 ("shard over a group of one, replicate over the
world") and single-process runs use the same code as the sharded stages.

Functions that take `async_op=True` return a `Pending` whose `wait()` must be called before the
output is read; on CUDA + NCCL the work runs on the communicator's stream and `wait()` makes the
current stream wait on it, on gloo it runs on gloo's own threads.

[Note: composed collectives]
The two bulk collectives of ZeRO (all-gather of parameters, reduce-scatter of gradients) have
two implementations, chosen per group once (`CommGroup.composed`): the backend's own
collectives, or ones composed of the backend's faster primitives: an all-gather as one
broadcast from each rank (every rank's chunk sent once to every peer, the bytes of an
all-gather), and a reduce-scatter as an all-reduce of the whole buffer (which overwrites it)
keeping this rank's chunk (twice the bytes of a reduce-scatter). The backend's collectives are
the fast path on NCCL. gloo's all-gather and reduce-scatter are slow for their bytes, so "auto"
composes them there: 2 ranks, fp32, 100 MB buffers, all-gather 164 ms native vs 50 ms as
broadcasts, reduce-scatter 178 ms native vs 106 ms through all-reduce (`benchmarks/collectives.py`).
Point-to-point sends were faster still for the reduce-scatter (58 ms) but were dropped: a gloo
group that had run them occasionally aborted the process at exit (2 of about 100 benchmark jobs).
Where the caller has a free buffer of the input's size (the unsharded gradients after their cast
to the reduce dtype), the composed reduce-scatter receives every rank's chunk into it with an
all-to-all (the bytes of a reduce-scatter) and sums them locally: 2 ranks, 12.8M elements, bf16
7 ms + 1 ms for the sum against 20 ms for the all-reduce (fp32 22 + 5 ms against 42 ms, but there
the buffer would be an extra allocation, so fp32 keeps the all-reduce).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

BulkCollectives = Literal["auto", "native", "composed"]


@dataclass(frozen=True)
class CommGroup:
    """A process group with its size and this process's rank in it (`pg=None` for a group of one)."""

    pg: dist.ProcessGroup | None
    rank: int
    size: int
    composed: bool = False  # bulk collectives composed of broadcasts / all-reduce ([Note: composed collectives])

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
        return CommGroup(pg=pg, rank=dist.get_rank(pg), size=dist.get_world_size(pg))

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def using(self, bulk: BulkCollectives) -> CommGroup:
        """This group with its all-gather and reduce-scatter carried as `bulk` says: `"native"` (the
        backend's collectives), `"composed"` (broadcasts / an all-reduce) or `"auto"` (composed on
        gloo, native elsewhere). See [Note: composed collectives]."""
        if bulk not in ("auto", "native", "composed"):
            raise ValueError(f"bulk collectives must be 'auto', 'native' or 'composed'; got {bulk!r}.")
        composed = bulk == "composed" or (bulk == "auto" and _backend(self) == "gloo")
        return replace(self, composed=composed and self.size > 1)


@dataclass
class Pending:
    """Issued communication; `wait()` blocks (or orders streams) until its output is ready, then runs
    `then` (the local step that completes it, e.g. summing received chunks)."""

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


def hybrid_groups(world: CommGroup, group_size: int, timeout_s: float) -> tuple[CommGroup, CommGroup]:
    """This rank's shard group (`group_size` consecutive ranks) and replicate group (the ranks at the
    same position in every shard group). Every rank creates every group, in the same order."""
    if world.size % group_size:
        raise ValueError(
            f"ZeroConfig.shard_group_size ({group_size}) must divide the world size ({world.size}); use the "
            "number of ranks per node."
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    n_groups = world.size // group_size
    rank = world.rank
    shard = replicate = None
    for g in range(n_groups):
        ranks = list(range(g * group_size, (g + 1) * group_size))
        pg = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            shard = CommGroup(pg=pg, rank=ranks.index(rank), size=group_size)
    for i in range(group_size):
        ranks = [g * group_size + i for g in range(n_groups)]
        pg = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            replicate = CommGroup(pg=pg, rank=ranks.index(rank), size=n_groups)
    if shard is None or replicate is None:
        raise RuntimeError(f"[rank {rank}] hf_zero: rank not in its own hybrid groups")
    return shard, replicate


def _backend(group: CommGroup) -> str:
    return "" if group.pg is None else str(dist.get_backend(group.pg)).lower()


def stream_ordered(group: CommGroup) -> bool:
    """Whether the group's collectives run in issue order on a device stream (NCCL, XCCL): a later
    collective of the group runs after an earlier one without any wait by the host or by the compute
    stream. On gloo, completion is a host-side fact, observed by polling."""
    backend = _backend(group)
    return "nccl" in backend or "xccl" in backend


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
    if first.then is not None or not stream_ordered(group) or device.type != "cuda":
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
    """The device a group's backend communicates on (CUDA for NCCL, CPU for gloo)."""
    if group.pg is None:
        return torch.device("cpu")
    backend = _backend(group)
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "xccl" in backend:  # Intel GPUs
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def _staged(tensor: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """`tensor` on the group's communication device: itself, or a copy there (a host shard under NCCL).

    [Note: staging] A backend only takes tensors on its own device (NCCL: the rank's GPU). Host
    tensors (offloaded shards and masters, a checkpoint's values) are staged through a device copy
    here, at the one door every collective goes through: each public collective stages its tensors
    once at its entry and copies results back as a completion step of its `Pending`. On gloo the
    communication device is the host and nothing is copied. `tests/test_offload.py` records every
    tensor that reaches `torch.distributed` with the communication device moved off the host and
    checks that none is offloaded host memory.
    """
    comm = comm_device(group)
    return tensor if tensor.device == comm else tensor.to(comm)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: CommGroup, async_op: bool = False) -> Pending:
    """Gather every rank's `shard` into the 1D `output` (`output.numel() == group.size * shard.numel()`).

    `shard` may be this rank's own chunk of `output` (in place). Tensors off the communication
    device are staged ([Note: staging]).
    """
    if group.size == 1:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard)
        return Pending()
    staged_out, staged_shard = _staged(output, group), _staged(shard, group)
    pending = _all_gather(staged_out, staged_shard, group)
    if staged_out is not output:  # [Note: staging]
        pending.and_then(lambda: output.copy_(staged_out))
    if not async_op:
        pending.wait()
    return pending


def _all_gather(output: torch.Tensor, shard: torch.Tensor, group: CommGroup) -> Pending:
    """`all_gather_into` on tensors already on the communication device, issued asynchronously."""
    if not group.composed:
        return Pending(_all_gather_single(output, shard, group=group.pg, async_op=True))
    chunks = output.view(group.size, -1)
    if chunks[group.rank].data_ptr() != shard.data_ptr():
        chunks[group.rank].copy_(shard)
    return Pending(
        [
            dist.broadcast(chunks[i], src=group.global_rank_of(i), group=group.pg, async_op=True)
            for i in range(group.size)
        ]
    )


def reduce_scatter_into(
    output: torch.Tensor,
    full: torch.Tensor,
    group: CommGroup,
    async_op: bool = False,
    scratch: torch.Tensor | None = None,
) -> Pending:
    """Sum `full` over the group and keep this rank's chunk in `output` (SUM, not mean).

    `output` must not overlap `full`. `full` is consumed: the composed implementation sums it in
    place (see [Note: composed collectives]). `scratch`, a free buffer of `full`'s size and dtype, lets
    the composed implementation receive every rank's chunk instead (an all-to-all, half the bytes of the
    all-reduce) and sum them here. Tensors off the communication device are staged ([Note: staging]).
    """
    if group.size == 1:
        if output.data_ptr() != full.data_ptr():
            output.copy_(full)
        return Pending()
    staged_out, staged_full = _staged(output, group), _staged(full, group)
    if not group.composed:
        pending = Pending(
            _reduce_scatter_single(staged_out, staged_full, op=dist.ReduceOp.SUM, group=group.pg, async_op=True)
        )
    elif scratch is not None:
        received = _staged(scratch, group).view(group.size, -1)
        pending = Pending(
            dist.all_to_all_single(received, staged_full.view(group.size, -1), group=group.pg, async_op=True),
            then=lambda: _sum_rows(received, staged_out),
        )
    else:
        own = staged_full.view(group.size, -1)[group.rank]
        pending = Pending(
            dist.all_reduce(staged_full, op=dist.ReduceOp.SUM, group=group.pg, async_op=True),
            then=lambda: staged_out.copy_(own),
        )
    if staged_out is not output:  # [Note: staging]
        pending.and_then(lambda: output.copy_(staged_out))
    if not async_op:
        pending.wait()
    return pending


def _sum_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """`out` = the sum of `rows` (`(n, out.numel())`), in rank order, in `out`'s dtype."""
    torch.add(rows[0], rows[1], out=out)
    for row in rows[2:]:
        out.add_(row)


def all_to_all_into(output: torch.Tensor, chunks: torch.Tensor, group: CommGroup, async_op: bool = False) -> Pending:
    """Send chunk j of `chunks` (`(group.size, n)`) to group rank j; `output` (`(group.size, n)`) receives
    rank i's chunk for this rank in row i."""
    if group.size == 1:
        output.copy_(chunks)
        return Pending()
    staged_out, staged_in = _staged(output, group), _staged(chunks, group)
    pending = Pending(dist.all_to_all_single(staged_out, staged_in, group=group.pg, async_op=True))
    if staged_out is not output:  # [Note: staging]
        pending.and_then(lambda: output.copy_(staged_out))
    if not async_op:
        pending.wait()
    return pending


def all_to_all_uneven(
    output: torch.Tensor,
    send: torch.Tensor,
    output_splits: Sequence[int],
    send_splits: Sequence[int],
    group: CommGroup,
) -> None:
    """Send `send_splits[j]` elements of the 1D `send` (taken in rank order) to group rank j, and receive
    `output_splits[i]` elements from rank i into the 1D `output` (in rank order). Blocking.

    Example:

    ```python
    >>> # rank 0 sends 3 elements to itself, rank 1 sends it 2: rank 0 receives 5, rank 1 none
    >>> all_to_all_uneven(out, send, [3, 2] if rank == 0 else [0, 0], [3, 0] if rank == 0 else [2, 0], group)
    ```
    """
    if sum(output_splits) != output.numel() or sum(send_splits) != send.numel():
        raise RuntimeError(f"[rank {group.global_rank}] hf_zero: all-to-all splits do not add up to the buffers")
    if group.size == 1:
        output.copy_(send)
        return
    staged_out, staged_in = _staged(output, group), _staged(send, group)
    dist.all_to_all_single(staged_out, staged_in, list(output_splits), list(send_splits), group=group.pg)
    if staged_out is not output:  # [Note: staging]
        output.copy_(staged_out)


def all_gather_rows(
    rows: torch.Tensor, values: torch.Tensor, capacity: int, group: CommGroup, async_op: bool = False
) -> tuple[Pending, torch.Tensor, torch.Tensor]:
    """Gather every rank's rows of a sparse matrix: `rows` (n,) int64 and `values` (n, dim), with
    `n <= capacity` on every rank (see `max_ints`). Each rank's entries are padded to `capacity`,
    the padding with row -1 and zero values.

    Returns the `Pending` and the gathered `(size * capacity,)` rows and `(size * capacity, dim)` values.
    """
    n, dim = values.shape
    if n > capacity:
        raise RuntimeError(
            f"[rank {group.global_rank}] hf_zero: {n} rows to gather exceed the agreed capacity {capacity}"
        )
    padded_rows = torch.full((capacity,), -1, dtype=torch.int64, device=values.device)
    padded_rows[:n] = rows
    padded_values = values.new_zeros(capacity, dim)
    padded_values[:n] = values
    all_rows = torch.empty(group.size * capacity, dtype=torch.int64, device=values.device)
    all_values = values.new_empty(group.size * capacity, dim)
    pending = Pending.join(
        all_gather_into(all_rows, padded_rows, group, async_op=True),
        all_gather_into(all_values.view(-1), padded_values.view(-1), group, async_op=True),
    )
    if not async_op:
        pending.wait()
    return pending, all_rows, all_values


def max_ints(values: Sequence[int], group: CommGroup) -> list[int]:
    """The elementwise maximum of small non-negative integers over the group (a host sync)."""
    if group.size == 1:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.int64, device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg)
    return [int(v) for v in t.tolist()]


def all_reduce_(
    tensor: torch.Tensor, group: CommGroup, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False
) -> Pending:
    """All-reduce `tensor` in place over the group (staged when off the communication device)."""
    if group.size == 1:
        return Pending()
    staged = _staged(tensor, group)
    if staged is not tensor:  # [Note: staging]
        dist.all_reduce(staged, op=op, group=group.pg)
        tensor.copy_(staged)
        return Pending()
    return Pending(dist.all_reduce(tensor, op=op, group=group.pg, async_op=async_op))


def broadcast_(tensor: torch.Tensor, group: CommGroup, src_group_rank: int = 0) -> None:
    """Overwrite `tensor` on every rank with the group's rank `src_group_rank` copy."""
    if group.size == 1:
        return
    src = group.global_rank_of(src_group_rank)
    staged = _staged(tensor, group)
    dist.broadcast(staged, src=src, group=group.pg)
    if staged is not tensor:  # [Note: staging]
        tensor.copy_(staged)


def failed_ranks(failed: bool, group: CommGroup) -> list[int]:
    """Agree on which ranks of `group` failed a local check; every rank gets the same list.

    Used before the first collective of a phase, so that an error on one rank raises on all
    of them instead of leaving the others blocked in a collective.
    """
    if group.size == 1:
        return [group.global_rank] if failed else []
    flags = torch.zeros(group.size, dtype=torch.int32, device=comm_device(group))
    flags[group.rank] = int(failed)
    dist.all_reduce(flags, group=group.pg)
    return [group.global_rank_of(r) for r, f in enumerate(flags.tolist()) if f]


def all_agree(value: int, group: CommGroup) -> bool:
    """Whether every rank of the group passed the same integer (e.g. a count or a layout hash)."""
    if group.size == 1:
        return True
    t = torch.tensor([value, -value], dtype=torch.int64, device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg)
    return int(t[0]) == value and int(t[1]) == -value


def sum_scalars(values: Sequence[torch.Tensor], group: CommGroup) -> torch.Tensor:
    """Stack scalars and sum them over the group in one collective (stays on device, no sync)."""
    t = torch.stack([v.reshape(()) for v in values]) if len(values) > 1 else values[0].reshape(1).clone()
    all_reduce_(t, group)
    return t


def max_scalar_(value: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Max of a scalar tensor over the group, in place."""
    all_reduce_(value, group, op=dist.ReduceOp.MAX)
    return value


def gather_objects(obj: Any, group: CommGroup) -> list[Any]:
    """Every rank's small picklable `obj` (file records, error texts), in group-rank order."""
    if group.size == 1:
        return [obj]
    out: list[Any] = [None] * group.size
    dist.all_gather_object(out, obj, group=group.pg)
    return out


def broadcast_object(obj: Any, group: CommGroup, src_group_rank: int = 0) -> Any:
    """The group's rank `src_group_rank` value of a small picklable `obj`, on every rank."""
    if group.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=group.global_rank_of(src_group_rank), group=group.pg)
    return box[0]


def barrier(group: CommGroup) -> None:
    if group.size > 1:
        dist.barrier(group=group.pg)


_RAISABLE: dict[str, type[Exception]] = {
    t.__name__: t for t in (ValueError, TypeError, FileNotFoundError, PermissionError, OSError, RuntimeError)
}


def raise_if_any_failed(error: BaseException | None, group: CommGroup, what: str) -> None:
    """Agree on a local check; if any rank failed, raise on every rank with the failing rank's cause.

    One small all-reduce when all is well; only on failure are the messages gathered. The failing
    rank re-raises its own exception; the others raise the same type, naming the rank, so every
    rank's log tells the cause and no rank is left waiting in a later collective.
    """
    bad = failed_ranks(error is not None, group)
    if not bad:
        return
    reports = gather_objects(None if error is None else (type(error).__name__, str(error)), group)
    if error is not None:
        raise error
    first = next(r for r in reports if r is not None)
    kind = _RAISABLE.get(first[0], RuntimeError)
    raise kind(f"[rank {group.global_rank}] {what} failed on rank(s) {bad}: {first[1]}")


class agreement:
    """A block whose failure on any rank raises on every rank: on leaving it, the ranks agree (one
    small all-reduce) on whether any of them raised, and those that did not raise the failing rank's
    error type and message (see `raise_if_any_failed`). Any `Exception` counts, whatever its type;
    a `BaseException` such as `KeyboardInterrupt` passes through without a collective.

    Example:

    ```python
    >>> with agreement(world, "hf_zero.save_checkpoint"):
    ...     if world.rank == 0:
    ...         tokenizer.save_pretrained(staging)   # a ValueError here raises on every rank
    ```
    """

    def __init__(self, group: CommGroup, what: str) -> None:
        self.group = group
        self.what = what

    def __enter__(self) -> agreement:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and not isinstance(exc, Exception):
            return  # KeyboardInterrupt and the like: propagate without a collective
        raise_if_any_failed(exc, self.group, self.what)
