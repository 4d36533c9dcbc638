"""`ZeroModel`: the methods a sharded model gains, added by swapping its class in place.

The model stays an instance of its own class (a subclass is made with the same name), so
`isinstance(model, LlamaForCausalLM)`, `model.config`, `generate` and the rest of the HF API keep
working and there is nothing to unwrap.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from .engine import ModelStateMemory, ZeroEngine

_ENGINE_ATTR = "_hf_zero_engine"
_SUBCLASSES: dict[type, type] = {}


class ZeroModel:
    """Mixin placed first in the MRO of a model sharded by `hf_zero.initialize`."""

    _is_accelerate_prepared = True  # Accelerate must not wrap it in DDP

    @property
    def zero_engine(self) -> ZeroEngine:
        return self.__dict__[_ENGINE_ATTR]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the gradient communication of the backward passes run inside, as with DDP and FSDP.

        Gradients then accumulate unsharded on each rank until a backward pass outside the
        context reduces them. At stages 0-1 they accumulate in the buffer that exists anyway; at
        stages 2-3 each unit keeps an unsharded gradient buffer (the parameters' size in the
        compute dtype) alive until the synchronising micro-batch, which costs that memory but
        saves one reduce-scatter per micro-batch.

        Example:

        ```python
        >>> with model.no_sync():
        ...     model(**micro_batch_1).loss.backward()
        >>> model(**micro_batch_2).loss.backward()  # reduces both micro-batches' gradients
        ```
        """
        with self.zero_engine.no_sync():
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the sharded gradients (and any unsharded ones held by `no_sync`)."""
        self.zero_engine.zero_grad()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by their global norm over all shards; returns that norm."""
        return self.zero_engine.clip_grad_norm_(max_norm, norm_type)

    def model_state_memory(self) -> ModelStateMemory:
        """The bytes of parameters, gradients and optimizer state this rank holds, by device."""
        return self.zero_engine.memory()


def attach(model: nn.Module, engine: ZeroEngine) -> None:
    """Swap `model`'s class for a same-named subclass with `ZeroModel` first, and store the engine."""
    cls = type(model)
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (ZeroModel, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        _SUBCLASSES[cls] = sub
    model.__class__ = sub
    model.__dict__[_ENGINE_ATTR] = engine


def is_sharded(model: object) -> bool:
    """Whether `model` was sharded by `hf_zero.initialize`."""
    return isinstance(model, nn.Module) and _ENGINE_ATTR in model.__dict__


def get_engine(model: nn.Module) -> ZeroEngine:
    """The engine of a model sharded by `hf_zero.initialize`; `ValueError` for any other model."""
    engine = model.__dict__.get(_ENGINE_ATTR) if isinstance(model, nn.Module) else None
    if engine is None:
        raise ValueError(
            f"{type(model).__name__} is not sharded by hf_zero: pass the model returned by hf_zero.initialize."
        )
    return engine
