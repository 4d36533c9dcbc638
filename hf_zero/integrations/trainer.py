"""`ZeroTrainer`: the Hugging Face `Trainer` with the hf_zero engine behind it.

[Note: Trainer integration]
The engine shards `self.model` in place, so `self.model` stays the `PreTrainedModel` the rest of
the Trainer expects (callbacks, `_save`, `prediction_step`) and is also what `model_wrapped`
points to; Accelerate sees the model and the sharded optimizer as already prepared and passes
them through (no DDP, no autocast: the engine owns precision). What the Trainer would otherwise
do wrongly for a sharded model is overridden, and only that:

- `_wrap_model`: shard the model (training: with the optimizer `create_optimizer` built, so
  `--optim`, the weight-decay groups and the lr keep working; evaluation: without).
- `_clip_grad_norm` / `_get_grad_norm`: the global norm over every rank's gradient shards.
- `save_model`: a periodic checkpoint (`_internal_call`) is an hf_zero sharded checkpoint in
  `checkpoint-N/hf_zero/` (master weights, optimizer state), written by every rank in parallel, and
  `checkpoint-N` itself is a model folder: `config.json`, `generation_config.json`, the tokenizer,
  `training_args.bin` and (`--zero_save_model_weights`, on by default) the weights in the compute
  dtype, each tensor written by the rank that owns it ([Note: owned tensors]), so
  `from_pretrained(checkpoint-N)` loads step N. A user call (and the end of training) writes a
  consolidated `from_pretrained` directory from rank 0, gathered one unit at a time.
- `_save_optimizer_and_scheduler`: the optimizer is in the sharded checkpoint; only `scheduler.pt`.
- `_load_from_checkpoint` (before sharding) remembers the checkpoint; `_load_optimizer_and_scheduler`
  (after) loads it into the shards, on any number of ranks. `_load_best_model` likewise.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings

from ..api import attach_optimizer, gathered_parameters, initialize, keep_fused_loss_head_gathered
from ..checkpoint import load_checkpoint, save_checkpoint, save_pretrained, wait_for_saves
from ..checkpoint.consolidate import save_pretrained_async
from ..checkpoint.format import last_complete_checkpoint, save_hf_files
from ..engine.facade import facade_of
from ..engine.module import is_sharded
from ..engine.placement import check_compute_device
from ..engine.step.optim import ShardedOptimizer
from ..features.compile import compile_as_requested
from .accelerate import deal_to_groups, gather_once_per_group
from .preemption import PREEMPTED_EXIT_CODE, PreemptionCallback, clear_marker, write_marker
from .training_args import ZeroArgumentsMixin, ZeroTrainingArguments
from .zero_fields import snapshot_budget

CHECKPOINT_SUBDIR = "hf_zero"


if TYPE_CHECKING:  # the checker sees the Trainer this mixin is always put before; at runtime it is a plain mixin
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class ZeroTrainerMixin(_TrainerBase):
    """The hf_zero engine for any `Trainer` subclass (see [Note: Trainer integration]): put it first.

    Works with the Trainers of other libraries because it overrides only the Trainer's own methods
    and calls `super()` in each: TRL's `SFTTrainer` and `DPOTrainer`, `Seq2SeqTrainer`. Their
    arguments class gets the `--zero_*` fields from `hf_zero.ZeroArgumentsMixin`, put first so the
    library's own defaults stay (TRL's configs turn `bf16` on, for one). For
    TRL, whose fused loss reads `lm_head.weight` without calling the head, the head is kept
    gathered through each forward at stage 3 ([Note: direct use]).

    Example:

    ```python
    >>> from dataclasses import dataclass
    >>> from trl import SFTConfig, SFTTrainer
    >>> @dataclass
    ... class ZeroSFTConfig(hf_zero.ZeroArgumentsMixin, SFTConfig):
    ...     pass
    >>> class ZeroSFTTrainer(hf_zero.ZeroTrainerMixin, SFTTrainer):
    ...     pass
    >>> trainer = ZeroSFTTrainer(model=model, args=ZeroSFTConfig(output_dir="out", zero_stage=3), train_dataset=data)
    ```
    """

    args: ZeroTrainingArguments

    def create_accelerator_and_postprocess(self) -> None:
        if not isinstance(self.args, ZeroArgumentsMixin):
            raise TypeError(
                f"ZeroTrainer needs ZeroTrainingArguments (with --zero_stage), or a config class with "
                f"hf_zero.ZeroArgumentsMixin mixed in first; got {type(self.args).__name__}."
            )
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "The Accelerate state has DeepSpeed or FSDP enabled (from `accelerate config` or the environment); "
                "hf_zero is the sharding engine here. Launch with a plain multi-process config instead."
            )
        self._zero_resume_from: str | None = None
        size = self._zero_sequence = self.args.to_zero_config().sequence_parallel
        if size > 1:  # [Note: sequence parallelism]: the ranks of a sequence group read the same batches
            accelerator = self.accelerator
            accelerator.prepare_data_loader = functools.partial(deal_to_groups, accelerator, size=size)
            accelerator.gather_for_metrics = functools.partial(gather_once_per_group, accelerator, size)
            self.gather_function = functools.partial(
                accelerator.gather_for_metrics, use_gather_object=self.args.eval_use_gather_object
            )

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        args["mixed_precision"] = "no"  # the engine owns precision (and the fp16 loss scale)
        # --parallelism_config's sequence size is the engine's (to_zero_config); the Trainer's own sequence- and
        # context-parallel paths (DeepSpeed's Ulysses, FSDP2's ring attention) must not see it
        args.pop("parallelism_config", None)
        return args

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        """`--include_num_input_tokens_seen`: the ranks of a sequence group read the same tokens; each counts once."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        if self._zero_sequence > 1:
            seen = self.state.num_input_tokens_seen - before
            self.state.num_input_tokens_seen = before + seen // self._zero_sequence

    def _zero_model(self) -> nn.Module:
        """The Trainer's model (set by the time any of these methods runs)."""
        if self.model is None:
            raise RuntimeError("ZeroTrainer has no model: pass model= (or model_init=) to the Trainer.")
        return self.model

    # ---- sharding ---------------------------------------------------------------------------
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        config = self.args.to_zero_config()
        if not is_sharded(self.model):
            optimizer = self.optimizer if training else None
            sharded_model, sharded = initialize(
                self._zero_model(), cast(Any, optimizer), config, device=self.args.device
            )
            self.model = sharded_model
            if sharded is not None:
                self.optimizer = sharded
            self._shard_for_direct_head(sharded_model)
            reference = getattr(self, "ref_model", None)  # DPO-style trainers: a frozen copy used for inference
            if config.stage == 3 and isinstance(reference, nn.Module) and not is_sharded(reference):
                reference.requires_grad_(False)  # inference only: frozen parts, compute dtype, no master copy
                reference, _ = initialize(reference, None, config, device=self.args.device)
                self._shard_for_direct_head(reference)
                self._sync_sharded_reference()
        else:  # sharded before (hf_zero.from_pretrained, or for evaluation first): batches must go where it computes
            check_compute_device(facade_of(self._zero_model()).device, self.args.device)
            self._shard_for_direct_head(self._zero_model())  # --use_liger_kernel patched it since
            if training and self.optimizer is not None and not isinstance(self.optimizer, ShardedOptimizer):
                self.optimizer = attach_optimizer(self._zero_model(), self.optimizer)
        # [Note: compile]: --torch_compile reaches Accelerate's prepare_model, which never sees the sharded model
        compile_as_requested(self._zero_model(), self.accelerator.state.dynamo_plugin, config.stage)
        return self._zero_model()

    def _update_auto_batch_size(self, batch_size: int) -> None:
        """`--auto_find_batch_size`: each attempt at a batch size starts here. After an out-of-memory error the
        sharded model forgets the pass it stopped in (gathered units freed, partial gradients dropped); the model
        stays sharded and keeps its optimizer, as the stock Trainer keeps its model and optimizer."""
        if is_sharded(self.model):
            facade_of(self._zero_model()).zero_grad(abandon_pass=True)
        super()._update_auto_batch_size(batch_size)

    def _sync_sharded_reference(self) -> None:
        """TR-DPO (`sync_ref_model=True`): TRL's callback mixes the policy into the reference model in place,
        which needs whole parameters; at stage 3 it does so inside `gathered_parameters` (DeepSpeed's answer)."""
        for callback in self.callback_handler.callbacks:
            if callable(getattr(callback, "sync_target_model", None)) and hasattr(callback, "ref_model"):
                callback.sync_target_model = _mix_into_sharded_reference

    def _shard_for_direct_head(self, model: nn.Module) -> None:
        """TRL computes log-probabilities from `lm_head.weight` directly: keep the head gathered through each
        forward of a sharded model ([Note: direct use]), and a forward Liger replaced reads it so too."""
        keep_fused_loss_head_gathered(model)
        get_head = getattr(model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        if _reads_head_directly(self) and isinstance(head, nn.Module):
            facade_of(model).use_directly(head)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self._sharded_optimizer().clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: torch.Tensor | float | None = None) -> torch.Tensor | float:
        if grad_norm is None:
            grad_norm = self._sharded_optimizer().clip_grad_norm_(float("inf"))
        return grad_norm

    def _sharded_optimizer(self) -> ShardedOptimizer:
        if not isinstance(self.optimizer, ShardedOptimizer):
            raise RuntimeError(f"[rank {self.args.process_index}] ZeroTrainer: the optimizer was not sharded")
        return self.optimizer

    # ---- evaluation -------------------------------------------------------------------------
    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """As the Trainer's, whose evaluation runs `self.model` rather than its DDP wrapper: no buffer broadcast
        (BatchNorm's running statistics are each rank's own, as under DDP), [Note: buffer broadcast]."""
        if not is_sharded(self.model):
            return super().evaluation_loop(*args, **kwargs)
        with facade_of(self._zero_model()).as_unwrapped():
            return super().evaluation_loop(*args, **kwargs)

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **gen_kwargs: Any,
    ) -> Any:
        """As the Trainer's; a generating Trainer (`Seq2SeqTrainer`, whose `prediction_step` passes
        `synced_gpus=False` unless DeepSpeed or FSDP is on) gets `synced_gpus=True` at stage 3 on
        several ranks, so ranks whose sequences end at different steps all return. A `synced_gpus`
        the caller gave is kept."""
        if not gen_kwargs and not hasattr(self, "_gen_kwargs"):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if is_sharded(self.model) and facade_of(self._zero_model()).generation_needs_sync:
            gen_kwargs = dict(gen_kwargs or getattr(self, "_gen_kwargs", {}))
            gen_kwargs.setdefault("synced_gpus", True)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)

    # ---- saving -----------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = str(output_dir if output_dir is not None else self.args.output_dir)
        if not is_sharded(self.model):
            return super().save_model(output_dir, _internal_call)
        periodic = _internal_call and not self.args.save_only_model
        if periodic:
            save_checkpoint(
                os.path.join(output_dir, CHECKPOINT_SUBDIR),
                self._zero_model(),
                self._sharded_optimizer(),
                tokenizer=self.processing_class,
                metadata={"global_step": self.state.global_step},
                async_save=bool(getattr(self.args, "zero_async_save", False)),
                snapshot_budget_bytes=snapshot_budget(self.args),
            )
        if getattr(self.model, "peft_config", None) is not None:  # a PEFT model: its adapter, as the stock Trainer
            if not periodic or self.args.zero_save_model_weights:
                cast(Any, self._zero_model()).save_pretrained(output_dir)
            if self.args.should_save and self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
        elif periodic and not self.args.zero_save_model_weights:  # the folder without its weights
            if self.args.should_save:
                save_hf_files(self._zero_model(), self.processing_class, Path(output_dir))
        elif periodic and getattr(self.args, "zero_async_save", False):  # as below, written in the background
            save_pretrained_async(
                self._zero_model(),
                output_dir,
                tokenizer=self.processing_class,
                dtype=facade_of(self._zero_model()).param_dtype,
            )
        elif periodic:  # every rank writes its share, in the dtype training computes in
            save_pretrained(
                self._zero_model(),
                output_dir,
                tokenizer=self.processing_class,
                dtype=facade_of(self._zero_model()).param_dtype,
                parallel=True,
                progress=False,  # the Trainer's own bar is the one shown
            )
        else:
            save_pretrained(
                self._zero_model(),
                output_dir,
                tokenizer=self.processing_class,
                progress=False,  # the Trainer's own bar is the one shown
            )
        if self.args.should_save:
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not is_sharded(self.model):
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save and self.lr_scheduler is not None:  # the optimizer is in the sharded checkpoint
            with warnings.catch_warnings(record=True) as caught:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            reissue_pt_warnings(caught)

    # ---- resuming ---------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """As `Trainer.train`; `resume_from_checkpoint=True` takes the last *complete* checkpoint-N
        (one whose save was interrupted is skipped)."""
        if resume_from_checkpoint is True:
            last = last_complete_checkpoint(str(self.args.output_dir), also_required=("trainer_state.json",))
            if last is None:
                # the stock Trainer's words (scripts search for them); "complete": an interrupted save is skipped
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
            resume_from_checkpoint = str(last)
        preemption = PreemptionCallback() if getattr(self.args, "zero_save_on_preemption", False) else None
        if preemption is not None:
            self.add_callback(preemption)
            if self.args.should_save:
                clear_marker(str(self.args.output_dir))  # [Note: preemption marker]: this launch resumes it
        try:
            result = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if preemption is not None:
                preemption.restore()
                self.remove_callback(preemption)
        if is_sharded(self.model):
            wait_for_saves(self._zero_model())  # [Note: asynchronous save]: the last checkpoint is committed
        if preemption is not None and preemption.preempted_at is not None:
            if self.args.should_save:  # [Note: preemption marker]: for a launcher that exits 1
                write_marker(str(self.args.output_dir), preemption.preempted_at)
            raise SystemExit(PREEMPTED_EXIT_CODE)  # [Note: preemption]: checkpoint-N is complete; requeue
        return result

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_SUBDIR)):
            self._zero_resume_from = resume_from_checkpoint  # loaded into the shards once they exist
            return
        if is_sharded(self.model):
            raise ValueError(
                f"{resume_from_checkpoint} is not an hf_zero checkpoint (no {CHECKPOINT_SUBDIR}/ inside) and the model "
                "is already sharded. Resume from a checkpoint-N directory written by ZeroTrainer."
            )
        super()._load_from_checkpoint(resume_from_checkpoint, model)  # a stock checkpoint, into the raw model

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or self._zero_resume_from is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_checkpoint(os.path.join(checkpoint, CHECKPOINT_SUBDIR), self._zero_model(), self._sharded_optimizer())
        self._zero_resume_from = None
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            with warnings.catch_warnings(record=True) as caught:
                self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
            reissue_pt_warnings(caught)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if not is_sharded(self.model) or best is None:
            return super()._load_best_model()
        load_checkpoint(os.path.join(best, CHECKPOINT_SUBDIR), self._zero_model())


class ZeroTrainer(ZeroTrainerMixin, Trainer):
    """A drop-in `Trainer` that trains with hf_zero's ZeRO engine (`ZeroTrainerMixin` over `Trainer`).

    Takes `ZeroTrainingArguments`; everything else is the stock `Trainer`'s.

    Example:

    ```python
    >>> args = ZeroTrainingArguments(output_dir="out", zero_stage=3, bf16=True, gradient_accumulation_steps=4)
    >>> trainer = ZeroTrainer(model=model, args=args, train_dataset=train, eval_dataset=held_out,
    ...                       processing_class=tokenizer)
    >>> trainer.train()
    >>> trainer.save_model("out/final")   # a from_pretrained directory
    ```
    """


@torch.no_grad()
def _mix_into_sharded_reference(model: nn.Module, reference: nn.Module, alpha: float) -> None:
    """`reference = alpha * model + (1 - alpha) * reference`, parameter by parameter, for sharded models: both
    are gathered, every rank mixes the same values, rank 0's are written back into the reference's shards."""
    with gathered_parameters(model), gathered_parameters(reference, modifier_rank=0):
        for target, source in zip(reference.parameters(), model.parameters(), strict=True):
            target.mul_(1.0 - alpha).add_(source.to(target.dtype), alpha=alpha)


def _reads_head_directly(trainer: object) -> bool:
    """Whether the trainer computes its loss from `lm_head.weight` without calling the head (TRL's trainers,
    with their default fused log-probabilities)."""
    return any(cls.__module__.split(".")[0] == "trl" for cls in type(trainer).__mro__)
