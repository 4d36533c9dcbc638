"""Long runs with periodic checkpoints: step times around each save, and resident memory over 1000+ steps.

    # step times: the small preset with a save every 10 steps, synchronous vs asynchronous vs none, side by side
    python benchmarks/soak.py compare --preset small --steps 40 --save-every 10 --out benchmarks/results
    # soak: 1000 steps of a tiny preset, an asynchronous save every 100, resident memory every 100 steps
    python benchmarks/soak.py soak --preset tiny --steps 1000 --save-every 100 --out benchmarks/results

Each run is 2 ranks on gloo (one thread each) of hf_zero ZeRO-3 + AdamW on the preset's LLaMA and random
tokens, launched with torchrun. A step is timed from after the previous step's all-reduce of the loss (which
lines the ranks up) to after its own. For `compare`, a step *overlaps* an asynchronous save when the save was
still being written as the step began; the figure is the median of those steps against the median of the steps
of the run without saves, and for the synchronous run the median of the steps that include a save (the stall).
Writes `<out>/soak_<mode>.json` and `.md`.
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

HERE = Path(__file__).resolve().parent
TINY = dict(hidden=128, layers=4, heads=4, kv_heads=4, inter=344, vocab=2048, seq=128, global_batch=8)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(args: argparse.Namespace) -> None:
    """One rank: train `steps` steps, saving every `save_every` steps as `mode` says; rank 0 writes the record."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    import hf_zero
    from _worker import PRESETS, build_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    p = TINY if args.preset == "tiny" else PRESETS[args.preset]
    model = build_model(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = hf_zero.initialize(model, opt, hf_zero.ZeroConfig(stage=3))
    micro = p["global_batch"] // world
    gen = torch.Generator().manual_seed(rank)
    steps, rss, overlapping, saving = [], {}, [], []
    handle = None
    dist.barrier()
    for i in range(1, args.steps + 1):
        in_flight = handle is not None and not handle.done()
        began = time.perf_counter()
        batch = torch.randint(0, p["vocab"], (micro, p["seq"]), generator=gen)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        saved = False
        if args.mode != "none" and i % args.save_every == 0:
            target = os.path.join(args.ckpt_dir, f"step_{i % (2 * args.save_every)}")
            if args.mode == "async":
                handle = hf_zero.save_checkpoint(target, model, opt, metadata={"step": i}, async_save=True)
            else:
                hf_zero.save_checkpoint(target, model, opt, metadata={"step": i})
            saved = True
        mean = loss.detach().reshape(1).clone()
        dist.all_reduce(mean)
        steps.append(time.perf_counter() - began)
        overlapping.append(in_flight)
        saving.append(saved)
        if i % 100 == 0 or i == 1:
            rss[i] = _rss_bytes()
    if handle is not None:
        handle.wait()
    records = [None] * world
    dist.all_gather_object(records, {"rank": rank, "step_s": steps, "overlapping": overlapping, "saving": saving,
                                     "rss": rss})
    if rank == 0:
        Path(args.record).write_text(json.dumps({"preset": args.preset, "mode": args.mode, "ranks": records}))
    dist.destroy_process_group()


def launch(preset: str, mode: str, steps: int, save_every: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
               "worker", "--preset", preset, "--mode", mode, "--steps", str(steps), "--save-every", str(save_every),
               "--ckpt-dir", str(Path(tmp) / "ckpt"), "--record", str(record)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=7200)
        if done.returncode != 0:
            raise RuntimeError(f"{mode} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(record.read_text())


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def compare(args: argparse.Namespace) -> dict:
    runs = {mode: launch(args.preset, mode, args.steps, args.save_every) for mode in ("none", "async", "sync")}
    warm = 2  # the first steps (allocation, the order being learned) are left out
    rank0 = {mode: run["ranks"][0] for mode, run in runs.items()}
    plain = _median(rank0["none"]["step_s"][warm:])
    a = rank0["async"]
    overlap = _median([s for s, o in zip(a["step_s"][warm:], a["overlapping"][warm:]) if o])
    calls = _median([s for s, v in zip(a["step_s"][warm:], a["saving"][warm:]) if v])
    s = rank0["sync"]
    stall = _median([t for t, v in zip(s["step_s"][warm:], s["saving"][warm:]) if v])
    overlapped = [round(s / plain, 3) for s, o in zip(a["step_s"][warm:], a["overlapping"][warm:]) if o]
    stalls = [round(t / plain, 3) for t, v in zip(s["step_s"][warm:], s["saving"][warm:]) if v]
    return {"preset": args.preset, "steps": args.steps, "save_every": args.save_every,
            "overlapping_step_ratios": overlapped, "sync_save_step_ratios": stalls,
            "median_step_s_without_saves": plain, "median_step_s_overlapping_async_save": overlap,
            "median_step_s_with_async_save_call": calls, "median_step_s_with_sync_save": stall,
            "overlap_ratio": overlap / plain, "async_call_ratio": calls / plain, "sync_ratio": stall / plain}


def soak(args: argparse.Namespace) -> dict:
    run = launch(args.preset, "async", args.steps, args.save_every)
    per_rank = {r["rank"]: {int(k): v for k, v in r["rss"].items()} for r in run["ranks"]}
    at = {rank: (rss.get(100), rss.get(max(rss))) for rank, rss in per_rank.items()}
    return {"preset": args.preset, "steps": args.steps, "save_every": args.save_every, "rss_by_step": per_rank,
            "rss_change_from_step_100": {rank: (b - a) / a for rank, (a, b) in at.items()},
            "median_step_s": _median(run["ranks"][0]["step_s"][2:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["compare", "soak", "worker"])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--mode", choices=["none", "async", "sync"], default="async")
    ap.add_argument("--ckpt-dir")
    ap.add_argument("--record")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    if args.command == "worker":
        worker(args)
        return
    started = time.perf_counter()
    result = compare(args) if args.command == "compare" else soak(args)
    result["wall_s"] = time.perf_counter() - started
    out = Path(args.out) / f"soak_{args.command}.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
