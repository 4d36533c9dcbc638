"""The tensors inside a forward's inputs and outputs, in any container.

[Note: containers]
A unit's hooks must see every tensor its forward takes and returns: the outputs to learn when its
backward begins, the inputs that carry its end-of-backward signal ([Note: backward end] in hooks.py).
A tensor they miss gets no hook, and at stage 3 the unit's backward would then read parameters already
freed. The walk is PyTorch's own `tree_flatten` (tuples, lists, dicts, namedtuples, `OrderedDict`, and
every registered node: Hugging Face's `ModelOutput`), extended to plain dataclasses, which pytree does
not know unless registered: their fields are walked in turn, and a rebuilt dataclass is a shallow copy
with the new field values (frozen ones too).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree


def _is_plain_dataclass(obj: Any) -> bool:
    """A dataclass instance pytree does not walk by itself."""
    return (
        dataclasses.is_dataclass(obj)
        and not isinstance(obj, type)
        and type(obj) not in pytree.SUPPORTED_NODES
        and not isinstance(obj, torch.Tensor)
    )


def flatten(obj: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """The leaves of `obj` (tensors and anything else), and a function that rebuilds `obj` from new leaves."""
    leaves, spec = pytree.tree_flatten(obj, is_leaf=_is_plain_dataclass)
    flat: list[Any] = []
    rebuilders: list[tuple[int, int, Callable[[list[Any]], Any] | None]] = []
    for leaf in leaves:
        if _is_plain_dataclass(leaf):
            fields = [f.name for f in dataclasses.fields(leaf)]
            inner, rebuild_fields = flatten({name: getattr(leaf, name) for name in fields})
            rebuilders.append((len(flat), len(inner), partial_dataclass(leaf, rebuild_fields)))
            flat.extend(inner)
        else:
            rebuilders.append((len(flat), 1, None))
            flat.append(leaf)

    def rebuild(new: list[Any]) -> Any:
        out = [new[start] if fn is None else fn(new[start : start + n]) for start, n, fn in rebuilders]
        return pytree.tree_unflatten(out, spec)

    return flat, rebuild


def partial_dataclass(template: Any, rebuild_fields: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """A function of new leaves: a shallow copy of `template` with its fields rebuilt from them."""

    def rebuild(new: list[Any]) -> Any:
        out = copy.copy(template)
        for name, value in rebuild_fields(new).items():
            object.__setattr__(out, name, value)
        return out

    return rebuild


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in `obj` ([Note: containers])."""
    return [leaf for leaf in flatten(obj)[0] if isinstance(leaf, torch.Tensor)]


def cast_floating_inputs(args: Any, kwargs: dict[str, Any], dtype: torch.dtype) -> tuple[Any, Any, bool]:
    """[Note: input dtype]
    Under mixed precision every parameter computes in `dtype` (bf16 or fp16), so a floating-point input in
    another dtype would meet them in the first matrix product and fail there ("mat1 and mat2 must have the same
    dtype"): a model fed features, pixels or `inputs_embeds` in fp32. The root's floating-point tensor inputs, in
    any container, are cast to `dtype` before its forward, as FSDP2 does by default
    (`MixedPrecisionPolicy(cast_forward_inputs=True)`); the cast is differentiable, so an input that requires grad
    gets its gradient in its own dtype. Targets passed as `labels` (or `label`, `*_labels`) keep theirs: they meet
    the outputs in the loss, where type promotion computes in the wider dtype. Integer and bool inputs (token ids,
    masks) are left alone. Returns the new args and kwargs and whether anything was cast."""
    targets = {k: v for k, v in kwargs.items() if k in ("labels", "label") or k.endswith("_labels")}
    leaves, rebuild = flatten((args, {k: v for k, v in kwargs.items() if k not in targets}))
    cast_any = False
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dtype != dtype:
            leaves[i] = leaf.to(dtype)
            cast_any = True
    if not cast_any:
        return args, kwargs, False
    new_args, new_kwargs = rebuild(leaves)
    return tuple(new_args), {**new_kwargs, **targets}, True
