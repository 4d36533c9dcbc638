"""`PassListener`: what a training pass tells the engine's parts that follow it, at fixed points.

[Note: pass events]
The hooks run the pass; what else must happen at its fixed points (the call-order header of a forward, the
gradients woken for autograd, the refusal of parameters replaced since `initialize`, the buffers' broadcast, the
gradients put to rest after a backward, the units a graph-building backward keeps whole, the parameters a forward
changed in place) belongs to other owners. Each is a `PassListener`, handed to the hooks once
(`HookSettings.listeners`: the forward checks, the call order, the engine; the hooks add their own checks last:
`GraphPins`, `ChangedInForward`, `UnitsCheck`) and told of every event in the order given; a listener overrides the
events it needs. A listener refuses by raising a `ValueError`: the pass it stopped is forgotten (at once, or by the
next forward) and the error goes on to the caller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .unit import Unit


class PassListener:
    """Told of a pass's events ([Note: pass events]); every method a no-op unless overridden.

    Example:

    ```python
    >>> class Counter(PassListener):
    ...     forwards = 0
    ...     def root_forward(self) -> None:
    ...         self.forwards += 1
    ```
    """

    def root_forward(self) -> None:
        """The model's forward begins (not a recomputation), before any unit gathers."""

    def direct_call(self) -> None:
        """A module of the root is called outside the model's forward ([Note: direct calls] in hooks.py)."""

    def before_gather(self, unit: Unit, planned: bool) -> None:
        """A unit's forward (not a recomputation) is about to gather its parameters; `planned`: the prefetch plan pairs
        that gather on every rank ([Note: units run on some ranks] in checks/units_run.py). A listener refuses by
        raising a `ValueError`, as below."""

    def unit_gathered(self, unit: Unit) -> None:
        """A unit's forward, or a direct call, has its parameters gathered and is about to compute (not a
        recomputation)."""

    def unit_forward_ended(self, unit: Unit, direct: bool) -> None:
        """A unit's forward (`direct`: a direct call of a module of the root) ended, its parameters still gathered
        (not a recomputation). A listener refuses what it ran by raising: the hooks forget the pass, then the error
        goes on to the caller (a `ValueError`, [Note: changed in forward] in checks/changed_in_forward.py)."""

    def forward_ended(self) -> None:
        """The model's forward with grad ended (the root's post-forward; the check of an earlier forward acted on
        first). A listener refuses by raising a `ValueError`."""

    def backward(self) -> None:
        """A backward pass begins, before any unit's gradients."""

    def reduced(self) -> None:
        """Fresh gradients reached the shards (the reductions of a backward were waited for)."""

    def deferred(self) -> None:
        """A backward pass ended whose reductions `no_sync` deferred."""

    def before_waiting(self) -> None:
        """What follows depends on the forward's units check, in flight: each listener waits for what it issued, in
        order (the call order's headers, then the units check itself: [Note: units run on some ranks] in
        checks/units_run.py). A listener refuses by raising a `ValueError`."""

    def backward_begun(self, create_graph: bool) -> None:
        """The backward pass's first unit: whether it builds a graph of its own ([Note: double backward] in
        checks/double_backward.py)."""

    def unit_backward(self, unit: Unit, create_graph: bool) -> None:
        """A unit's backward begins with its parameters gathered (its backward reads them)."""

    def backward_ended(self, create_graph: bool) -> None:
        """A backward pass's final callback ended: every unit reduced (or deferred)."""

    def weights_changed(self) -> None:
        """The weights changed between passes (an optimizer step, a load, a change through `gathered_parameters`):
        whatever was gathered before them is stale. A pass's facts stay (a forward's check may still be in flight)."""

    def forget(self) -> None:
        """The pass was interrupted (an exception, or `zero_grad(abandon_pass=True)`): what was kept for it goes."""
