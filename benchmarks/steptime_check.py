"""Validate the step-time model (`hf_zero/steptime.py`) on this machine: measure its parts, predict, compare.

    python benchmarks/steptime_check.py --presets small large --out benchmarks/results

For each benchmark preset it measures, separately:
- the compute rate: forward + backward of the preset's model on one rank's micro-batch, in one
  process with one thread (FLOPs by the model's formula / median time);
- the optimizer rate: torch's AdamW step over the model's parameters (32 bytes per element);
- the collective bandwidths: hf_zero's own all-gather and reduce-scatter of a 32 MB buffer between
  2 processes (gloo, composed as the engine uses them);
then predicts the step time of hf_zero ZeRO-1, 2 and 3 on 2 ranks with `overlap=0` (on 2 cores the
communication runs on the cores that compute) and runs those engines with `benchmarks/_worker.py`
(the same runs as `bench.py`) to measure it. Writes `<out>/steptime_check.md` and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from hf_zero.steptime import Hardware, Job, ModelShape, predict  # noqa: E402


def measure_compute(preset: dict, micro: int, steps: int = 3) -> tuple[float, ModelShape]:
    """Achieved FLOP/s of forward + backward on one rank's micro-batch (the model formula's FLOPs)."""
    from _worker import build_model, hf_config

    torch.set_num_threads(1)
    model = build_model(preset)
    shape = ModelShape.from_model(model, hf_config(preset))
    batch = torch.randint(0, preset["vocab"], (micro, preset["seq"]))
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        if i:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    tokens = micro * preset["seq"]
    flops = (6 * (shape.block_params * shape.layers + shape.head_params)
             + 12 * shape.layers * shape.hidden * preset["seq"]) * tokens
    return flops / statistics.median(times), shape


def measure_optimizer(shape: ModelShape, steps: int = 3) -> float:
    """AdamW's effective memory rate (bytes/s at 32 bytes per element) over half the model (one rank's share)."""
    torch.set_num_threads(1)
    elements = shape.params // 2
    params = [torch.nn.Parameter(torch.randn(min(elements, 4 << 20))) for _ in range(max(1, elements // (4 << 20)))]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        opt.step()
        if i:
            times.append(time.perf_counter() - start)
    return 32 * sum(p.numel() for p in params) / statistics.median(times)


def _collectives_rank(out: str) -> None:
    """Run under torchrun: hf_zero's composed all-gather and reduce-scatter of 32 MB, bus bytes/s."""
    import torch.distributed as dist

    from hf_zero.engine.collectives import CommGroup, all_gather_into, reduce_scatter_into

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = CommGroup.world().using("auto")
    numel = 8 << 20  # 32 MB of fp32
    full = torch.randn(numel)
    shard = torch.randn(numel // group.size)
    result = {}
    for name, op in (("all_gather", lambda: all_gather_into(full, shard, group)),
                     ("reduce_scatter", lambda: reduce_scatter_into(shard, full.clone(), group))):
        times = []
        for i in range(6):
            dist.barrier()
            start = time.perf_counter()
            op()
            if i:
                times.append(time.perf_counter() - start)
        result[name] = (group.size - 1) / group.size * numel * 4 / statistics.median(times)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()
    os._exit(0)  # a measurement script: skip the interpreter teardown ([Note: clean exit] in hf_zero/engine/teardown.py)


def measure_collectives() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "c.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
               "--collectives-rank", str(out)]
        subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["small", "large"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--collectives-rank", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.collectives_rank:
        _collectives_rank(args.collectives_rank)
        return
    from _worker import PRESETS
    from bench import run_one, save_initial_weights

    bandwidth = measure_collectives()
    lines = ["| preset | stage | predicted step (s) | measured step (s) | error | compute / comm / optimizer predicted (s) |",
             "|---|---|---|---|---|---|"]
    notes = [f"gloo bus bandwidth (2 ranks, 32 MB): all-gather {bandwidth['all_gather'] / 1e9:.2f} GB/s, "
             f"reduce-scatter {bandwidth['reduce_scatter'] / 1e9:.2f} GB/s"]
    worst = 0.0
    for name in args.presets:
        preset = PRESETS[name]
        micro = preset["global_batch"] // 2
        flops, shape = measure_compute(preset, micro)
        adam = measure_optimizer(shape)
        notes.append(f"{name}: compute {flops / 1e9:.1f} GFLOP/s per rank (1 thread), AdamW {adam / 1e9:.2f} GB/s")
        hw = Hardware("this CPU", peak_flops=flops, compute_efficiency=1.0, intra_node_bandwidth=bandwidth["all_gather"],
                      inter_node_bandwidth=bandwidth["all_gather"], optimizer_bytes_per_s=adam, devices_per_node=2,
                      latency_s=200e-6, overlap=0.0, reduce_bandwidth=bandwidth["reduce_scatter"])
        with tempfile.TemporaryDirectory() as weights:
            save_initial_weights(name, weights)
            for stage in (1, 2, 3):
                job = Job(world_size=2, stage=stage, micro_batch=micro, seq_len=preset["seq"], param_bytes=4,
                          reduce_bytes=4)
                t = predict(shape, job, hw)
                records = run_one(f"hf_zero{stage}", name, weights, args.steps, 1, 1)
                measured = statistics.median(statistics.median(r["step_s"]) for r in records)
                error = t.step_s / measured - 1
                worst = max(worst, abs(error))
                lines.append(f"| {name} | {stage} | {t.step_s:.3f} | {measured:.3f} | {error:+.1%} | "
                             f"{t.compute_s:.3f} / {t.exposed_comm_s:.3f} / {t.optimizer_s:.3f} |")
                print(lines[-1], flush=True)
    text = "\n".join(["## Step-time model against measured step times (2 ranks, gloo, fp32)", "",
                      *[f"- {n}" for n in notes], "", *lines, "", f"Largest error: {worst:.1%}."])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "steptime_check.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
