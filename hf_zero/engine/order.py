"""The prefetch plan: which units each unit gathers ahead of it, fixed once from the first forward's order."""

from __future__ import annotations

from .unit import Prefetch, Unit


def plan_prefetches(order: list[Unit], ahead: int) -> None:
    """[Note: prefetch] fix each unit's prefetch targets from the forward order: the next `ahead` units in forward
    order, and in reverse order during backward (skipping units whose backward needs no parameters, see
    `UnitSpec.backward_reads_params`).

    A backward prefetch that would hold more at once than the largest unit's parameters and gradients (the floor
    of the peak) is issued after the unit's backward instead (`late`): with a 32000-word head, not gathering the
    last block during the head's backward saves a block. The reduction in flight and the prefetch never coexist
    ([Note: reduction-gated prefetch] in hooks.py).

    Args:
        order (`list[Unit]`): the inner units in the order the first forward ran them.
        ahead (`int`): how many units are gathered ahead of the running one (`ZeroConfig.prefetch`).
    """
    backward = [u for u in reversed(order) if u.spec.backward_reads_params]
    budget = max(u.param_nbytes + u.grad_nbytes for u in order)
    reverse = order[::-1]
    for unit in order:
        i, j = order.index(unit), reverse.index(unit)
        later = backward[backward.index(unit) + 1 :][:ahead] if unit in backward else []
        in_flight = reverse[j - 1].grad_nbytes if j > 0 else 0  # the reduction of the unit before
        late = unit in backward and (
            unit.param_nbytes + unit.grad_nbytes + max(in_flight, sum(u.param_nbytes for u in later)) > budget
        )
        unit.plan_prefetch(
            Prefetch(
                forward=tuple(order[i + 1 : i + 1 + ahead]),
                backward=tuple(later),
                late=late,
                pooled_after_forward=_sizes(order[i + 1 : i + 2 + ahead]),
                pooled_after_backward=_sizes(reverse[j + 1 : j + 2 + ahead]),
            )
        )


def _sizes(units: list[Unit]) -> frozenset[int]:
    """The pooled buffer sizes `units` take."""
    return frozenset().union(*(u.buffer_nbytes for u in units))
