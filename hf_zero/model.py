"""`ZeroModel`: what a sharded model gains, added by swapping its class in place.

The model stays an instance of its own class (a subclass is made with the same name), so
`isinstance(model, LlamaForCausalLM)`, `model.config` and the rest of the HF API keep working and
there is nothing to unwrap. The methods below are the ones whose stock behaviour would read
sharded memory, or hang when ranks diverge, and do the sharded equivalent instead:
`state_dict` / `load_state_dict` (full tensors, gathered unit by unit), `save_pretrained` (one
`from_pretrained` directory, written once), `generate` (`synced_gpus` at stage 3),
`resize_token_embeddings` (re-shards the changed model).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from types import FrameType
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.algorithms.join import JoinHook

from .config import ZeroConfig
from .engine.collectives import agreement
from .engine.engine import ModelStateMemory, ZeroEngine
from .engine.facade import facade_of
from .engine.full_state import load_state_dict, state_dict, unshard_model
from .engine.module import ENGINE_ATTR, get_engine, register_params

_SUBCLASSES: dict[type, type] = {}


class ZeroModel:
    """Mixin placed first in the MRO of a model sharded by `hf_zero.initialize`."""

    _is_accelerate_prepared = True  # Accelerate must not wrap it in DDP

    @property
    def zero_engine(self) -> ZeroEngine:
        return self.__dict__[ENGINE_ATTR]

    # ---- the training loop ------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation's context, as with DDP and FSDP (the Trainer and `accelerator.accumulate`
        enter it on every micro-batch but the last).

        At stages 0-1 the backward passes run inside skip their reduction: gradients accumulate in
        the unsharded buffer that exists anyway and the synchronising micro-batch reduces them once.
        At stages 2-3 every micro-batch is still reduced into the fp32 gradient shards, so model
        states stay at the ZeRO formula during accumulation (what DeepSpeed does);
        `ZeroConfig(no_sync_keeps_grads=True)` skips those reductions instead, keeping every
        unit's unsharded gradients (the full model's, in the compute dtype) until the synchronising
        micro-batch: fewer collectives, more memory.

        Example:

        ```python
        >>> with model.no_sync():
        ...     model(**micro_batch_1).loss.backward()
        >>> model(**micro_batch_2).loss.backward()  # both micro-batches' gradients are in the shards now
        ```
        """
        with self.zero_engine.no_sync():
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the sharded gradients (and any unsharded ones held by `no_sync`); `set_to_none=False`: parameters that
        had a gradient step on a zero one, as torch's optimizers do."""
        self.zero_engine.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by their global norm over all shards; returns that norm."""
        return self.zero_engine.clip_grad_norm_(max_norm, norm_type)

    def model_state_memory(self) -> ModelStateMemory:
        """The bytes of parameters, gradients and optimizer state this rank holds, by device."""
        return self.zero_engine.memory()

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> Any:
        """[Note: DDP around a sharded model]
        `DistributedDataParallel(model)` around a sharded model (a DDP loop's line kept when moving to hf_zero):
        hf_zero already is the data parallelism, averaging gradients over the ranks in its own reductions, so DDP
        would reduce them a second time over the engine's stand-ins (unrefused: DDP's message about unused
        parameters at the second step at stages 1-2, a stand-in's error at stage 3). DDP's constructor
        reads this attribute before anything else, on every rank: refused there, by name. Any other reader (a
        library listing attributes) sees it as absent, or as set: setting it (TRL's DPO script does, for DDP) is
        kept and harmless."""
        if not _read_by_ddp_constructor():
            if "_hf_zero_ddp_ignored" in self.__dict__:
                return self.__dict__["_hf_zero_ddp_ignored"]
            raise AttributeError("_ddp_params_and_buffers_to_ignore")
        raise TypeError(
            "hf_zero: torch.nn.parallel.DistributedDataParallel around a model sharded by hf_zero: hf_zero already "
            "is the data parallelism (it averages the gradients over the ranks in its own reductions), and DDP would "
            "reduce them again. Use the model hf_zero.initialize returned as it is (`model(batch)`, "
            "`loss.backward()`, `optimizer.step()`; `with model.no_sync():` for gradient accumulation, as with DDP); "
            "Accelerate's prepare() does not wrap it."
        )

    @_ddp_params_and_buffers_to_ignore.setter
    def _ddp_params_and_buffers_to_ignore(self, value: Any) -> None:
        self.__dict__["_hf_zero_ddp_ignored"] = value

    # ---- torch's Join ----------------------------------------------------------------------------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """[Note: uneven inputs] in engine/checks/forward.py: what `Join([model, ...])` asks of each of its
        joinables (Accelerate's `join_uneven_inputs` builds one on every multi-GPU run). A hook that does nothing:
        disabled (`even_batches=True`, Accelerate's default) the context changes nothing, as with DDP; enabled, the
        first forward inside it is refused."""
        return JoinHook()

    @property
    def join_device(self) -> torch.device:
        """Where `Join` puts the flags it all-reduces (the compute device)."""
        return self.zero_engine.device

    @property
    def join_process_group(self) -> Any:
        """The group `Join` counts the ranks in: the engine's world."""
        return self.zero_engine.world.pg

    # ---- dtype and device -------------------------------------------------------------------
    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """`model.to(...)`, `.cuda()`, `.cpu()`, `.half()`, `.bfloat16()`, `.float()` of a sharded model: allowed
        where it changes nothing (Accelerate's `model.to(accelerator.device)`, a DDP loop's `model.to(device)`);
        refused by name where it would change the parameters' dtype or device, which the engine owns. (Applied,
        it would cast the buffers alone, so RoPE tables went bf16 under fp32 weights, and at stages 1-2 cut the
        parameters loose from the engine's flat buffers: the backward then failed in autograd.)"""
        first = next(iter(cast(nn.Module, self).parameters()), None)
        if first is None:
            return super()._apply(fn, recurse)  # type: ignore[misc]  # the mixin sits before nn.Module
        probe = torch.empty(0, dtype=first.dtype, device=first.device)
        converted = fn(probe)
        if converted.dtype == probe.dtype and converted.device == probe.device:
            return super()._apply(fn, recurse)  # type: ignore[misc]
        raise ValueError(
            f"This model is sharded by hf_zero, whose engine owns its parameters (computing in {probe.dtype} on "
            f"{probe.device}); a conversion to {converted.dtype} on {converted.device} (model.to / .half() / "
            ".bfloat16() / .cuda() / .cpu()) cannot apply to them. To compute in bf16 or fp16, shard with "
            "ZeroConfig(mixed_precision='bf16') (the Trainer's --bf16); to compute on another device, shard it "
            "there (hf_zero.initialize(..., device=...)); for a plain copy in another dtype or place, load "
            "hf_zero.full_state_dict(model) or a save_pretrained directory into a new model."
        )

    # ---- copies -------------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """`copy.deepcopy(model)` (what `torch.optim.swa_utils.AveragedModel`, an EMA or a frozen reference model
        do): refused by name. The parameters are shards of a model every rank holds a part of, owned by the
        engine and its process group, which a copy cannot share (unrefused, it failed on pickling the process
        group, or at stage 3 on the first empty parameter)."""
        raise TypeError(
            "hf_zero: copy.deepcopy of a sharded model (AveragedModel, an EMA or a reference model copies it so): "
            "its parameters are shards owned by the engine on every rank, which a copy cannot share. Make the copy "
            "before hf_zero.initialize (`ema = copy.deepcopy(model)`), and update it from the fp32 master weights "
            "on every rank: `full = hf_zero.full_state_dict(model, rank0_only=False, device=device)`, then "
            "`p.lerp_(full[name], 1 - decay)` for each `name, p` of `ema.named_parameters()` under "
            "`torch.no_grad()`; or load `hf_zero.full_state_dict(model)` into a model built afresh."
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickling a sharded model (`torch.save(model)`, handing it to another process): refused by name."""
        raise TypeError(
            "hf_zero: pickling a sharded model (torch.save(model, path), copy.copy, sending it to another "
            "process): its parameters are shards owned by the engine on every rank. Save its weights instead: "
            "model.save_pretrained(dir), or torch.save(model.state_dict(), path) (full tensors; every rank must "
            "call state_dict), or hf_zero.save_checkpoint(...) for a state training can resume from."
        )

    # ---- whole weights ----------------------------------------------------------------------
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The full, unsharded state dict, as the unsharded model's, at every stage: master values,
        tied names sharing one tensor. A collective: every rank must call it.

        Gathered one unit at a time (transient memory: one unit, plus the result). By default every
        rank gets every tensor on the compute device; `hf_zero.state_dict_options(model,
        rank0_only=True, device="cpu")` makes it rank 0 only, in host memory (FSDP's
        `FULL_STATE_DICT` with `rank0_only` and `offload_to_cpu`). With `keep_vars=True` the
        parameter objects the modules hold now are returned, as `nn.Module.state_dict` does.

        Example:

        ```python
        >>> sd = model.state_dict()                 # on every rank
        >>> torch.save(sd, f"weights-rank{rank}.pt")
        ```
        """
        if args:  # the positional form nn.Module still accepts: (destination, prefix, keep_vars)
            destination, prefix, keep_vars = (list(args) + [destination, prefix, keep_vars][len(args) :])[:3]
        if keep_vars:
            return nn.Module.state_dict(cast(nn.Module, self), destination=destination, prefix=prefix, keep_vars=True)
        full = state_dict(self.zero_engine, self.zero_engine.state_dict_options)
        out = OrderedDict() if destination is None else destination
        for key, value in full.items():
            out[prefix + key] = value
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Write a full state dict into every rank's shards (master weights included), at every stage.

        Keys, `strict` and the returned missing / unexpected keys are as in `nn.Module.load_state_dict`.
        A collective: every rank must call it, each with the full state dict.

        Example:

        ```python
        >>> model.load_state_dict(torch.load("weights.pt"))
        ```
        """
        if assign:
            raise ValueError(
                "load_state_dict(assign=True) would replace the sharded parameters; hf_zero copies values into its "
                "shards, so use assign=False."
            )
        return load_state_dict(self.zero_engine, state_dict, strict=strict)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike[str],
        is_main_process: bool = True,
        state_dict: dict[str, torch.Tensor] | None = None,
        push_to_hub: bool = False,
        max_shard_size: int | str = "50GB",
        *,
        dtype: str | torch.dtype | None = None,
        parallel: bool = False,
        **kwargs: Any,
    ) -> None:
        """Write a `from_pretrained` directory of the sharded model: from rank 0, gathering one unit at a time, or
        (`parallel=True`) from every rank at once, each writing the tensors it owns.

        Call it on every rank, as with any distributed model (`is_main_process` is not needed). Weights are
        written in `dtype` (`"bf16"`, `"fp16"`, `"fp32"` or a `torch.dtype`; by default the dtype the model had
        before `hf_zero.initialize`), with `config.json` and `generation_config.json`; save the tokenizer beside
        them with its own `save_pretrained`. With `parallel`, every rank writes its own
        `model-0000k-of-0000N.safetensors` into `save_directory` (a file system all ranks share) and no rank
        gathers the model ([Note: owned tensors] in hf_zero/checkpoint/owned.py). With a `state_dict` already
        gathered (`model.state_dict()`), the stock writer saves that instead. A sharded `PeftModel` writes its
        adapter (PEFT's files), gathering only units that hold one.

        Example:

        ```python
        >>> model.save_pretrained("llama-domain")                                      # every rank
        >>> model.save_pretrained("/shared/llama-domain", dtype="bf16", parallel=True)  # every rank writes
        >>> AutoModelForCausalLM.from_pretrained("llama-domain")
        ```
        """
        if getattr(self, "peft_config", None) is not None and state_dict is None:
            return self._save_peft_adapter(save_directory, is_main_process=is_main_process, **kwargs)
        if state_dict is not None:
            super().save_pretrained(  # type: ignore[misc]  # the mixin sits before the model class, which has it
                save_directory,
                is_main_process=is_main_process,
                state_dict=state_dict,
                push_to_hub=push_to_hub,
                max_shard_size=max_shard_size,
                **kwargs,
            )
            return
        if push_to_hub or kwargs.get("safe_serialization") is False:
            raise ValueError(
                "save_pretrained of a sharded model writes safetensors locally; push the written directory with "
                "huggingface_hub afterwards."
            )
        if kwargs.get("variant") is not None:  # it would write model.safetensors over the directory's main weights
            raise ValueError(
                f"save_pretrained of a sharded model writes model.safetensors; variant={kwargs['variant']!r} is not "
                "supported: save into a directory of its own instead."
            )
        from .checkpoint.consolidate import save_pretrained as write_pretrained

        engine = self.zero_engine
        write_pretrained(
            cast(nn.Module, self),
            save_directory,
            dtype=engine.model_dtype if dtype is None else dtype,
            max_shard_size=max_shard_size,
            progress=False,
            parallel=parallel,
        )

    def _save_peft_adapter(self, save_directory: str | os.PathLike[str], **kwargs: Any) -> None:
        """A `PeftModel` sharded as a whole: its trainable parameters (the adapter) are gathered to rank 0
        (units without one are not gathered at all) and PEFT's own `save_pretrained` writes them there."""
        engine = self.zero_engine
        adapter = engine.full_state_dict(rank0_only=True, device="cpu", trainable_only=True)
        kwargs.pop("is_main_process", None)
        with agreement(engine.world, "save_pretrained (PEFT adapter)"):
            if engine.world.rank == 0:
                super().save_pretrained(save_directory, state_dict=adapter, is_main_process=True, **kwargs)  # type: ignore[misc]  # the mixin sits before the model class, which has it

    # ---- generation and structure -----------------------------------------------------------
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """`generate`, with `synced_gpus=True` by default at stage 3 on several ranks: a rank whose
        sequences are done keeps running forwards (on dummy input) until every rank is done, since
        each forward gathers parameters. An explicit `synced_gpus` is respected. Every rank must call it."""
        if kwargs.get("synced_gpus") is None and self.zero_engine.generation_needs_sync:
            kwargs["synced_gpus"] = True
        return super().generate(*args, **kwargs)  # type: ignore[misc]  # the mixin sits before the model class, which has it

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> Any:
        """Resize the vocabulary of a sharded model: the model is gathered (a full copy on each rank for
        the moment), resized by the stock method, and sharded anew with rank 0's values for the new
        rows. Call it on every rank, before an optimizer is attached.

        Example:

        ```python
        >>> tokenizer.add_special_tokens({"pad_token": "<pad>"})
        >>> model.resize_token_embeddings(len(tokenizer))
        ```
        """
        engine = self.zero_engine
        if engine.steps.attached:
            raise ValueError(
                "resize_token_embeddings replaces the embedding parameters, which the attached optimizer holds. "
                "Resize before building the optimizer (hf_zero.initialize(model, None, config), resize, then "
                "hf_zero.attach_optimizer), or before hf_zero.initialize."
            )
        return restructure(
            cast(nn.Module, self), lambda model: type(model).resize_token_embeddings(model, *args, **kwargs)
        )


# [Note: re-sharding] `restructure` (resize_token_embeddings) shards the changed model again with `initialize`,
# which lives in hf_zero.api, a module that imports this one: api hands it in when it is imported.
_SHARDERS: list[Callable[[nn.Module, ZeroConfig], object]] = []


def use_sharder(shard: Callable[[nn.Module, ZeroConfig], object]) -> None:
    """Set how `restructure` shards a model again (`hf_zero.api` gives `initialize`, which imports this module:
    passed in rather than imported back)."""
    _SHARDERS[:] = [shard]


def restructure(model: nn.Module, change: Any) -> Any:
    """Undo the sharding of `model`, apply `change(model)` (which may replace parameters), shard it
    again with the same settings (values of new parameters from rank 0); returns what `change` returned."""
    if not _SHARDERS:
        raise RuntimeError("hf_zero.model.restructure: no sharder set (hf_zero.api sets it when imported)")
    engine = unshard_and_detach(model)
    result = change(model)
    _SHARDERS[0](model, replace(engine.config, sync_module_states=True))
    return result


def unshard_and_detach(model: nn.Module) -> ZeroEngine:
    """Make a sharded `model` a plain module again (whole parameters, its own class) and let its engine go
    (offload files closed); returns that engine, for its settings."""
    engine = get_engine(model)
    engine.steps.release()
    unshard_model(engine)
    detach(model)
    engine.flat_step.close()  # [Note: master stores]: the offload files, if any
    return engine


def attach(model: nn.Module, engine: ZeroEngine) -> None:
    """Swap `model`'s class for a same-named subclass with `ZeroModel` first, and store the engine."""
    cls = type(model)
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        namespace = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "forward": _through_call(cls.forward),
        }
        if hasattr(getattr(model, "base_model", None), "merge_and_unload"):  # a PeftModel: [Note: merging an adapter]
            namespace["merge_and_unload"] = _merge_and_unload
        sub = type(cls.__name__, (ZeroModel, cls), namespace)
        _SUBCLASSES[cls] = sub
    model.__class__ = sub
    model.__dict__[ENGINE_ATTR] = engine
    register_params(engine)


def _through_call(forward: Callable[..., Any]) -> Callable[..., Any]:
    """[Note: forward called directly]
    DDP does its work inside its `forward`, so DDP code may call `model.forward(...)` instead of `model(...)` and
    still train correctly. hf_zero's work runs in the hooks `nn.Module.__call__` runs around `forward`: called
    directly, the root's forward ran without them (at stage 3 its own parameters not gathered: an error about
    sharded parameters; at stages 0-2 no buffer broadcast, no input cast, no units check, no call-order header).
    So the sharded model's `forward`, called outside its `__call__`, goes through it; inside it (the running pass
    counts the root's forwards running, `Pass.in_root_forward`) it is the model's own. `functools.wraps` keeps the
    signature, which the Trainer reads to choose the dataset's columns."""

    @functools.wraps(forward)
    def routed(self: Any, *args: Any, **kwargs: Any) -> Any:
        if facade_of(self).in_root_forward:
            return forward(self, *args, **kwargs)
        return self(*args, **kwargs)

    return routed


def _read_by_ddp_constructor() -> bool:
    """Whether `DistributedDataParallel.__init__` is the caller of the property reading this (within a few frames)."""
    frame: FrameType | None = sys._getframe(2)  # the property's caller
    for _ in range(3):
        if frame is None:
            return False
        if frame.f_code.co_name == "__init__" and isinstance(
            frame.f_locals.get("self"), nn.parallel.DistributedDataParallel
        ):
            return True
        frame = frame.f_back
    return False


def _merge_and_unload(self: Any, *args: Any, **kwargs: Any) -> Any:
    """[Note: merging an adapter]
    PEFT's `merge_and_unload()` (its `LoraModel`'s, reached through the `PeftModel`) adds each adapter's product
    into its base weight and returns the base model (a DDP script's `model.module.merge_and_unload()
    .save_pretrained(dir)` on rank 0). At stages 0-2 every weight is whole on every rank and it works as under DDP,
    locally. At stage 3 the weights are shards, so PEFT's merge would meet the stand-ins' generic error at its
    first read: refused here instead, naming the way that works."""
    if facade_of(self).gathers_each_forward:
        raise ValueError(
            "hf_zero: merge_and_unload() of a PEFT model sharded at ZeRO stage 3: its base weights are shards "
            "spread over the ranks, and merging needs each whole. Save the adapter on every rank with "
            "model.save_pretrained(dir) (PEFT's files), then merge where the whole model fits: "
            "`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), dir).merge_and_unload()"
            ".save_pretrained(merged_dir)`; or train at stage 1 or 2, where it merges in place as under DDP."
        )
    return self.base_model.merge_and_unload(*args, **kwargs)


def detach(model: nn.Module) -> None:
    """Give `model` its own class back and forget its engine (after `unshard_model`)."""
    cls = type(model)
    if ZeroModel in cls.__bases__:
        model.__class__ = next(base for base in cls.__bases__ if base is not ZeroModel)
    model.__dict__.pop(ENGINE_ATTR, None)
