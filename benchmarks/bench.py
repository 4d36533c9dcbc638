"""hf_zero beside DDP, FSDP2 (`fully_shard`) and DeepSpeed ZeRO on the same model, side by side.

    python benchmarks/bench.py --preset small --rounds 3 --steps 5 --out benchmarks/results
    python benchmarks/bench.py --preset small --sweep --rounds 2        # tune hf_zero's settings

    python benchmarks/bench.py --device cuda --preset large --rounds 3   # NCCL, one rank per visible GPU

Each round runs every engine once, in order, as a fresh torchrun job (so machine drift
hits every engine alike, and each job's peak memory is its own); DeepSpeed runs when it is
installed. Every engine starts from the same saved initial weights. Reports tokens/s (median,
min, max over rounds; a run's throughput is that of its median timed step), the ratios that
matter (paired by round), peak resident memory per rank above the process baseline (loading
included) and during training, model-state bytes per rank, and checks that every engine's
losses agree with DDP's. Writes `<out>/<preset>.json`,
`<out>/<preset>.md` and, with matplotlib, `<out>/<preset>.png`.

`--sweep` instead runs hf_zero ZeRO-3 (and ZeRO-2) over `prefetch` x `bucket_size_mb`, interleaved
the same way, and writes `<out>/<preset>_sweep.md`: the table the defaults were chosen from.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINES = ["local", "ddp", "hf_zero1", "hf_zero2", "hf_zero3", "hf_zero3_q", "hf_zero3_offload", "fsdp2", "fsdp2_noreshard",
           "ds1", "ds2", "ds3", "ds3_raw"]
# Losses must match DDP's within 1e-4 relative; the quantized engine rounds in transit, so within 2e-2;
# "local" (no communication, each rank trains alone) is not the same training and is not compared.
LOSS_TOL = {"hf_zero3_q": 2e-2, "local": float("inf")}
LABELS = {"local": "no communication (compute floor)", "ddp": "DDP", "hf_zero1": "hf_zero ZeRO-1", "hf_zero2": "hf_zero ZeRO-2", "hf_zero3": "hf_zero ZeRO-3",
          "hf_zero3_q": "hf_zero ZeRO-3 int8 weights + bf16 grads",
          "hf_zero3_offload": "hf_zero ZeRO-3 + offload", "fsdp2": "FSDP2 (reshard)", "fsdp2_noreshard": "FSDP2 (no reshard)",
          "ds1": "DeepSpeed ZeRO-1", "ds2": "DeepSpeed ZeRO-2", "ds3": "DeepSpeed ZeRO-3 (HF config)",
          "ds3_raw": "DeepSpeed ZeRO-3 (its defaults)"}


def run_one(engine: str, preset: str, weights: str, steps: int, warmup: int, threads: int,
            options: dict | None = None, device: str = "cpu", nproc: int = 2, precision: str = "fp32") -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               str(HERE / "_worker.py"), "--engine", engine, "--preset", preset, "--weights", weights,
               "--steps", str(steps), "--warmup", str(warmup), "--options", json.dumps(options or {}),
               "--device", device, "--precision", precision, "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(HERE.parent)}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if done.returncode != 0:
            # Never drop a failure: stop the benchmark, naming the engine and its last output.
            raise RuntimeError(f"{engine} {options or ''} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def save_initial_weights(preset: str, directory: str) -> None:
    """The preset's initial model, saved once: every engine of every round loads these weights."""
    sys.path.insert(0, str(HERE))
    from _worker import PRESETS, build_model

    build_model(PRESETS[preset]).save_pretrained(directory)


def summarize(runs: dict[str, list[list[dict]]]) -> dict[str, dict]:
    summary = {}
    for engine, rounds in runs.items():
        tps = [r[0]["tokens_per_s"] for r in rounds]
        summary[engine] = {
            "tokens_per_s": {"median": statistics.median(tps), "min": min(tps), "max": max(tps), "all": tps},
            "peak_rss_bytes_per_rank": max(rec["peak_rss_bytes"] for r in rounds for rec in r),
            "train_peak_rss_bytes_per_rank": max(rec["train_peak_rss_bytes"] for r in rounds for rec in r),
            "model_state_bytes_per_rank": max(rec["model_state_bytes"] for rec in rounds[-1]),
            "zero3_state_formula_bytes": rounds[-1][0]["zero3_state_formula_bytes"],
            "losses": rounds[-1][0]["losses"],
            "params": rounds[-1][0]["params"],
            "world": rounds[-1][0]["world"],
            "device": rounds[-1][0].get("device", "cpu"),
            "device_name": rounds[-1][0].get("device_name", "cpu"),
            "peer_config": rounds[-1][0].get("peer_config") or None,
            "precision": rounds[-1][0].get("precision", "fp32"),
            "options": rounds[-1][0].get("options") or None,
        }
    return summary


def ratios(summary: dict[str, dict]) -> list[tuple[str, float, float, float]]:
    """(name, median, min, max) of per-round throughput ratios (the rounds pair the engines)."""
    pairs = [("hf_zero ZeRO-3 / FSDP2 (reshard)", "hf_zero3", "fsdp2"),
             ("hf_zero ZeRO-3 / DeepSpeed ZeRO-3 (HF config)", "hf_zero3", "ds3"),
             ("hf_zero ZeRO-3 / DeepSpeed ZeRO-3 (its defaults)", "hf_zero3", "ds3_raw"),
             ("hf_zero ZeRO-2 / DeepSpeed ZeRO-2", "hf_zero2", "ds2"),
             ("hf_zero ZeRO-1 / DDP", "hf_zero1", "ddp"),
             ("hf_zero ZeRO-3 / DDP", "hf_zero3", "ddp"),
             ("hf_zero ZeRO-3 int8+bf16 / ZeRO-3", "hf_zero3_q", "hf_zero3"),
             ("hf_zero ZeRO-3 int8+bf16 / DDP", "hf_zero3_q", "ddp"),
             ("hf_zero ZeRO-3 int8+bf16 / FSDP2 (reshard)", "hf_zero3_q", "fsdp2"),
             # the most any cut in communication can give: a step with collectives that cost nothing
             ("compute floor / hf_zero ZeRO-3", "local", "hf_zero3"),
             ("compute floor / DDP", "local", "ddp")]
    out = []
    for name, a, b in pairs:
        if a in summary and b in summary:
            r = [x / y for x, y in zip(summary[a]["tokens_per_s"]["all"], summary[b]["tokens_per_s"]["all"])]
            out.append((name, statistics.median(r), min(r), max(r)))
    return out


def _precision(record: dict) -> str:
    if record.get("precision") == "bf16":
        return ("bf16 mixed precision (hf_zero `mixed_precision=\"bf16\"`, DDP under autocast, FSDP2 with Accelerate's "
                "`MixedPrecisionPolicy`, DeepSpeed `bf16.enabled`), fp32")
    return "fp32"


def markdown(preset: str, summary: dict[str, dict], rs: list, rounds: int, steps: int) -> str:
    mib = 2**20
    first = next(iter(summary.values()))
    formula = first["zero3_state_formula_bytes"]
    where = "gloo, CPU" if first.get("device", "cpu") == "cpu" else f"NCCL, {first.get('device_name', 'CUDA')}"
    memory = "peak RSS" if first.get("device", "cpu") == "cpu" else "peak CUDA allocated"
    lines = [f"### preset `{preset}`: LLaMA with {first['params'] / 1e6:.0f}M parameters, {first['world']} ranks ({where}), "
             f"{_precision(first)} AdamW; {rounds} interleaved rounds of {steps} timed steps (a run counts its median "
             "step)",
             "", f"Peak memory is per rank, above the process baseline (loading and wrapping included), and as "
             f"a multiple of the ZeRO-3 model-state formula 16Ψ/N = {formula / mib:.0f} MiB.", "",
             f"| engine | tokens/s median | min | max | {memory} / rank (MiB) | peak / (16Ψ/N) | "
             "training-loop peak growth (MiB) | model states / rank (MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for engine, s in summary.items():
        t = s["tokens_per_s"]
        state = f"{s['model_state_bytes_per_rank'] / mib:.0f}" if s["model_state_bytes_per_rank"] >= 0 else "n/a"
        peak = s["peak_rss_bytes_per_rank"]
        lines.append(f"| {LABELS[engine]} | {t['median']:.1f} | {t['min']:.1f} | {t['max']:.1f} | {peak / mib:.0f} | "
                     f"{peak / formula:.2f} | {s['train_peak_rss_bytes_per_rank'] / mib:.0f} | {state} |")
    lines += ["", "| ratio (tokens/s, paired by round) | median | min | max |", "|---|---|---|---|"]
    lines += [f"| {n} | {m:.3f} | {lo:.3f} | {hi:.3f} |" for n, m, lo, hi in rs]
    peers = [(LABELS[e], s["peer_config"]) for e, s in summary.items() if s.get("peer_config")]
    if peers:
        lines += ["", "The peers' configurations, as each run recorded them (benchmarks/_peers.py):", ""]
        lines += [f"- {label}: `{json.dumps(config, sort_keys=True)}`" for label, config in peers]
    ours = [(LABELS[e], s["options"]) for e, s in summary.items() if e.startswith("hf_zero") and s.get("options")]
    if ours:
        lines += ["", "hf_zero's settings beyond its defaults (`--hf-zero-options`):", ""]
        lines += [f"- {label}: `{json.dumps(options, sort_keys=True)}`" for label, options in ours]
    return "\n".join(lines) + "\n"


def chart(path: Path, preset: str, summary: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [LABELS[e] for e in summary]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    med = [s["tokens_per_s"]["median"] for s in summary.values()]
    err = [[m - s["tokens_per_s"]["min"] for m, s in zip(med, summary.values())],
           [s["tokens_per_s"]["max"] - m for m, s in zip(med, summary.values())]]
    colors = ["tab:green" if n.startswith("hf_zero") else "tab:gray" for n in names]
    ax1.barh(names, med, xerr=err, color=colors)
    ax1.set_xlabel("tokens/s (median, min-max)")
    ax2.barh(names, [s["peak_rss_bytes_per_rank"] / 2**30 for s in summary.values()], color=colors)
    ax2.set_xlabel("peak resident memory per rank above the process baseline (GiB)")
    ax2.set_yticklabels([])
    fig.suptitle(f"hf_zero vs DDP, FSDP2, DeepSpeed — preset {preset}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SWEEP = [{"prefetch": p, "bucket_size_mb": b} for p in (0, 1, 2) for b in (0, 25)] + [{"prefetch": 1, "bucket_size_mb": 50}]


def sweep(args: argparse.Namespace, weights: str) -> None:
    """hf_zero ZeRO-3 and ZeRO-2 over prefetch x bucket_size_mb, interleaved; a markdown table."""
    cases = [("hf_zero3", o) for o in SWEEP] + [("hf_zero2", {"bucket_size_mb": b}) for b in (0, 25)]
    results: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for engine, options in cases:
            key = f"{engine} {json.dumps(options)}"
            results.setdefault(key, []).append(run_one(engine, args.preset, weights, args.steps, args.warmup, args.threads, options,
                                                               device=args.device, nproc=args.nproc)[0])
            print(f"round {r + 1}/{args.rounds} {key}: {results[key][-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    mib = 2**20
    lines = [f"### `{args.preset}` sweep: {args.rounds} interleaved rounds of {args.steps} steps", "",
             "| engine | settings | tokens/s median | min | max | peak RSS / rank (MiB) |", "|---|---|---|---|---|---|"]
    for key, recs in results.items():
        engine, options = key.split(" ", 1)
        tps = [x["tokens_per_s"] for x in recs]
        lines.append(f"| {LABELS[engine]} | `{options}` | {statistics.median(tps):.1f} | {min(tps):.1f} | {max(tps):.1f} | "
                     f"{max(x['peak_rss_bytes'] for x in recs) / mib:.0f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.preset}_sweep.json").write_text(json.dumps(results, indent=1))
    (out / f"{args.preset}_sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["small", "large", "small_tied"], default="small")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    ap.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    ap.add_argument("--sweep", action="store_true", help="tune hf_zero's prefetch and bucket size instead")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu",
                    help="cuda: NCCL, one rank per GPU; auto: cuda when a GPU is visible")
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: 2 on CPU, every visible GPU on CUDA)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: each engine's mixed precision as its users turn it on (results named <preset>_bf16)")
    ap.add_argument("--hf-zero-options", default="{}",
                    help='JSON of ZeroConfig fields for every hf_zero engine, e.g. \'{"reduce_dtype": "bf16"}\'')
    ap.add_argument("--label", default="", help="appended to the result files' names")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "auto":
        args.device = "cuda" if gpus else "cpu"
    if args.device == "cuda" and not gpus:
        raise SystemExit("--device cuda: this torch sees no CUDA GPU (torch.cuda.is_available() is False).")
    args.nproc = args.nproc or (gpus if args.device == "cuda" else 2)
    if args.device == "cuda" and args.nproc > gpus:
        raise SystemExit(f"--nproc {args.nproc} on CUDA needs {args.nproc} GPUs; {gpus} visible (NCCL: one GPU per rank).")
    with tempfile.TemporaryDirectory() as weights:
        save_initial_weights(args.preset, weights)
        if args.sweep:
            sweep(args, weights)
            return
        compare(args, weights)


def compare(args: argparse.Namespace, weights: str) -> None:
    engines = [e for e in args.engines if not e.startswith("ds") or importlib.util.find_spec("deepspeed")]
    runs: dict[str, list[list[dict]]] = {e: [] for e in engines}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.preset + ("_bf16" if args.precision == "bf16" else "") + args.label
    partial = out / f"{name}.partial.json"  # every finished run, in case a later one fails
    for r in range(args.rounds):
        for engine in engines:
            options = json.loads(args.hf_zero_options) if engine.startswith("hf_zero") else None
            runs[engine].append(run_one(engine, args.preset, weights, args.steps, args.warmup, args.threads, options,
                                        device=args.device, nproc=args.nproc, precision=args.precision))
            partial.write_text(json.dumps(runs))
            print(f"round {r + 1}/{args.rounds} {engine}: {runs[engine][-1][0]['tokens_per_s']:.1f} tokens/s", flush=True)
    partial.unlink()
    summary = summarize(runs)
    reference = summary.get("ddp", next(s for e, s in summary.items() if e != "local"))["losses"]
    for engine, s in summary.items():
        worst = max(abs(a - b) / abs(b) for a, b in zip(s["losses"], reference))
        s["loss_rel_diff_vs_ddp"] = worst
        if worst > (2e-2 if args.precision == "bf16" else LOSS_TOL.get(engine, 1e-4)):  # bf16 rounds differently
            raise SystemExit(f"{engine}'s losses differ from DDP's by {worst:.2e} (relative): not the same training")
    rs = ratios(summary)
    (out / f"{name}.json").write_text(json.dumps({"summary": summary, "ratios": rs, "runs": runs}, indent=1))
    table = markdown(name, summary, rs, args.rounds, args.steps)
    (out / f"{name}.md").write_text(table)
    if importlib.util.find_spec("matplotlib"):
        chart(out / f"{name}.png", name, summary)
    print(table)


if __name__ == "__main__":
    main()
