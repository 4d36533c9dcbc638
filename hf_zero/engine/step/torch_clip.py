"""torch's gradient clipping functions, made right for the parameters of a sharded model.

[Note: torch clipping]
`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` is the unchanged line of every DDP loop.
On a sharded model it would see no gradient: after the backward every parameter's `.grad` is a stand-in with
no value (the gradients live in flat shards, [Note: gradients] in grads.py, [Note: resting gradients] in
resting.py); were it None, torch would return a norm of 0 and clip nothing, silently. `install()` (run when
hf_zero is imported) replaces `clip_grad_norm_` and `clip_grad_value_` in `torch.nn.utils` and
`torch.nn.utils.clip_grad` by functions that, for the parameters of a sharded model (all or some of them, real
ones or stand-ins), clip its gradient shards: the norm is the global one over every rank's shards (a
collective: every rank must call it, as every rank calls it under DDP), equal to what torch returns for the
unsharded gradients, and the value clip is elementwise on the shards. Parameters of no sharded model go to
torch's own functions unchanged.

A copy of torch's `clip_grad_norm_` bound before hf_zero was imported (`from torch.nn.utils import
clip_grad_norm_` above `import hf_zero`), and torch's two-step `get_total_norm` + `clip_grads_with_norm_`,
reach torch's internal `_clip_grads_with_norm_`, which is replaced too: for a sharded model's parameters it
raises, naming the call to use, instead of scaling by a norm computed from no gradient.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.nn.utils as nn_utils
import torch.nn.utils.clip_grad as clip_grad


class Clippable(Protocol):
    """What the clipping functions ask of an engine (`ZeroEngine` is one)."""

    def owns(self, param: torch.Tensor) -> bool: ...

    def model_params_of(self, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None: ...

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, params: Iterable[torch.Tensor] | None = None
    ) -> torch.Tensor: ...

    def clip_grad_value_(self, clip_value: float, params: Iterable[torch.Tensor] | None = None) -> None: ...


_engines: weakref.WeakSet[Any] = weakref.WeakSet()
_original: dict[str, Any] = {}


def register(engine: Clippable) -> None:
    """Have torch's clipping functions recognize `engine`'s parameters."""
    _engines.add(engine)


def _owner(params: list[torch.Tensor], caller: str) -> tuple[Clippable | None, list[torch.Tensor]]:
    """The one engine that owns `params` (None when none of them belongs to a sharded model) and the model
    parameters they stand for: themselves, or, for tensors of its optimizers' `param_groups` (Lightning clips
    `optimizer.param_groups`' tensors), the parameters of those groups."""
    for engine in _engines:
        chosen = engine.model_params_of(params)
        if chosen is not None:
            return engine, chosen
    return _model_owner(params, caller), params


def _model_owner(params: list[torch.Tensor], caller: str) -> Clippable | None:
    owners = [next((e for e in _engines if e.owns(p)), None) for p in params]
    engines = {id(e): e for e in owners if e is not None}
    if not engines:
        return None
    if len(engines) > 1 or None in owners:
        raise ValueError(
            f"torch.nn.utils.{caller} got parameters of {len(engines)} sharded model(s)"
            + (" and parameters of no sharded model" if None in owners else "")
            + ": hf_zero clips one sharded model's parameters per call. Call it once per model."
        )
    return next(iter(engines.values()))


def _as_list(parameters: Any) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def clip_grad_norm_(
    parameters: Any,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """torch's `clip_grad_norm_`; for a sharded model's parameters, the global norm of their gradient shards,
    clipped in place ([Note: torch clipping])."""
    engine, params = _owner(_as_list(parameters), "clip_grad_norm_")
    if engine is None:
        return _original["clip_grad_norm_"](params, max_norm, norm_type, error_if_nonfinite, foreach)
    norm_type = float(norm_type)
    if error_if_nonfinite:
        total = engine.clip_grad_norm_(math.inf, norm_type, params)
        if not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
                "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
    return engine.clip_grad_norm_(max_norm, norm_type, params)


def clip_grad_value_(parameters: Any, clip_value: float, foreach: bool | None = None) -> None:
    """torch's `clip_grad_value_`; for a sharded model's parameters, their gradient shards clamped in place."""
    engine, params = _owner(_as_list(parameters), "clip_grad_value_")
    if engine is None:
        return _original["clip_grad_value_"](params, clip_value, foreach)
    engine.clip_grad_value_(clip_value, params)
    return None


def _clip_grads_with_norm_(parameters: Any, max_norm: float, total_norm: torch.Tensor, foreach: Any = None) -> None:
    """torch's internal scaling step: refused for a sharded model's parameters ([Note: torch clipping])."""
    params = _as_list(parameters)
    if _owner(params, "clip_grads_with_norm_")[0] is not None:
        raise ValueError(
            "torch's gradient clipping got the parameters of a model sharded by hf_zero, whose .grad holds no "
            "value (the gradients live in flat shards), through a copy of torch.nn.utils.clip_grad_norm_ bound "
            "before hf_zero was imported, or through get_total_norm + clip_grads_with_norm_. Call "
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) after `import hf_zero`, or "
            "optimizer.clip_grad_norm_(max_norm) (the optimizer hf_zero.initialize returned)."
        )
    _original["_clip_grads_with_norm_"](params, max_norm, total_norm, foreach)


def install() -> None:
    """Replace torch's clipping functions ([Note: torch clipping]); idempotent."""
    if _original:
        return
    _original.update(
        clip_grad_norm_=clip_grad.clip_grad_norm_,
        clip_grad_value_=clip_grad.clip_grad_value_,
        _clip_grads_with_norm_=clip_grad._clip_grads_with_norm_,
    )
    replaced: dict[str, Any] = {"clip_grad_norm_": clip_grad_norm_, "clip_grad_value_": clip_grad_value_}
    for module in (nn_utils, clip_grad):
        for name, fn in replaced.items():
            setattr(module, name, fn)
    for module, name in ((clip_grad, "_clip_grads_with_norm_"), (nn_utils, "clip_grads_with_norm_")):
        setattr(module, name, _clip_grads_with_norm_)
