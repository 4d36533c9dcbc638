"""The units check: which units ran their forward, and which changed their parameters, on which ranks.

[Note: units run on some ranks]
A unit may run its forward on some ranks and not others in a step (LayerDrop drawn per rank, an expert no token of a
rank reached, a branch on the data); its reduction would then be issued on some ranks only and the collectives would
pair up wrongly or hang. After every forward with grad, one all-gather of a byte per unit (the root last; bit 0: it
ran since the last backward, bit 1: its forward changed its parameters in place, [Note: changed in forward] in
checks/changed_in_forward.py) is issued at the root's post-forward (`forward_ended`) and waited for
(`before_waiting`) only before what depends on it: the first hook of the backward past the root's, a recomputed
forward, the final callback, or the next forward (waiting at the point of issue cost 80-95 ms per step on the small
preset, 2 ranks on gloo). Where the
ranks differ: at stages 0-2 the backward defers every reduction to its final callback, in unit order, a rank that
did not run a unit reducing zeros for it (exact, as DDP with `find_unused_parameters=True`); at stage 3, whose
gathers already depend on which units ran, it is refused on every rank, naming the units. A gather no prefetch plan
pairs on every rank (the first forward, or no prefetch) is agreed on first (`before_gather`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..collectives import CommGroup, issue_flags_gather, issue_ints_gather
from ..pass_events import PassListener
from .changed_in_forward import ChangedInForward, changed_in_forward_error

if TYPE_CHECKING:
    from ..passes import Pass
    from ..unit import Unit


def units_apart_error(what: str) -> ValueError:
    """[Note: units run on some ranks] the stage-3 refusal; `what` names the units and how the ranks differ."""
    return ValueError(
        f"hf_zero: {what}. At ZeRO stage 3 every rank must run the same units (each forward gathers their parameters "
        "with the other ranks). Make the choice the same on every rank (draw LayerDrop or routing from a seed shared "
        "by all ranks), run the skipped unit on zero-sized input, or use ZeroConfig(stage=2)."
    )


class UnitsCheck(PassListener):
    """[Note: units run on some ranks] for one model's units over `world` (None: a world of one checks nothing), the
    last of the pass's listeners ([Note: pass events] in pass_events.py).

    `gathers`: stage 3 (units apart are refused, not deferred). `changes`: which units' forwards changed their
    parameters in place. `current`: the running pass, whose verbs keep the check in flight and the units that ran
    anywhere. Told when a gather is about to be issued, when a forward with grad ends (the check issued) and when the
    hooks wait for it (the call order's headers read first, [Note: call order] in checks/call_order.py); a refusal
    is a `ValueError`, on which the hooks forget the pass."""

    def __init__(
        self, units: list[Unit], world: CommGroup | None, gathers: bool, changes: ChangedInForward, current: Pass
    ) -> None:
        self.units, self.world, self.gathers, self.changes, self.current = units, world, gathers, changes, current

    def before_gather(self, unit: Unit, planned: bool) -> None:
        """A gather no prefetch plan pairs on every rank (`planned` False: the first forward, or no prefetch), at stage
        3 over several ranks: every rank says which unit it gathers (a few bytes), so a unit one rank skips is refused
        here, naming it, instead of its gather meeting another unit's (wrong weights, or a hang)."""
        world = self.world
        if planned or not self.gathers or not unit.needs_gather or world is None or world.size == 1:
            return
        indices = [row[0] for row in issue_ints_gather([self.units.index(unit)], world).values()]
        if len(set(indices)) > 1:
            names = sorted({self.units[i].name for i in indices})
            raise units_apart_error(f"the ranks gather different units ({names}) at the same point of a forward")

    def forward_ended(self) -> None:
        """After a forward with grad, at the root's post-forward (an earlier forward's check acted on first): the
        check of this forward, waited for later. Over no other rank there is nothing to wait for: a change in place is
        refused at once ([Note: changed in forward] at a world of one, where stage 3 gathers to cast or to copy from
        the host)."""
        if self.world is None or self.world.size == 1:
            changed = self.changes.changed_names()
            if changed:
                raise changed_in_forward_error(changed)
            return
        codes = [int(self.current.ran(u)) | int(self.changes.changed(u)) << 1 for u in self.units]
        self.current.issue_units_check(issue_flags_gather(codes, self.world))

    def before_waiting(self) -> None:
        """Wait for the check issued after the forward and act on it: refuse a change in place or (stage 3) units
        apart, or defer the reductions (stages 0-2)."""
        check = self.current.take_units_check()
        if check is None:
            return
        inner = self.units[:-1]
        codes = check.values()  # per rank, per unit (the root last)
        if any(code & 2 for row in codes for code in row):  # [Note: changed in forward], on some rank
            changed = self.changes.changed_names()
            raise changed_in_forward_error(changed or ["(on another rank)"])
        ran_on = [[bool(code & 1) for code in row[:-1]] for row in codes]
        anywhere = [any(column) for column in zip(*ran_on)]
        mixed = [u for u, column in zip(inner, zip(*ran_on)) if any(column) and not all(column)]
        if not mixed:
            return
        if self.gathers:
            raise units_apart_error(
                f"units {[u.name for u in mixed]} ran their forward on some ranks and not on others"
            )
        self.current.ranks_ran([u for u, ran in zip(inner, anywhere) if ran])  # the reductions wait, in unit order
