"""Long sequences: the longest one ZeRO-3 trains with and without sequence parallelism, and the speed at a length
both take ([Note: sequence parallelism], [Note: tiled loss]), side by side in one invocation.

    python benchmarks/sequence.py --out benchmarks/results                         # the defaults below
    python benchmarks/sequence.py --layers 16 --hidden 2048 --dtype bf16 --budget-gib 9 --lengths 4096,8192,16384

Each run is a fresh 2-rank torchrun job (gloo): a LLaMA of `--layers` x `--hidden` (TinyLlama's proportions,
32k vocabulary), ZeRO-3, gradient checkpointing on, AdamW; 2 optimizer steps of one sequence of the given length
per data-parallel replica (with sequence parallelism 2 both ranks share it, each holding half its tokens;
without, each rank trains its own, as a user of 2 ranks does). With `--warmup-length N` the first step trains N
tokens instead: it allocates the optimizer state, so the second, at the length, meets every model state as a
longer run does, in half the time. A run fits when both steps finish with every rank's peak resident memory
(VmHWM, process baseline included) within `--budget-gib`; a run whose memory passes 1.3x the budget (with
`--stop-at-budget`: the budget) is stopped. Tokens/s counts the tokens trained per second by the job (both ranks).

The `_packed` modes train packed rows instead ([Note: packed documents]): `--documents` documents end to end in
each sequence, `position_ids` restarting at each, each document's first label ignored (as
`DataCollatorWithFlattening` and TRL's `padding_free` make them), attention within each document.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GIB = 2**30


def _config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    hidden = args.hidden
    config = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64, num_hidden_layers=args.layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(2, hidden // 512), vocab_size=32000,
                         max_position_embeddings=max(args.length, 2048), tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


def _hf_zero_step(args: argparse.Namespace) -> tuple[Callable[[Any], float], Any]:
    import torch
    from transformers import LlamaForCausalLM

    import hf_zero

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(args))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    zc = hf_zero.ZeroConfig(stage=3, mixed_precision="bf16" if args.dtype == "bf16" else "no",
                            sequence_parallel=args.sequence_parallel, tiled_mlp=args.tiled_mlp)
    model, opt = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-5), zc)
    if args.tiled_only:  # the control: the tiled loss on whole sequences, nothing split ([Note: tiled loss])
        from hf_zero.engine.collectives.group import CommGroup
        from hf_zero.features import sequence_parallel as sequence

        sequence.enable(model, CommGroup.single())
    model.train()

    def step(ids: Any) -> float:
        PHASES.clear()
        PHASES["before"] = _resident()
        _reset_peak()
        loss = model(input_ids=ids, **_packing(args, ids)).loss
        PHASES["forward_peak"], PHASES["after_forward"] = _peak(), _resident()
        _reset_peak()
        loss.backward()
        PHASES["backward_peak"], PHASES["after_backward"] = _peak(), _resident()
        _reset_peak()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        PHASES["step_peak"] = _peak()
        return float(loss.detach())

    return step, model


PHASES: dict[str, int] = {}  # where one rank's memory goes in the last step (bytes): resident and peaks per phase


def _packing(args: argparse.Namespace, ids: Any) -> dict[str, Any]:
    """The labels (and, for packed rows, the positions) of one row: `--documents` documents of equal length end
    to end, positions restarting at each, each document's first label ignored."""
    if not args.packed:
        return {"labels": ids}
    import torch

    length = ids.shape[1]
    starts = torch.arange(0, length, length // args.documents)
    positions = torch.arange(length) - starts.repeat_interleave(length // args.documents)[:length]
    labels = ids.clone()
    labels[:, starts] = -100
    return {"labels": labels, "position_ids": positions.unsqueeze(0)}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _resident() -> int:
    return _status("VmRSS")


def _peak() -> int:
    return _status("VmHWM")


def _reset_peak() -> None:
    """Start a new peak (VmHWM) from the resident set now (Linux: `5` to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _ulysses_step(args: argparse.Namespace) -> tuple[Callable[[Any], float], Any]:
    """DeepSpeed's Ulysses (ALST) as its tutorial sets it up: the attention registered with transformers, ZeRO-3
    with the HF Trainer's values, each rank feeding its slice of the tokens with global positions and shifted
    labels, the loss averaged over the group weighted by each rank's labelled tokens."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from torch.distributed.nn.functional import all_gather
    from transformers import LlamaForCausalLM

    sys.path.insert(0, str(HERE))
    from _peers import deepspeed_config

    config = _config(args)
    ds_config = deepspeed_config(config.hidden_size, micro=1, bf16=args.dtype == "bf16")
    ds_config["sequence_parallel_size"] = args.sequence_parallel
    PEER_CONFIG.update(ds_config)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=args.sequence_parallel,
        micro_batch_size=1, seq_length=args.length, seq_length_is_variable=bool(args.warmup_length))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                           optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5), mpu=mpu)
    group, size = mpu.get_sequence_parallel_group(), args.sequence_parallel
    engine.train()

    def step(ids: Any) -> float:
        part = ids.shape[1] // size
        lo = dist.get_rank(group) * part
        shifted = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)[:, lo : lo + part]
        positions = torch.arange(ids.shape[1]).unsqueeze(0)[:, lo : lo + part]
        loss = engine(input_ids=ids[:, lo : lo + part], position_ids=positions, labels=shifted,
                      shift_labels=shifted).loss
        good = (shifted != -100).sum().reshape(1)
        goods = [torch.zeros_like(good) for _ in range(size)]
        dist.all_gather(goods, good, group=group)
        losses = all_gather(loss, group=group)
        total = sum(losses[r] * goods[r] for r in range(size)) / sum(goods)
        engine.backward(total)
        engine.step()
        return float(total.detach())

    return step, model


PEER_CONFIG: dict = {}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.ulysses:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    step, model = (_ulysses_step if args.ulysses else _hf_zero_step)(args)
    replica = rank // args.sequence_parallel
    g = torch.Generator().manual_seed(replica)
    times, losses = [], []
    init_peak = _peak()  # building and sharding the model (the phases below reset the high-water mark)
    for length in ([args.warmup_length] if args.warmup_length else [args.length]) + [args.length]:
        ids = torch.randint(0, 32000, (1, length), generator=g)
        dist.barrier()
        start = time.perf_counter()
        losses.append(step(ids))
        dist.barrier()
        times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"step {len(times)}: {times[-1]:.1f} s", flush=True)
    peak = max([init_peak, _peak(), *PHASES.values()])  # every high-water mark since the start
    peaks = [None, None]
    dist.all_gather_object(peaks, peak)
    phases: list[Any] = [None, None]
    dist.all_gather_object(phases, dict(PHASES))
    if rank == 0:
        replicas = dist.get_world_size() // args.sequence_parallel
        Path(args.result).write_text(json.dumps({
            "length": args.length, "sequence_parallel": args.sequence_parallel, "peaks": peaks, "step_s": times,
            "losses": losses, "tokens_per_s": replicas * args.length / times[-1], "peer_config": PEER_CONFIG,
            "phases": phases,
            "params": sum(p.numel() for p in model.parameters()) if not args.ulysses else None}))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


MODES = {  # mode -> (sequence parallelism, tiled loss without a split, tiled MLP, what the row is)
    "whole": (1, False, False, "ZeRO-3, no sequence parallelism (the model's own loss: whole logits)"),
    "tiled": (1, True, False, "ZeRO-3, no sequence parallelism, hf_zero's tiled loss (the control)"),
    "split": (2, False, False, "ZeRO-3 + sequence parallelism 2 (tiled loss)"),
    "split_mlp": (2, False, True, "ZeRO-3 + sequence parallelism 2 (tiled loss) + `tiled_mlp`"),
    "ulysses": (2, False, False, "DeepSpeed ZeRO-3 (the HF Trainer's values) + its Ulysses sequence parallelism 2"),
    "whole_packed": (1, False, False, "as `whole`, on packed rows (documents end to end)"),
    "split_packed": (2, False, False, "as `split`, on packed rows (documents end to end)"),
}


def run(args: argparse.Namespace, length: int, mode: str, work: Path) -> dict:
    sp, tiled, mlp, _ = MODES[mode]
    out = work / f"{mode}-{length}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--worker", "--length", str(length), "--sequence-parallel", str(sp), "--layers", str(args.layers),
           "--hidden", str(args.hidden), "--dtype", args.dtype, "--result", str(out),
           "--warmup-length", str(args.warmup_length)] + (["--tiled-only"] if tiled else [])
    cmd += ["--ulysses"] if mode == "ulysses" else []
    cmd += ["--tiled-mlp"] if mlp else []
    cmd += ["--packed", "--documents", str(args.documents)] if mode.endswith("_packed") else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    limit = int((1.0 if args.stop_at_budget else 1.3) * args.budget_gib * GIB)  # resident memory, polled every 0.1 s
    started = time.time()
    with open(work / f"{mode}-{length}.log", "w") as log:
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
    base = {"mode": mode, "length": length, "sequence_parallel": sp}
    if killed or not out.exists():
        return base | {"ok": False, "why": killed or f"exit {job.returncode}"}
    r = base | json.loads(out.read_text())
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
             "checkpointing, AdamW, 2 steps of one sequence per data-parallel replica"
             + (f" (the first of {args.warmup_length} tokens)" if args.warmup_length else "")
             + "; peak resident memory per rank "
             "(VmHWM, process baseline included). A ladder stops at its first length that does not fit.", "",
             "| run | length | result | peak GiB (rank 0, 1) | last step (s) | tokens/s |", "|---|---|---|---|---|---|"]
    for r in runs:
        peaks = ", ".join(f"{p / GIB:.2f}" for p in r.get("peaks", [])) if r.get("peaks") else ""
        step = f"{r['step_s'][-1]:.1f}" if r.get("step_s") else ""
        tps = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else ""
        lines.append(f"| {r['mode']} | {r['length']} | {'fits' if r['ok'] else r['why']} | {peaks} | {step} | {tps} |")
    ran = [m for m in MODES if any(r["mode"] == m for r in runs)]
    lines += ["", "Runs: " + "; ".join(f"`{m}`: {MODES[m][3]}" for m in ran) + ".", ""]
    longest = {m: max([r["length"] for r in runs if r["ok"] and r["mode"] == m] or [0]) for m in MODES}
    stopped = {m: next((r["why"] for r in runs if r["mode"] == m and not r["ok"]), "the ladder's end") for m in ran}
    for m in ran:
        lines.append(f"- longest `{m}`: {longest[m]} tokens (next: {stopped[m]})")
    if longest["whole"] and longest["split"]:
        lines.append(f"- sequence parallelism 2 / without: {longest['split'] / longest['whole']:.2f}x"
                     + (f"; against the tiled-loss control: {longest['split'] / longest['tiled']:.2f}x"
                        if longest["tiled"] else ""))
    if longest["whole_packed"] and longest["split_packed"]:
        lines.append(f"- packed rows: sequence parallelism 2 / without: "
                     f"{longest['split_packed'] / longest['whole_packed']:.2f}x")
    if longest["split"] and "ulysses" in ran:
        lines.append(f"- hf_zero's sequence parallelism / DeepSpeed's Ulysses (ALST): {longest['split']} against "
                     f"{longest['ulysses']} tokens")
    fit = {m: {r["length"]: r for r in runs if r["ok"] and r["mode"] == m} for m in MODES}
    both = sorted(set(fit["whole"]) & set(fit["split"]))
    if both:
        at = both[-1]
        one, two = fit["whole"][at], fit["split"][at]
        lines.append(f"- at {at} tokens, which both take: {two['tokens_per_s']:.0f} tokens/s with sequence "
                     f"parallelism against {one['tokens_per_s']:.0f} without ({two['tokens_per_s'] / one['tokens_per_s']:.2f}x;"
                     " with it the two ranks train one sequence, without it two)")
    for at in sorted(set(fit["split"]) & set(fit["split_mlp"])):
        plain, tiled = fit["split"][at], fit["split_mlp"][at]
        lines.append(f"- at {at} tokens, `tiled_mlp`: peak {max(tiled['peaks']) / GIB:.2f} GiB against "
                     f"{max(plain['peaks']) / GIB:.2f} GiB, {tiled['tokens_per_s'] / plain['tokens_per_s']:.2f}x the "
                     "tokens/s")
    if longest["split"] and longest["split_mlp"]:
        lines.append(f"- `tiled_mlp` / sequence parallelism alone: {longest['split_mlp'] / longest['split']:.2f}x")
    return "\n".join(lines + account(runs)) + "\n"


def account(runs: list[dict]) -> list[str]:
    """Where rank 0's memory goes in the measured step of each run that fits (resident GiB, process included)."""
    keys = ["before", "forward_peak", "after_forward", "backward_peak", "after_backward"]
    rows = [r for r in runs if r.get("ok") and r.get("phases")]
    if not rows:
        return []
    lines = ["", "## Where one rank's memory goes (rank 0, the measured step; GiB, resident, process included)", "",
             "| run | length | before the step (model states + process) | forward peak | after forward | backward peak "
             "| after backward |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        phase = r["phases"][0]
        lines.append(f"| {r['mode']} | {r['length']} | " + " | ".join(f"{phase[k] / GIB:.2f}" for k in keys) + " |")
    return lines


def chart(runs: list[dict], path: Path, budget_gib: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for m, (_, _, _, what) in MODES.items():
        done = [r for r in runs if r["mode"] == m and r.get("peaks")]
        if not done:
            continue
        ax.plot([r["length"] for r in done], [max(r["peaks"]) / GIB for r in done], marker="o", label=what)
    ax.axhline(budget_gib, color="grey", linestyle="--", label="budget per rank")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak GiB per rank")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--budget-gib", type=float, default=3.0)
    ap.add_argument("--lengths", default="2048,4096,8192,12288,16384")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--modes", default="whole,tiled,split", help="which ladders, of " + ", ".join(MODES))
    ap.add_argument("--warmup-length", type=int, default=0,
                    help="the first step's tokens (0: the length): it allocates the optimizer state")
    ap.add_argument("--start", default="", help="where a ladder starts, per mode (split=8192,ulysses=8192): "
                    "shorter lengths fit where a longer one does")
    ap.add_argument("--stop-at-budget", action="store_true",
                    help="stop a run as soon as a rank's resident memory passes the budget (default: at 1.3x it, so "
                    "the peak of a run just over the budget is measured)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--sequence-parallel", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tiled-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ulysses", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tiled-mlp", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--packed", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--documents", type=int, default=4, help="documents per packed row (the `_packed` modes)")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    work = Path(tempfile.mkdtemp(prefix="hf_zero-sequence-"))
    runs = []
    start = {m: int(n) for m, n in (x.split("=") for x in args.start.split(",") if x)}
    for mode in args.modes.split(","):
        for length in [int(x) for x in args.lengths.split(",") if int(x) >= start.get(mode, 0)]:
            r = run(args, length, mode, work)
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
        chart(runs, args.out / "sequence.png", args.budget_gib)


if __name__ == "__main__":
    main()
