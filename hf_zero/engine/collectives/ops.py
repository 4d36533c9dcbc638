"""The data collectives the engine issues, as plain functions over a `CommGroup` (group.py).

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
broadcast from each rank (every rank's row sent once to every peer, the bytes of an
all-gather), and a reduce-scatter as an all-reduce of the whole buffer (which overwrites it)
keeping this rank's row (twice the bytes of a reduce-scatter). The backend's collectives are
the fast path on NCCL. gloo's all-gather and reduce-scatter are slow for their bytes, so "auto"
composes them there: 2 ranks, fp32, 100 MB buffers, all-gather 164 ms native vs 50 ms as
broadcasts, reduce-scatter 178 ms native vs 106 ms through all-reduce (`benchmarks/collectives.py`).
Point-to-point sends were faster still for the reduce-scatter (58 ms) but were dropped: a gloo
group that had run them occasionally aborted the process at exit (2 of about 100 benchmark jobs).
Where the caller has a free buffer of the input's size (the unsharded gradients after their cast
to the reduce dtype), the composed reduce-scatter receives every rank's row into it with an
all-to-all (the bytes of a reduce-scatter) and sums them locally: 2 ranks, 12.8M elements, bf16
7 ms + 1 ms for the sum against 20 ms for the all-reduce (fp32 22 + 5 ms against 42 ms, but there
the buffer would be an extra allocation, so fp32 keeps the all-reduce).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .group import CommGroup, Pending, comm_device

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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

    `shard` may be this rank's own row of `output` (in place). Tensors off the communication
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
    rows = output.view(group.size, -1)
    if rows[group.rank].data_ptr() != shard.data_ptr():
        rows[group.rank].copy_(shard)
    return Pending(
        [dist.broadcast(rows[i], src=group.global_rank_of(i), group=group.pg, async_op=True) for i in range(group.size)]
    )


def reduce_scatter_into(
    output: torch.Tensor,
    full: torch.Tensor,
    group: CommGroup,
    async_op: bool = False,
    scratch: torch.Tensor | None = None,
) -> Pending:
    """Sum `full` over the group and keep this rank's row in `output` (SUM, not mean).

    `output` must not overlap `full`. `full` is consumed: the composed implementation sums it in
    place (see [Note: composed collectives]). `scratch`, a free buffer of `full`'s size and dtype, lets
    the composed implementation receive every rank's row instead (an all-to-all, half the bytes of the
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


def all_to_all_into(output: torch.Tensor, rows: torch.Tensor, group: CommGroup, async_op: bool = False) -> Pending:
    """Send row j of `rows` (`(group.size, n)`) to group rank j; `output` (`(group.size, n)`) receives rank i's row
    for this rank in row i."""
    if group.size == 1:
        output.copy_(rows)
        return Pending()
    staged_out, staged_in = _staged(output, group), _staged(rows, group)
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


class GatheredInts:
    """An all-gather of every rank's small integers in flight (`issue_ints_gather`); `values()` waits for it."""

    def __init__(self, out: torch.Tensor, pending: Pending, size: int, mine: torch.Tensor | None = None) -> None:
        self._out, self._pending, self._size = out, pending, size
        self._mine = mine  # the input stays alive until the collective that reads it is waited for

    def values(self) -> list[list[int]]:
        """Every rank's integers, indexed by group rank (waits, then a host sync)."""
        self._pending.wait()
        return [[int(v) for v in row] for row in self._out.view(self._size, -1).tolist()]


class GatheredFlags(GatheredInts):
    """An all-gather of every rank's flags in flight (`issue_flags_gather`); `rows()` waits for it."""

    def rows(self) -> list[list[bool]]:
        """Every rank's flags, indexed by group rank (waits, then a host sync)."""
        return [[bool(v) for v in row] for row in self.values()]


def issue_flags_gather(flags: Sequence[int], group: CommGroup) -> GatheredFlags:
    """Issue an all-gather of every rank's flags (small integers, the same count on each: one all-gather of bytes,
    cheaper than an all-reduce on gloo) without waiting: the ranks meet when `rows()` is called, so a rank that
    arrives early keeps computing instead of waiting for the others at the point of issue."""
    mine = queued_tensor([int(f) for f in flags], torch.uint8, comm_device(group))
    return GatheredFlags(*_issue_gather(mine, group))


def issue_ints_gather(values: Sequence[int], group: CommGroup) -> GatheredInts:
    """Issue an all-gather of a few int64 from every rank (the same count on each) without waiting."""
    mine = queued_tensor(list(values), torch.int64, comm_device(group))
    return GatheredInts(*_issue_gather(mine, group))


def queued_tensor(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A few integers on `device`, queued without a host sync: torch copies pageable host memory to a device
    with a copy and then a stream synchronize, which at a forward's start or end (where the units check and the
    call-order header are issued, [Note: call order]) would make the host wait for every kernel queued before it;
    from pinned memory with `non_blocking` the copy is queued like a kernel (the pinned block is not reused before
    it ran: torch's host allocator records the stream)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _issue_gather(mine: torch.Tensor, group: CommGroup) -> tuple[torch.Tensor, Pending, int, torch.Tensor | None]:
    if group.size == 1:
        return mine, Pending(), 1, None
    out = torch.empty(group.size * mine.numel(), dtype=mine.dtype, device=mine.device)
    work = _all_gather_single(out, mine, group=group.pg, async_op=True)
    return out, Pending(work), group.size, mine


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


def broadcast_tensors(tensors: Sequence[torch.Tensor], group: CommGroup, src_group_rank: int = 0) -> None:
    """Overwrite each of `tensors` on every rank with the copy of the group's rank `src_group_rank`: one broadcast
    per (dtype, device) of them, through a flat staging buffer (none for a single tensor)."""
    if group.size == 1 or not tensors:
        return
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for same in by_kind.values():
        if len(same) == 1 and same[0].is_contiguous():
            broadcast_(same[0], group, src_group_rank)
            continue
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        broadcast_(flat, group, src_group_rank)
        offset = 0
        for t in same:
            t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def sum_scalars(values: Sequence[torch.Tensor], group: CommGroup) -> torch.Tensor:
    """Stack scalars and sum them over the group in one collective (stays on device, no sync)."""
    t = torch.stack([v.reshape(()) for v in values]) if len(values) > 1 else values[0].reshape(1).clone()
    all_reduce_(t, group)
    return t


def max_scalar_(value: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Max of a scalar tensor over the group, in place."""
    all_reduce_(value, group, op=dist.ReduceOp.MAX)
    return value
