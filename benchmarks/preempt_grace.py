"""How much preemption grace a job needs: signal -> checkpoint committed -> job gone, measured end to end.

    python benchmarks/preempt_grace.py --size demo --out benchmarks/results
    python benchmarks/preempt_grace.py --size 0.84b --out benchmarks/results   # fp32 on an AVX2-only CPU

The job is the one a user runs: `hf-zero preemptible RUN -- accelerate launch --config_file
accelerate_configs/cpu_2proc.yaml examples/train_clm.py ... --zero_stage 3 --zero_save_on_preemption`, 2 ranks,
on the demo's corpus and tokenizer (`make demo` makes them; `--assets`). `demo` trains the demo's base model;
`0.84b` a LLaMA with TinyLlama's shapes and 16 layers, written once as a from_pretrained folder (fp32, random
weights, `--model-cache`). After `--after-steps` logged steps SIGTERM goes to rank 1 alone (as Slurm's `--signal`
reaches one task first); the driver then polls the run folder every 20 ms. Reported, from the signal:

- `save started`: the Trainer made `checkpoint-N/` (the step in progress when the signal came is done);
- `state committed`: `checkpoint-N/hf_zero/hf_zero_manifest.json` is there (the sharded state's commit);
- `checkpoint complete`: the Trainer's `trainer_state.json` too (what a resume looks for);
- `marker`: `hf_zero_preempted.json` appears (written after the commit);
- `gone`: the wrapper has exited (every rank and the launcher are gone); its exit code must be 75.

With the step time (between logged steps before the signal) and the checkpoint's bytes, so the grace formula in
docs/failures.md can be checked against the measurement: results in OUT/preempt_grace_SIZE.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "examples"))
import _quiet  # noqa: E402, F401 - first: silences optional packages' import-time notes
from _capacity_model import SHAPE, n_params  # noqa: E402

TAG = "HF_ZERO_GRACE_RUN"  # set in the job's environment: how the driver finds the ranks among all processes


def _big_model(cache: Path, layers: int) -> Path:
    """The 0.84B from_pretrained folder (fp32 safetensors), written once."""
    if (cache / "model.safetensors.index.json").exists() or (cache / "model.safetensors").exists():
        return cache
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tmp = cache.with_name(cache.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **SHAPE)).save_pretrained(tmp)
    tmp.rename(cache)
    return cache


def _rank_pid(run_id: str, rank: int) -> int | None:
    """The pid of the job's rank `rank` (a process whose environment holds our tag and RANK=rank)."""
    want = {f"{TAG}={run_id}".encode(), f"RANK={rank}".encode()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = set((entry / "environ").read_bytes().split(b"\0"))
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if want <= env and b"train_clm.py" in cmd:
            return int(entry.name)
    return None


def _alive(pid: int | None) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _command(args: argparse.Namespace, model: Path, run: Path) -> list[str]:
    bin_dir = Path(sys.executable).parent
    assets = Path(args.assets)
    held_out = assets / "corpus/held_out.jsonl"
    if args.size != "demo":  # the example evaluates before training: a few records, not minutes of 0.84B forwards
        lines = held_out.read_text().splitlines(keepends=True)[:2]
        held_out = run.with_name("held_out_few.jsonl")
        held_out.write_text("".join(lines))
    return [str(bin_dir / "hf-zero"), "preemptible", str(run), "--",
            str(bin_dir / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs/cpu_2proc.yaml"),
            "--num_cpu_threads_per_process", str(args.threads), str(ROOT / "examples/train_clm.py"),
            "--model_name_or_path", str(model), "--tokenizer_name", str(assets / "base"),
            "--train_files", str(assets / "corpus/train.jsonl"), "--validation_files",
            str(held_out), "--block_size", str(args.block_size), "--output_dir", str(run),
            "--zero_stage", "3", "--zero_save_on_preemption", "--per_device_train_batch_size", str(args.batch),
            "--max_steps", "100000", "--save_steps", "100000", "--logging_steps", "1", "--eval_strategy", "no",
            "--seed", "42", "--report_to", "none", "--use_cpu", "--disable_tqdm", "true"]


def _watch(proc: subprocess.Popen, steps: list[float], log: list[str]) -> None:
    for line in proc.stdout:  # type: ignore[union-attr]
        log.append(line)
        if re.search(r"'loss': ", line):
            steps.append(time.monotonic())


def measure(args: argparse.Namespace) -> dict:
    run = Path(args.work) / f"run_{args.size}"
    shutil.rmtree(run, ignore_errors=True)
    run.parent.mkdir(parents=True, exist_ok=True)
    model = Path(args.assets) / "base" if args.size == "demo" else _big_model(Path(args.model_cache), args.layers)
    run_id = f"{os.getpid()}-{time.time_ns()}"
    env = {**os.environ, TAG: run_id, "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.Popen(_command(args, model, run), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    steps: list[float] = []
    log: list[str] = []
    threading.Thread(target=_watch, args=(proc, steps, log), daemon=True).start()
    try:
        while len(steps) < args.after_steps:
            if proc.poll() is not None:
                raise RuntimeError("the job ended before the signal:\n" + "".join(log[-40:]))
            time.sleep(0.05)
        pids = [_rank_pid(run_id, rank) for rank in (0, 1)]
        if None in pids:
            raise RuntimeError("the job's ranks were not found under /proc")
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGTERM)  # type: ignore[arg-type]
        marks: dict[str, float] = {}
        while proc.poll() is None:
            now = time.monotonic()
            for mark, path in (("save started", ""), ("state committed", "hf_zero/hf_zero_manifest.json"),
                               ("checkpoint complete", "trainer_state.json")):
                if mark not in marks and any((p / path).exists() for p in run.glob("checkpoint-*")):
                    marks[mark] = now - t0
            if "marker" not in marks and (run / "hf_zero_preempted.json").exists():
                marks["marker"] = now - t0
            if "ranks gone" not in marks and not any(_alive(p) for p in pids):
                marks["ranks gone"] = now - t0
            time.sleep(0.02)
        marks["gone"] = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    marker = json.loads((run / "hf_zero_preempted.json").read_text())
    checkpoint = run / marker["checkpoint"]
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b <= t0]
    result = {
        "size": args.size, "parameters": n_params(args.layers) if args.size != "demo" else _count(model),
        "dtype": "fp32", "ranks": 2, "exit_code": proc.returncode,
        "step_s": sorted(gaps)[len(gaps) // 2] if gaps else None,
        "checkpoint_gb": sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()) / 1e9,
        "stopped_at": marker["step"], "signal_to_s": marks,
    }
    if not args.keep:
        shutil.rmtree(run, ignore_errors=True)
    return result


def _count(model: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n = 1
                for d in st.get_slice(k).get_shape():
                    n *= d
                total += n
    return total


def report(results: list[dict], command: str) -> str:
    r = results[0]
    marks = ("save started", "state committed", "checkpoint complete", "marker", "ranks gone", "gone")
    head = " | ".join(f"signal -> {k} (s)" for k in marks)
    rows = []
    for x in results:
        m = x["signal_to_s"]
        step = f"{x['step_s']:.2f}" if x["step_s"] is not None else "n/a"
        cells = " | ".join(f"{m[k]:.2f}" if k in m else "not seen" for k in marks)
        rows.append(f"| {step} | {x['checkpoint_gb']:.2f} | {cells} | {x['stopped_at']} | {x['exit_code']} |")
    return (f"# Preemption grace: {r['size']} ({r['parameters'] / 1e9:.3f}B parameters, {r['dtype']}, "
            f"{r['ranks']} ranks, ZeRO-3, this machine)\n\n"
            f"| step (s) | checkpoint (GB) | {head} | stopped at step | exit code |\n|{'---|' * (len(marks) + 4)}\n"
            + "\n".join(rows) + "\n\n"
            f"One row per run. SIGTERM to rank 1 alone after {r['after_steps']} logged steps. `gone`: the wrapper "
            f"`hf-zero preemptible` has exited. Command: `{command}`.\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["demo", "0.84b"], default="demo")
    ap.add_argument("--assets", default=str(ROOT / "outputs/demo"), help="what `make demo` made (corpus, base)")
    ap.add_argument("--model-cache", default=str(ROOT / "outputs/grace_0.84b"))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--work", default=str(ROOT / "outputs/grace"))
    ap.add_argument("--after-steps", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="runs, one table row each")
    ap.add_argument("--keep", action="store_true", help="keep the run folder")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.batch is None:
        args.batch = 8 if args.size == "demo" else 1
    results = []
    for _ in range(args.repeats):
        results.append({**measure(args), "after_steps": args.after_steps})
    command = " ".join(["python benchmarks/preempt_grace.py", *sys.argv[1:]])
    text = report(results, command)
    print(text)
    if args.out:
        out = Path(args.out)
        (out / f"preempt_grace_{args.size}.json").write_text(json.dumps(results, indent=2) + "\n")
        (out / f"preempt_grace_{args.size}.md").write_text(text)


if __name__ == "__main__":
    main()
