"""Which engine shards a model, and which engine owns a parameter (primitives for the API floor).

The engine is stored in the model's `__dict__` (by `hf_zero.model.attach`); parameters are found
through a weak registry, so that `hf_zero.gathered_parameters(params)` needs no model argument, as
DeepSpeed's `GatheredParameters` needs none, without writing attributes onto the parameters.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from .engine import ZeroEngine

ENGINE_ATTR = "_hf_zero_engine"

# A parameter (the engine's own, or its stand-in) -> its engine. Weak both ways: a dropped model
# leaves nothing behind.
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_params(engine: ZeroEngine) -> None:
    """Record `engine` as the owner of its parameters and their stand-ins."""
    ref = weakref.ref(engine)
    for part in engine.parts:
        for p in part.params:
            _OWNERS[p] = ref
        if part.module_holders is not None:
            for r in part.module_holders.resting:
                _OWNERS[r] = ref


def engine_of_param(param: torch.Tensor) -> ZeroEngine | None:
    """The live engine that owns `param`, or None."""
    ref = _OWNERS.get(param)
    return ref() if ref is not None else None


def is_sharded(model: object) -> bool:
    """Whether `model` was sharded by `hf_zero.initialize`."""
    return isinstance(model, nn.Module) and ENGINE_ATTR in model.__dict__


def get_engine(model: nn.Module) -> ZeroEngine:
    """The engine of a model sharded by `hf_zero.initialize`; `ValueError` for any other model."""
    engine = model.__dict__.get(ENGINE_ATTR) if isinstance(model, nn.Module) else None
    if engine is None:
        inner = getattr(model, "_orig_mod", None)  # torch.compile's wrapper: the engine is on the model it compiled
        hint = (
            " (torch.compile returned a wrapper: pass the model you compiled, `compiled._orig_mod`)"
            if is_sharded(inner)
            else ""
        )
        raise ValueError(
            f"{type(model).__name__} is not sharded by hf_zero: pass the model returned by hf_zero.initialize{hint}."
        )
    return engine


def wrapped_model(model: nn.Module) -> nn.Module:
    """The model a wrapper that has `get_base_model()` (a PEFT model) holds, or `model` itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model
