"""Long sequences: the longest one ZeRO-3 trains with and without sequence parallelism, and the speed at a length
both take ([Note: sequence parallelism], [Note: tiled loss]), side by side in one invocation.

    python benchmarks/sequence.py --out benchmarks/results                         # the defaults below
    python benchmarks/sequence.py --layers 16 --hidden 2048 --dtype bf16 --budget-gib 9 --lengths 4096,8192,16384

Each run is a fresh 2-rank torchrun job (gloo): a LLaMA of `--layers` x `--hidden` (TinyLlama's proportions,
32k vocabulary), ZeRO-3, gradient checkpointing on, AdamW; 2 optimizer steps of one sequence of the given length
per data-parallel replica (with sequence parallelism 2 both ranks share it, each holding half its tokens;
without, each rank trains its own, as a user of 2 ranks does). A run fits when both steps finish with every
rank's peak resident memory (VmHWM, process baseline included) within `--budget-gib`; a run whose memory passes
1.3x the budget is stopped. Tokens/s counts the tokens trained per second by the job (both ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 2**30


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    hidden = args.hidden
    config = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64, num_hidden_layers=args.layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(2, hidden // 512), vocab_size=32000,
                         max_position_embeddings=max(args.length, 2048), tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    zc = hf_zero.ZeroConfig(stage=3, mixed_precision="bf16" if dtype == torch.bfloat16 else "no",
                            sequence_parallel=args.sequence_parallel)
    model, opt = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-5), zc)
    model.train()
    replica = rank // args.sequence_parallel
    g = torch.Generator().manual_seed(replica)
    times, losses = [], []
    for _ in range(2):
        ids = torch.randint(0, 32000, (1, args.length), generator=g)
        dist.barrier()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        if rank == 0:
            print(f"step {len(times)}: {times[-1]:.1f} s", flush=True)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    peaks = [None, None]
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        replicas = dist.get_world_size() // args.sequence_parallel
        Path(args.result).write_text(json.dumps({
            "length": args.length, "sequence_parallel": args.sequence_parallel, "peaks": peaks, "step_s": times,
            "losses": losses, "tokens_per_s": replicas * args.length / times[-1],
            "params": sum(p.numel() for p in model.parameters())}))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def run(args: argparse.Namespace, length: int, sp: int, work: Path) -> dict:
    out = work / f"sp{sp}-{length}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--worker", "--length", str(length), "--sequence-parallel", str(sp), "--layers", str(args.layers),
           "--hidden", str(args.hidden), "--dtype", args.dtype, "--result", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    limit = int(1.3 * args.budget_gib * GIB)
    started = time.time()
    with open(work / f"sp{sp}-{length}.log", "w") as log:
        job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        killed = None
        while job.poll() is None:
            rss = _ranks_rss(job.pid)
            if rss and max(rss) > limit:
                killed = f"stopped at {max(rss) / GIB:.2f} GiB"
            elif time.time() - started > args.timeout:
                killed = f"timeout after {args.timeout} s"
            if killed:
                os.killpg(job.pid, signal.SIGKILL)
                for pid in _ranks(job.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                job.wait()
                break
            time.sleep(0.1)
    if killed or not out.exists():
        return {"length": length, "sequence_parallel": sp, "ok": False, "why": killed or f"exit {job.returncode}"}
    r = json.loads(out.read_text())
    fits = max(r["peaks"]) <= args.budget_gib * GIB
    r.update(ok=fits, why="" if fits else f"peak {max(r['peaks']) / GIB:.2f} GiB over the budget")
    return r


def _ranks(root: int) -> list[int]:
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        found += [int(c) for c in children]
        todo += [int(c) for c in children]
    return found


def _ranks_rss(root: int) -> list[int]:
    out = []
    for pid in _ranks(root):
        try:
            out.append(int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
        except OSError:
            continue
    return out


def report(args: argparse.Namespace, runs: list[dict]) -> str:
    lines = [f"# Sequence parallelism: longest sequence trained, 2 ranks, {args.budget_gib} GiB per rank", "",
             f"LLaMA {args.layers} layers x hidden {args.hidden} (32k vocabulary), ZeRO-3, {args.dtype}, gradient "
             "checkpointing, AdamW, 2 steps; peak resident memory per rank (VmHWM, process baseline included).", "",
             "| sequence parallelism | length | result | peak GiB (rank 0, 1) | last step (s) | tokens/s |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        peaks = ", ".join(f"{p / GIB:.2f}" for p in r.get("peaks", [])) if r.get("peaks") else ""
        step = f"{r['step_s'][-1]:.1f}" if r.get("step_s") else ""
        tps = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else ""
        lines.append(f"| {r['sequence_parallel']} | {r['length']} | {'fits' if r['ok'] else r['why']} | {peaks} | "
                     f"{step} | {tps} |")
    longest = {sp: max([r["length"] for r in runs if r["ok"] and r["sequence_parallel"] == sp] or [0]) for sp in (1, 2)}
    lines += ["", f"Longest that fits: {longest[1]} tokens without, {longest[2]} with sequence parallelism 2"
              + (f" ({longest[2] / longest[1]:.2f}x)." if longest[1] else ".")]
    both = sorted({r["length"] for r in runs if r["ok"] and r["sequence_parallel"] == 1}
                  & {r["length"] for r in runs if r["ok"] and r["sequence_parallel"] == 2})
    if both:
        at = both[-1]
        one = next(r for r in runs if r["ok"] and r["length"] == at and r["sequence_parallel"] == 1)
        two = next(r for r in runs if r["ok"] and r["length"] == at and r["sequence_parallel"] == 2)
        lines.append(f"At {at} tokens, which both take: {two['tokens_per_s']:.0f} tokens/s with sequence parallelism "
                     f"against {one['tokens_per_s']:.0f} without ({two['tokens_per_s'] / one['tokens_per_s']:.2f}x; "
                     "with it the two ranks train one sequence, without it two).")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--budget-gib", type=float, default=3.0)
    ap.add_argument("--lengths", default="2048,4096,8192,12288,16384")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--sequence-parallel", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    work = Path(tempfile.mkdtemp(prefix="hf_zero-sequence-"))
    runs = []
    for sp in (1, 2):
        for length in [int(x) for x in args.lengths.split(",")]:
            r = run(args, length, sp, work)
            runs.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "losses"}), flush=True)
            if not r["ok"]:
                break
    text = report(args, runs)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sequence.md").write_text(text)
        (args.out / "sequence.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs},
                                                           indent=1, default=str))


if __name__ == "__main__":
    main()
