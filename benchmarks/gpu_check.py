"""`make gpu-check`: the CUDA + NCCL path, checked in one command on a machine with NVIDIA GPUs.

    python3 benchmarks/gpu_check.py [--venv .venv-cuda] [--torch "torch==2.13.0"] [--out outputs/gpu_check]

On a machine without a CUDA GPU it says so and exits 0 (nothing to check). Otherwise it:

1. creates `--venv` (kept apart from the CPU `.venv`) with the CUDA build of the pinned torch
   (`--torch`, the pip requirement; on Linux x86-64 PyPI's `torch==2.13.0` is the CUDA build, pass
   e.g. `"torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"` for another CUDA) and
   hf_zero with its `dev` and `bench` extras;
2. runs the parity demo under `torchrun --nproc_per_node <gpus>` at ZeRO-1/2/3 in fp32 (losses
   within 1e-5 of unsharded training) and bf16;
3. runs the device-agnostic tests (parity, checkpoints, the Trainer, bf16/fp16 against fp32, CPU
   offload, hybrid sharding) with
   `HF_ZERO_TEST_DEVICE=cuda`: every rank on the GPU of its LOCAL_RANK, NCCL between them; a test
   that needs more ranks than there are GPUs is skipped and counted;
4. runs the benchmark beside DDP, FSDP2 and DeepSpeed with `--device cuda`;

and writes `<out>/report.md` (GPUs, versions, each phase's result, time and output tail, the
benchmark table). Exits non-zero when any phase fails. Uses only the standard library itself.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/test_placement.py", "tests/test_parity.py", "tests/test_checkpoint.py", "tests/test_trainer.py",
         "tests/test_precision_and_lifecycle.py", "tests/test_offload.py", "tests/test_hybrid.py",
         "tests/test_disk_offload.py"]


@dataclass
class Phase:
    name: str
    ok: bool
    seconds: float
    tail: str


def visible_gpus() -> list[str]:
    """GPU names from `nvidia-smi -L` (empty without a driver or GPU); CUDA_VISIBLE_DEVICES is respected."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = [line.strip() for line in done.stdout.splitlines() if line.startswith("GPU ")] if done.returncode == 0 else []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and gpus:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        gpus = [g for i, g in enumerate(gpus) if str(i) in wanted or any(w in g for w in wanted)]
    return gpus


def run(name: str, cmd: list[str], env: dict[str, str], timeout: int, phases: list[Phase]) -> Phase:
    print(f"[gpu-check] {name}: {' '.join(cmd)}", flush=True)
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        ok, output = done.returncode == 0, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        ok, output = False, f"timed out after {timeout} s\n{(e.stdout or b'')[-4000:]!r}"
    phase = Phase(name, ok, time.perf_counter() - started, output[-4000:])
    phases.append(phase)
    print(f"[gpu-check] {name}: {'ok' if ok else 'FAILED'} in {phase.seconds:.0f} s", flush=True)
    if not ok:
        print(phase.tail, flush=True)
    return phase


def install(venv: Path, torch_spec: str, phases: list[Phase]) -> Path | None:
    python = venv / "bin" / "python"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    if not python.exists():
        if not run("create venv", [sys.executable, "-m", "venv", str(venv)], env, 600, phases).ok:
            return None
    if not run("install CUDA torch", [str(python), "-m", "pip", "install", "-q", *torch_spec.split()], env, 3600, phases).ok:
        return None
    if not run("install hf_zero", [str(python), "-m", "pip", "install", "-q", "-e", ".[dev,bench]"], env, 3600, phases).ok:
        return None
    probe = run("torch sees CUDA", [str(python), "-c", "import torch, sys; print(torch.__version__, torch.version.cuda, "
                                   "torch.cuda.nccl.version(), torch.cuda.device_count()); "
                                   "sys.exit(0 if torch.cuda.is_available() else 1)"], env, 600, phases)
    if not probe.ok:
        probe.tail += (f"\nThe installed torch has no CUDA. Pass the CUDA build: make gpu-check "
                       f"CUDA_TORCH_SPEC=\"torch==2.13.0 --index-url https://download.pytorch.org/whl/<cuda tag>\"")
        return None
    return python


def report(out: Path, gpus: list[str], phases: list[Phase], bench_md: Path) -> None:
    lines = ["# hf_zero GPU check", "", f"GPUs ({len(gpus)}):", *[f"- {g}" for g in gpus], "",
             "| phase | result | seconds |", "|---|---|---|"]
    lines += [f"| {p.name} | {'ok' if p.ok else 'FAILED'} | {p.seconds:.0f} |" for p in phases]
    for p in phases:
        lines += ["", f"## {p.name}", "", "```", p.tail.strip()[-2500:], "```"]
    if bench_md.is_file():
        lines += ["", "## benchmark", "", bench_md.read_text()]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=str(ROOT / ".venv-cuda"))
    ap.add_argument("--torch", default="torch==2.13.0", help="pip requirement (and options) of the CUDA torch")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "gpu_check"))
    ap.add_argument("--preset", default="small", help="benchmark preset")
    args = ap.parse_args()

    gpus = visible_gpus()
    if not gpus:
        print("gpu-check: no CUDA GPU on this machine (nvidia-smi lists none), so there is nothing to check here; "
              "the CPU + gloo path is what `make test` checks.")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"[gpu-check] {len(gpus)} GPU(s): " + "; ".join(gpus), flush=True)
    phases: list[Phase] = []
    python = install(Path(args.venv), args.torch, phases)
    if python is not None:
        n = str(len(gpus))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "4"}
        env.pop("ACCELERATE_USE_CPU", None)
        torchrun = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", n]
        if len(gpus) >= 2:
            for stage in (1, 2, 3):
                run(f"parity demo ZeRO-{stage} fp32 ({n} GPUs)", torchrun + ["examples/zero_parity_demo.py",
                    "--zero_stage", str(stage), "--max_rel_diff", "1e-5"], env, 1200, phases)
            run(f"parity demo ZeRO-3 bf16 ({n} GPUs)", torchrun + ["examples/zero_parity_demo.py", "--zero_stage", "3",
                "--mixed_precision", "bf16", "--max_rel_diff", "3e-2"], env, 1200, phases)
        else:
            print("[gpu-check] one GPU: the multi-rank parity demo and most tests need 2 (NCCL: one GPU per rank)")
        run("device-agnostic tests on CUDA + NCCL", [str(python), "-m", "pytest", "-q", "-rs", "-m", "device_agnostic",
            *TESTS], {**env, "HF_ZERO_TEST_DEVICE": "cuda"}, 5400, phases)
        if len(gpus) >= 2:
            run("benchmark (DDP, FSDP2, DeepSpeed, hf_zero)", [str(python), "benchmarks/bench.py", "--device", "cuda",
                "--preset", args.preset, "--rounds", "2", "--steps", "10", "--threads", "4", "--out", str(out)],
                env, 5400, phases)
    report(out, gpus, phases, out / f"{args.preset}.md")
    failed = [p.name for p in phases if not p.ok]
    print(f"[gpu-check] report: {out / 'report.md'}" + (f"; FAILED: {', '.join(failed)}" if failed else "; all passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
