"""`ZeroTrainingArguments`: the Trainer's arguments plus hf_zero's, translated into one `ZeroConfig`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from transformers import TrainingArguments

from ..config import ZeroConfig

_DEFAULT = ZeroConfig()  # the engine's defaults are the one source of the defaults below


@dataclass
class ZeroTrainingArguments(TrainingArguments):
    """`TrainingArguments` with the hf_zero engine's settings, exposed as `--zero_*` flags.

    Precision comes from the Trainer's own `--bf16` / `--fp16` (or, as for `TrainingArguments`, from
    `accelerate launch --mixed_precision`), so it has one owner. The
    combinations that cannot work are refused here, before `torch.distributed` starts, with a
    message that says what to do instead: `--deepspeed`, `--fsdp` (and their Accelerate
    environment switches), and `--auto_find_batch_size` with a sharded optimizer.

    Example:

    ```python
    >>> from transformers import HfArgumentParser
    >>> (args,) = HfArgumentParser(ZeroTrainingArguments).parse_args_into_dataclasses(
    ...     ["--output_dir", "out", "--zero_stage", "3", "--bf16"])
    >>> args.to_zero_config()
    ZeroConfig(stage=3, mixed_precision='bf16', ...)
    ```
    """

    zero_stage: Literal[0, 1, 2, 3] = field(
        default=_DEFAULT.stage,
        metadata={"help": "ZeRO stage: 0 plain data parallel, 1 shard optimizer state, 2 also gradients, "
                          "3 also parameters (model-state memory per rank for fp32 Adam: 1: 8Ψ+12Ψ/N, 2: 4Ψ+12Ψ/N, "
                          "3: 16Ψ/N bytes; stage 3 communicates 1.5x more)."},
    )
    zero_wrap: str = field(
        default="auto",
        metadata={"help": "Sharding units: 'auto' (the model's _no_split_modules, e.g. LlamaDecoderLayer) or "
                          "comma-separated module class names."},
    )
    zero_reduce_dtype: str | None = field(
        default=None,
        metadata={"help": "Gradient reduction dtype: fp32, bf16 or fp16 (default: fp32 with --bf16/--fp16, else the "
                          "parameters' dtype). bf16 halves gradient traffic at some accuracy cost."},
    )
    zero_offload_optimizer: bool = field(
        default=_DEFAULT.offload_optimizer,
        metadata={"help": "ZeRO-Offload: fp32 master weights, gradient shards and optimizer state in host memory; "
                          "the optimizer step runs on the CPU (less device memory, more host memory and PCIe traffic)."},
    )
    zero_offload_params: bool = field(
        default=_DEFAULT.offload_params,
        metadata={"help": "Stage 3 with --zero_offload_optimizer: the parameter shards live in host memory too and "
                          "are copied to the device before each gather."},
    )
    zero_no_sync_keeps_grads: bool = field(
        default=_DEFAULT.no_sync_keeps_grads,
        metadata={"help": "Stages 2-3 with gradient accumulation: keep unsharded gradients across micro-batches and "
                          "reduce once per step (fewer collectives, the full model's gradients on every rank) instead "
                          "of reducing every micro-batch into the shards (the default)."},
    )
    zero_prefetch: int = field(
        default=_DEFAULT.prefetch,
        metadata={"help": "Stage 3: units gathered ahead of the running one (overlaps communication with compute; "
                          "each adds one gathered unit of device memory). 0 disables."},
    )
    zero_bucket_size_mb: float = field(
        default=_DEFAULT.bucket_size_mb,
        metadata={"help": "Group consecutive transformer blocks into one unit (one all-gather, one reduce-scatter) "
                          "until it holds this many MB of parameters. 0: one block per unit."},
    )
    zero_collectives: str = field(
        default=_DEFAULT.collectives,
        metadata={"help": "How gathers and reductions travel: the backend's collectives (native), composed of "
                          "broadcasts and all-reduce (composed), or auto (composed on gloo, native on NCCL).",
                  "choices": ["auto", "native", "composed"]},
    )
    zero_hybrid_shard: bool = field(
        default=False,
        metadata={"help": "Hybrid sharding: shard within each node (the launcher's LOCAL_WORLD_SIZE ranks) and replicate "
                          "across nodes, so the big collectives stay inside the node."},
    )
    zero_shard_group_size: int | None = field(
        default=_DEFAULT.shard_group_size,
        metadata={"help": "Hybrid sharding with an explicit group size (must divide the world size)."},
    )
    zero_sync_module_states: bool = field(
        default=_DEFAULT.sync_module_states,
        metadata={"help": "Broadcast rank 0's weights to every rank when sharding (as DDP does)."},
    )

    @property
    def place_model_on_device(self) -> bool:
        return False  # the engine moves the model to the device one unit (and one shard) at a time

    def __post_init__(self) -> None:
        # Everything is checked before super().__post_init__(), which starts torch.distributed: a
        # mistake raises the same error on every rank and nothing waits in a collective.
        self._refuse_incompatible()
        self.to_zero_config()
        super().__post_init__()

    def _refuse_incompatible(self) -> None:
        if self.deepspeed or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true", "yes"):
            raise ValueError(
                "hf_zero cannot be combined with DeepSpeed (--deepspeed or ACCELERATE_USE_DEEPSPEED): hf_zero is the "
                "ZeRO engine here. Drop the DeepSpeed config and pass --zero_stage (and --zero_* settings) instead."
            )
        if self.fsdp or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true", "yes"):
            raise ValueError(
                "hf_zero cannot be combined with FSDP (--fsdp or ACCELERATE_USE_FSDP): both shard the model. Drop "
                "--fsdp and use --zero_stage 3 for full sharding."
            )
        if self.auto_find_batch_size and self.zero_stage > 0:
            raise ValueError(
                "--auto_find_batch_size rebuilds the model after an out-of-memory error but would keep the sharded "
                "optimizer of the first attempt. Set --per_device_train_batch_size yourself (hf-zero estimate helps) "
                "or use --zero_stage 0."
            )

    def to_zero_config(self) -> ZeroConfig:
        """The `ZeroConfig` these arguments describe (the one translation from Trainer arguments)."""
        if self.fp16 and self.bf16:
            raise ValueError("Pass at most one of --bf16 and --fp16.")
        # TrainingArguments' own rule: the launcher's setting, overridden by --bf16 / --fp16.
        mixed = "bf16" if self.bf16 else "fp16" if self.fp16 else os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        if mixed not in ("no", "bf16", "fp16"):
            raise ValueError(f"hf_zero supports mixed precision 'no', 'bf16' or 'fp16'; the launcher asked for {mixed!r}.")
        wrap: str | tuple[str, ...] = self.zero_wrap.strip()
        if wrap != "auto":
            wrap = tuple(name.strip() for name in wrap.split(",") if name.strip())
            if not wrap:
                raise ValueError("--zero_wrap must be 'auto' or comma-separated module class names.")
        group_size = self.zero_shard_group_size
        if self.zero_hybrid_shard:
            if group_size is not None:
                raise ValueError("Pass --zero_hybrid_shard or --zero_shard_group_size, not both.")
            group_size = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None
            if group_size is None:
                raise ValueError(
                    "--zero_hybrid_shard takes the group size from LOCAL_WORLD_SIZE, which the launcher (accelerate "
                    "launch, torchrun) sets; it is not set here. Pass --zero_shard_group_size N instead."
                )
        return ZeroConfig(
            stage=self.zero_stage,
            shard_group_size=group_size,
            mixed_precision=mixed,
            reduce_dtype=self.zero_reduce_dtype,  # type: ignore[arg-type]
            wrap=wrap,
            sync_module_states=self.zero_sync_module_states,
            prefetch=self.zero_prefetch,
            no_sync_keeps_grads=self.zero_no_sync_keeps_grads,
            bucket_size_mb=self.zero_bucket_size_mb,
            collectives=self.zero_collectives,  # type: ignore[arg-type]
            offload_optimizer=self.zero_offload_optimizer,
            offload_params=self.zero_offload_params,
        )
