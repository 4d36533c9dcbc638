"""The public entry points of the engine: `initialize`, `full_state_dict`, `model_state_memory`."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar, cast, overload

import torch
from torch import nn

from .checkpoint.format import format_size
from .checkpoint.pretrained import Conversions, PretrainedSource
from .config import ZeroConfig
from .engine.checks.same_model import refuse_configs_that_differ, refuse_models_that_differ, refuse_weights_that_differ
from .engine.collectives import CommGroup, raise_if_any_failed
from .engine.collectives.group import sequence_group
from .engine.engine import ModelStateMemory, StateDictOptions, ZeroEngine
from .engine.full_state import gathered_parameters as _gathered
from .engine.full_state import unique_params
from .engine.module import engine_of_param, get_engine, is_sharded, wrapped_model
from .engine.placement import check_compute_device, validate_model
from .engine.pool import map_large_host_allocations
from .engine.quantized import check_quantized, keep_codes_in_place
from .engine.step.optim import ShardedOptimizer, check_optimizers, optimizer_list, shard_optimizers
from .engine.wrap import UnitSpec, units_for
from .model import attach, unshard_and_detach, use_sharder

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)


@overload
def initialize(
    model: M,
    optimizer: None = None,
    config: ZeroConfig | None = None,
    *,
    weights_from: str | os.PathLike[str] | None = None,
    device: torch.device | str | None = None,
) -> tuple[M, None]: ...
@overload
def initialize(
    model: M,
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig | None = None,
    *,
    weights_from: str | os.PathLike[str] | None = None,
    device: torch.device | str | None = None,
) -> tuple[M, ShardedOptimizer]: ...
@overload
def initialize(
    model: M,
    optimizer: list[torch.optim.Optimizer],
    config: ZeroConfig | None = None,
    *,
    weights_from: str | os.PathLike[str] | None = None,
    device: torch.device | str | None = None,
) -> tuple[M, list[ShardedOptimizer]]: ...
@overload
def initialize(
    model: M,
    optimizer: tuple[torch.optim.Optimizer, ...],
    config: ZeroConfig | None = None,
    *,
    weights_from: str | os.PathLike[str] | None = None,
    device: torch.device | str | None = None,
) -> tuple[M, tuple[ShardedOptimizer, ...]]: ...
def initialize(
    model: M,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    config: ZeroConfig | None = None,
    *,
    weights_from: str | os.PathLike[str] | None = None,
    device: torch.device | str | None = None,
) -> tuple[M, Any]:
    """Shard `model` in place over the default process group and shard `optimizer` to match.

    Every rank must call it with the same model architecture and config. The model stays an
    instance of its own class; its parameters become views of the engine's flat buffers, so
    `model.config`, `generate` and the rest of the Hugging Face API keep working. After it, the
    usual loop runs unchanged: `loss = model(**batch).loss; loss.backward(); optimizer.step();
    optimizer.zero_grad()`. Without an initialized `torch.distributed`, it runs as one rank.

    Args:
        model (`nn.Module`):
            The model, with materialized weights on the CPU or on this rank's device (they move
            to the compute device unit by unit: see `device`).
        optimizer (`torch.optim.Optimizer` or a list or tuple of them, *optional*):
            Any optimizer built over `model.parameters()`, with any param groups; it must not have
            stepped yet. Its groups and hyperparameters are kept. Elementwise optimizers step flat
            shards, every other one whole parameters ([Note: whole-parameter step]). Several
            optimizers over disjoint parameters (Muon on the matrices, AdamW on the rest) come back
            sharded in the same list or tuple ([Note: several optimizers]).
        config (`ZeroConfig`, *optional*):
            The engine settings; defaults to `ZeroConfig()` (stage 3, fp32).
        weights_from (`str` or `os.PathLike`, *optional*):
            A `save_pretrained` directory (safetensors, or `.bin` files) to read the initial weights from, each rank
            reading only its own slices. The model may then live on the meta device (see
            `hf_zero.from_pretrained`, which builds it so); an optimizer built over its meta
            parameters is remapped to the real ones.
        device (`torch.device` or `str`, *optional*):
            The device to compute on: where the training loop puts its batches (the Trainer and the
            Accelerate plugin pass theirs). By default the parameters' device, or for a model on the
            host this rank's GPU when the backend communicates on one or the process runs alone and has
            one, else the CPU ([Note: compute device]).

    Returns:
        `tuple[nn.Module, ShardedOptimizer | None]`: the same model object, sharded, and a
        `torch.optim.Optimizer` that steps this rank's shards (`None` without an optimizer; a list or
        tuple of them for a list or tuple).

    Raises:
        TypeError / ValueError: for a wrong argument (on every rank, before any other collective).

    Example:

    ```python
    >>> import torch, hf_zero
    >>> from transformers import AutoModelForCausalLM
    >>> torch.distributed.init_process_group("nccl")  # or launch with accelerate / torchrun
    >>> model = AutoModelForCausalLM.from_pretrained("./llama-base")
    >>> optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.1)
    >>> model, optimizer = hf_zero.initialize(model, optimizer, hf_zero.ZeroConfig(stage=3))
    >>> loss = model(**batch).loss
    >>> loss.backward()
    >>> optimizer.clip_grad_norm_(1.0)
    >>> optimizer.step()
    >>> optimizer.zero_grad()
    ```
    """
    if is_sharded(model):
        return _initialize_again(model, optimizer, config, device)
    world = CommGroup.world()
    error: Exception | None = None
    specs: list[UnitSpec] = []
    cfg = ZeroConfig()
    source: PretrainedSource | None = None
    fingerprint = 0  # of the files, where the weights come from them
    compute = torch.device("cpu")  # decided by validate_model below, once
    try:
        _check_arguments(model, optimizer, config)
        cfg = config or cfg
        if cfg.shard_group_size is not None and world.size % cfg.shard_group_size:
            raise ValueError(
                f"ZeroConfig.shard_group_size ({cfg.shard_group_size}) must divide the world size ({world.size}); "
                "use the number of ranks per node."
            )
        if cfg.sequence_parallel > 1:
            _check_sequence_parallel(model, cfg.sequence_parallel, world.size)
        if cfg.tiled_mlp:
            from .features import tiled_mlp

            tiled_mlp.check(model)
        check_quantized(model, cfg)  # [Note: quantized base]
        keep_codes_in_place(model)  # [Note: codes repacked on the CPU]
        specs = units_for(model, cfg)
        if weights_from is not None:
            source = PretrainedSource(weights_from, model, _file_conversions(model))
            source.check(specs)
            fingerprint = source.fingerprint()
        requested = _as_device(device)
        compute = validate_model(model, world, has_source=source is not None, requested=requested)
        frozen = any(not p.requires_grad for p in model.parameters())  # a LoRA / QLoRA base
        if compute.type == "cpu" and (cfg.sequence_parallel > 1 or frozen):
            map_large_host_allocations()  # [Note: host heap] in engine/pool.py, before the weights are read
        if getattr(model, "hf_zero_four_bit", None):  # [Note: quantized load]: quantized where it computes
            from .checkpoint.conversions import place

            place(model, compute)
        check_optimizers(optimizer_list(optimizer), model, cfg.offload_dir)
        if source is not None:
            source.load_buffers(model)
    except Exception as e:  # noqa: BLE001 - whatever the type, every rank raises it
        error = e
    # Agree before the first collective: a mistake on one rank raises on every rank.
    raise_if_any_failed(error, world, "hf_zero.initialize")
    refuse_configs_that_differ(cfg, world)  # [Note: the same model on every rank], before the first exchange
    refuse_models_that_differ(model, world)
    if source is not None:
        refuse_weights_that_differ(fingerprint, str(source.directory), world)
    started = time.perf_counter()
    engine = ZeroEngine(model, specs, cfg, world, compute, source)
    if source is not None:  # [Note: read errors] in checkpoint/pretrained.py
        raise_if_any_failed(source.error, world, f"hf_zero.initialize (reading {source.directory})")
    attach(model, engine)
    if world.rank == 0 and logger.isEnabledFor(logging.INFO):
        read = None if source is None else (source.bytes_read, time.perf_counter() - started)
        logger.info(startup_line(engine, specs, read))
    keep_fused_loss_head_gathered(model)
    if cfg.sequence_parallel > 1:  # [Note: sequence parallelism]
        from .features import sequence_parallel as sequence

        sequence.enable(model, sequence_group(world, cfg.sequence_parallel, cfg.group_timeout_s))
    if cfg.tiled_mlp:  # [Note: tiled MLP]
        from .features import tiled_mlp

        tiled_mlp.enable(model)
    return model, shard_optimizers(optimizer, engine)


def startup_line(engine: ZeroEngine, specs: list[UnitSpec], read: tuple[int, float] | None = None) -> str:
    """The one line `initialize` logs on rank 0: what was set up, the model-state memory per rank that an
    Adam-style optimizer brings at its first step (`hf-zero estimate`'s count, exact against the engine's), and,
    given `read` (bytes, seconds), how fast rank 0 filled its shards from the weight files."""
    from .estimate import model_states

    config = engine.config
    params = {id(p): p for p in engine.model.parameters()}.values()
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    adam = model_states(specs, config, engine.world.size, engine.world.rank, engine.model_dtype).total()
    offload = "optimizer and parameters" if config.offload_params else "optimizer" if config.offload_optimizer else ""
    where = f" in {config.offload_dir}" if config.offload_dir else " to host memory" if offload else ""
    trainable = f" ({_count(trained)} trainable)" if trained != total else ""
    backend = engine.world.backend or "one process"
    return (
        f"hf_zero: ZeRO stage {config.stage} on {engine.world.size} rank(s) ({engine.device.type}, {backend}), "
        f"{len(engine.units)} units, {_count(total)} parameters{trainable}, compute "
        f"{str(engine.param_dtype).removeprefix('torch.')}"
        + (f", {offload} offloaded{where}" if offload else "")
        + f"; model states per rank: {format_size(engine.memory().total())} now, {format_size(adam)} with Adam's state"
        + (_read_figure(*read) if read is not None else "")
    )


def _read_figure(nbytes: int, seconds: float) -> str:
    """How fast rank 0 filled its shards from the weight files (the reads, the casts and the first touch of its
    masters), for the start-up line."""
    rate = nbytes / max(seconds, 1e-9)
    return f"; weights read on rank 0: {format_size(nbytes)} in {seconds:.1f} s ({format_size(int(rate))}/s)"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def _file_conversions(model: nn.Module) -> Conversions | None:
    """transformers' checkpoint conversions for a transformers model ([Note: converted weights] in
    checkpoint/conversions.py); None for any other model."""
    if "transformers" not in sys.modules:  # a transformers model was built with it imported
        return None
    from .checkpoint.conversions import checkpoint_conversions, with_built

    conversions = checkpoint_conversions(model)
    four_bit = getattr(model, "hf_zero_four_bit", None)  # [Note: quantized load] in integrations/quantized_load.py
    return with_built(conversions, four_bit) if four_bit else conversions


def keep_fused_loss_head_gathered(model: nn.Module) -> None:
    """If Liger replaced the sharded model's forward (`apply_liger_kernel_to_llama()`, `AutoLigerKernelForCausalLM`,
    the Trainer's `--use_liger_kernel`): its fused linear cross-entropy takes `lm_head.weight` as an argument and
    never calls the head, so at stage 3 the head's unit is kept gathered through each forward ([Note: direct use]).
    Called by `initialize` and by the integrations that shard a model before Liger is applied to it."""
    base = wrapped_model(model)  # PEFT: the model inside
    forward = getattr(base, "forward", None)
    where = getattr(getattr(forward, "__func__", forward), "__module__", None) or ""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if where.split(".")[0] == "liger_kernel" and callable(get_head) else None
    if isinstance(head, nn.Module):
        get_engine(model).use_directly(head)


def _check_sequence_parallel(model: nn.Module, size: int, world_size: int) -> None:
    from .features import sequence_parallel as sequence

    if world_size % size:
        raise ValueError(
            f"ZeroConfig.sequence_parallel ({size}) must divide the world size ({world_size}): each group of {size} "
            "consecutive ranks shares its samples."
        )
    sequence.check(model, size)


use_sharder(lambda model, config: initialize(model, None, config))  # [Note: re-sharding] in model.py: restructure


def _initialize_again(
    model: M,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
    config: ZeroConfig | None,
    device: torch.device | str | None,
) -> tuple[M, Any]:
    """`initialize` on a model it already sharded (a second Trainer, a second script stage): under the same
    settings (or `config=None`) the engine stays and `optimizer` is attached to it, releasing the one before;
    under other settings the model is made whole and sharded anew."""
    engine = get_engine(model)
    if config is not None and not isinstance(config, ZeroConfig):
        raise TypeError(f"hf_zero.initialize expects a ZeroConfig as config; got {type(config).__name__}.")
    check_compute_device(engine.device, _as_device(device))
    if config is None or config == engine.config:
        keep_fused_loss_head_gathered(model)  # Liger applied since the model was sharded
        return model, (attach_optimizer(model, optimizer) if optimizer is not None else None)
    for each in optimizer_list(optimizer):  # built over what the modules hold now (stand-ins at stage 3): the real ones
        for group in each.param_groups:
            group["params"] = [engine.compute_param(p) for p in group["params"]]
    if engine.config.sequence_parallel > 1:
        from .features import sequence_parallel as sequence

        sequence.disable(model)
    unshard_and_detach(model)
    return initialize(model, cast(Any, optimizer), config, device=device)  # one, several or none: overloads


def _as_device(device: torch.device | str | None) -> torch.device | None:
    if device is None or isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise TypeError(
            f"hf_zero.initialize expects device as a torch.device or a string; got {type(device).__name__}."
        )
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"hf_zero.initialize: device={device!r} is not a device ({e}).") from None


def _check_arguments(model: object, optimizer: object, config: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"hf_zero.initialize expects an nn.Module as model; got {type(model).__name__}.")
    if config is not None and not isinstance(config, ZeroConfig):
        raise TypeError(f"hf_zero.initialize expects a ZeroConfig as config; got {type(config).__name__}.")
    _refuse_parallel_wrappers(model)
    for each in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
        if each is not None and not isinstance(each, torch.optim.Optimizer):
            raise TypeError(
                "hf_zero.initialize expects a torch.optim.Optimizer, a list or tuple of them, or None; got "
                f"{type(each).__name__}."
            )


def _refuse_parallel_wrappers(model: nn.Module) -> None:
    """[Note: DDP around a sharded model] in model.py, the other way round: a model already inside DDP,
    `nn.DataParallel` or FSDP (a DDP script's `model = DDP(model)` kept above `hf_zero.initialize`). DDP's reducer
    would average the gradients a second time (unrefused: DDP's message about unused parameters at the second
    step), FSDP already shards the parameters hf_zero would shard: refused, naming where."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel, FullyShardedDataParallel, FSDPModule)
    for name, module in model.named_modules():
        if isinstance(module, wrappers):
            kind = next(w.__name__ for w in wrappers if isinstance(module, w))
            where = f"the model at '{name}' is" if name else "the model is"
            raise TypeError(
                f"hf_zero.initialize: {where} a {kind}: hf_zero does the data parallelism and the sharding itself, "
                "and the wrapper would reduce (or shard) the same parameters again. Pass the plain model: leave out "
                "the `DistributedDataParallel(model)` / `fully_shard(model)` line (for a DDP or DataParallel "
                "wrapper, `wrapper.module` holds the same parameters, so an optimizer built over it stays valid)."
            )


def full_state_dict(
    model: nn.Module, *, rank0_only: bool = True, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Gather the full, unsharded state dict of a sharded model, one unit at a time.

    A collective: every rank must call it. Parameters come from the fp32 master shards (the
    most precise copy), keyed like `model.state_dict()` (tied weights under each of their
    names); buffers are copied as they are. Peak memory is one unit's parameters plus the
    result on the writing rank(s).

    Args:
        model (`nn.Module`): a model returned by `hf_zero.initialize`.
        rank0_only (`bool`, *optional*, defaults to `True`): only rank 0 keeps the result;
            the other ranks get `{}`.
        device (`str` or `torch.device`, *optional*, defaults to `"cpu"`): where the result lives.

    Example:

    ```python
    >>> state_dict = hf_zero.full_state_dict(model)
    >>> if torch.distributed.get_rank() == 0:
    ...     model.save_pretrained("out", state_dict=state_dict)
    ```
    """
    return get_engine(model).full_state_dict(rank0_only=rank0_only, device=device)


def model_state_memory(model: nn.Module) -> ModelStateMemory:
    """The bytes of parameters, gradients and optimizer state this rank holds now, by device.

    Example:

    ```python
    >>> mem = hf_zero.model_state_memory(model)
    >>> mem.parameters, mem.gradients, mem.optimizer_states
    ({'cpu': 427264}, {'cpu': 427264}, {'cpu': 854528})
    ```
    """
    return get_engine(model).memory()


def attach_optimizer(model: nn.Module, optimizer: Any) -> Any:
    """Shard an optimizer (or a list or tuple of them, as `initialize`) built over the parameters of a model that
    `initialize` already sharded; returns it sharded, in the shape given.

    For integrations that shard a model before its optimizer exists (e.g. an evaluation run
    before training), and for a model that outlives its optimizer (a second `ZeroTrainer` on a
    trained model): an optimizer attached before is released (its state freed; its `step`
    raises). A collective agreement step: every rank must call it.

    Example:

    ```python
    >>> model, _ = hf_zero.initialize(model, None, config)      # e.g. to evaluate first
    >>> optimizer = hf_zero.attach_optimizer(model, torch.optim.AdamW(model.parameters()))
    ```
    """
    engine = get_engine(model)
    error: Exception | None = None
    try:
        _check_arguments(model, optimizer, None)
        check_optimizers(optimizer_list(optimizer), model, engine.config.offload_dir, engine)
    except Exception as e:  # noqa: BLE001 - whatever the type, every rank raises it
        error = e
    raise_if_any_failed(error, engine.world, "hf_zero.attach_optimizer")
    engine.steps.release()  # a model outlives its optimizer (a second Trainer): the first one lets go
    return shard_optimizers(optimizer, engine)


@contextlib.contextmanager
def gathered_parameters(
    module_or_params: nn.Module | torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None
) -> Iterator[None]:
    """Make parameters of a sharded model whole inside the block; with `modifier_rank`, keep that
    rank's changes on every rank.

    A collective: every rank must enter it with the same parameters. Inside, the parameters hold
    their full values (at stage 3 the modules hold the real parameters again; at stages 0-2 they
    always do) and the block may read them, run forward passes or change them in place. On exit,
    with `modifier_rank=r`, rank r's values are broadcast and written into every rank's shards
    *and* fp32 master weights (elements the block changed take the new value; the others keep
    their exact master value), so the next training step starts from them. With
    `modifier_rank=None` the block is read-only: at stage 3 a change made in place is refused at the
    exit, on every rank (the gathered copy it lives in is freed); at stages 0-2 the parameters are
    the model's own and a change is one between steps (each rank's, as under DDP). Memory: the
    gathered units, as during their forward. This is DeepSpeed's
    `GatheredParameters`, which also updates the master weights here.

    Args:
        module_or_params (`nn.Module`, `torch.Tensor` or an iterable of them):
            A module of the sharded model (all its parameters), one parameter, or several.
        modifier_rank (`int`, *optional*): the rank whose changes are kept.

    Raises:
        ValueError: for tensors that are not parameters of a sharded model, a bad rank, or (stage 3) a
            change made with `modifier_rank=None` (on every rank).

    Example:

    ```python
    >>> with hf_zero.gathered_parameters(model.lm_head, modifier_rank=0):
    ...     if torch.distributed.get_rank() == 0:
    ...         model.lm_head.weight[tokenizer.pad_token_id].zero_()
    ```
    """
    params = unique_params(module_or_params)
    engine = None
    if isinstance(module_or_params, nn.Module) and is_sharded(module_or_params):
        engine = get_engine(module_or_params)
    engines = {id(e): e for e in (engine_of_param(p) for p in params) if e is not None}
    if engine is None and len(engines) == 1:
        engine = next(iter(engines.values()))
    if engine is None:
        raise ValueError(
            "gathered_parameters needs parameters of one model sharded by hf_zero.initialize; "
            f"got {len(params)} tensor(s) belonging to {len(engines)} sharded model(s)."
        )
    with _gathered(engine, params, modifier_rank):
        yield


@contextlib.contextmanager
def state_dict_options(
    model: nn.Module, *, rank0_only: bool = False, device: torch.device | str | None = None
) -> Iterator[None]:
    """Choose what `model.state_dict()` returns inside the block (FSDP's `FULL_STATE_DICT` options).

    Args:
        model (`nn.Module`): a model returned by `hf_zero.initialize`.
        rank0_only (`bool`, *optional*, defaults to `False`): only rank 0 gets the tensors; the
            other ranks take part in the gathers and get `{}`.
        device (`str` or `torch.device`, *optional*): where the tensors are put (`"cpu"` keeps a
            GPU free of the full copy); defaults to the compute device.

    Example:

    ```python
    >>> with hf_zero.state_dict_options(model, rank0_only=True, device="cpu"):
    ...     sd = model.state_dict()
    >>> if torch.distributed.get_rank() == 0:
    ...     torch.save(sd, "weights.pt")
    ```
    """
    engine = get_engine(model)
    previous = engine.state_dict_options
    engine.state_dict_options = StateDictOptions(rank0_only=rank0_only, device=device)
    try:
        yield
    finally:
        engine.state_dict_options = previous
