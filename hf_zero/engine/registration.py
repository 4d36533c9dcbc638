"""Where the engine's hooks sit among a module's other hooks ([Note: hook order]), and the modules and parameters
they are registered on."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

from torch import nn
from torch.utils.hooks import RemovableHandle

from .unit import Unit

# [Note: hook order]
# A unit's forward hooks share its modules with hooks others registered: a forward pre-hook that reads the
# unit's weights registered before `initialize` (user code, a library's patch), a forward hook that reads them
# registered after it (`block.register_forward_hook(lambda m, a, o: o + c * m.lin.weight.sum())`). Both run
# while the unit's parameters are whole when the engine's pre-forward hook runs first (registered with
# `prepend=True`) and its post-forward hook runs last (each forward of the unit moves it back to the end of the
# module's forward hooks if one was registered after it: `keep_last`). Under DDP every hook sees the weights;
# here, in any other order, stage 3 met the stand-ins and stages 1-2 the gradient of a weight the pre-hook used
# after the unit's reduction. Running last, the engine also hooks the outputs the other hooks returned, which are
# what the rest of the model uses. Hooks registered with `prepend=True` after `initialize`, and global module
# hooks (`register_module_forward_pre_hook`), still run before the engine's.


def register_first_pre_hook(module: nn.Module, hook: Callable[..., Any], with_kwargs: bool = False) -> RemovableHandle:
    """[Note: hook order] a forward pre-hook that runs before those already on `module`."""
    return module.register_forward_pre_hook(hook, prepend=True, with_kwargs=with_kwargs)


def keep_last(module: nn.Module, handle: RemovableHandle) -> None:
    """[Note: hook order] move the forward hook `handle` to the end of `module`'s, if another came after it."""
    hooks = cast("OrderedDict[int, Callable[..., Any]]", module._forward_hooks)  # an OrderedDict in torch
    if hooks and next(reversed(hooks)) != handle.id and handle.id in hooks:
        hooks.move_to_end(handle.id)


def members(unit: Unit) -> list[nn.Module]:
    """[Note: direct calls] in hooks.py: the modules that hold `unit`'s parameters, other than the unit's own."""
    own = {id(m) for m in unit.spec.all_modules}
    found = {id(m): m for part in unit.parts for holders in part.spec.holders for m, _ in holders}
    return [m for key, m in found.items() if key not in own]


def weakly(method: weakref.WeakMethod[Callable[..., Any]], unit: weakref.ref[Unit], *args: Any) -> None:
    """Call `method(unit, *args)` (both weak references) if they still live."""
    bound, target = method(), unit()
    if bound is not None and target is not None:
        bound(target, *args)
