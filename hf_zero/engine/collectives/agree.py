"""Agreement among ranks: a local check or failure that raises on every rank, small objects exchanged.

Every function here is a collective that every rank of the group calls: a check that failed on one rank
raises on all of them (naming the rank and its cause) instead of leaving the others waiting in the
next collective.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from .group import CommGroup, comm_device


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


def digest_of(text: str) -> int:
    """A 56-bit digest of `text`, for `all_agree` and `first_to_differ`."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def first_to_differ(digest: int, value: Any, group: CommGroup) -> tuple[int, Any] | None:
    """None where every rank of `group` passed the same `digest` (one small all-reduce); else the global rank and the
    `value` (small, picklable; gathered only then) of the first rank whose digest differs from this one's."""
    if all_agree(digest, group):
        return None
    every = gather_objects((digest, value), group)
    other = next(r for r, (theirs, _) in enumerate(every) if theirs != digest)
    return group.global_rank_of(other), every[other][1]


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


def _raisable_name(error: BaseException) -> str:
    """The name of the first class of `error`'s that the other ranks re-raise (a subclass of `TypeError` defined
    elsewhere is re-raised as a `TypeError`); `RuntimeError` when none is."""
    return next((c.__name__ for c in type(error).__mro__ if c.__name__ in _RAISABLE), "RuntimeError")


def raise_if_any_failed(error: BaseException | None, group: CommGroup, what: str) -> None:
    """Agree on a local check; if any rank failed, raise on every rank with the failing rank's cause.

    One small all-reduce when all is well; only on failure are the messages gathered. The failing
    rank re-raises its own exception; the others raise the same type, naming the rank, so every
    rank's log tells the cause and no rank is left waiting in a later collective.
    """
    bad = failed_ranks(error is not None, group)
    if not bad:
        return
    reports = gather_objects(None if error is None else (_raisable_name(error), str(error)), group)
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
