"""`ZeroConfig`: the one source of truth for every engine setting.

The engine never reads environment variables or global state; the Trainer and Accelerate
integrations each translate their own arguments into a `ZeroConfig` in one function.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import torch

from .dtypes import SHORT_NAMES

MixedPrecision = Literal["no", "bf16", "fp16"]
ReduceDtype = Literal["fp32", "bf16", "fp16"]
Collectives = Literal["auto", "native", "composed"]

_STAGE_HELP = "0 = plain data parallel, 1 = shard optimizer state, 2 = also shard gradients, 3 = also shard parameters"


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """Every setting of the hf_zero engine, validated once at construction.

    Args:
        stage (`int`, *optional*, defaults to 3):
            The ZeRO stage. 0 is plain data parallelism (every rank holds everything). 1 shards
            the fp32 master weights and optimizer state across ranks. 2 also shards the reduced
            gradients (unsharded gradients live only while a unit's backward runs). 3 also
            shards the parameters: a unit's parameters are gathered just before they are used
            and freed right after. Model-state memory per rank for fp32 Adam with Ψ parameters
            on N ranks: stage 1 `8Ψ + 12Ψ/N`, stage 2 `4Ψ + 12Ψ/N`, stage 3 `16Ψ/N` bytes.
            Stage 3 moves 1.5x the bytes of plain data parallelism.
        mixed_precision (`str`, *optional*, defaults to `"no"`):
            `"no"`, `"bf16"` or `"fp16"`. With bf16/fp16 the parameters the model computes with
            (and gathers, at stage 3) are in that dtype, while the master weights, the optimizer
            state and (by default) the gradient reduction stay in fp32. fp16 applies dynamic
            loss scaling. The model's floating-point inputs (features, `inputs_embeds`) are cast to
            that dtype before its forward, `labels` excepted, as FSDP2 does by default.
        reduce_dtype (`str`, *optional*):
            Dtype of the gradient reduction: `"fp32"`, `"bf16"` or `"fp16"`. Defaults to fp32
            under mixed precision and to the parameters' dtype otherwise. A low-precision
            reduction halves the gradient traffic at some cost in accuracy.
        wrap (`"auto"` or a sequence of class names, *optional*, defaults to `"auto"`):
            Which modules form the sharding units (each unit's parameters are gathered and
            reduced together). `"auto"` takes the classes named by the model's
            `_no_split_modules` (e.g. `LlamaDecoderLayer`, `FalconDecoderLayer`), or, for other
            models, the repeated blocks of an `nn.ModuleList`. Parameters outside every unit
            (embeddings, final norm, head) form the root unit. A model with neither (a
            classifier, an `nn.Sequential`, a model of a few parameters) is one unit when it
            fits one bucket (`bucket_size_mb`), else a unit per child module with parameters;
            the choice is logged ([Note: units without blocks] in `hf_zero/engine/wrap.py`).
        sync_module_states (`bool`, *optional*, defaults to `True`):
            Broadcast rank 0's parameters and buffers to every rank at `initialize`, as DDP
            does, so that ranks seeded differently still train one model. Costs one broadcast
            of the model.
        broadcast_buffers (`bool`, *optional*, defaults to `True`):
            Broadcast rank 0's buffers (BatchNorm's running statistics) to every rank before each
            training forward (grad mode on, outside `no_sync`), as DDP does by default, so every
            rank evaluates and saves rank 0's statistics. `False` keeps each rank's own, as FSDP
            does. Costs one broadcast per dtype of the model's buffers per forward, none for a
            model without buffers.
        offload_optimizer (`bool`, *optional*, defaults to `False`):
            ZeRO-Offload: keep the fp32 master shards, the gradient shards and the optimizer
            state in host (CPU) memory and run the optimizer step there. Device memory for model
            states drops to the compute-dtype parameters (stage 3: 2Ψ/N bytes with bf16); host
            memory per node grows by about 16Ψ × (ranks per node) / N. Each step copies the
            gradient shards to the host and the updated shards back (pinned memory on CUDA); use
            a fast CPU optimizer (e.g. `torch.optim.AdamW(..., fused=True)`).
        offload_params (`bool`, *optional*, defaults to `False`):
            Stage 3 only, with `offload_optimizer`: the sharded parameters live in host memory
            too, and each unit's shard is copied to the device just before its all-gather. The
            device then holds only the gathered units; each gather costs one host-to-device copy.
            With `offload_dir` too, no parameter shard is kept anywhere: each gather reads the unit's
            master shard from the files and casts it (host memory for model states drops to the
            gradient shards, 4Ψ/N; each step reads the files twice more, in forward and backward).
        offload_dir (`str`, *optional*):
            ZeRO-Infinity, with `offload_optimizer`: the fp32 master shards and the elementwise
            optimizer state live in files under this folder (a local NVMe disk), one preallocated
            set per rank, instead of host memory; the optimizer step streams them through a few
            host buffers, reading ahead and writing behind on background threads. Host memory for
            model states drops to the gradient shards (4Ψ/N bytes) and the compute-dtype parameter
            shards; the disk needs 12Ψ/N bytes per rank with AdamW (checked at `initialize`, on every
            rank). Each step reads and writes those bytes once. The files are removed when the model
            is released. See [Note: disk offload] in `hf_zero/engine/step/disk.py`.
        prefetch (`int`, *optional*, defaults to 1):
            Stage 3: how many units' all-gathers are issued ahead of the running unit (in forward
            order, and in reverse order during backward; the order is learned from the first
            forward), so communication overlaps computation. Each adds one gathered unit to the
            device memory peak; 0 gathers each unit only when it is needed (each forward gather is
            then preceded by a few-byte check that every rank gathers the same unit, as in the
            first forward: [Note: units run on some ranks]). A backward prefetch
            that would hold more at once than the largest unit's parameters and gradients (e.g.
            the last block during the head's backward) is issued when the unit's backward ends.
        bucket_size_mb (`float`, *optional*, defaults to 25):
            The size of the communication bucket: a unit takes in the next sibling transformer
            block for as long as it holds less than this many MiB of parameters (in the compute
            dtype), and each unit is gathered with one all-gather and reduced with one
            reduce-scatter. Larger buckets mean fewer, larger collectives and fewer hook
            round-trips (helps models with small blocks, or links where each collective pays a
            latency) at the cost of gathering more parameters at once at stage 3. Blocks frozen whole
            at `initialize` join only each other (gradual unfreezing starts them later). 0 makes every
            block a unit of its own; a block of 25 MiB or more is always alone, so large models
            are unaffected by the default. The default (DDP's bucket size too) comes from
            `benchmarks/bench.py --sweep` on the small preset (12 MiB blocks, grouped by 3):
            ZeRO-3 ran 674 tokens/s (641-708) with 25 MiB against 603 (600-607) with one block
            per unit, for 10% more peak memory; ZeRO-2 was within noise either way.
        shard_group_size (`int`, *optional*):
            Hybrid sharding (FSDP's HYBRID_SHARD, ZeRO++ hpZ): shard within groups of this many
            consecutive ranks (usually the ranks of one node) and replicate across the groups.
            Gradients are reduce-scattered inside a group and all-reduced across groups, so the
            large collectives stay on the node's fast links; model states per rank are those of
            a world of `shard_group_size` ranks. Must divide the world size. `None` shards over
            every rank.
        sequence_parallel (`int`, *optional*, defaults to 1):
            Sequence parallelism (the Ulysses scheme, [Note: sequence parallelism]): groups of this
            many consecutive ranks train on the same samples, each rank on 1/N of every sequence's
            tokens; attention sees the whole sequence through two all-to-alls per layer (tokens for
            heads, and back). Activations per rank shrink by N; ZeRO still shards over every rank.
            Every rank of a group must be given the same batch; the sequence length must be a
            multiple of N, and the model's attention and key-value heads too. Must divide the
            world size. 1: off.
        tiled_mlp (`bool`, *optional*, defaults to `False`):
            Compute each decoder MLP (a submodule named `mlp`) over the sequence in tiles, each recomputed in its
            own backward ([Note: tiled MLP]): in training at long sequences the MLP's activations, the largest of
            a layer, are those of one tile (16 MB) instead of the whole sequence's, for one more MLP forward per
            step. Exact; with or without `sequence_parallel`.
        collectives (`str`, *optional*, defaults to `"auto"`):
            How the parameter all-gathers and gradient reduce-scatters travel: `"native"` uses the
            backend's own collectives; `"composed"` builds them from faster primitives (an
            all-gather as one broadcast per rank, a reduce-scatter as an all-reduce of the buffer);
            `"auto"` composes them on gloo (3.3x and 1.7x faster there at 100 MB,
            `benchmarks/collectives.py`) and uses the native ones on NCCL and other backends.
        group_timeout_s (`float`, *optional*):
            Timeout of the process groups hf_zero creates at `initialize` (hybrid sharding, sequence
            parallelism, and the gloo group background saves agree on), their creation included: a rank
            that stops answering makes the others raise after this long instead of hanging. By default
            the default process group's own, which the launcher sets (`--ddp_timeout` with the Trainer,
            `InitProcessGroupKwargs(timeout=...)` with Accelerate), so hf_zero's groups wait as long as
            the job's others (600 s where that cannot be read).
        no_sync_keeps_grads (`bool`, *optional*, defaults to `False`):
            Stages 2-3: what `model.no_sync()` does (the Trainer and `accelerator.accumulate` use it
            on every micro-batch but the last). By default every micro-batch's gradients are still
            reduce-scattered into the fp32 gradient shards, so model states stay at the ZeRO
            formula during gradient accumulation, as DeepSpeed does. `True` skips those
            reductions and keeps every unit's unsharded gradients, in the compute dtype, until the
            synchronising micro-batch (FSDP's `no_sync`): one reduce-scatter per unit per
            optimizer step instead of one per micro-batch, for the full model's gradients on every
            rank (2Ψ bytes in bf16, 4Ψ in fp32) and a sum in the compute dtype. Stages 0-1 always
            skip (their unsharded gradient buffer exists anyway).
        quantized_weights (`bool`, *optional*, defaults to `False`):
            Stage 3: all-gather the parameters in int8 with one scale per `quantization_block`
            elements (symmetric, absmax), dequantized into the compute dtype on arrival (ZeRO++'s
            qwZ): a quarter of the fp32 bytes, half of bf16's. Forward and backward then see weights
            rounded to about 1/254 of each block's largest magnitude; the master weights and the
            optimizer state stay exact, so rounding does not accumulate across steps.
        quantized_gradients (`bool`, *optional*, defaults to `False`):
            Stages 2-3: reduce-scatter gradients in int8 with per-block scales (ZeRO++'s qgZ): each
            rank quantizes the part every other rank owns, sends it with one all-to-all, and the
            owner dequantizes and sums in fp32. A quarter of fp32's bytes; each rank's contribution
            is rounded once, the sum is not. (`reduce_dtype="bf16"` is the milder option: half.)
        quantization_block (`int`, *optional*, defaults to 256):
            Elements per int8 scale for `quantized_weights` and `quantized_gradients`. Smaller
            blocks follow the values more closely (an extra 4 bytes per block).
        initial_loss_scale (`float`, *optional*, defaults to 65536.0):
            Starting loss scale for fp16 (ignored otherwise). The scale halves on overflow and
            doubles after `loss_scale_window` clean steps.
        loss_scale_window (`int`, *optional*, defaults to 1000):
            Number of overflow-free steps after which the fp16 loss scale doubles.

    Example:

    ```python
    >>> from hf_zero import ZeroConfig
    >>> config = ZeroConfig(stage=3, mixed_precision="bf16")
    >>> config.param_dtype, config.resolved_reduce_dtype
    (torch.bfloat16, torch.float32)
    ```
    """

    # Each field's `help` is its one-line summary for the integrations' settings (`--zero_<name>`,
    # `ZeroPlugin(zero_<name>=...)`), derived from these fields in integrations/zero_fields.py.
    stage: Literal[0, 1, 2, 3] = field(
        default=3,
        metadata={
            "help": _STAGE_HELP + " (model-state memory per rank for "
            "fp32 Adam: 1: 8Ψ+12Ψ/N, 2: 4Ψ+12Ψ/N, 3: 16Ψ/N bytes; stage 3 communicates 1.5x more)."
        },
    )
    mixed_precision: MixedPrecision = field(
        default="no",
        metadata={
            "help": "Compute dtype (no, bf16, fp16); the "
            "integrations take it from the Trainer's --bf16/--fp16 or Accelerate's mixed_precision.",
            "host_owned": True,
        },
    )
    reduce_dtype: ReduceDtype | None = field(
        default=None,
        metadata={
            "help": "Gradient reduction dtype (default: fp32 "
            "under mixed precision, else the parameters' dtype). bf16 halves gradient traffic at some accuracy cost."
        },
    )
    wrap: str | tuple[str, ...] = field(
        default="auto",
        metadata={
            "help": "Sharding units: 'auto' (the model's "
            "_no_split_modules, e.g. LlamaDecoderLayer) or module class names (comma-separated on the command line)."
        },
    )
    sync_module_states: bool = field(
        default=True, metadata={"help": "Broadcast rank 0's weights to every rank when sharding (as DDP does)."}
    )
    broadcast_buffers: bool = field(
        default=True,
        metadata={
            "help": "Broadcast rank 0's buffers before each training forward (DDP's default); False: each rank's."
        },
    )
    offload_optimizer: bool = field(
        default=False,
        metadata={
            "help": "ZeRO-Offload: fp32 master weights, gradient "
            "shards and optimizer state in host memory; the optimizer step runs on the CPU."
        },
    )
    offload_params: bool = field(
        default=False,
        metadata={
            "help": "Stage 3 with offload_optimizer: the parameter shards live in host memory too and are copied "
            "to the device before each gather; with offload_dir, each gather reads the unit's master shard from the "
            "files instead (no parameter shard kept)."
        },
    )
    offload_dir: str | None = field(
        default=None,
        metadata={
            "help": "ZeRO-Infinity, with offload_optimizer: keep the fp32 master weights and optimizer state in "
            "files under this folder (a fast local disk), streamed through a few host buffers at each step, instead "
            "of host memory."
        },
    )
    prefetch: int = field(
        default=1,
        metadata={
            "help": "Stage 3: units gathered ahead of the running one (overlaps "
            "communication with compute; each adds one gathered unit of device memory). 0 disables."
        },
    )
    bucket_size_mb: float = field(
        default=25.0,
        metadata={
            "help": "Group consecutive transformer blocks into one unit "
            "(one all-gather, one reduce-scatter) until it holds this many MiB of parameters. 0: one block per unit."
        },
    )
    shard_group_size: int | None = field(
        default=None,
        metadata={
            "help": "Hybrid sharding: shard within groups of this "
            "many consecutive ranks (a node) and replicate across them; must divide the world size."
        },
    )
    sequence_parallel: int = field(
        default=1,
        metadata={
            "help": "Sequence parallelism: groups of this many consecutive ranks share each sample, each rank "
            "holding 1/N of every sequence (Ulysses all-to-all around attention); must divide the world size."
        },
    )
    tiled_mlp: bool = field(
        default=False,
        metadata={
            "help": "Compute each decoder MLP over the sequence in tiles recomputed in the backward: long sequences "
            "hold one tile's MLP activations, for one more MLP forward per step."
        },
    )
    collectives: Collectives = field(
        default="auto",
        metadata={
            "help": "How gathers and reductions travel: native "
            "(the backend's), composed (broadcasts and all-reduce) or auto (composed on gloo, native on NCCL)."
        },
    )
    group_timeout_s: float | None = field(
        default=None,
        metadata={
            "help": "Timeout in seconds of the process groups hf_zero creates (hybrid sharding, sequence parallelism, "
            "background saves); by default the default process group's (--ddp_timeout)."
        },
    )
    no_sync_keeps_grads: bool = field(
        default=False,
        metadata={
            "help": "Stages 2-3 with gradient accumulation: keep "
            "unsharded gradients across micro-batches and reduce once per step (fewer collectives, the full model's "
            "gradients on every rank) instead of reducing every micro-batch into the shards."
        },
    )
    quantized_weights: bool = field(
        default=False,
        metadata={
            "help": "Stage 3: all-gather parameters in int8 with "
            "per-block scales (ZeRO++ qwZ): fewer bytes, weights rounded in forward/backward; masters stay exact."
        },
    )
    quantized_gradients: bool = field(
        default=False,
        metadata={
            "help": "Stages 2-3: reduce-scatter gradients in int8 "
            "with per-block scales through an all-to-all, summed in fp32 by the owner (ZeRO++ qgZ)."
        },
    )
    quantization_block: int = field(
        default=256, metadata={"help": "Elements per int8 scale for the quantized collectives."}
    )
    initial_loss_scale: float = field(default=65536.0, metadata={"help": "fp16: the starting dynamic loss scale."})
    loss_scale_window: int = field(
        default=1000, metadata={"help": "fp16: overflow-free steps after which the loss scale doubles."}
    )

    def __post_init__(self) -> None:
        """Check every field (`TypeError` / `ValueError` naming the field and what it takes), then the fields
        that only make sense together."""
        self._check_choices()
        self._check_numbers()
        self._check_combinations()

    def _check_choices(self) -> None:
        """The fields that take one of a few values, and the flags."""
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeroConfig.stage must be 0, 1, 2 or 3 ({_STAGE_HELP}); got {self.stage!r}.")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(
                f"ZeroConfig.mixed_precision must be 'no', 'bf16' or 'fp16'; got {self.mixed_precision!r}."
            )
        if self.reduce_dtype is not None and self.reduce_dtype not in SHORT_NAMES:
            raise ValueError(
                f"ZeroConfig.reduce_dtype must be None, 'fp32', 'bf16' or 'fp16'; got {self.reduce_dtype!r}."
            )
        object.__setattr__(self, "wrap", _normalize_wrap(self.wrap))
        for name in (
            "sync_module_states",
            "broadcast_buffers",
            "offload_optimizer",
            "offload_params",
            "no_sync_keeps_grads",
            "quantized_weights",
            "quantized_gradients",
            "tiled_mlp",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ZeroConfig.{name} must be a bool; got {getattr(self, name)!r}.")
        if self.collectives not in ("auto", "native", "composed"):
            raise ValueError(
                f"ZeroConfig.collectives must be 'auto', 'native' or 'composed'; got {self.collectives!r}."
            )
        if self.offload_dir is not None:
            if not isinstance(self.offload_dir, (str, os.PathLike)) or not os.fspath(self.offload_dir):
                raise TypeError(f"ZeroConfig.offload_dir must be a folder path (str); got {self.offload_dir!r}.")
            object.__setattr__(self, "offload_dir", os.fspath(self.offload_dir))

    def _check_combinations(self) -> None:
        """The fields that need others: offload, hybrid sharding and quantization by stage."""
        if self.offload_params and (self.stage != 3 or not self.offload_optimizer):
            raise ValueError(
                "ZeroConfig.offload_params needs stage=3 and offload_optimizer=True: parameters are only sharded at "
                "stage 3, and their master copy is updated where the optimizer runs. Set stage=3, "
                "offload_optimizer=True (or drop offload_params)."
            )
        if self.offload_dir is not None and not self.offload_optimizer:
            raise ValueError(
                "ZeroConfig.offload_dir needs offload_optimizer=True: the optimizer step runs on the host, "
                "streaming its state from the files. Set offload_optimizer=True (or drop offload_dir)."
            )
        if self.shard_group_size is not None and self.stage == 0:
            raise ValueError("ZeroConfig.shard_group_size needs stage 1, 2 or 3: stage 0 shards nothing.")
        if (
            isinstance(self.sequence_parallel, bool)
            or not isinstance(self.sequence_parallel, int)
            or (self.sequence_parallel < 1)
        ):
            raise ValueError(
                f"ZeroConfig.sequence_parallel must be a positive int (ranks per sequence; 1: off); got "
                f"{self.sequence_parallel!r}."
            )
        if self.quantized_weights and self.stage != 3:
            raise ValueError("ZeroConfig.quantized_weights needs stage=3: only stage 3 gathers parameters every step.")
        if self.quantized_gradients and self.stage < 2:
            raise ValueError(
                "ZeroConfig.quantized_gradients needs stage 2 or 3 (a reduce-scatter of every gradient); "
                "stages 0-1 all-reduce them."
            )

    def _check_numbers(self) -> None:
        """The counts, sizes and scales, each in its range."""
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"ZeroConfig.prefetch must be an int >= 0 (units gathered ahead); got {self.prefetch!r}.")
        if (
            isinstance(self.bucket_size_mb, bool)
            or not isinstance(self.bucket_size_mb, (int, float))
            or not (0 <= self.bucket_size_mb < float("inf"))
        ):
            raise ValueError(
                "ZeroConfig.bucket_size_mb must be a number >= 0 (MB of parameters per unit); got "
                f"{self.bucket_size_mb!r}."
            )
        if self.shard_group_size is not None and (
            isinstance(self.shard_group_size, bool)
            or not isinstance(self.shard_group_size, int)
            or self.shard_group_size < 1
        ):
            raise ValueError(
                f"ZeroConfig.shard_group_size must be None or a positive int (e.g. the GPUs per node); "
                f"got {self.shard_group_size!r}."
            )
        if (
            isinstance(self.quantization_block, bool)
            or not isinstance(self.quantization_block, int)
            or not (8 <= self.quantization_block <= 2**20)
        ):
            raise ValueError(
                f"ZeroConfig.quantization_block must be an int in [8, 1048576]; got {self.quantization_block!r}."
            )
        if self.group_timeout_s is not None and not (
            isinstance(self.group_timeout_s, (int, float)) and self.group_timeout_s > 0
        ):
            raise ValueError(f"ZeroConfig.group_timeout_s must be None or > 0 seconds; got {self.group_timeout_s!r}.")
        if not (isinstance(self.initial_loss_scale, (int, float)) and self.initial_loss_scale > 0):
            raise ValueError(f"ZeroConfig.initial_loss_scale must be > 0; got {self.initial_loss_scale!r}.")
        if (
            isinstance(self.loss_scale_window, bool)
            or not isinstance(self.loss_scale_window, int)
            or (self.loss_scale_window < 1)
        ):
            raise ValueError(f"ZeroConfig.loss_scale_window must be an int >= 1; got {self.loss_scale_window!r}.")

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The compute dtype of the parameters, or `None` to keep the model's own dtype."""
        return None if self.mixed_precision == "no" else SHORT_NAMES[self.mixed_precision]

    def bucket_numel(self, model_dtype: torch.dtype) -> int:
        """`bucket_size_mb` in parameters of the compute dtype (the model's own without mixed precision)."""
        return int(self.bucket_size_mb * 2**20) // (self.param_dtype or model_dtype).itemsize

    @property
    def shard_alignment(self) -> int:
        """Elements every rank's shard is a multiple of: whole int8 blocks when any transfer is quantized."""
        return self.quantization_block if self.quantized_weights or self.quantized_gradients else 1

    @property
    def resolved_reduce_dtype(self) -> torch.dtype | None:
        """The gradient-reduction dtype, or `None` for "the parameters' dtype"."""
        if self.reduce_dtype is not None:
            return SHORT_NAMES[self.reduce_dtype]
        return torch.float32 if self.mixed_precision != "no" else None


def _normalize_wrap(wrap: object) -> str | tuple[str, ...]:
    if wrap == "auto":
        return "auto"
    if isinstance(wrap, str):
        raise ValueError(
            f"ZeroConfig.wrap must be 'auto' or a list of module class names; got the string {wrap!r}. "
            f"Write wrap=[{wrap!r}] to name one class."
        )
    if not isinstance(wrap, (list, tuple)) or not wrap or not all(isinstance(w, str) and w for w in wrap):
        raise ValueError(
            "ZeroConfig.wrap must be 'auto' or a non-empty list of module class names "
            f"(e.g. ['LlamaDecoderLayer']); got {wrap!r}."
        )
    return tuple(wrap)
