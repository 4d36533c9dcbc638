"""`GraphPins`: the units a backward that builds a graph keeps whole for the backward that goes through it.

[Note: double backward]
A backward run with `create_graph=True` (`torch.autograd.grad(..., create_graph=True)` for a gradient penalty)
builds a graph that reads the parameters again when a later backward goes through it. At stage 3 its units are
pinned as its backward gathers them, and stay whole until the final callback of the next backward pass that builds
no graph (or an optimizer step, after which torch refuses that graph anyway); that pass, which runs the
second-order terms in no fixed order, reduces every unit in its final callback, in unit order, at every stage
(each thread numbers the nodes it creates: on a GPU that graph comes from the device's autograd thread, and its
terms may follow a unit's end signal). `GraphPins` is told of the pass's events like every listener ([Note: pass
events] in pass_events.py); the pass asks it whether a graph was built (`built`) to defer its reductions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lifecycle import TrainingState
from ..pass_events import PassListener

if TYPE_CHECKING:
    from ..unit import Unit


class GraphPins(PassListener):
    """[Note: double backward] for one model's units; `pins`: the parameters rest as shards between uses (stage 3),
    so a graph's units must be pinned (at stages 0-2 they stay whole anyway).

    Example:

    ```python
    >>> graph = GraphPins(pins=True)
    >>> graph.backward_begun(create_graph=True)     # a gradient penalty's backward
    >>> graph.unit_backward(unit, create_graph=True)  # its units stay gathered
    >>> graph.built
    True
    ```
    """

    def __init__(self, pins: bool) -> None:
        self._pins = pins
        self._units: list[Unit] = []  # pinned for the graph, in the order the backward gathered them
        self._built = False  # a backward built a graph that a later one may go through

    @property
    def built(self) -> bool:
        """Whether a backward built a graph that a later backward may go through (its reductions are deferred)."""
        return self._built

    def backward_begun(self, create_graph: bool) -> None:
        if create_graph:
            self._built = True

    def unit_backward(self, unit: Unit, create_graph: bool) -> None:
        if create_graph and self._pins and unit not in self._units:
            unit.pin()
            self._units.append(unit)

    def backward_ended(self, create_graph: bool) -> None:
        if not create_graph:
            self.forget()  # the graph the pins served was consumed

    def weights_changed(self) -> None:
        self.forget()  # a graph built before is stale: its units were gathered from the old weights

    def forget(self) -> None:
        """The graph is gone (consumed, invalidated by a step, or its pass interrupted): unpin and free its units."""
        units, self._units = self._units, []
        self._built = False
        for unit in units:
            unit.unpin()
            if unit.training_state in (TrainingState.IDLE, TrainingState.REDUCING):
                unit.release()
