"""A bucket of blocks left open by a forward that did not run its blocks once each in order ([Note: bucket blocks
skipped or repeated]): which unit is open, the output it ends with, and the modules whose forward calls its blocks.

[Note: bucket blocks skipped or repeated]
A unit may join several sibling blocks (`bucket_size_mb`): it is gathered at its first block's pre-forward and its
forward ends at its last block's post-forward. Models do not always run each block once in order: LayerDrop skips
blocks (OPT's `layerdrop`, drawn from a seed every rank shares), early exits skip the last ones, ALBERT and looped
transformers run a block again. Under DDP each of these trains. Here a unit's forward begins at whichever of its
blocks runs first (its inputs then carry the unit's end signal, [Note: backward end] in hooks.py); a block of the
open unit run again finds it gathered; after a block other than its last the unit stays open, with that block's
output as the unit's, and its forward ends when another unit begins, when the module that calls the blocks returns
(the decoder of `model.model(...)`, TRL's backbone calls), when the model's forward ends, or at once where none of
these runs (a block called on its own). Its backward then runs from the gradient of the output of the last block
that ran to its first inputs', as for one module. Skipped blocks' parameters get no gradient on this rank (zeros in
the reduction, as under DDP)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from .passes import in_backward
from .unit import Unit

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # hold blocks, never called


class OpenBucket:
    """The bucketed unit whose forward has not ended after a block other than its last, and its latest output."""

    def __init__(self) -> None:
        self._unit: Unit | None = None
        self._output: Any = None
        self._callers_running = 0  # forwards of the modules that call bucketed blocks, running now

    def holds(self, unit: Unit) -> bool:
        return self._unit is unit

    def keep_open(self, unit: Unit, output: Any) -> None:
        """`unit`'s block other than its last returned `output`: the unit stays open with it."""
        self._unit, self._output = unit, output

    def take(self) -> tuple[Unit, Any] | None:
        """The open unit and its output, forgotten here (its forward is to end now), or None."""
        if self._unit is None:
            return None
        taken = (self._unit, self._output)
        self.forget()
        return taken

    def forget(self) -> None:
        self._unit, self._output = None, None

    def hook_callers(self, callers: list[nn.Module], close: Callable[[], None]) -> list[RemovableHandle]:
        """Count the forwards of `callers` (`bucket_callers`) running; as one returns, `close()` the open bucket."""

        def enter(module: nn.Module, args: Any) -> None:
            self._callers_running += 1

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            self._callers_running = max(0, self._callers_running - 1)
            if not in_backward():
                close()

        handles = []
        for caller in callers:
            handles.append(caller.register_forward_pre_hook(enter))
            handles.append(caller.register_forward_hook(leave, always_call=True))
        return handles

    def caller_running(self) -> bool:
        """Whether a module that calls bucketed blocks (other than the root) is in its forward."""
        return self._callers_running > 0


def bucket_callers(root: nn.Module, units: list[Unit]) -> list[nn.Module]:
    """The modules whose forward calls the blocks of a bucketed unit (the nearest ancestor of its blocks that is not
    a `ModuleList`/`ModuleDict`), the root excepted."""
    parent: dict[int, nn.Module] = {}
    for module in root.modules():
        for child in module.children():
            parent.setdefault(id(child), module)
    callers: dict[int, nn.Module] = {}
    for unit in units:
        blocks = unit.spec.all_modules
        if len(blocks) < 2:
            continue
        caller = parent.get(id(blocks[0]))
        while caller is not None and isinstance(caller, _CONTAINERS):
            caller = parent.get(id(caller))
        if caller is not None and caller is not root:
            callers[id(caller)] = caller
    return list(callers.values())
