"""The correctness phases of the GPU check, each run under `torch.distributed.run` by `gpu_check.py`.

    python -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/_gpu_phases.py single --device cuda
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/_gpu_phases.py multi --device cuda
    python -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/_gpu_phases.py trainer --device cuda

- `single`: a world of one over NCCL: stages 1-3 x fp32/bf16 against plain single-process PyTorch
  training (fp32: losses, clip norms and weights within 1e-5 relative; bf16 tracks fp32 within 2e-2),
  ZeRO-Offload (pinned host masters), `offload_dir`, an asynchronous save (pinned snapshot) loaded at
  another stage, and its consolidation loaded with `from_pretrained` on the device.
- `multi`: two processes sharing the one GPU (gloo between them, CUDA compute: host-staged collectives)
  at stages 1-3 against single-process training of the whole batch; ZeRO-3 with Liger's kernels against
  the same kernels on the whole batch; and sequence parallelism over the two
  (all-to-alls around attention, the tiled loss, `tiled_mlp` in 4-token tiles) against the same.
- `trainer`: `ZeroTrainer` with `zero_stage=3` and bf16 for a few steps with checkpoints; a second run
  resumes from the middle one and must end where the uninterrupted run ended; the final model loads
  with `from_pretrained`.

On the CPU (`--device cpu`, the rehearsal) the same code runs over gloo. Results: `<out>/<phase>.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _gpu_common import (
    SIZES,
    Cases,
    Sizes,
    adamw,
    corpus,
    init_group,
    liger_kernels,
    llama,
    norm_diff,
    phase_arguments,
    rel_diff,
    require,
    weights_diff,
)

import hf_zero

FP32_TOL = 1e-5  # losses, clip norms and weights against single-process fp32 training
BF16_TOL = 2e-2  # bf16 compute (fp32 master, optimizer and reduction) against fp32 training
RESUME_TOL = 1e-3  # a resumed bf16 run against the uninterrupted one on a GPU (nondeterministic attention backward)


def apply_liger(model: torch.nn.Module, device: torch.device) -> str:
    """Liger's kernels on the model instance, as the Trainer's `--use_liger_kernel` applies them: RMSNorm, SwiGLU,
    RoPE and the fused linear cross-entropy, whose forward passes `lm_head.weight` to an autograd Function and never
    calls the head ([Note: direct use] keeps the head's unit gathered at stage 3). Liger needs triton and a GPU: on
    the CPU rehearsal the test suite's Liger-like forward (tests/_training.apply_liger_like) stands in. Returns
    which ran."""
    if device.type == "cuda":  # the real kernels, from .whl/ (make gpu-wheels): a missing wheel fails the case
        return liger_kernels(model)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests` is a package of the working tree
    from tests._training import apply_liger_like

    apply_liger_like(model)
    return "Liger-like stand-in (no triton here)"


def train_reference(sizes: Sizes, data: torch.Tensor, device: torch.device, pieces: int = 1,
                    tiled: bool = False, liger: bool = False) -> dict[str, Any]:
    """Plain PyTorch: the whole global batch per micro-step, accumulation, clipping at 1.0, AdamW. `pieces` > 1
    runs each micro-batch as that many row slices (the same mathematics in other matrix shapes: how far the
    GPU's kernels alone move the result, the rounding floor); `tiled` runs the MLPs in `tiled_mlp`'s tiles;
    `liger`, the model with Liger's kernels (`apply_liger`)."""
    model = llama(sizes).to(device)
    if liger:
        apply_liger(model, device)
    if tiled:
        from hf_zero.features import tiled_mlp

        tiled_mlp.enable(model)
    optimizer = adamw(model)
    losses, norms = [], []
    for step in range(sizes.steps):
        micro = []
        for a in range(sizes.accum):
            for rows in data[step, a].to(device).chunk(pieces):
                loss = model(input_ids=rows, labels=rows).loss
                (loss / (sizes.accum * pieces)).backward()
                micro.append(loss.detach().float())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(torch.stack(micro).mean()))
    return {"losses": losses, "norms": norms, "state": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


def train_zero(model: torch.nn.Module, optimizer: Any, sizes: Sizes, data: torch.Tensor, device: torch.device,
               steps: range | None = None, same_rows: bool = False) -> dict[str, Any]:
    """The same training on a sharded model: each rank its slice of every micro-batch (`same_rows`, sequence
    parallelism over every rank: the whole micro-batch), `no_sync` on all but the last micro-batch, the sharded
    optimizer's clipping; losses averaged over the ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rows_of = slice(None) if same_rows else slice(rank * sizes.micro, (rank + 1) * sizes.micro)
    losses, norms = [], []
    for step in steps or range(sizes.steps):
        micro = []
        for a in range(sizes.accum):
            rows = data[step, a, rows_of].to(device)
            sync = contextlib.nullcontext() if a == sizes.accum - 1 else model.no_sync()
            with sync:
                loss = model(input_ids=rows, labels=rows).loss
                (loss / sizes.accum).backward()
            micro.append(loss.detach().float())
        norms.append(float(optimizer.clip_grad_norm_(1.0)))
        optimizer.step()
        optimizer.zero_grad()
        mean = torch.stack(micro).mean().to(_comm_device())
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return {"losses": losses, "norms": norms}


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def compare(got: dict[str, Any], state: dict[str, torch.Tensor], ref: dict[str, Any], tol: float,
            weights_tol: float | None = None) -> dict[str, Any]:
    """Losses, clip norms and weights (within `weights_tol`, default `tol`) of a sharded run against the
    reference, within `tol` relative (a bf16 run: its losses); the run must also have trained (its loss fell by
    more than twice the tolerance)."""
    figures = {
        "loss_rel": max(rel_diff(a, b) for a, b in zip(got["losses"], ref["losses"])),
        "norm_rel": max(rel_diff(a, b) for a, b in zip(got["norms"], ref["norms"])),
        "first_norm_rel": rel_diff(got["norms"][0], ref["norms"][0]),
        "weights_rel": weights_diff(state, ref["state"]),
        "losses": [round(x, 5) for x in got["losses"]],
    }
    seen = f" ({', '.join(f'{k}={v:.2e}' for k, v in figures.items() if k.endswith('_rel'))})"
    require(figures["loss_rel"] <= tol, f"losses differ by {figures['loss_rel']:.2e} relative (allowed {tol:.0e})"
            + seen)
    if tol == FP32_TOL:  # bf16 is held to its losses, as the test suite does; its norms and weights are reported
        require(figures["norm_rel"] <= tol, f"clip norms differ by {figures['norm_rel']:.2e} relative" + seen)
        allowed = weights_tol or tol
        require(figures["weights_rel"] <= allowed,
                f"weights differ by {figures['weights_rel']:.2e} relative (allowed {allowed:.1e})" + seen)
    fell = (got["losses"][0] - got["losses"][-1]) / got["losses"][0]
    require(fell > 2 * tol, f"the loss did not fall ({got['losses']})")
    return figures


def sharded_case(sizes: Sizes, data: torch.Tensor, device: torch.device, ref: dict[str, Any],
                 on_device: bool = False, weights_tol: float | None = None, checkpointing: str = "",
                 liger: bool = False, **config: Any) -> dict[str, Any]:
    """Train a fresh model sharded with `config` and compare it with `ref` (bf16 at the looser tolerance).
    `checkpointing`: "" (none), "hf" (`gradient_checkpointing_enable()`, transformers' default) or "reentrant"
    (`use_reentrant=True`: the recomputed blocks' backward is a nested backward on the device's autograd thread);
    `liger`: Liger's kernels applied before `initialize` (`apply_liger`)."""
    model = llama(sizes)
    kernels = apply_liger(model, device) if liger else None
    if checkpointing:
        kwargs = {"use_reentrant": True} if checkpointing == "reentrant" else None
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.train()
    if on_device:
        model = model.to(device)
    model, optimizer = hf_zero.initialize(model, adamw(model), hf_zero.ZeroConfig(**config))
    moves = device_moves(model, device)
    got = train_zero(model, optimizer, sizes, data, device, same_rows=config.get("sequence_parallel", 1) > 1)
    state = hf_zero.full_state_dict(model, rank0_only=False)
    figures = compare(got, state, ref, BF16_TOL if config.get("mixed_precision") == "bf16" else FP32_TOL,
                      weights_tol)
    figures["moves"] = moves
    if kernels is not None:
        figures["liger"] = kernels
    if checkpointing:
        require(bool(getattr(model, "is_gradient_checkpointing", False)), "gradient checkpointing is not on")
        figures["checkpointing"] = checkpointing
    figures["device"] = str(next(model.parameters()).device)
    require(figures["device"].split(":")[0] == device.type, f"trained on {figures['device']}, not {device}")
    if config.get("offload_optimizer") and device.type == "cuda":
        engine = model.zero_engine
        host = [p.sharded_master for p in engine.parts if p.has_trainable and p.master_device.type == "cpu"]
        require(bool(host), "no master shard on the host under offload_optimizer")
        if not config.get("offload_dir"):
            require(all(t.is_pinned() for t in host), "an offloaded master shard is not in pinned memory")
        figures["host_masters"] = len(host)
    from hf_zero.checkpoint import wait_for_saves

    wait_for_saves(model)
    return figures


def device_moves(model: torch.nn.Module, device: torch.device) -> str:
    """The moves users write after sharding: Accelerate's `model.to(accelerator.device)` and a DDP loop's
    `model.to("cuda")` / `.cuda()` change nothing and must be accepted (whatever the offload: the parameters the
    modules hold live on the compute device); `.half()` would change the dtype and must be refused by name."""
    model.to(device)
    if device.type == "cuda":
        model.to("cuda")
        model.cuda()
    try:
        model.half()
    except ValueError as error:
        require("mixed_precision" in str(error), f"model.half() refused without naming the fix: {error}")
    else:
        require(False, "model.half() on a sharded model was applied, not refused")
    return ("to(device), to('cuda'), cuda()" if device.type == "cuda" else "to(device)") + " accepted; half() refused"


def phase_single(args: argparse.Namespace, device: torch.device, cases: Cases) -> None:
    sizes = SIZES[args.size]
    data = corpus(sizes, world=1)
    ref = train_reference(sizes, data, device)
    for stage in (1, 2, 3):
        for precision in ("no", "bf16"):
            name = f"ZeRO-{stage} {'bf16' if precision == 'bf16' else 'fp32'} vs PyTorch"
            cases.run(name, lambda s=stage, p=precision: sharded_case(sizes, data, device, ref, stage=s,
                                                                       mixed_precision=p))
    cases.run("ZeRO-3 offload_optimizer+offload_params (pinned host)", lambda: sharded_case(
        sizes, data, device, ref, stage=3, offload_optimizer=True, offload_params=True))
    with tempfile.TemporaryDirectory(prefix="hf_zero_gpu_check_") as tmp:
        cases.run("ZeRO-3 offload_dir (master and Adam on disk)", lambda: sharded_case(
            sizes, data, device, ref, stage=3, offload_optimizer=True, offload_dir=str(Path(tmp) / "offload")))
        cases.run("async save at ZeRO-3 bf16, load at ZeRO-1, consolidate, from_pretrained",
                  lambda: save_load_case(sizes, data, device, Path(tmp)))
    cases.run("ZeRO-2 bf16: weights changed in place between steps reach the masters",
              lambda: edits_case(sizes, data, device))
    cases.run("ZeRO-2 bf16 offload_optimizer: in-place changes reach the host masters (fingerprints)",
              lambda: edits_case(sizes, data, device, offload_optimizer=True))
    cases.run("ZeRO-3 bf16: torch.compile of each block (regional) vs eager",
              lambda: compile_case(sizes, data, device))
    cases.run("units check and call-order header: queued on the device without a host sync",
              lambda: queued_case(device))


def queued_case(device: torch.device) -> dict[str, Any]:
    """[Note: call order] the few integers the units check and the call-order header send at every forward are
    queued on the device (pinned, non_blocking) instead of copied with a stream sync: behind a kernel that runs for
    about a second, making them returns at once, where torch's plain `torch.tensor(..., device=)` waits for it. The
    CPU rehearsal checks the values only (nothing is queued on the host)."""
    from hf_zero.engine.collectives.ops import queued_tensor

    timings = {}
    for way in ("queued", "plain"):
        if device.type == "cuda":
            torch.cuda._sleep(2_000_000_000)  # cycles: about a second of a busy device
        started = time.perf_counter()
        t = queued_tensor([3, 1, 4], torch.int64, device) if way == "queued" else torch.tensor(
            [3, 1, 4], dtype=torch.int64, device=device)
        timings[way] = round(time.perf_counter() - started, 4)
        require(t.tolist() == [3, 1, 4], f"{way}: the values came back as {t.tolist()}")
    if device.type == "cuda":
        require(timings["queued"] < 0.05, f"making the queued tensor waited {timings['queued']} s for the device")
    return {"queued_s": timings["queued"], "plain_s": timings["plain"]}


def compile_case(sizes: Sizes, data: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """[Note: compile] ZeRO-3 bf16 with each block's forward compiled as Accelerate's regional compilation asks
    (through the integrations' `compile_as_requested`; inductor on the GPU, aot_eager in the CPU rehearsal) against
    the same run uncompiled: losses within the bf16 tolerance, compiled frames counted, both runs timed (the
    compiled one includes its compilation)."""
    import time

    from accelerate.utils import TorchDynamoPlugin
    from torch._dynamo.utils import counters

    from hf_zero.features.compile import compile_as_requested

    backend = "inductor" if device.type == "cuda" else "aot_eager"
    runs = {}
    for compiled in (False, True):
        model = llama(sizes, seed=0)
        config = hf_zero.ZeroConfig(stage=3, mixed_precision="bf16")
        model, opt = hf_zero.initialize(model, adamw(model), config, device=device)
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            compile_as_requested(model, TorchDynamoPlugin(backend=backend, use_regional_compilation=True), 3)
        started = time.perf_counter()
        losses = train_zero(model, opt, sizes, data, device)["losses"]
        runs[compiled] = (losses, round(time.perf_counter() - started, 2))
    frames = counters["frames"]["ok"]
    require(frames >= 1, "compile_as_requested compiled nothing")
    loss_rel = max(rel_diff(a, b) for a, b in zip(runs[True][0], runs[False][0]))
    require(loss_rel <= BF16_TOL, f"compiled losses differ from eager by {loss_rel:.2e} relative")
    return {"backend": backend, "frames": frames, "loss_rel": loss_rel, "eager_s": runs[False][1],
            "compiled_s": runs[True][1]}


def edits_case(
    sizes: Sizes, data: torch.Tensor, device: torch.device, offload_optimizer: bool = False
) -> dict[str, Any]:
    """[Note: edits between steps] every weight scaled in place after each step, as DDP code does, at ZeRO-2 in bf16
    (fp32 masters apart from the compute weights; with `offload_optimizer`, on the host, where a fingerprint of each
    chunk tells which changed): the same losses and weights, bit for bit, as the same change made inside
    `gathered_parameters(modifier_rank=0)`."""
    runs = {}
    for how in ("plain", "gathered"):
        model = llama(sizes, seed=0)
        config = hf_zero.ZeroConfig(stage=2, mixed_precision="bf16", offload_optimizer=offload_optimizer)
        model, opt = hf_zero.initialize(model, adamw(model), config, device=device)
        if offload_optimizer and device.type == "cuda":
            parts = model.zero_engine.parts
            require(all(p.fingerprinted for p in parts), "a part with its master on the host is not fingerprinted")
        losses = []
        for step in range(sizes.steps):
            batch = data[step, 0].to(device)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
            params = list(model.parameters())
            block = hf_zero.gathered_parameters(params, modifier_rank=0) if how == "gathered" else None
            with block or contextlib.nullcontext(), torch.no_grad():
                for p in params:
                    p.mul_(0.9)
        runs[how] = (losses, hf_zero.full_state_dict(model))
    require(runs["plain"][0] == runs["gathered"][0], f"losses {runs['plain'][0]} != {runs['gathered'][0]}")
    diff = weights_diff(runs["plain"][1], runs["gathered"][1])
    require(diff == 0.0, f"weights differ from the gathered_parameters run by {diff:.2e}")
    return {"weights_rel": diff, "last_loss": round(runs["plain"][0][-1], 4)}


def save_load_case(sizes: Sizes, data: torch.Tensor, device: torch.device, tmp: Path) -> dict[str, Any]:
    """Train 2 steps at ZeRO-3 in bf16, save in the background while step 3 runs, load the checkpoint into a
    ZeRO-1 model (another stage, another init): the same master weights and the same step-4 loss; then
    consolidate it and load it with `from_pretrained` on the device: the same weights and the same loss."""
    config = hf_zero.ZeroConfig(stage=3, mixed_precision="bf16")
    model = llama(sizes)
    model, optimizer = hf_zero.initialize(model, adamw(model), config)
    train_zero(model, optimizer, sizes, data, device, steps=range(2))
    saved = {k: v.clone() for k, v in hf_zero.full_state_dict(model, rank0_only=False).items()}
    handle = hf_zero.save_checkpoint(tmp / "ckpt", model, optimizer, async_save=True, metadata={"step": 2})
    train_zero(model, optimizer, sizes, data, device, steps=range(2, 3))  # writes the tensors being saved
    handle.wait()
    after = train_zero(model, optimizer, sizes, data, device, steps=range(3, 4))

    other = llama(sizes, seed=7)
    other, other_opt = hf_zero.initialize(other, adamw(other), hf_zero.ZeroConfig(stage=1, mixed_precision="bf16"))
    meta = hf_zero.load_checkpoint(tmp / "ckpt", other, other_opt)
    loaded = hf_zero.full_state_dict(other, rank0_only=False)
    require(meta.get("step") == 2, f"metadata {meta}")
    load_diff = weights_diff(loaded, saved)
    require(load_diff == 0.0, f"loaded masters differ from the saved ones by {load_diff:.2e}")
    resumed = train_zero(other, other_opt, sizes, data, device, steps=range(2, 4))
    step4 = rel_diff(resumed["losses"][-1], after["losses"][-1])
    require(step4 <= BF16_TOL / 10, f"step-4 loss after load differs by {step4:.2e}")

    if dist.get_rank() == 0:
        hf_zero.consolidate(tmp / "ckpt", tmp / "hf", progress=False)
    dist.barrier()
    from transformers import AutoModelForCausalLM

    pretrained = AutoModelForCausalLM.from_pretrained(tmp / "hf", dtype=torch.float32).to(device)
    pre_diff = weights_diff({k: v for k, v in pretrained.state_dict().items()}, saved)
    require(pre_diff == 0.0, f"from_pretrained weights differ from the saved masters by {pre_diff:.2e}")
    reference = llama(sizes).to(device)
    reference.load_state_dict(saved)
    rows = data[0, 0].to(device)
    with torch.no_grad():
        a, b = pretrained(input_ids=rows, labels=rows).loss, reference(input_ids=rows, labels=rows).loss
    loss_rel = rel_diff(float(a), float(b))  # the same weights and kernels; 1e-6 leaves room for atomics on a GPU
    require(loss_rel <= 1e-6, f"from_pretrained loss {float(a)} != {float(b)}")

    # hf_zero's own from_pretrained: each rank's ranges read and cast into shards on the device
    sharded, _ = hf_zero.from_pretrained(AutoModelForCausalLM, tmp / "hf", config, dtype=torch.float32, device=device)
    ours = hf_zero.full_state_dict(sharded, rank0_only=False)
    ours_diff = weights_diff(ours, saved)
    require(ours_diff == 0.0, f"hf_zero.from_pretrained weights differ from the saved masters by {ours_diff:.2e}")
    shard_device = str(next(t for t in sharded.parameters()).device)

    # a damaged model file: the load raises and the masters (on the device: their copy too) are put back
    damaged = tmp / "damaged"
    shutil.copytree(tmp / "ckpt", damaged)
    if dist.get_rank() == 0:
        path = next(damaged.glob("model-*.safetensors"))
        raw = bytearray(path.read_bytes())
        raw[-7] ^= 0xFF
        path.write_bytes(bytes(raw))
    dist.barrier()
    before = {k: v.clone() for k, v in hf_zero.full_state_dict(other, rank0_only=False).items()}
    try:
        hf_zero.load_checkpoint(damaged, other, other_opt)
        raised = "nothing"
    except ValueError as e:
        raised = "corrupted" if "corrupted" in str(e) else str(e)
    require(raised == "corrupted", f"a damaged model file raised {raised}")
    kept = weights_diff(hf_zero.full_state_dict(other, rank0_only=False), before)
    require(kept == 0.0, f"a failed load left the weights changed by {kept:.2e}")
    return {"load_weights_rel": load_diff, "step4_loss_rel": step4, "from_pretrained_loss_rel": loss_rel,
            "from_pretrained_device": str(a.device), "hf_zero_from_pretrained_rel": ours_diff,
            "hf_zero_from_pretrained_device": shard_device, "damaged_load_weights_rel": kept,
            "files": sorted(p.name for p in (tmp / "hf").iterdir())}


def phase_multi(args: argparse.Namespace, device: torch.device, cases: Cases) -> None:
    """Two ranks against one process. Their weights after 4 AdamW steps are held to the larger of 1e-5 and 4x the
    rounding floor measured in this run (the reference against itself in other matrix shapes): at this learning
    rate AdamW turns last-bit differences of tiny gradients into whole steps (on an H100 the floor alone is
    4.9e-6), so the first steps' clip norms and every loss carry the exactness (1e-5), the weights the trajectory."""
    sizes = SIZES[args.size]
    data = corpus(sizes, world=dist.get_world_size())
    ref = train_reference(sizes, data, device)
    floor = floor_figures(ref, train_reference(sizes, data, device, pieces=2))
    cases.run("rounding floor: PyTorch with each micro-batch in 2 row slices vs whole", lambda: floor)
    loose = max(FP32_TOL, 4 * floor["weights_rel"])
    for stage in (1, 2, 3):
        cases.run(f"ZeRO-{stage} fp32, {dist.get_world_size()} ranks on one device vs PyTorch",
                  lambda s=stage: sharded_case(sizes, data, device, ref, on_device=True, weights_tol=loose, stage=s))
    cases.run(f"ZeRO-3 bf16, {dist.get_world_size()} ranks on one device vs PyTorch fp32",
              lambda: sharded_case(sizes, data, device, ref, on_device=True, stage=3, mixed_precision="bf16"))
    for kind in ("hf", "reentrant"):
        cases.run(f"ZeRO-3 fp32 + gradient checkpointing ({kind}), {dist.get_world_size()} ranks vs PyTorch",
                  lambda k=kind: sharded_case(sizes, data, device, ref, on_device=True, weights_tol=loose, stage=3,
                                              checkpointing=k))
    liger = train_reference(sizes, data, device, liger=True)  # the same kernels on the whole batch
    cases.run(f"ZeRO-3 fp32 + Liger's kernels (fused linear cross-entropy: the head read, not called), "
              f"{dist.get_world_size()} ranks vs PyTorch with the same kernels",
              lambda: sharded_case(sizes, data, device, liger, on_device=True, weights_tol=loose, stage=3, liger=True))
    from hf_zero.features import tiled_mlp

    world = dist.get_world_size()
    cases.run(f"ZeRO-3 fp32 + sequence_parallel {world} (all-to-all), {world} ranks vs PyTorch",
              lambda: sharded_case(sizes, data, device, ref, on_device=True, weights_tol=loose, stage=3,
                                   sequence_parallel=world))
    tiled_mlp.TILE_BYTES = sizes.micro * dist.get_world_size() * sizes.hidden * 2 * 4 * 4  # 4-token tiles
    tiled = train_reference(sizes, data, device, tiled=True)  # the same tiles: the same sums in the MLP's gradient
    cases.run("rounding floor: PyTorch with 4-token MLP tiles vs whole", lambda: floor_figures(ref, tiled))
    cases.run(f"ZeRO-3 fp32 + sequence_parallel {world} + tiled_mlp, {world} ranks vs PyTorch with the same tiles",
              lambda: sharded_case(sizes, data, device, tiled, on_device=True, weights_tol=loose, stage=3,
                                   sequence_parallel=world, tiled_mlp=True))


def floor_figures(ref: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """The reference against itself computed in other shapes: what the kernels' rounding alone gives."""
    return {"loss_rel": max(rel_diff(a, b) for a, b in zip(other["losses"], ref["losses"])),
            "norm_rel": max(rel_diff(a, b) for a, b in zip(other["norms"], ref["norms"])),
            "first_norm_rel": rel_diff(other["norms"][0], ref["norms"][0]),
            "weights_rel": weights_diff(other["state"], ref["state"])}


def phase_trainer(args: argparse.Namespace, device: torch.device, cases: Cases) -> None:
    out = Path(tempfile.mkdtemp(prefix="hf_zero_gpu_trainer_"))
    try:
        cases.run("ZeroTrainer ZeRO-3 bf16: train, checkpoint, resume, from_pretrained",
                  lambda: trainer_case(SIZES[args.size], device, out))
    finally:
        shutil.rmtree(out, ignore_errors=True)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _trainer_run(sizes: Sizes, device: torch.device, out: Path, resume: str | None, seed: int) -> Any:
    from transformers import TrainerCallback

    class Losses(TrainerCallback):
        def __init__(self) -> None:
            self.losses: dict[int, float] = {}

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
            if logs and "loss" in logs:
                self.losses[state.global_step] = float(logs["loss"])

    rows = corpus(sizes, world=1).reshape(-1, sizes.seq)
    arguments = hf_zero.ZeroTrainingArguments(
        output_dir=str(out), zero_stage=3, bf16=True, per_device_train_batch_size=sizes.micro,
        gradient_accumulation_steps=sizes.accum, max_steps=4, save_steps=2, logging_steps=1, learning_rate=1e-3,
        seed=0, data_seed=0, report_to="none", disable_tqdm=True, use_cpu=device.type == "cpu",
        dataloader_num_workers=0,
    )
    losses = Losses()
    trainer = hf_zero.ZeroTrainer(model=llama(sizes, seed=seed), args=arguments, train_dataset=_Rows(rows),
                                  callbacks=[losses])
    trainer.train(resume_from_checkpoint=resume)
    state = {k: v.clone() for k, v in hf_zero.full_state_dict(trainer.model, rank0_only=False).items()}
    return trainer, losses.losses, state


def trainer_case(sizes: Sizes, device: torch.device, out: Path) -> dict[str, Any]:
    first, losses, state = _trainer_run(sizes, device, out / "run", resume=None, seed=0)
    trained_on = str(next(first.model.parameters()).device)
    require(trained_on.split(":")[0] == device.type, f"the Trainer trained on {trained_on}")
    require(sorted(losses) == [1, 2, 3, 4], f"logged steps {sorted(losses)}")
    first.save_model(str(out / "final"))
    _, resumed, resumed_state = _trainer_run(sizes, device, out / "resumed", str(out / "run" / "checkpoint-2"), 5)
    loss_rel = max(rel_diff(resumed[s], losses[s]) for s in (3, 4))
    weights = weights_diff(resumed_state, state)
    # On the CPU the resumed run is bit for bit the uninterrupted one. On a GPU, bf16 attention's backward
    # (flash / memory-efficient kernels) accumulates with atomics, so two runs of the same steps may differ in
    # the last bits: the figures are reported, held to RESUME_TOL there.
    tol = 0.0 if device.type == "cpu" else RESUME_TOL
    require(loss_rel <= tol, f"resumed losses {resumed} vs uninterrupted {losses}")
    require(weights <= tol, f"resumed weights differ by {weights:.2e}")
    from transformers import AutoModelForCausalLM

    pretrained = AutoModelForCausalLM.from_pretrained(out / "final").to(device)
    final = max(norm_diff(v.float(), state[k].float()) for k, v in pretrained.state_dict().items() if k in state)
    require(final <= 1e-2, f"from_pretrained weights differ from the trained model by {final:.2e}")
    return {"trained_on": trained_on, "losses": [round(losses[s], 5) for s in sorted(losses)],
            "resume_loss_rel": loss_rel, "resume_weights_rel": weights, "from_pretrained_rel": final,
            "pretrained_dtype": str(next(pretrained.parameters()).dtype)}


PHASES = {"single": phase_single, "multi": phase_multi, "trainer": phase_trainer}


def main() -> int:
    args, out = phase_arguments(__doc__, SIZES, PHASES)
    if args.phase == "trainer":  # the Trainer makes (or not) its own process group, as it does for users
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else \
            torch.device("cpu")
        cases = Cases(args.phase, out)
        PHASES[args.phase](args, device, cases)
    else:
        device = init_group(args.device, backend="gloo" if args.phase == "multi" else None)
        cases = Cases(args.phase, out)
        PHASES[args.phase](args, device, cases)
        dist.barrier()
    return 1 if cases.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
