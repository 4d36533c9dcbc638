"""Memory estimates per device and per host, for every stage and offload setting, before launching.

[Note: estimator]
Model states are computed with the engine's own rules (the same `units_for` and `FlatLayout`
on a meta-device model, so padding, tied weights and frozen parameters count exactly as they
will: frozen ones in the compute dtype only, [Note: frozen parameters]), for Adam-type optimizers
(two moments of the master dtype and a scalar step per parameter piece) or Adafactor on whole
parameters. The estimate equals what `hf_zero.model_state_memory` reports after the first step.

On top of model states, a device holds, at its peak (the start of the backward pass):
- gathered units (stage 3): the root unit, the running unit and the one prefetched ahead of it
  (the unit before it in the backward pass), in the compute dtype;
- unsharded gradients (stages 2-3): those of the root, the running unit and the unit whose
  reduction is in flight (the one after it), plus a cast copy for the reduction when the reduce
  dtype differs from the compute dtype; both counted at the unit of the backward pass where their
  sum peaks (a model's embedding and head are not live together; a lone embedding's gradient
  travels as rows);
- activations of a decoder LLM: each layer saves, per token, 8h + 3I elements in the compute
  dtype and, under eager attention, aL attention probabilities in fp32 (plus their compute-dtype
  copy under bf16/fp16), h hidden, I intermediate, a heads, L sequence length; sdpa and flash
  attention keep no probabilities (their kernels save one statistic per row: nothing beside 8h).
  Without activation checkpointing the peak is at the start of the backward pass, with every
  layer's activations saved; with it, each layer keeps only its input (h per token), and the peak
  is inside one layer's backward, with that layer's activations recomputed.
  The logits add B·L·V elements in the compute dtype, an fp32 copy when that is not fp32 (the
  loss upcasts), and fp32 log-probabilities. With sequence parallelism over N ranks every
  per-token term counts L/N tokens (a rank's eager attention holds 1/N of the heads over all L),
  and the loss is computed in tiles ([Note: tiled loss]): one tile's fp32 logits and softmax and
  its gradient in the compute dtype, not the rank's whole logits. With `tiled_mlp` ([Note: tiled MLP])
  the 3I term of a layer is that of one tile (3 x 16 MB at most);
- stages 0-1: a reduction buffer of the largest unit in the reduce dtype.
An input embedding's gradient is sparse rows, not a dense buffer ([Note: sparse lookup gradients]).
The activation coefficients were fitted on measured CPU runs of LLaMA (one configuration, with
and without checkpointing; the model ran sdpa attention, so the probabilities term is not
measured) and checked on others, up to 2048 tokens: tests/test_estimate.py states the method.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from .config import ZeroConfig
from .engine.engine import ModelStateMemory
from .engine.layout import FlatLayout
from .engine.step.pieces import chunk_bounds
from .engine.step.whole import deal
from .engine.unit import split_parts
from .engine.wrap import UnitSpec, units_for
from .features.tiled_loss import tile_rows
from .features.tiled_mlp import TILE_BYTES

_BYTES = {torch.float64: 8, torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
DISK_BUFFER_BYTES = 7 * 3 * 16 * 2**20  # [Note: disk offload]: windows in flight x (master + 2 moments) x 16 MiB
_ADAM_STEP_BYTES = 4  # torch keeps Adam's `step` as a float32 scalar per optimizer tensor (chunk)


@dataclass(frozen=True)
class Workload:
    """What the activations depend on."""

    micro_batch: int = 1
    seq_len: int = 2048
    gradient_checkpointing: bool = False
    sequence_parallel: int = 1  # ranks per sequence: each holds seq_len / N tokens ([Note: sequence parallelism])
    attention: Literal["eager", "sdpa"] = "eager"  # "sdpa" also for flash attention: no probabilities kept
    tiled_mlp: bool = False  # [Note: tiled MLP]: the MLP's intermediates of one tile at a time


@dataclass(frozen=True)
class Estimate:
    """One row of the table: bytes per device (worst rank) and per host."""

    stage: int
    offload: str  # "none", "optimizer", "optimizer+params", "disk" (optimizer state and masters in offload_dir),
    # "disk+params" (stage 3: no parameter shard kept either, [Note: parameters on disk])
    model_states: int
    gathered_units: int
    activations: int
    buffers: int
    host_per_node: int
    disk_per_node: int = 0

    @property
    def device_total(self) -> int:
        return self.model_states + self.gathered_units + self.activations + self.buffers


def model_states(
    specs: list[UnitSpec],
    config: ZeroConfig,
    world_size: int,
    rank: int,
    model_dtype: torch.dtype = torch.float32,
    optimizer: str = "adamw",
    order: list[str] | None = None,
) -> ModelStateMemory:
    """The model-state bytes rank `rank` holds after a step, by placement (`"device"` or `"host"`).

    `optimizer`: `"adamw"` (flat shards, [Note: optimizer shards]) or `"adafactor"` (torch's, on whole parameters:
    each rank holds the factored state of the parameters it owns, dealt as the engine deals them over the
    trainable parameters in `order`, their names in the optimizer's order; default: the units' order).

    Example:

    ```python
    >>> with torch.device("meta"):
    ...     model = AutoModelForCausalLM.from_config(config)
    >>> model_states(units_for(model, ZeroConfig(stage=3)), ZeroConfig(stage=3), world_size=8, rank=0).total()
    ```
    """
    param_dtype = config.param_dtype or model_dtype
    master_dtype = torch.float32 if config.param_dtype is not None else model_dtype
    pd, md = _BYTES[param_dtype], _BYTES[master_dtype]
    shards = 1 if config.stage == 0 else world_size
    shard_rank = 0 if config.stage == 0 else rank
    persistent = config.stage < 3
    host = "host" if config.offload_optimizer else "device"
    parts: dict[str, dict[str, int]] = {"parameters": {}, "gradients": {}, "optimizer_states": {}}

    def add(category: str, where: str, n: int) -> None:
        if n:
            parts[category][where] = parts[category].get(where, 0) + n

    for spec in (part for unit in specs for part in split_parts(unit, model_dtype)):  # [Note: frozen parameters]
        layout = FlatLayout.build(spec.param_names, [p.shape for p in spec.params], shards)
        s, padded = layout.shard_numel, layout.padded_numel
        pieces = layout.local_pieces(shard_rank)
        trainable = [(i, a, b) for i, a, b in pieces if spec.params[i].requires_grad]
        has_grads = any(p.requires_grad for p in spec.params)
        if spec.frozen:  # the compute-dtype shard is the only copy; never offloaded, no gradient, no state
            kept = spec.dtype.itemsize if spec.dtype is not None else pd  # its own dtype (4-bit codes: uint8)
            add("parameters", "device", (padded if persistent else s) * kept)
            continue
        master_where = "disk" if config.offload_dir is not None else host  # [Note: disk offload]
        if persistent:
            add("parameters", "device", padded * pd)
            master_is_param = param_dtype == master_dtype and not config.offload_optimizer
        elif not config.offload_optimizer:  # [Note: cast on gather]: the master is the gather source
            add("parameters", "device", s * md)
            master_is_param = True
        elif config.offload_params and config.offload_dir is not None:
            master_is_param = False  # [Note: parameters on disk]: gathers read the master file; no shard kept
        elif config.offload_params:
            add("parameters", "host", s * pd)  # the host master itself when the dtypes agree (in memory)
            master_is_param = param_dtype == master_dtype
        else:
            add("parameters", "device", s * pd)
            master_is_param = False
        if not master_is_param:
            add("optimizer_states", master_where, s * md)
        if has_grads:
            add("gradients", host, s * md)
            if config.stage <= 1 and spec.backward_reads_params:  # a lookup's gradient travels as rows
                add("gradients", "device", padded * pd)  # the unsharded buffer, kept and reused
        if optimizer == "adamw":
            add("optimizer_states", master_where, sum(2 * (b - a) * md for _, a, b in trainable))
            add("optimizer_states", host, sum(_ADAM_STEP_BYTES * len(chunk_bounds(b - a)) for _, a, b in trainable))
    if optimizer != "adamw":  # [Note: whole-parameter step]: the owned parameters' state, whole
        for shape in owned_shapes(specs, shards, shard_rank, md, order):
            add("optimizer_states", host, adafactor_state_bytes(shape, md))
    return ModelStateMemory(**parts)


def owned_shapes(
    specs: list[UnitSpec], shards: int, shard_rank: int, master_bytes: int, order: list[str] | None = None
) -> list[tuple[int, ...]]:
    """The shapes of the trainable parameters that shard rank `shard_rank` owns on the whole-parameter path."""
    shapes = {n: tuple(p.shape) for spec in specs for n, p in zip(spec.param_names, spec.params) if p.requires_grad}
    names = [n for n in order if n in shapes] if order is not None else list(shapes)
    sizes = [math.prod(shapes[n]) * master_bytes for n in names]
    return [shapes[names[i]] for i in deal(sizes, shards)[shard_rank]]


def adafactor_state_bytes(shape: tuple[int, ...], master_bytes: int) -> int:
    """torch's Adafactor state of one parameter: row and column second moments of a matrix (the variance of a
    vector), and a float32 step."""
    n = math.prod(shape)
    factored = n // shape[-1] + n // shape[-2] if len(shape) >= 2 else n
    return factored * master_bytes + _ADAM_STEP_BYTES


def activation_bytes(config: Any, workload: Workload, dtype_bytes: int) -> int:
    """Activations of one micro-batch of a decoder LLM on one device (see [Note: estimator])."""
    h = config.hidden_size
    inter = getattr(config, "intermediate_size", None) or getattr(config, "ffn_hidden_size", None) or 4 * h
    heads = config.num_attention_heads
    layers = config.num_hidden_layers
    b, seq = workload.micro_batch, workload.seq_len
    tokens = -(-seq // workload.sequence_parallel)  # this rank's; its attention rows still span the sequence
    upcast = 4 if dtype_bytes < 4 else 0  # an fp32 copy made from a bf16/fp16 tensor
    rows = heads * seq * (4 + dtype_bytes * (upcast > 0)) if workload.attention == "eager" else 0
    mlp = 3 * b * tokens * inter * dtype_bytes
    if workload.tiled_mlp:  # [Note: tiled MLP]: one tile's intermediates (its widest is TILE_BYTES)
        mlp = min(mlp, 3 * TILE_BYTES)
    per_layer = b * tokens * (8 * h * dtype_bytes + rows) + mlp
    if workload.gradient_checkpointing:
        layer_total = layers * b * tokens * h * dtype_bytes + per_layer
    else:
        layer_total = layers * per_layer
    vocab = config.vocab_size
    if workload.sequence_parallel > 1:  # [Note: tiled loss]: one tile's logits at a time
        logits = min(b * tokens, tile_rows(vocab)) * vocab * (4 + 4 + dtype_bytes)
    else:
        logits = b * tokens * vocab * (dtype_bytes + upcast + 4)
    return layer_total + logits


QLORA_BLOCK = 64  # bitsandbytes' 4-bit blocksize: one scale per 64 weights


def as_4bit(model: nn.Module, double_quant: bool = True) -> int:
    """[Note: quantized base] in engine/quantized.py, for the estimate: each linear weight transformers quantizes
    for QLoRA (every `nn.Linear`'s but the output head's and the LoRA adapters') replaced, on the meta device, by the
    packed codes bitsandbytes stores, `(numel + 1) // 2` bytes, frozen (kept in their own part whatever dtype stores
    them: the same bytes).
    Returns the bytes of their quantization state (block scales; with `double_quant` one byte per block plus the
    second level's scales; code tables), which every rank keeps whole.

    Example:

    ```python
    >>> scales = as_4bit(meta_peft_model)   # then estimate(meta_peft_model, ..., mixed_precision="no")
    ```
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    scales = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or module is head or "lora_" in name:
            continue
        weight = module.weight
        numel = weight.numel()
        packed = torch.empty(((numel + 1) // 2, 1), dtype=torch.uint8, device="meta")
        module.weight = nn.Parameter(packed, requires_grad=False)
        blocks = -(-numel // QLORA_BLOCK)
        if double_quant:  # uint8 block scales, an fp32 scale per 256 of them, the two code tables, an offset
            scales += blocks + 4 * -(-blocks // 256) + 4 * (16 + 256) + 4
        else:  # fp32 block scales and the code table
            scales += 4 * blocks + 4 * 16
    return scales


def estimate(
    model: nn.Module,
    hf_config: Any,
    *,
    world_size: int,
    nodes: int = 1,
    workload: Workload = Workload(),
    mixed_precision: str = "bf16",
    optimizer: str = "adamw",
    whole_state_bytes: int = 0,
    stream_ordered: bool = True,
) -> list[Estimate]:
    """Rows for stages 0-3 with no offload, optimizer offload, (stage 3) parameter offload, (stages 1-3)
    disk offload (`offload_dir`) and (stage 3) disk offload with `offload_params`.

    `stream_ordered`: collectives ordered on a device stream (NCCL, the default): a unit's backward may hold the
    prefetched unit's parameters and the previous unit's gradients at once; `False` (gloo, a CPU run) gates the
    prefetch on the reduction, one unit's buffers fewer ([Note: reduction-gated prefetch] in engine/hooks.py).

    `model` may live on the meta device (only shapes are read). `optimizer`: `"adamw"` or `"adafactor"` (on whole
    parameters, [Note: whole-parameter step]: its owned state, and one largest parameter's master and gradient
    in transit among the buffers; offload_dir does not take it, so no disk rows). `whole_state_bytes`: model state
    every rank keeps whole on the device besides its shards (a 4-bit base's quantization state, `as_4bit`).
    """
    if world_size < 1 or nodes < 1 or world_size % nodes:
        raise ValueError(f"--world-size ({world_size}) must be a positive multiple of --nodes ({nodes}).")
    n = workload.sequence_parallel
    if n < 1 or world_size % n:
        raise ValueError(f"--sequence-parallel ({n}) must be a positive divisor of --world-size ({world_size}).")
    model_dtype = next(model.parameters()).dtype
    specs = units_for(model, ZeroConfig(mixed_precision=mixed_precision))  # type: ignore[arg-type]  # a str the caller checked against the Literal
    order = [n for n, p in model.named_parameters() if p.requires_grad]  # the order an optimizer holds them in
    whole = optimizer != "adamw"
    rows = []
    per_node = world_size // nodes
    for stage in (0, 1, 2, 3):
        for offload in ("none", "optimizer", "optimizer+params", "disk", "disk+params"):
            if (offload.endswith("params") and stage != 3) or (offload == "disk" and stage == 0):
                continue
            if whole and offload.startswith("disk"):
                continue
            config = ZeroConfig(
                stage=stage,
                mixed_precision=mixed_precision,  # type: ignore[arg-type]  # a str the caller checked against the Literal
                offload_optimizer=offload != "none",
                offload_params=offload.endswith("params"),
                offload_dir="PATH" if offload.startswith("disk") else None,
            )
            worst = max(
                (
                    model_states(specs, config, world_size, r, model_dtype, optimizer, order)
                    for r in {0, world_size - 1}
                ),
                key=lambda m: m.total("device"),
            )
            e = _BYTES[config.param_dtype or model_dtype]
            reduce_bytes = _BYTES[config.resolved_reduce_dtype or config.param_dtype or model_dtype]
            grad_sizes = [sum(p.numel() for p in s.params if p.requires_grad) for s in specs]  # frozen: none
            live, live_grads = _backward_window(specs, config.prefetch, stream_ordered)
            gathered = live * e if stage == 3 else 0  # parameters: running + prefetched
            if stage >= 2:  # unsharded gradients: running unit + the one whose reduction is in flight
                buffers = live_grads * e + (max(grad_sizes) * reduce_bytes if reduce_bytes != e else 0)
            else:
                buffers = max(grad_sizes) * reduce_bytes
            if whole:  # one parameter whole in transit: its master and its gradient, in the master dtype
                buffers += (
                    2 * max(grad_sizes_of_params(specs)) * _BYTES[torch.float32 if config.param_dtype else model_dtype]
                )
            rows.append(
                Estimate(
                    stage=stage,
                    offload=offload,
                    model_states=worst.total("device") + whole_state_bytes,
                    gathered_units=gathered,
                    activations=activation_bytes(hf_config, workload, e),
                    buffers=buffers,
                    host_per_node=(worst.total("host") + (DISK_BUFFER_BYTES if offload.startswith("disk") else 0))
                    * per_node,
                    disk_per_node=worst.total("disk") * per_node,
                )
            )
    return rows


def _backward_window(specs: list[UnitSpec], prefetch: int, stream_ordered: bool = True) -> tuple[int, int]:
    """The most elements of parameters and of unsharded gradients live together in the backward pass, at the unit
    where their sum peaks: the root's, the running unit's and the `prefetch` units gathered ahead of it (the ones
    before it in the forward order), and the gradients of the running unit and of the one after it, whose
    reduction is in flight; where the prefetch waits for that reduction (not `stream_ordered`), either the
    prefetched units or the in-flight gradients, the larger. A lone embedding's gradient travels as rows ([Note:
    sparse lookup gradients]): no unsharded buffer. Units in `specs` are in forward order, the root last."""
    params = [sum(p.numel() for p in s.params) for s in specs[:-1]]
    grads = [sum(p.numel() for p in s.params if p.requires_grad) if s.backward_reads_params else 0 for s in specs[:-1]]
    root_params = sum(p.numel() for p in specs[-1].params) if specs else 0
    root_grads = sum(p.numel() for p in specs[-1].params if p.requires_grad) if specs else 0
    best = (0, 0)
    for j in range(len(params)):
        ahead, behind = sum(params[max(0, j - prefetch) : j]), sum(grads[j + 1 : j + 2])
        if stream_ordered:
            windows = [(params[j] + ahead, grads[j] + behind)]
        else:  # [Note: reduction-gated prefetch]
            windows = [(params[j] + ahead, grads[j]), (params[j], grads[j] + behind)]
        best = max([best, *windows], key=sum)
    return root_params + best[0], root_grads + best[1]


def grad_sizes_of_params(specs: list[UnitSpec]) -> list[int]:
    """The element counts of the trainable parameters (0 when there is none)."""
    return [p.numel() for spec in specs for p in spec.params if p.requires_grad] or [0]


def fits(row: Estimate, device_memory: int | None, host_memory: int | None, disk: int | None) -> list[str]:
    """What `row` overflows of the sizes given (`"device"`, `"host"`, `"disk"`); empty when it fits."""
    needs = (row.device_total, row.host_per_node, row.disk_per_node)
    limits = (device_memory, host_memory, disk)
    return [
        name for name, need, have in zip(("device", "host", "disk"), needs, limits) if have is not None and need > have
    ]


# Cheapest first: no offload before host offload before disk, and within each the lower stage (fewer collectives)
_PREFERENCE = ("none", "optimizer", "optimizer+params", "disk", "disk+params")


def recommend(
    rows: list[Estimate], device_memory: int, host_memory: int | None = None, disk: int | None = None
) -> tuple[Estimate | None, str]:
    """The configuration to train with, and why: the fastest that fits (no offload before offload, host before
    disk, then the lowest stage: each step up costs communication), keeping a tenth of the device free for the
    allocator's fragmentation. `(None, why)` when no row fits.

    Example:

    ```python
    >>> row, why = recommend(rows, device_memory=80 * 10**9)
    >>> row.stage, row.offload
    (3, 'none')
    ```
    """
    usable = int(device_memory * 0.9)
    fitting = [r for r in rows if not fits(r, usable, host_memory, disk)]
    if not fitting:
        smallest = min(rows, key=lambda r: r.device_total)
        return None, (
            f"nothing fits in {device_memory / 2**30:.0f} GiB per device with a tenth kept free (the smallest, stage "
            f"{smallest.stage} with offload {smallest.offload}, needs {smallest.device_total / 2**30:.1f} GiB): add "
            "devices (--world-size), turn on --gradient-checkpointing, or shorten --seq-len / --micro-batch."
        )
    best = min(fitting, key=lambda r: (_PREFERENCE.index(r.offload), r.stage))
    reason = (
        "the lowest stage without offload that fits"
        if best.offload == "none"
        else (f"no stage fits without offload; offload {best.offload!r} at the lowest stage that fits")
    )
    host = f"; {best.host_per_node / 2**30:.0f} GiB of host memory per node" if best.host_per_node else ""
    on_disk = f"; {best.disk_per_node / 2**30:.0f} GiB of disk per node" if best.disk_per_node else ""
    return best, (
        f"stage {best.stage}, offload {best.offload}: {reason} ({best.device_total / 2**30:.1f} of "
        f"{device_memory / 2**30:.1f} GiB per device, a tenth kept free{host}{on_disk})."
    )


def format_table(
    rows: list[Estimate], device_memory: int | None = None, host_memory: int | None = None, disk: int | None = None
) -> str:
    """A markdown table of the rows (GiB), its columns aligned, with a 'fits' column when any size is given: a row
    fits when its per-device, host-per-node and disk-per-node bytes are within the sizes given; a row that does
    not says what it overflows.

    Example:

    ```python
    >>> print(format_table(rows, device_memory=80 * 2**30, host_memory=2**40))
    ```
    """
    gib = 2**30
    head = [
        "stage",
        "offload",
        "model states",
        "gathered units",
        "activations",
        "buffers",
        "per device",
        "host per node",
        "disk per node",
    ]
    sized = any(x is not None for x in (device_memory, host_memory, disk))
    table = []
    for r in rows:
        cells = [str(r.stage), r.offload] + [
            f"{v / gib:.2f}" for v in (r.model_states, r.gathered_units, r.activations, r.buffers, r.device_total)
        ]
        cells += [f"{r.host_per_node / gib:.1f}", f"{r.disk_per_node / gib:.1f}"]
        if sized:
            over = fits(r, device_memory, host_memory, disk)
            cells.append("yes" if not over else "no (" + ", ".join(over) + ")")
        table.append(cells)
    if sized:
        head.append("fits")
    widths = [max(len(c) for c in column) for column in zip(head, *table)]
    numeric = [False, False] + [True] * 7 + [False]

    def line(cells: list[str]) -> str:
        padded = [c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if numeric[i] else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), rule, *(line(cells) for cells in table)])
