"""Two revisions of hf_zero side by side: one engine's tokens/s on one preset, rounds interleaved.

    python benchmarks/ab.py --before 107993d --after HEAD --engine hf_zero3 --preset small --rounds 3

Each revision is unpacked with `git archive` into a temporary folder and run by its own
`benchmarks/_worker.py` (2 ranks, gloo, one thread each, as `bench.py` runs them) on the same initial
weights; rounds alternate which revision goes first, so a slow spell of the machine falls on both.
Prints each run's tokens/s (the median step's) and last losses, then the medians and their ratio
(after / before). A revision whose run fails stops the comparison with its output.

With `--peer fsdp2` (any engine of `_worker.py`), every round also runs that engine from the after tree, in
turn with the two revisions, and the ratio after / peer is printed beside: one invocation gives both figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def unpack(rev: str, into: Path) -> None:
    """The tree of `rev` (any git revision) under `into`."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=HERE.parent, capture_output=True, check=True)
    tar_path = into.with_suffix(".tar")
    tar_path.write_bytes(archive.stdout)
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")


def run(tree: Path, engine: str, preset: str, weights: str, steps: int, warmup: int) -> dict:
    """One run of `tree`'s worker; its rank-0 record."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(tree / "benchmarks" / "_worker.py"), "--engine", engine, "--preset", preset, "--weights", weights,
               "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"{tree.name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="git revision measured first in even rounds")
    ap.add_argument("--after", default="HEAD", help="git revision compared against --before")
    ap.add_argument("--engine", default="hf_zero3")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peer", default=None, help="an engine of _worker.py run from the after tree in every round")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": Path(tmp) / "before", "after": Path(tmp) / "after"}
        unpack(args.before, trees["before"])
        unpack(args.after, trees["after"])
        weights = str(Path(tmp) / "weights")
        sys.path.insert(0, str(trees["after"] / "benchmarks"))
        from _worker import PRESETS, build_model

        build_model(PRESETS[args.preset]).save_pretrained(weights)
        names = ["before", "after"] + (["peer"] if args.peer else [])
        tps: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # each goes first in turn
                engine, tree = (args.peer, trees["after"]) if name == "peer" else (args.engine, trees[name])
                rec = run(tree, engine, args.preset, weights, args.steps, args.warmup)
                tps[name].append(rec["tokens_per_s"])
                print(f"round {r} {name:6s} {rec['tokens_per_s']:9.1f} tokens/s  last losses {rec['losses'][-2:]}",
                      flush=True)
    medians = {name: statistics.median(v) for name, v in tps.items()}
    result = {"before": args.before, "after": args.after, "engine": args.engine, "preset": args.preset,
              "tokens_per_s": tps, "median_before": medians["before"], "median_after": medians["after"],
              "ratio_after_over_before": medians["after"] / medians["before"]}
    if args.peer:
        result |= {"peer": args.peer, "median_peer": medians["peer"], "ratio_after_over_peer": medians["after"] /
                   medians["peer"]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
