"""What a Trainer checkpoint's weights cost: time, bytes and memory of the three saves of a sharded model,
side by side in one job (2 ranks, ZeRO-3, bf16 mixed precision, AdamW, one step taken first).

    python benchmarks/save_cost.py --layers 8 --out benchmarks/results

- `state`: `save_checkpoint` of the sharded training state (fp32 masters and Adam's moments), every rank
  writing its shards: what every checkpoint-N holds in `hf_zero/`.
- `weights, every rank`: `save_pretrained(parallel=True, dtype=bf16)`, each tensor written by the rank that
  owns it ([Note: owned tensors]): what `--zero_save_model_weights` adds to each checkpoint-N.
- `weights, rank 0`: `save_pretrained(dtype=bf16)`, rank 0 gathering one unit at a time and writing all.

Model: LLaMA with TinyLlama's shapes (hidden 2048, vocabulary 32000) and `--layers` decoder layers. Each save
runs `--repeats` times in turn; the median time is reported, with the bytes written and, per rank, the
growth of the peak resident set during the save (VmHWM reset before each). The job is killed as soon as a
rank passes `--budget-gib` of resident memory: a size that does not fit fails cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _capacity_model import GIB, SHAPE, n_params  # noqa: E402
from capacity import _kill, _tree_rss  # noqa: E402

SAVES = ("state", "weights, every rank", "weights, rank 0")


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero
    from _capacity_worker import _status  # VmRSS / VmHWM of this process

    torch.set_num_threads(4)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=args.layers, **SHAPE))
    model, opt = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-5),
                                    hf_zero.ZeroConfig(stage=3, mixed_precision="bf16"))
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 128), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    work = Path(args.work)
    saves = {
        "state": lambda d: hf_zero.save_checkpoint(d, model, opt),
        "weights, every rank": lambda d: model.save_pretrained(d, dtype="bf16", parallel=True),
        "weights, rank 0": lambda d: model.save_pretrained(d, dtype="bf16"),
    }
    times: dict[str, list[float]] = {k: [] for k in SAVES}
    growth: dict[str, int] = {k: 0 for k in SAVES}
    written: dict[str, int] = {}
    for _ in range(args.repeats):
        for name in SAVES:
            target = work / name.replace(" ", "_").replace(",", "")
            dist.barrier()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident set
            before = _status("VmRSS:")
            start = time.perf_counter()
            saves[name](target)
            dist.barrier()
            times[name].append(time.perf_counter() - start)
            growth[name] = max(growth[name], _status("VmHWM:") - before)
            if rank == 0:
                written[name] = _dir_bytes(target)
                shutil.rmtree(target)
            dist.barrier()
    growths = [None] * dist.get_world_size()
    dist.all_gather_object(growths, growth)
    if rank == 0:
        result = {"layers": args.layers, "params": n_params(args.layers), "repeats": args.repeats,
                  "saves": {name: {"seconds": statistics.median(times[name]), "all_seconds": times[name],
                                   "bytes": written[name], "peak_growth": [g[name] for g in growths]}
                            for name in SAVES}}
        Path(args.result).write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def report(result: dict) -> str:
    lines = [f"# Save cost: {result['params'] / 1e9:.2f}B LLaMA, 2 ranks, ZeRO-3 bf16 (median of {result['repeats']})",
             "", "| save | seconds | GB written | GB/s | peak RSS growth per rank (GiB) |", "|---|---|---|---|---|"]
    for name, s in result["saves"].items():
        growth = ", ".join(f"{g / GIB:.2f}" for g in s["peak_growth"])
        lines.append(f"| {name} | {s['seconds']:.2f} | {s['bytes'] / 1e9:.2f} | {s['bytes'] / 1e9 / s['seconds']:.2f} | {growth} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-gib", type=float, default=9.0, help="resident memory allowed per rank")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--out", type=Path, default=None, help="folder for save_cost.json / save_cost.md")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    work = Path(tempfile.mkdtemp(prefix="hf_zero-save-cost-", dir=os.environ.get("TMPDIR")))
    result_file = work / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, "--worker",
           "--layers", str(args.layers), "--repeats", str(args.repeats), "--work", str(work), "--result", str(result_file)]
    env = {**os.environ, "OMP_NUM_THREADS": "4", "PYTHONPATH": str(HERE.parent)}
    started, budget = time.time(), int(args.budget_gib * GIB)
    with open(work / "log.txt", "w") as log:
        job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while job.poll() is None:
            rss = _tree_rss(job.pid)
            if any(v > budget for v in rss.values()) or time.time() - started > args.timeout:
                _kill(job)
                sys.exit(f"save_cost: killed (over {args.budget_gib} GiB per rank or past {args.timeout}s); log in {work}")
            time.sleep(0.05)
    if job.returncode != 0 or not result_file.exists():
        sys.exit(f"save_cost: the job failed (exit {job.returncode}); log in {work}/log.txt")
    result = json.loads(result_file.read_text())
    text = report(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "save_cost.json").write_text(json.dumps(result, indent=2))
        (args.out / "save_cost.md").write_text(text)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
