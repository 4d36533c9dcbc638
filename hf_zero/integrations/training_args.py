"""`ZeroTrainingArguments`: the Trainer's arguments plus hf_zero's, translated into one `ZeroConfig`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, make_dataclass
from typing import TYPE_CHECKING, Any

from transformers import TrainingArguments

from ..config import ZeroConfig
from ..launch import cpu_launch_warning, has_accelerator
from .zero_fields import field_specs, launch_env, save_specs, sequence_size, snapshot_budget, to_zero_config

logger = logging.getLogger(__name__)


class _ZeroArguments:
    """Every hf_zero engine setting as a `--zero_<name>` field (the `ZeroConfig` field of that name: same
    default, help and choices; `--zero_wrap` takes comma-separated names), for any `TrainingArguments`
    class: `ZeroTrainingArguments` is this over `TrainingArguments`; over another library's config,
    put this first so that config keeps its own defaults (TRL's `SFTConfig` turns `bf16` on, for one):
    `class ZeroSFTConfig(hf_zero.ZeroArgumentsMixin, SFTConfig)`.

    Precision comes from the Trainer's own `--bf16` / `--fp16` (or, as for `TrainingArguments`, from
    `accelerate launch --mixed_precision`), so it has one owner. The
    combinations that cannot work are refused here, before `torch.distributed` starts, with a
    message that says what to do instead: `--deepspeed` and `--fsdp` (and their Accelerate
    environment switches), and the `--optim` choices that step inside backward (`lomo`, `adalomo`, the
    layer-wise ones such as `galore_adamw_layerwise`).

    Example:

    ```python
    >>> from transformers import HfArgumentParser
    >>> (args,) = HfArgumentParser(ZeroTrainingArguments).parse_args_into_dataclasses(
    ...     ["--output_dir", "out", "--zero_stage", "3", "--bf16"])
    >>> args.to_zero_config()
    ZeroConfig(stage=3, mixed_precision='bf16', ...)
    ```
    """

    if TYPE_CHECKING:  # for the checker only: at runtime an annotation here would change how the Trainer's
        # parser types the flag (it reads the annotations of every class in the MRO)
        fp16: bool  # declared by TrainingArguments, which every class this is mixed into derives from
        bf16: bool
        deepspeed: dict[str, Any] | str | None
        fsdp: Any
        optim: Any
        save_total_limit: int | None
        parallelism_config: Any
        use_cpu: bool
        world_size: int
        zero_shard_group_size: int | None  # the fields the mixin adds
        zero_sequence_parallel: int
        zero_hybrid_shard: bool
        zero_save_model_weights: bool
        zero_async_save: bool
        zero_snapshot_budget: str | None
        zero_save_on_preemption: bool

    @property
    def place_model_on_device(self) -> bool:
        return False  # the engine moves the model to the device one unit (and one shard) at a time

    def __post_init__(self) -> None:
        # Everything is checked before super().__post_init__(), which starts torch.distributed: a
        # mistake raises the same error on every rank and nothing waits in a collective.
        self._refuse_incompatible()
        snapshot_budget(self)
        self.to_zero_config()
        self._cpu_where_launched()
        super().__post_init__()  # type: ignore[misc]  # TrainingArguments, after this mixin in the MRO, has it
        self._check_launched_world()

    def _cpu_where_launched(self) -> None:
        """[Note: launched world]
        `torchrun` / `accelerate launch` started WORLD_SIZE processes, on a machine with no GPU, without
        `--use_cpu` or `ACCELERATE_USE_CPU`: the stock Trainer then decides it is one process (no distributed
        sampler, every rank logging) while hf_zero shards over the launcher's process group, so each rank would
        train the same batches: several copies of one process, half the work asked for. There is nothing else
        such a launch can mean, so it trains on the CPU as the N-process run it is (`use_cpu=True`)."""
        env = launch_env()
        if self.use_cpu or env.use_cpu or (env.world_size or 1) <= 1 or has_accelerator():
            return
        self.use_cpu = True
        if not env.local_rank:
            logger.warning(cpu_launch_warning(env.world_size or 1))

    def _check_launched_world(self) -> None:
        """[Note: launched world] what the Trainer believes against what the launcher started, before any step;
        the same decision on every rank (both come from the environment), so every rank raises."""
        launched = launch_env().world_size or 1
        believed = int(self.world_size)
        if launched > 1 and believed != launched:
            raise ValueError(
                f"The launcher started {launched} processes (WORLD_SIZE={launched}) but the Trainer sees {believed}: "
                f"each rank would train the same batches as a copy of one process. On a machine without GPUs pass "
                "--use_cpu (use_cpu=True) or set ACCELERATE_USE_CPU=true; on GPUs launch with one process per GPU "
                "(torchrun --nproc_per_node N or accelerate launch --num_processes N) and let the Trainer set up "
                "the process group (do not create a PartialState or Accelerator with other settings first)."
            )

    def _refuse_incompatible(self) -> None:
        env = launch_env()
        if self.deepspeed or env.use_deepspeed:
            raise ValueError(
                "hf_zero cannot be combined with DeepSpeed (--deepspeed or ACCELERATE_USE_DEEPSPEED): hf_zero is the "
                "ZeRO engine here. Drop the DeepSpeed config and pass --zero_stage (and --zero_* settings) instead."
            )
        if self.fsdp or env.use_fsdp:
            raise ValueError(
                "hf_zero cannot be combined with FSDP (--fsdp or ACCELERATE_USE_FSDP): both shard the model. Drop "
                "--fsdp and use --zero_stage 3 for full sharding."
            )
        if self.zero_async_save and self.save_total_limit == 1:
            raise ValueError(
                "--zero_async_save with --save_total_limit 1 would delete the last complete checkpoint while the new "
                "one is still being written. Use --save_total_limit 2 (or none)."
            )
        for flag in ("bf16_full_eval", "fp16_full_eval"):
            if getattr(self, flag, False):
                precision = flag.split("_")[0]
                raise ValueError(
                    f"--{flag} casts the whole model to {precision} for evaluation, and a model sharded by hf_zero "
                    f"keeps the dtype its engine owns. Drop --{flag}: with --{precision} the engine already evaluates "
                    f"in {precision} (fp32 masters stay as they are)."
                )
        optim = str(getattr(self.optim, "value", self.optim))
        if optim in ("lomo", "adalomo"):
            raise ValueError(
                f"--optim {optim} updates each parameter inside backward from its unreduced gradient (fused "
                "backward), which cannot step hf_zero's reduced shards. Use --optim adafactor or adamw_torch_8bit for "
                "small optimizer state: with --zero_stage 3 each rank keeps 1/N of it."
            )
        if optim.endswith("_layerwise"):
            raise ValueError(
                f"--optim {optim} steps each parameter from a hook on it inside backward, before any reduction, so it "
                "cannot step hf_zero's reduced shards. Use --optim " + optim.removesuffix("_layerwise") + ": it steps "
                "on whole parameters, each on the rank that owns it, and ZeRO already keeps 1/N of its state per rank."
            )

    def to_zero_config(self) -> ZeroConfig:
        """The `ZeroConfig` these arguments describe (the one translation from Trainer arguments)."""
        if self.fp16 and self.bf16:
            raise ValueError("Pass at most one of --bf16 and --fp16.")
        env = launch_env()
        # TrainingArguments' own rule: the launcher's setting, overridden by --bf16 / --fp16.
        mixed = "bf16" if self.bf16 else "fp16" if self.fp16 else env.mixed_precision or "no"
        if mixed not in ("no", "bf16", "fp16"):
            raise ValueError(
                f"hf_zero supports mixed precision 'no', 'bf16' or 'fp16'; the launcher asked for {mixed!r}."
            )
        group_size = self.zero_shard_group_size
        if self.zero_hybrid_shard:
            if group_size is not None:
                raise ValueError("Pass --zero_hybrid_shard or --zero_shard_group_size, not both.")
            group_size = env.local_world_size
            if group_size is None:
                raise ValueError(
                    "--zero_hybrid_shard takes the group size from LOCAL_WORLD_SIZE, which the launcher (accelerate "
                    "launch, torchrun) sets; it is not set here. Pass --zero_shard_group_size N instead."
                )
        sequence = sequence_size(getattr(self, "parallelism_config", None), self.zero_sequence_parallel)
        return to_zero_config(self, mixed, shard_group_size=group_size, sequence_parallel=sequence)


# [Note: one source of truth] in zero_fields.py: every ZeroConfig field as --zero_<field>, derived. The mixin
# holds only these fields (no TrainingArguments defaults), so mixed into another config it keeps that one's.
_ZeroArgumentsMixin = make_dataclass(
    "ZeroArgumentsMixin",
    [
        *field_specs(cli=True),
        *save_specs(),
        (
            "zero_hybrid_shard",
            bool,
            field(
                default=False,
                metadata={
                    "help": "Hybrid sharding: shard within each node (the launcher's LOCAL_WORLD_SIZE ranks) and "
                    "replicate across nodes, so the big collectives stay inside the node."
                },
            ),
        ),
        (
            "zero_save_model_weights",
            bool,
            field(
                default=True,
                metadata={
                    "help": "Also write the weights, in the dtype training computes in, into each checkpoint-N "
                    "(beside its sharded state in checkpoint-N/hf_zero), so that from_pretrained(checkpoint-N) loads "
                    "that step, as DeepSpeed's stage3_gather_16bit_weights_on_model_save does. Every rank writes the "
                    "tensors it owns; no rank gathers the model. Costs 2 bytes per parameter per checkpoint in "
                    "bf16/fp16 (4 in fp32)."
                },
            ),
        ),
    ],
    bases=(_ZeroArguments,),
    namespace={"__doc__": _ZeroArguments.__doc__, "__module__": __name__},
)
if TYPE_CHECKING:  # a class made by make_dataclass is no type to a checker: it sees the class it extends
    ZeroArgumentsMixin = _ZeroArguments
else:
    ZeroArgumentsMixin = _ZeroArgumentsMixin


@dataclass
class ZeroTrainingArguments(ZeroArgumentsMixin, TrainingArguments):
    """`TrainingArguments` with every hf_zero setting as a `--zero_<name>` flag (`ZeroArgumentsMixin`).

    Example:

    ```python
    >>> args = ZeroTrainingArguments(output_dir="out", zero_stage=3, bf16=True, gradient_accumulation_steps=4)
    >>> args.to_zero_config().stage
    3
    ```
    """
