"""What a stage-3 parameter is between uses: a `RestingParameter`, safe to touch.

[Note: resting parameters]
At stage 3 a unit's compute parameters (views of its flat buffer, [Note: flat layout] in flat.py)
hold memory only while the unit is gathered. Between uses the modules do not hold those views
(reading a view of a freed buffer reads freed memory: a segfault, or garbage); each holder (a module attribute
that holds a parameter) holds a `RestingParameter` instead, registered in `module._parameters` whenever the unit is
resharded and swapped back for the real parameter when it is gathered (as FSDP2 swaps its
sharded and unsharded parameters). A `RestingParameter`:

- has the parameter's full shape, dtype, device and `requires_grad`, so metadata code works
  unchanged: `numel()`, `model.num_parameters()`, `model.device`, `model.dtype`, `.to()` to the
  same device, `requires_grad_()` (kept in step with the real parameter);
- forwards gradient hooks (`register_hook`, `register_post_accumulate_grad_hook`) to the real
  parameter, which is the one autograd sees, and so do `loss.backward(inputs=[...])` and
  `torch.autograd.grad(loss, [...])` given stand-ins ([Note: backward to resting parameters]);
- refuses `param.data = tensor` by name (the next gather would drop it);
- raises a `RestingParameterError` (a `TypeError`, and a `RuntimeError`) on any read of values (`sum`, `norm`,
  `clone`, `torch.equal`, `tolist`, `torch.save`, `copy.deepcopy`, ...) naming the parameter and what to use instead:
  `model.state_dict()`, `hf_zero.gathered_parameters(...)` or `hf_zero.full_state_dict(model)`.

Why not torch's `DTensor`: a `DTensor` shards each parameter along a dimension (`Shard(0)`: rank r
holds rows `[r*c, (r+1)*c)` of every parameter), while a unit's flat shard holds contiguous
element ranges of the concatenated parameters, so most parameters live on one or two ranks
only. Representing that as a `DTensor` needs the per-parameter layout (and a copy-in/copy-out
around every collective); an error that names the way out costs nothing and never lies.
Why not DeepSpeed's empty tensors: `p.sum()` of an emptied parameter is 0, a silently wrong
value, and its shape is wrong for code that checks shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

T = TypeVar("T")

_METADATA_OPS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _message(name: str) -> str:
    return (
        f"'{name}' is sharded across ranks by hf_zero (ZeRO stage 3) and holds no full value between forward "
        "passes. To read it, call model.state_dict() (full tensors; every rank must call it); to read or change "
        "it in place, use `with hf_zero.gathered_parameters(module, modifier_rank=0): ...` on every rank. A "
        "submodule of a unit called outside the unit's forward (`model.layers[1].mlp(x)`) finds it so too: call it "
        "inside the unit's forward, or call the unit's module; and so does a forward that reads it from a module "
        "of another unit without calling that module (`F.linear(h, self.lm_head.weight)`): call the module, or "
        "give ZeroConfig.wrap a list that leaves that module in the reader's unit (`wrap=['LlamaDecoderLayer']` "
        "keeps the head in the root's)."
    )


class RestingParameterError(TypeError, RuntimeError):
    """What a read of a resting stage-3 parameter's values raises ([Note: resting parameters]): a user's mistake,
    so a `TypeError` (the stand-in holds no values), and a `RuntimeError` as well, for code that caught that."""


class RestingParameter(torch.Tensor):
    """The stand-in a module holds for a stage-3 parameter while its unit is resharded
    ([Note: resting parameters]). Metadata works; any read of values raises a `RestingParameterError`
    that says what to use.

    Example:

    ```python
    >>> model, _ = hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=3))
    >>> model.lm_head.weight.shape          # metadata: fine
    torch.Size([32000, 4096])
    >>> model.lm_head.weight.norm()         # a value: RestingParameterError, naming state_dict / gathered_parameters
    ```
    """

    _hf_zero_name: str
    _hf_zero_param: nn.Parameter  # set on the nn.Parameter that wraps it (`of`): the real parameter

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str) -> RestingParameter:
        t = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=like.device, requires_grad=like.requires_grad
        )
        t._hf_zero_name = name
        return t

    @staticmethod
    def of(param: nn.Parameter, name: str) -> nn.Parameter:
        """The stand-in of `param`: an `nn.Parameter` (by `isinstance`) of the same shape, dtype and device."""
        stand_in = nn.Parameter(RestingParameter(param, name), requires_grad=param.requires_grad)
        stand_in._hf_zero_param = param  # type: ignore[attr-defined]  # an nn.Parameter, which declares no such field
        return stand_in

    # Gradient hooks belong to the parameter that autograd sees: the real one.
    def register_hook(self, hook: Any) -> Any:
        return self._hf_zero_param.register_hook(hook)

    def register_post_accumulate_grad_hook(self, hook: Any) -> Any:
        return self._hf_zero_param.register_post_accumulate_grad_hook(hook)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]  # torch's stub types it as an instance method
        first = args[0] if args else None
        if func in _METADATA_OPS and isinstance(first, RestingParameter):
            return RestingParameter(first, first._hf_zero_name)
        flat = _flat(args, kwargs)
        grads = [a._hf_zero_name for a in flat if isinstance(a, ShardedGrad)]
        if grads:  # an optimizer hf_zero never saw, stepping a resting parameter by its `.grad`: the gradient's word
            raise TypeError(f"{_grad_message(grads[0])} (operation: {func})")
        names = [a._hf_zero_name for a in flat if isinstance(a, RestingParameter)]
        raise RestingParameterError(f"{_message(names[0] if names else 'a parameter')} (operation: {func})")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """[Note: backward to resting parameters]
        `loss.backward(inputs=list(model.head.parameters()))` (a gradient for some parameters only): at stage 3
        the modules hold the stand-ins by then, which autograd never saw, so given as they are the backward would
        compute nothing for them and the step move nothing. `torch.autograd.backward` offers its `inputs` to this
        hook: the stand-ins become the real parameters, the ones the graph holds. `param.data = tensor` reaches
        this hook too (torch offers property setters to it), and is refused by name: it would replace the
        stand-in's data only, silently dropped at the next gather. Every other function goes on as torch's idiom
        for subclasses does (with this hook off: to `__torch_dispatch__`)."""
        if func is torch.autograd.backward and kwargs and kwargs.get("inputs") is not None:
            inputs = tuple(getattr(t, "_hf_zero_param", t) for t in kwargs["inputs"])
            return torch.autograd.backward(*args, **{**kwargs, "inputs": inputs})
        if getattr(func, "__self__", None) is torch._C.TensorBase.data and func.__name__ == "__set__":
            if args[1] is args[0]:  # `model.to(its own device)`: nn.Module._apply sets each `.data` to itself
                return None
            raise ValueError(_data_message(args[0]._hf_zero_name))
        if func is torch.autograd.grad:
            outputs, inputs, *rest = args
            inputs = tuple(getattr(t, "_hf_zero_param", t) for t in inputs)
            return torch.autograd.grad(outputs, inputs, *rest, **(kwargs or {}))
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})

    def __repr__(self, **kwargs: Any) -> str:  # type: ignore[override]  # torch's stub names a keyword-only `Any`
        return f"RestingParameter('{self._hf_zero_name}', shape={tuple(self.shape)}, dtype={self.dtype})"

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RestingParameterError(_message(self._hf_zero_name))

    tolist = item = numpy = __reduce_ex__ = __deepcopy__ = __array__ = _refuse  # all refuse alike


def _data_message(name: str) -> str:
    """`param.data = tensor` on a resting stage-3 parameter (weight surgery, `vector_to_parameters`): it replaced the
    stand-in's data only, and the next gather put the engine's values back, the change dropped without a word."""
    return (
        f"hf_zero: `param.data = tensor` on '{name}', sharded across ranks by hf_zero (ZeRO stage 3): between uses "
        "the module holds a stand-in, so the new tensor would be dropped at the next gather. Change the values in "
        "place where they live, on every rank: `with hf_zero.gathered_parameters([param], modifier_rank=0): "
        "param.copy_(tensor)`, or model.load_state_dict(...)."
    )


def _grad_message(name: str) -> str:
    return (
        f"'{name}'.grad of a model sharded by hf_zero: after the backward each rank holds only its shard of the "
        "averaged gradient (under no_sync, its own sum, not yet averaged, in the engine's buffers), so `.grad` has "
        "no value to read or change ([Note: resting gradients]). To change "
        "gradients, register `param.register_hook(fn)` before the backward (fn gets this rank's gradient before the "
        "mean over ranks: scaling and masking commute with it). To clip, call "
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) after `import hf_zero`, or "
        "optimizer.clip_grad_norm_(max_norm), not torch's get_total_norm + clip_grads_with_norm_ or a "
        "clip_grad_norm_ bound before the import; its return value is the global gradient norm (max_norm=inf "
        "only measures it). An optimizer reads `.grad` too: build it before hf_zero.initialize and pass it there "
        "(or to hf_zero.attach_optimizer), which steps the shards."
    )


GRAD_SCALER_MESSAGE = (
    "hf_zero: torch.amp.GradScaler was given an optimizer over a sharded model's parameters that is not the one "
    "hf_zero.initialize returned: their .grad holds no gradient (the gradients live in the shards). Pass the "
    "optimizer hf_zero.initialize returned to scaler.unscale_ / scaler.step: it unscales and checks every rank's "
    "shards ([Note: grad scaler] in step/amp.py)."
)
_UNSCALE = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default


class ShardedGrad(torch.Tensor):
    """[Note: resting gradients]
    What a trainable parameter's `.grad` is on a sharded model between the end of a backward and the next
    `zero_grad`, forward or backward: the gradient itself lives in the engine's shards (each rank a part of the
    mean over ranks), so under DDP's semantics `.grad` would be the whole averaged gradient, which no rank holds.
    Left `None` (as DeepSpeed leaves it), code written for DDP went silently wrong: `if p.grad is not None: ...`
    skipped every edit (rows of an embedding's gradient zeroed, gradient noise, a scale) and every norm it
    logged was 0. This stand-in has the parameter's shape, dtype and device, so `p.grad is not None` holds where
    DDP's would, and any read or write of a value raises a `TypeError` that names the parameter and the ways
    that work: a gradient hook before the backward, hf_zero's clipping and the norm it returns. The engine
    removes it at `zero_grad`, at the next forward with grad and at the start of the next backward pass, so
    autograd never accumulates into it.
    """

    _hf_zero_name: str

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str) -> ShardedGrad:
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)
        t._hf_zero_name = name
        return t

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]  # torch's stub types it as an instance method
        if func is _UNSCALE:  # GradScaler.unscale_ over the optimizer's tensors: the scaler itself is the mistake
            raise ValueError(GRAD_SCALER_MESSAGE)
        names = [a._hf_zero_name for a in _flat(args, kwargs) if isinstance(a, ShardedGrad)]
        raise TypeError(f"{_grad_message(names[0] if names else 'a parameter')} (operation: {func})")

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # torch's own idiom for subclasses

    def __repr__(self, **kwargs: Any) -> str:  # type: ignore[override]  # torch's stub names a keyword-only `Any`
        return f"ShardedGrad('{self._hf_zero_name}', shape={tuple(self.shape)}, dtype={self.dtype})"

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(_grad_message(self._hf_zero_name))

    tolist = item = numpy = __reduce_ex__ = __deepcopy__ = __array__ = _refuse  # all refuse alike
    # Python's operators reach no dispatch on a subclass with torch functions disabled: refused here by name
    __add__ = __radd__ = __iadd__ = __sub__ = __rsub__ = __isub__ = __mul__ = __rmul__ = __imul__ = _refuse
    __truediv__ = __rtruediv__ = __itruediv__ = __pow__ = __rpow__ = __matmul__ = __rmatmul__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = __float__ = __int__ = __bool__ = _refuse


def _flat(args: Any, kwargs: Any) -> list[Any]:
    out: list[Any] = []
    for obj in (args, kwargs or {}):
        stack = [obj]
        while stack:
            x = stack.pop()
            if isinstance(x, (list, tuple)):
                stack.extend(x)
            elif isinstance(x, dict):
                stack.extend(x.values())
            else:
                out.append(x)
    return out


class ModuleHolders:
    """Where a unit's parameters are registered (every `(module, attribute)` of each, tied aliases
    included), and which of the real parameter or its stand-in those holders hold now."""

    def __init__(
        self,
        params: tuple[nn.Parameter, ...],
        names: tuple[str, ...],
        holders: tuple[tuple[tuple[nn.Module, str], ...], ...],
    ) -> None:
        self.params = params  # the real parameters: views of the unit's flat buffer
        self.resting = tuple(RestingParameter.of(p, n) for p, n in zip(params, names))
        self.holders = holders  # per parameter: the (module, attribute name) pairs that hold it
        self.holds_real = True

    def bind(self, real: bool) -> None:
        """Register the real parameters (`real`) or their stand-ins in every holder; `requires_grad`
        follows whichever object the modules held until now. A holder holding neither holds a tensor a call put
        there for its length (`torch.func.functional_call`): it is left as it is, so the forward computes with it
        ([Note: parameters replaced after initialize] in checks/forward.py)."""
        if real == self.holds_real:
            return
        at_c_speed(self._bind, real)
        self.holds_real = real

    def _bind(self, real: bool) -> None:
        for p, r, holders in zip(self.params, self.resting, self.holders):
            new, old = (p, r) if real else (r, p)
            if new.requires_grad != old.requires_grad:
                new.requires_grad_(old.requires_grad)
            for module, attr in holders:
                held = module._parameters.get(attr)
                if held is old or held is new:
                    module._parameters[attr] = new
                # else a tensor put in the holder for one call (torch.func.functional_call): left to that call


# dynamo cannot trace the context, nor the stand-ins read from `module._parameters`. torch.compiler.disable, applied
# at the first call (importing dynamo costs ~1 s of `import hf_zero`, the CLI's start)
@torch._disable_dynamo
def at_c_speed(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` with the stand-ins' `__torch_function__` off, so their attributes (`requires_grad`, `.grad`) read
    at C speed: through the hook each read costs 2.5 us, and the engine reads one per parameter at each gather,
    reshard and backward. Never traced by dynamo (a compiled model's hooks break their graph here: 1 us a call
    in eager)."""
    with torch._C.DisableTorchFunctionSubclass():
        return fn(*args)


def parameter_holders(
    model: nn.Module, params: tuple[nn.Parameter, ...]
) -> tuple[tuple[tuple[nn.Module, str], ...], ...]:
    """For each of `params`, every `(module, attribute name)` of `model` that registers it."""
    where: dict[int, list[tuple[nn.Module, str]]] = {id(p): [] for p in params}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None and id(p) in where:
                where[id(p)].append((module, attr))
    return tuple(tuple(where[id(p)]) for p in params)
