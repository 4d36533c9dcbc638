"""The host's share of a step, two revisions side by side: a tiny LLaMA of many blocks at ZeRO-3 on 2 CPU ranks.

    python benchmarks/host_overhead.py --before 0aed717 --after HEAD --rounds 6

With 32-wide layers the arithmetic is almost nothing, so a step's time is the engine's own work on the host (its
hooks, one per unit and per gradient, the gathers' and reductions' calls, the optimizer's bookkeeping) and gloo's
latency: a change in the hooks' path shows here at a size the small preset's compute (`ab.py`) would hide. Each
revision is unpacked as `ab.py` unpacks it and runs the same worker (this file, `--worker`), which uses only the public
API; rounds alternate which revision goes first. Prints each run's ms per step and last loss (equal across
revisions), then the medians and their ratio (after / before: above 1 is slower).
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

from ab import unpack

LAYERS, STEPS, WARMUP = 24, 60, 5


def worker() -> None:
    """One rank: the model, 5 warm-up steps, then `STEPS` timed ones; rank 0 prints its record."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    model, opt = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), hf_zero.ZeroConfig(stage=3))
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))

    def step() -> float:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    for _ in range(WARMUP):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(STEPS):
        loss = step()
    dist.barrier()
    if dist.get_rank() == 0:
        print(json.dumps({"ms_per_step": (time.perf_counter() - start) / STEPS * 1e3, "loss": loss}))
    dist.destroy_process_group()


def run(tree: Path) -> dict:
    """One run of the worker over `tree`'s hf_zero."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--worker"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{tree.name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="git revision measured first in even rounds")
    ap.add_argument("--after", default="HEAD", help="git revision compared against --before")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker()
        return
    if args.before is None:
        ap.error("--before is required")
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": Path(tmp) / "before", "after": Path(tmp) / "after"}
        unpack(args.before, trees["before"])
        unpack(args.after, trees["after"])
        ms: dict[str, list[float]] = {"before": [], "after": []}
        for r in range(args.rounds):
            for name in (["before", "after"] if r % 2 == 0 else ["after", "before"]):
                rec = run(trees[name])
                ms[name].append(rec["ms_per_step"])
                print(f"round {r} {name:6s} {rec['ms_per_step']:8.1f} ms/step  last loss {rec['loss']:.6f}", flush=True)
    medians = {name: statistics.median(v) for name, v in ms.items()}
    print(json.dumps({"before": args.before, "after": args.after, "layers": LAYERS, "steps": STEPS,
                      "ms_per_step": ms, "median_before": medians["before"], "median_after": medians["after"],
                      "ratio_after_over_before": medians["after"] / medians["before"]}))


if __name__ == "__main__":
    main()
