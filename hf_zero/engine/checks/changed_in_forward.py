"""`ChangedInForward`: parameters a forward changed in place, where the change would be lost.

[Note: changed in forward]
At stage 3 a unit's forward runs on its gathered parameters, which are freed after it: a change the forward makes to
them in place (`nn.Embedding(max_norm=...)` renormalizing the rows it looks up, a weight clamped inside forward)
would be lost, and the backward would recompute with the old values. Under DDP such a change is kept. So the
versions of a gathered unit's parameters are taken when its forward (or a direct call of a module of the root,
[Note: direct calls] in hooks.py) gathers them and compared when it ends. A forward without grad, or a direct call,
is refused at once on the ranks that changed (no collective follows it). A forward with grad is refused on every
rank by the units check after the forward ([Note: units run on some ranks] in checks/units_run.py), which carries
a bit per unit saying its forward changed its parameters (at a world of one, where stage 3 gathers only to cast or to
copy from the host, at the root's post-forward, with nothing to wait for). At stages 0-2 the parameters stay whole
(persistent units) and a change is kept, as under DDP: nothing is taken.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..pass_events import PassListener

if TYPE_CHECKING:
    from ..unit import Unit


def changed_in_forward_error(names: list[str]) -> ValueError:
    """[Note: changed in forward] the refusal naming the parameters a stage-3 forward changed in place."""
    return ValueError(
        f"hf_zero: the forward changed parameters {names} in place (e.g. nn.Embedding(max_norm=...), or a weight "
        "renormalized or clamped inside forward). At ZeRO stage 3 a unit's parameters are gathered for its forward "
        "and freed after it, so the change would be lost and the backward would use the old values. Make the "
        "change between steps, inside `with hf_zero.gathered_parameters(params, modifier_rank=0):`, or train "
        "at ZeRO stage 1 or 2, where the parameters stay whole and such a change is kept."
    )


class ChangedInForward(PassListener):
    """[Note: changed in forward] for one model's units, told of the pass's events ([Note: pass events] in
    pass_events.py).

    Example:

    ```python
    >>> changes = ChangedInForward()
    >>> changes.unit_gathered(unit)                   # the versions as gathered
    >>> changes.unit_forward_ended(unit, direct=False)  # with grad: kept for the units check
    >>> changes.changed(unit)
    True
    ```
    """

    def __init__(self) -> None:
        self._versions: dict[int, tuple[int, ...]] = {}  # by id(unit): its parameters' versions at the gather
        self._changed: dict[int, list[str]] = {}  # by id(unit): what forwards with grad changed this pass

    def changed(self, unit: Unit) -> bool:
        """Whether a forward with grad changed `unit`'s parameters in place this pass."""
        return id(unit) in self._changed

    def changed_names(self) -> list[str]:
        """The parameters forwards with grad changed in place this pass, sorted."""
        return sorted({n for names in self._changed.values() for n in names})

    def unit_gathered(self, unit: Unit) -> None:
        if not unit.persistent:
            self._versions[id(unit)] = unit.param_versions()

    def unit_forward_ended(self, unit: Unit, direct: bool) -> None:
        """Refuse a change in a direct call or a forward without grad; keep one with grad for the units check."""
        versions = self._versions.pop(id(unit), None)
        changed = unit.changed_since(versions) if versions is not None else []
        if not changed:
            return
        if direct or not torch.is_grad_enabled():
            raise changed_in_forward_error(changed)
        self._changed.setdefault(id(unit), []).extend(changed)

    def backward_ended(self, create_graph: bool) -> None:
        self.forget()

    def forget(self) -> None:
        self._versions.clear()
        self._changed.clear()
