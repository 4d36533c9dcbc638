"""A step-time model: compute, communication, overlap, optimizer, step time and MFU of a training
step, for clusters this project cannot run on.

[Note: step-time model]
Per rank and per optimizer step (`accum` micro-batches of `micro_batch` x `seq_len` tokens):

- Compute: 6 FLOPs per matmul parameter per token (forward 2, backward 4), matmul parameters
  being the blocks' and the head's (an input embedding is a lookup), plus attention's
  12·layers·hidden·seq per token; activation checkpointing adds one more forward of the blocks.
  Time = FLOPs / (peak x `compute_efficiency`), the efficiency being what the device's matmuls
  reach in practice. A third of it is the forward, the rest the backward.
- Communication, ring collectives: an all-gather or reduce-scatter of M bytes over G ranks moves
  (G-1)/G·M per rank, an all-reduce twice that; bandwidth is the device's intra-node bus
  bandwidth while the group fits in a node, the inter-node one per device otherwise; each
  collective also pays `latency_s`. What moves, per stage (as hf_zero does it):
  - 0 (DDP): one all-reduce of the gradients per step;
  - 1-2: a reduce-scatter of the gradients (stage 2: per micro-batch; stage 1: per step) and an
    all-gather of the updated parameters after the optimizer step;
  - 3: per micro-batch, an all-gather of every unit for the forward and again for the backward
    (less the head, kept from the forward, and the input embedding, which a lookup's backward
    does not need), and a reduce-scatter of the gradients;
  - hybrid (`shard_group_size` G < N): the above within a node, plus an all-reduce of each
    rank's gradient shard (1/G of them) across the N/G replicas over the inter-node links;
  - quantized weights: 1 + 4/block bytes per gathered element; quantized gradients: an
    all-to-all of (G-1)/G of the gradients at 1 + 4/block bytes per element.
- Overlap: with `overlap` = 1 (CUDA streams), forward gathers hide behind forward compute and
  backward gathers and reductions behind backward compute, except the first unit's gather and
  the last unit's reduction; what exceeds the compute it runs beside is exposed. Stage 1-2's
  parameter all-gather after the optimizer step is exposed. `overlap` = 0 exposes everything
  (ranks that share the cores communication runs on, as on a 2-core CPU machine).
- Sequence parallelism (`sequence_parallel` N, [Note: sequence parallelism]): a rank computes 1/N of
  each sequence's tokens (its attention: 1/N of the heads over the whole sequence, the same FLOPs
  per local token as above) and, per layer and pass (forward, backward, and the recomputation with
  activation checkpointing), four all-to-alls (query, key, value, output) of its tokens' hidden
  states in the compute dtype over the N ranks, in a node. They sit between attention and the rest
  of the layer, so none of them overlaps: they are all exposed.
- Optimizer: AdamW over the rank's share of the parameters (all of them for DDP), at
  `optimizer_bytes_per_s` for 32 bytes per element (fp32 parameter, gradient, two moments,
  read and written).

Step time = compute + exposed communication + optimizer; MFU = model FLOPs (no recomputation) /
(step time x peak). Assumptions not modelled: pipeline bubbles, stragglers, data loading,
kernel launch overheads beyond `latency_s`, memory-bound elementwise work beyond what
`compute_efficiency` absorbs, network contention between jobs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Hardware:
    """One device and its links (bandwidths are bytes/s per device, as NCCL's bus bandwidth)."""

    name: str
    peak_flops: float  # dense, in the compute dtype
    compute_efficiency: float  # share of the peak a step's matmuls reach
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    optimizer_bytes_per_s: float  # AdamW's memory traffic rate
    devices_per_node: int = 8
    latency_s: float = 30e-6
    overlap: float = 1.0
    reduce_bandwidth: float | None = None  # a reduce-scatter's, when it differs from an all-gather's (gloo)


# Public datasheet peaks; bus bandwidths as NCCL benchmarks report them for large messages (NVLink 4 / 3,
# 8x400 Gb/s InfiniBand per node: 50 GB/s per GPU, ~80% reached); efficiency: a typical share for LLM training.
GPUS = {
    "h100": Hardware("H100 SXM (bf16)", 989e12, 0.45, 360e9, 40e9, 2.5e12),
    "h200": Hardware("H200 SXM (bf16)", 989e12, 0.47, 360e9, 40e9, 3.6e12),
    "a100": Hardware("A100 SXM 80GB (bf16)", 312e12, 0.50, 230e9, 20e9, 1.6e12),
}


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts of a decoder LM: the blocks, the input embedding (a lookup) and the head (a matmul)."""

    block_params: int  # one block
    layers: int
    embedding_params: int
    head_params: int  # the head's matmul parameters (counted even when tied to the embedding)
    tied: bool
    hidden: int

    @property
    def params(self) -> int:
        return self.block_params * self.layers + self.embedding_params + (0 if self.tied else self.head_params)

    @classmethod
    def from_model(cls, model: Any, config: Any) -> ModelShape:
        """From a (meta-device) Hugging Face causal LM and its config."""
        embedding = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        tied = head is embedding
        total = sum(p.numel() for p in model.parameters())
        layers = int(config.num_hidden_layers)
        rest = total - embedding.numel() - (0 if tied else head.numel())
        return cls(
            block_params=rest // layers,
            layers=layers,
            embedding_params=embedding.numel(),
            head_params=head.numel(),
            tied=tied,
            hidden=int(config.hidden_size),
        )


@dataclass(frozen=True)
class Job:
    """How the model is trained."""

    world_size: int
    stage: int = 3
    micro_batch: int = 1
    seq_len: int = 2048
    accum: int = 1
    gradient_checkpointing: bool = False
    param_bytes: int = 2  # compute dtype (gathers)
    reduce_bytes: int = 4  # gradient reduction dtype
    shard_group_size: int | None = None  # hybrid sharding
    quantized_weights: bool = False
    quantized_gradients: bool = False
    quantization_block: int = 256
    sequence_parallel: int = 1  # ranks per sequence (each computes seq_len / N tokens)


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_bytes: float  # per rank per step
    comm_s: float  # all communication, if nothing overlapped
    exposed_comm_s: float
    optimizer_s: float
    step_s: float
    tokens_per_s_per_device: float
    mfu: float


def _ring(nbytes: float, ranks: int, bandwidth: float, all_reduce: bool = False) -> tuple[float, float]:
    """(bytes moved per rank, seconds) of a ring collective; (0, 0) for one rank."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0, 0.0
    moved = (2.0 if all_reduce else 1.0) * (ranks - 1) / ranks * nbytes
    return moved, moved / bandwidth


def predict(shape: ModelShape, job: Job, hw: Hardware) -> StepTime:
    """Predict one optimizer step ([Note: step-time model]).

    Example:
        >>> shape = ModelShape(block_params=218_112_000, layers=32, embedding_params=525_336_576,
        ...                    head_params=525_336_576, tied=False, hidden=4096)  # LLaMA-3 8B
        >>> t = predict(shape, Job(world_size=8, seq_len=8192), GPUS["h100"])
        >>> 0.25 < t.mfu < 0.45
        True
    """
    if job.world_size < 1 or job.stage not in (0, 1, 2, 3):
        raise ValueError(f"world_size must be >= 1 and stage 0-3; got {job.world_size}, {job.stage}.")
    n = job.world_size
    g = job.shard_group_size or n
    if n % g:
        raise ValueError(f"shard_group_size {g} must divide world_size {n}.")
    if job.sequence_parallel < 1 or n % job.sequence_parallel:
        raise ValueError(f"sequence_parallel {job.sequence_parallel} must divide world_size {n}.")
    tokens = job.micro_batch * job.seq_len * job.accum / job.sequence_parallel  # this rank's
    matmul = shape.block_params * shape.layers + shape.head_params
    attention = 12 * shape.layers * shape.hidden * job.seq_len
    model_flops = (6 * matmul + attention) * tokens
    recompute = (2 * shape.block_params * shape.layers + attention / 3) * tokens if job.gradient_checkpointing else 0
    compute_s = (model_flops + recompute) / (hw.peak_flops * hw.compute_efficiency)
    forward_s = compute_s * model_flops / 3 / (model_flops + recompute)
    backward_s = compute_s - forward_s
    comm = _Communication(hw)
    _add_collectives(comm, shape, job, hw, n, g)
    units = shape.layers + 1
    comm_s = comm.fwd + comm.bwd + comm.tail
    first_last = (comm.fwd + comm.bwd) / max(1, units)  # the first gather and the last reduction wait for nothing
    hidden_exposed = max(0.0, comm.fwd - forward_s) + max(0.0, comm.bwd - backward_s) + first_last + comm.tail
    exposed = hw.overlap * min(comm_s, hidden_exposed) + (1 - hw.overlap) * comm_s + comm.critical
    comm_s += comm.critical
    elements = shape.params if job.stage == 0 else shape.params / g
    optimizer_s = 32 * elements / hw.optimizer_bytes_per_s
    step_s = compute_s + exposed + optimizer_s
    return StepTime(
        compute_s=compute_s,
        comm_bytes=comm.moved,
        comm_s=comm_s,
        exposed_comm_s=exposed,
        optimizer_s=optimizer_s,
        step_s=step_s,
        tokens_per_s_per_device=tokens / step_s,
        mfu=model_flops / (step_s * hw.peak_flops),
    )


class _Communication:
    """Seconds of communication beside the forward, the backward and after the step, and the bytes moved."""

    def __init__(self, hw: Hardware) -> None:
        self.hw = hw
        self.fwd = self.bwd = self.tail = 0.0
        self.critical = 0.0  # on the compute's path: never overlapped (sequence parallelism's all-to-alls)
        self.moved = 0.0
        self.collectives = 0

    def bandwidth(self, ranks: int) -> float:
        hw = self.hw
        if ranks <= hw.devices_per_node:
            return hw.intra_node_bandwidth
        return min(hw.intra_node_bandwidth, hw.inter_node_bandwidth)

    def add(self, where: str, nbytes: float, ranks: int, bw: float, all_reduce: bool = False, count: int = 1) -> None:
        b, s = _ring(nbytes, ranks, bw, all_reduce)
        if not b:
            return
        self.moved += b
        self.collectives += count
        s += count * self.hw.latency_s
        if where == "fwd":
            self.fwd += s
        elif where == "bwd":
            self.bwd += s
        elif where == "critical":
            self.critical += s
        else:
            self.tail += s


def _add_collectives(comm: _Communication, shape: ModelShape, job: Job, hw: Hardware, n: int, g: int) -> None:
    """The collectives of one step at `job.stage`, over `n` ranks sharded in groups of `g`."""
    p = shape.params
    qbytes = 1 + 4 / job.quantization_block
    gather_bytes = qbytes if job.quantized_weights else job.param_bytes
    units = shape.layers + 1

    def reduce(elements: float, count: int) -> None:
        bw = comm.bandwidth(g) * (hw.reduce_bandwidth / hw.intra_node_bandwidth if hw.reduce_bandwidth else 1.0)
        if job.quantized_gradients and job.stage >= 2:
            comm.add("bwd", elements * qbytes, g, bw, count=count)  # all-to-all: (g-1)/g moves
        else:
            comm.add("bwd", elements * job.reduce_bytes, g, bw, count=count)
        if g < n:  # hybrid: the shard's gradients across replicas
            comm.add("bwd", elements / g * job.reduce_bytes, n // g, hw.inter_node_bandwidth, True, count)

    sp = job.sequence_parallel
    if sp > 1:  # four all-to-alls of this rank's tokens' hidden states per layer and pass
        passes = 3 if job.gradient_checkpointing else 2
        per_pass = 4 * job.micro_batch * job.seq_len / sp * shape.hidden * job.param_bytes * shape.layers
        for _ in range(job.accum * passes):
            comm.add("critical", per_pass, sp, comm.bandwidth(sp), count=4 * shape.layers)
    if job.stage == 0:
        comm.add("bwd", p * job.reduce_bytes, n, comm.bandwidth(n), all_reduce=True, count=units)
    elif job.stage in (1, 2):
        for _ in range(job.accum if job.stage == 2 else 1):
            reduce(p, units)
        comm.add("tail", p * job.param_bytes, g, comm.bandwidth(g), count=units)
    else:
        backward_gathered = p - shape.embedding_params - (0 if shape.tied else shape.head_params)
        for _ in range(job.accum):
            comm.add("fwd", p * gather_bytes, g, comm.bandwidth(g), count=units)
            comm.add("bwd", backward_gathered * gather_bytes, g, comm.bandwidth(g), count=units)
            reduce(p, units)


def format_predictions(shape: ModelShape, job: Job, hw: Hardware, world_sizes: list[int]) -> str:
    """A table of predictions for each world size and stage (and ZeRO-3 with int8 weights + bf16 gradients)."""
    lines = [
        f"{hw.name}: peak {hw.peak_flops / 1e12:.0f} TFLOP/s x efficiency {hw.compute_efficiency:.2f}, "
        f"bus bandwidth {hw.intra_node_bandwidth / 1e9:.0f} GB/s in a node, {hw.inter_node_bandwidth / 1e9:.0f} "
        f"GB/s across, {hw.devices_per_node} per node; {shape.params / 1e9:.2f}B parameters, micro-batch "
        f"{job.micro_batch} x {job.seq_len}, accumulation {job.accum}"
        + (f", sequence parallelism {job.sequence_parallel}" if job.sequence_parallel > 1 else ""),
        "| devices | setting | compute (s) | comm (GB/rank) | exposed comm (s) | optimizer (s) | step (s) | "
        "tokens/s/device | MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    settings = [
        ("DDP", dict(stage=0)),
        ("ZeRO-1", dict(stage=1)),
        ("ZeRO-2", dict(stage=2)),
        ("ZeRO-3", dict(stage=3)),
        ("ZeRO-3 int8 w + bf16 g", dict(stage=3, quantized_weights=True, reduce_bytes=2)),
    ]
    for world in world_sizes:
        for label, change in settings:
            t = predict(shape, replace(job, world_size=world, **change), hw)  # type: ignore[arg-type]  # ints and bools by name
            lines.append(
                f"| {world} | {label} | {t.compute_s:.3f} | {t.comm_bytes / 1e9:.2f} | {t.exposed_comm_s:.3f} | "
                f"{t.optimizer_s:.3f} | {t.step_s:.3f} | {t.tokens_per_s_per_device:,.0f} | {t.mfu:.1%} |"
            )
    return "\n".join(lines)
