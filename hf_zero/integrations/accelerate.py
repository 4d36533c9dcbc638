"""`ZeroPlugin` and `ZeroAccelerator`: the hf_zero engine behind a plain Accelerate training loop.

[Note: Accelerate integration]
Accelerate has no extension point for a third-party engine (closed `DistributedType`, fixed
plugin arguments), so `ZeroAccelerator` subclasses `Accelerator` and overrides only what a
sharded model needs:

- `__init__`: refuses DeepSpeed/FSDP; takes the requested precision (argument, or the
  `accelerate launch --mixed_precision` environment) for the engine and runs Accelerate itself
  with `mixed_precision="no"` (no autocast, no GradScaler: the engine casts and scales). With no
  CUDA device it runs on the CPU (`cpu=True`), avoiding Accelerate's silent one-process fallback.
- `prepare`: shards the model and its optimizer with `hf_zero.initialize`, hands Accelerate the
  sharded optimizer inside an `AcceleratedOptimizer` (so `accumulate()` and `step()` behave as
  usual); dataloaders and schedulers are Accelerate's. The model's own `no_sync()` plugs into
  `accelerator.accumulate` / `no_sync` unchanged.
- `clip_grad_norm_`: the global norm over every rank's shards.
- `get_state_dict`, `save_model`: gathered unit by unit (rank 0 gets the full state dict).
- `save_state` / `load_state`: the model and optimizer go to an hf_zero sharded checkpoint in
  `<dir>/hf_zero/` (every rank writes its shards; resumable on any world size); schedulers,
  dataloaders, RNG states and custom objects are Accelerate's own files.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, make_dataclass, replace
from typing import Any, cast

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

from ..api import attach_optimizer, full_state_dict, initialize
from ..checkpoint import last_complete_checkpoint, load_checkpoint, save_checkpoint, save_pretrained, wait_for_saves
from ..config import ZeroConfig
from ..engine.collectives import CommGroup, agreement
from ..engine.facade import facade_of
from ..engine.module import is_sharded
from ..engine.step.optim import ShardedOptimizer
from ..features.compile import check_compile_request, compile_as_requested
from ..launch import cpu_launch_warning
from .preemption import SignalRecorder
from .zero_fields import field_specs, launch_env, save_specs, sequence_size, snapshot_budget, to_zero_config

CHECKPOINT_SUBDIR = "hf_zero"
logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class _ZeroPlugin:
    """Every hf_zero engine setting for `ZeroAccelerator`, as `zero_<name>` (the `ZeroConfig` field of
    that name, with its default; see [Note: one source of truth]). Precision comes from Accelerate's
    own `mixed_precision` (argument, or `accelerate launch --mixed_precision`).

    Example:

    ```python
    >>> plugin = ZeroPlugin(zero_stage=3, zero_offload_optimizer=True, zero_bucket_size_mb=50)
    >>> accelerator = ZeroAccelerator(zero_plugin=plugin, mixed_precision="bf16")
    ```
    """

    def __post_init__(self) -> None:
        self.to_zero_config("no")  # validates every field, with ZeroConfig's messages
        snapshot_budget(self)

    def to_zero_config(self, mixed_precision: str) -> ZeroConfig:
        """The `ZeroConfig` for this plugin and Accelerate's precision setting."""
        return to_zero_config(self, mixed_precision)


ZeroPlugin = make_dataclass(
    "ZeroPlugin",
    field_specs(cli=False) + save_specs(),
    bases=(_ZeroPlugin,),
    frozen=True,
    kw_only=True,
    namespace={"__doc__": _ZeroPlugin.__doc__, "__module__": __name__},
)


class _ShardedAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper, reporting the engine's skipped steps (fp16 overflow)."""

    _is_accelerate_prepared = True

    @property
    def step_was_skipped(self) -> bool:
        return bool(getattr(self.optimizer, "step_was_skipped", False))


class ZeroAccelerator(Accelerator):
    """An `Accelerator` whose `prepare` shards the model with hf_zero (see [Note: Accelerate integration]).

    A plain Accelerate loop becomes a ZeRO loop by changing `Accelerator(...)` into
    `ZeroAccelerator(zero_plugin=ZeroPlugin(zero_stage=3), ...)`.

    Example:

    ```python
    >>> accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(zero_stage=3), gradient_accumulation_steps=4)
    >>> model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    >>> for batch in loader:
    ...     with accelerator.accumulate(model):
    ...         accelerator.backward(model(**batch).loss)
    ...         if accelerator.sync_gradients:
    ...             accelerator.clip_grad_norm_(model.parameters(), 1.0)
    ...         optimizer.step(); scheduler.step(); optimizer.zero_grad()
    >>> accelerator.save_state("ckpt")
    ```
    """

    def __init__(self, *args: Any, zero_plugin: _ZeroPlugin | None = None, **kwargs: Any) -> None:
        for key in ("deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin"):
            if kwargs.get(key) is not None:
                raise ValueError(f"ZeroAccelerator cannot take {key}: hf_zero is the sharding engine here.")
        env = launch_env()
        for var, on in (("ACCELERATE_USE_DEEPSPEED", env.use_deepspeed), ("ACCELERATE_USE_FSDP", env.use_fsdp)):
            if on:
                raise ValueError(
                    f"{var} is set (by `accelerate config` or `accelerate launch`); hf_zero is the sharding engine "
                    "here. Launch with one of hf_zero's accelerate_configs/ instead."
                )
        if zero_plugin is not None and not isinstance(zero_plugin, ZeroPlugin):
            raise TypeError(f"zero_plugin must be a ZeroPlugin; got {type(zero_plugin).__name__}.")
        requested = kwargs.pop("mixed_precision", None) or env.mixed_precision or "no"
        if "cpu" not in kwargs and not torch.cuda.is_available():
            kwargs["cpu"] = True
            if (env.world_size or 1) > 1 and not env.use_cpu and not env.local_rank:
                logger.warning(cpu_launch_warning(env.world_size or 1))
        self.zero_plugin = zero_plugin or ZeroPlugin()
        config = self.zero_plugin.to_zero_config(str(requested).lower())
        # Accelerate's ParallelismConfig(sp_size= / cp_size=) asks for hf_zero's sequence parallelism; Accelerate
        # itself is not given it (its meshes and DeepSpeed's sequence parallelism are not the engine here)
        sequence = sequence_size(kwargs.pop("parallelism_config", None), config.sequence_parallel)
        self.zero_config = replace(config, sequence_parallel=sequence)
        self._signals: SignalRecorder | None = None
        if getattr(self.zero_plugin, "zero_save_on_preemption", False):  # [Note: preemption]
            self._signals = SignalRecorder()
            self._signals.install()
        super().__init__(*args, mixed_precision="no", **kwargs)
        launched = env.world_size or 1
        if launched > 1 and self.num_processes != launched:  # [Note: launched world] in training_args.py
            raise ValueError(
                f"The launcher started {launched} processes (WORLD_SIZE={launched}) but Accelerate sees "
                f"{self.num_processes}: each rank would train the same batches as a copy of one process. On a machine "
                "without GPUs pass cpu=True or set ACCELERATE_USE_CPU=true; do not create a PartialState or "
                "Accelerator with other settings before this one."
            )
        check_compile_request(self.state.dynamo_plugin, self.zero_config.stage)  # [Note: compile]: refused up front
        self._zero_model: nn.Module | None = None
        self._inference_models = 0  # models prepared without trainable parameters (sharded for inference)
        self._zero_optimizers: list[
            ShardedOptimizer
        ] = []  # several over disjoint parameters: [Note: several optimizers]

    # ---- prepare ----------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """As Accelerate's: the model is sharded with the optimizers given with it. The model may come first and
        its optimizers in a later call, built over the sharded model's parameters (what Accelerate's FSDP guide
        advises: `model = accelerator.prepare(model)`, then `optimizer = AdamW(model.parameters())`, then
        `accelerator.prepare(optimizer, ...)`): they are attached to it then (`hf_zero.attach_optimizer`; those of
        an earlier call are released, as a model outliving its optimizer wants). Models without trainable
        parameters (a distillation's teacher, a frozen reference) are sharded too, for inference (no optimizer,
        no master copy), in the same call or a later one; one model per accelerator trains."""
        modules = [i for i, a in enumerate(args) if isinstance(a, nn.Module)]
        optimizers = [i for i, a in enumerate(args) if isinstance(a, torch.optim.Optimizer)]
        if not modules and not optimizers:
            return super().prepare(*args, device_placement=device_placement)
        items = list(args)
        trained = self._trained_model(items, modules, optimizers)
        for i in modules:
            if i != trained:  # frozen: sharded for inference
                items[i], _ = initialize(items[i], None, self.zero_config, device=self.device)
                self._inference_models += 1
                compile_as_requested(items[i], self.state.dynamo_plugin, self.zero_config.stage)  # [Note: compile]
        if trained is None and not optimizers:
            return super().prepare(*items, device_placement=device_placement)
        inner = [o.optimizer if isinstance(o, AcceleratedOptimizer) else o for o in (items[i] for i in optimizers)]
        if trained is not None and items[trained] is not self._zero_model:
            model, sharded = initialize(items[trained], inner or None, self.zero_config, device=self.device)
            items[trained] = model
            compile_as_requested(model, self.state.dynamo_plugin, self.zero_config.stage)  # [Note: compile]
            self._zero_model, self._zero_optimizers = model, list(sharded or [])
        elif inner:  # optimizers for the model prepared before
            self._zero_optimizers = list(attach_optimizer(cast(nn.Module, self._zero_model), inner))
        for i, each in zip(optimizers, self._zero_optimizers):
            items[i] = _ShardedAcceleratedOptimizer(each, device_placement=False, scaler=None)
        return super().prepare(*items, device_placement=device_placement)

    def _trained_model(self, items: list[Any], modules: list[int], optimizers: list[int]) -> int | None:
        """Which of `items[modules]` is the model that trains (the one with trainable parameters; the only one
        given with optimizers), or None when every one is frozen or the model was prepared before."""
        trainable = [i for i in modules if any(p.requires_grad for p in items[i].parameters())]
        if optimizers and not trainable and len(modules) == 1 and self._zero_model is None:
            trainable = modules  # a frozen model with an optimizer: as initialize takes it
        again = bool(trainable) and items[trainable[0]] is self._zero_model  # prepared before: its optimizers attach
        if len(trainable) > 1 or (trainable and self._zero_model is not None and not again):
            raise ValueError(
                "ZeroAccelerator trains one model (with its optimizers) per accelerator; got another model with "
                "trainable parameters. Prepare the trained model and its optimizers in one call; a model that only "
                "runs forwards (a teacher, a reference) is sharded for inference once its parameters are frozen "
                "(`teacher.requires_grad_(False)` before prepare)."
            )
        if optimizers and not trainable and self._zero_model is None:
            if self._inference_models:
                raise ValueError(
                    "ZeroAccelerator: an optimizer was prepared, but the models prepared before had no trainable "
                    "parameters, so they were sharded for inference. Leave the parameters to train trainable when "
                    "the model is prepared (freeze them after, with requires_grad_(False), to train them later)."
                )
            raise ValueError(
                "ZeroAccelerator: an optimizer was prepared before its model. Prepare the model first (or in the same "
                "call): `model = accelerator.prepare(model)`, then build the optimizer over model.parameters()."
            )
        return trainable[0] if trainable else None

    def prepare_data_loader(
        self, data_loader: Any, device_placement: bool | None = None, slice_fn_for_dispatch: Any = None
    ) -> Any:
        """As Accelerate's, but with sequence parallelism the batches are dealt to the data-parallel groups: the
        ranks of a sequence group get the same batches ([Note: sequence parallelism])."""
        size = self.zero_config.sequence_parallel
        if size == 1:
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        return deal_to_groups(self, data_loader, size, device_placement, slice_fn_for_dispatch)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """As Accelerate's; with sequence parallelism each sample once, not once per rank of its sequence group."""
        size = self.zero_config.sequence_parallel
        if size == 1:
            return super().gather_for_metrics(input_data, use_gather_object)
        return gather_once_per_group(self, size, input_data, use_gather_object)

    # ---- gradients --------------------------------------------------------------------------
    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        if not self._zero_optimizers or self._zero_model is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if not facade_of(self._zero_model).owns_params(params):  # stand-ins count as what they stand for
            raise ValueError(
                "clip_grad_norm_ got parameters that are not the sharded model's; pass model.parameters() of the "
                "model ZeroAccelerator prepared (its norm is taken over every rank's gradient shards)."
            )
        return self._zero_optimizers[0].clip_grad_norm_(max_norm, norm_type)  # over the model: every optimizer's

    # ---- full weights -----------------------------------------------------------------------
    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """For a sharded model: the full state dict, gathered unit by unit (on rank 0; `{}` elsewhere)."""
        if is_sharded(model):
            return full_state_dict(model)
        return super().get_state_dict(model, unwrap=unwrap)

    def save_model(
        self,
        model: nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """For a sharded model: a `from_pretrained` directory written by rank 0 (a collective)."""
        if not is_sharded(model):
            return super().save_model(model, save_directory, max_shard_size, safe_serialization)
        save_pretrained(model, save_directory, max_shard_size=max_shard_size, progress=self.is_main_process)

    # ---- training state ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _without_engine_objects(self) -> Iterator[None]:
        """Hide the sharded model and optimizer from Accelerate's own state files (they are saved sharded)."""
        this = cast(Any, self)  # Accelerator's lists, untyped there
        models, optimizers = list(this._models), list(this._optimizers)
        this._models = [m for m in models if m is not self._zero_model]
        ours = {id(o) for o in self._zero_optimizers}
        this._optimizers = [o for o in optimizers if id(getattr(o, "optimizer", None)) not in ours]
        try:
            yield
        finally:
            this._models, this._optimizers = models, optimizers

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        if self._zero_model is None:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        with agreement(CommGroup.world(), "ZeroAccelerator.save_state"):
            self._refuse_state_hooks(self._save_model_state_pre_hook, "register_save_state_pre_hook")
        with self._without_engine_objects():
            location = super().save_state(output_dir, safe_serialization, **kwargs)
        directory = str(location or output_dir)
        save_checkpoint(
            os.path.join(directory, CHECKPOINT_SUBDIR),
            self._zero_model,
            self._optimizer_arg(),
            metadata={"step": self.step},
            async_save=bool(getattr(self.zero_plugin, "zero_async_save", False)),
            snapshot_budget_bytes=snapshot_budget(self.zero_plugin),
        )
        return directory

    def wait_for_checkpoints(self) -> None:
        """Wait until an asynchronous `save_state` ([Note: asynchronous save]) is committed; its error raises here.

        Example:

        ```python
        >>> accelerator.save_state("ckpt")      # with ZeroPlugin(zero_async_save=True): returns at once
        >>> accelerator.wait_for_checkpoints()  # ckpt/hf_zero is complete
        ```
        """
        if self._zero_model is not None:
            wait_for_saves(self._zero_model)

    def end_training(self) -> None:
        self.wait_for_checkpoints()
        if self._signals is not None:
            self._signals.restore()
        super().end_training()

    def preempted(self) -> bool:
        """With `ZeroPlugin(zero_save_on_preemption=True)`: whether any rank got SIGTERM or SIGUSR1 ([Note:
        preemption]). A collective (one small all-reduce): call it on every rank at the same point of each step,
        so every rank stops at the same step. False without the setting (and no collective).

        Example:

        ```python
        >>> for batch in loader:
        ...     ...  # forward, backward, step
        ...     if accelerator.preempted():
        ...         accelerator.save_state("ckpt")
        ...         accelerator.end_training()
        ...         raise SystemExit(hf_zero.PREEMPTED_EXIT_CODE)
        ```
        """
        return self._signals is not None and self._signals.agreed()

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        if self._zero_model is None:
            return super().load_state(input_dir, load_kwargs, **kwargs)
        with agreement(CommGroup.world(), "ZeroAccelerator.load_state"):
            self._refuse_state_hooks(self._load_model_state_pre_hook, "register_load_state_pre_hook")
            if input_dir is None:
                input_dir = self._latest_state()
        with self._without_engine_objects():
            super().load_state(input_dir, load_kwargs, **kwargs)
        load_checkpoint(os.path.join(input_dir, CHECKPOINT_SUBDIR), self._zero_model, self._optimizer_arg())

    @staticmethod
    def _refuse_state_hooks(hooks: Any, registered_with: str) -> None:
        """Accelerate calls its save/load-state hooks with the models it saves or loads; a sharded model is saved
        and loaded by hf_zero (its `hf_zero/` folder), so a hook would get none and do nothing, silently."""
        if hooks:
            raise ValueError(
                f"A hook given to accelerator.{registered_with} would get no model: hf_zero saves and loads the "
                "sharded model itself (the state's hf_zero/ folder), not through Accelerate's list of models. Do "
                "what the hook does after save_state / load_state instead (e.g. model.save_pretrained(dir) on every "
                "rank), and remove the hook."
            )

    def _latest_state(self) -> str:
        """`load_state()` without a directory, as Accelerate's: with `automatic_checkpoint_naming`, the newest
        `project_dir/checkpoints/checkpoint_N` (here the newest whose sharded state is complete)."""
        if not self.project_configuration.automatic_checkpoint_naming:
            raise ValueError(
                "ZeroAccelerator.load_state needs the checkpoint directory (input_dir), or a ProjectConfiguration "
                "with automatic_checkpoint_naming=True to take the newest one."
            )
        root = os.path.join(self.project_dir, "checkpoints")
        latest = last_complete_checkpoint(root, pattern=r"checkpoint_(\d+)", subdir=CHECKPOINT_SUBDIR)
        if latest is None:
            raise FileNotFoundError(f"No complete checkpoint_N under {root} to load.")
        return str(latest)

    def _optimizer_arg(self) -> ShardedOptimizer | list[ShardedOptimizer] | None:
        """The prepared optimizers as the checkpoint functions take them (one saves as one, several as a list)."""
        if len(self._zero_optimizers) == 1:
            return self._zero_optimizers[0]
        return list(self._zero_optimizers) or None

    def free_memory(self, *objects: Any) -> Any:
        """As Accelerate's (and its alias `clear`): forget the model and optimizers prepared, so that a new model can
        be prepared and sharded (Accelerate's `find_executable_batch_size` loop calls it before each attempt)."""
        self._zero_model, self._zero_optimizers, self._inference_models = None, [], 0
        return super().free_memory(*objects)


def deal_to_groups(
    accelerator: Accelerator,
    data_loader: Any,
    size: int,
    device_placement: bool | None = None,
    slice_fn_for_dispatch: Any = None,
) -> Any:
    """`accelerator.prepare_data_loader` with the batches dealt to groups of `size` consecutive ranks (each group
    one data-parallel replica) instead of to every rank: the ranks of a sequence-parallel group get the same
    batches ([Note: sequence parallelism])."""
    from accelerate.data_loader import prepare_data_loader

    if getattr(data_loader, "_is_accelerate_prepared", False):
        return data_loader
    if accelerator.dispatch_batches:
        raise ValueError(
            "ZeroConfig.sequence_parallel deals each batch to a group of ranks; Accelerate's dispatch_batches (one "
            "process reads and sends to all, used for iterable datasets) is not supported with it. Use a map-style "
            "dataset, or DataLoaderConfiguration(dispatch_batches=False)."
        )
    prepared = prepare_data_loader(
        data_loader,
        accelerator.device,
        num_processes=accelerator.num_processes // size,
        process_index=accelerator.process_index // size,
        split_batches=accelerator.split_batches,
        put_on_device=accelerator.device_placement if device_placement is None else device_placement,
        rng_types=accelerator.rng_types.copy(),
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        slice_fn_for_dispatch=slice_fn_for_dispatch,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )
    accelerator._dataloaders.append(prepared)
    return prepared


def gather_once_per_group(accelerator: Accelerator, size: int, input_data: Any, use_gather_object: bool = False) -> Any:
    """`accelerator.gather_for_metrics` when the ranks of each sequence group hold the same samples: every sample
    comes back once (from the group's first rank), and the last batch loses the samples the sampler repeated to
    fill it, as with plain data parallelism ([Note: sequence parallelism]). Without this, each sample is counted
    once per rank of its group, and on several groups the last batch's truncation keeps the wrong samples."""
    from accelerate.utils import gather_object, recursively_apply

    try:
        recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        tensors = True
    except TypeError:
        tensors = False
    leader = accelerator.process_index % size == 0
    if use_gather_object or not tensors:
        data = gather_object(input_data if leader else type(input_data)())  # a list per rank, rank order
    else:
        world = accelerator.num_processes

        def first_of_each_group(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.shape[0] % world:
                raise RuntimeError(
                    f"[rank {accelerator.process_index}] hf_zero: gathered {tensor.shape[0]} rows from {world} ranks"
                )
            return tensor.unflatten(0, (world, -1))[::size].flatten(0, 1)

        data = recursively_apply(first_of_each_group, accelerator.gather(input_data))
    state = accelerator.gradient_state
    if state.end_of_dataloader and state.remainder > 0:
        if use_gather_object or not tensors:
            return data[: state.remainder]
        return recursively_apply(lambda tensor: tensor[: state.remainder], data)
    return data
