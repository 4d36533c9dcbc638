"""`make gpu-check`: hf_zero on CUDA + NCCL, checked in one command on the one GPU a session is lent.

    python3 benchmarks/gpu_check.py [--out DIR] [--size full|tiny] [--budget S]      # on the GPU machine
    PIP_NO_INDEX=1 python benchmarks/gpu_check.py --rehearse [--size tiny]            # here, on the CPU

It installs nothing from a network. It runs with the first `python3` it finds whose torch sees a CUDA
GPU (the lent machine's own: torch 2.11, transformers 5.17, accelerate 1.15, no `datasets`); hf_zero
comes from this working tree through `PYTHONPATH`; the wheels under `.whl/` (`make gpu-wheels`, the
pure-Python packages that machine lacks, if any) are installed with `pip --no-index --no-deps` into a
folder of its own. `--rehearse` runs the very same phases on the CPU with this interpreter (gloo in
place of NCCL), so the orchestration, the budgets and the report are tested before device minutes
are spent; `tests/test_gpu_check.py` runs it at `--size tiny`.

Phases, most valuable first, each with its own timeout (its budget, cut to what is left of the whole
run's `--budget`); a failing phase does not stop the next:

1. `env`: the interpreter, the versions, the GPU, NCCL; hf_zero imports from this tree.
2. `single`: a world of one over NCCL: stages 1-3 x fp32/bf16 against plain PyTorch, ZeRO-Offload
   (pinned host masters), `offload_dir`, an async save (pinned snapshot) loaded at another stage,
   consolidated and loaded with `from_pretrained` on the GPU, weights changed in place between steps at ZeRO-2
   bf16, with the masters in memory and offloaded to the host, ZeRO-3 bf16 with each block compiled (inductor)
   against eager (`benchmarks/_gpu_phases.py`).
3. `multi`: two processes sharing the GPU (gloo between them, CUDA compute) at stages 1-3, ZeRO-3 with Liger's
   kernels (triton; the fused linear cross-entropy reads the head's weight without calling the head), and
   sequence parallelism over the two (with `tiled_mlp`).
4. `trainer`: `ZeroTrainer`, ZeRO-3, bf16: checkpoints, a resume that ends where the uninterrupted run
   ended, the final model through `from_pretrained`.
5. `speed`: a 0.94B LLaMA in bf16 at a world of one: PyTorch, FSDP2 and hf_zero ZeRO-3 side by side:
   tokens/s, MFU, `max_memory_allocated` (`benchmarks/_gpu_speed.py`).
6. `example`: the README's main job in miniature as a user runs it: `accelerate launch` of
   `examples/train_clm.py --zero_stage 3 --bf16` with `accelerate_configs/single_gpu.yaml`, `hf-zero
   consolidate`, `from_pretrained` and `generate` on the GPU (`benchmarks/_gpu_example.py`; needs the
   `datasets` wheel from `.whl/`).
7. `profile`: where a step of each speed-phase engine goes (forward, backward, clipping, optimizer step,
   `zero_grad`, each timed between device synchronizations) and hf_zero's most costly operators under
   `torch.profiler` (`benchmarks/_gpu_profile.py`; `profile_ops.txt`).
8. `peers`: the test suite's peer scenarios (DDP idioms: exact against plain data parallelism or refused by
   name) at stages 1-3 with models, batches and engine on the GPU, two ranks sharing it over gloo
   (`benchmarks/_gpu_peers.py`).
9. `io`: `hf_zero.from_pretrained` onto the GPU (against transformers' own, weights equal) and a checkpoint's
   save and load, each beside plain O_DIRECT reads or writes of the same bytes on the machine's disk
   (`benchmarks/_gpu_io.py`).
10. `qlora`: QLoRA with bitsandbytes' CUDA kernels, two ranks sharing the GPU: stages 1-3 against one process,
   and `hf_zero.from_pretrained` quantizing on the GPU as it reads against transformers' 4-bit load
   (`benchmarks/_gpu_qlora.py`; needs the bitsandbytes and peft wheels from `.whl/`).
11. `rank_of_n`: one rank of a large job on the one GPU through torch's fake process group: LLaMA-3-8B, ZeRO-3
   bf16, 4096 tokens, gradient checkpointing, at N = 8 and 64: its peak against `hf-zero estimate` (within 5%) and
   its step's time against the step-time model's (`benchmarks/_gpu_rank_of_n.py`, `benchmarks/rank_of_n.py`).
12. `compiled`: the speed phase's three engines as users who care about speed run them: Liger's kernels (from
   `.whl/`) and regional `torch.compile` of each decoder layer (inductor), the warm-up including the compilation
   (`benchmarks/_gpu_speed.py --compiled`); beside the eager figures in the speed table.

Writes `<out>/report.json` and `<out>/report.md` after every phase (a run cut short still leaves what
it finished; `--out` defaults to `$OUT` where the device tool sets it). Exits 1 when a phase failed or
ran over its budget. Uses only the standard library itself.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
WHEELS = ROOT / ".whl"
WHEELS_PYTHON = "3.12"  # the lent machine's Python, which `make gpu-wheels` downloads for

# Seconds each phase may take, by run: the GPU's (measured on the CPU rehearsal and sized for an H100 with
# process starts of ~10 s) and the tiny CPU rehearsal's (what the CI test runs; the whole under 2 minutes).
BUDGETS = {
    "full": {"wheels": 15, "env": 30, "single": 80, "multi": 90, "trainer": 50, "speed": 110, "example": 110,
             "profile": 60, "peers": 90, "io": 75, "qlora": 60, "rank_of_n": 100,
             "compiled": 120},
    "tiny": {"wheels": 10, "env": 25, "single": 30, "multi": 35, "trainer": 30, "speed": 30, "example": 45,
             "profile": 25, "peers": 30, "io": 25, "qlora": 45, "rank_of_n": 30,
             "compiled": 30},
}
TOTAL_BUDGET = {"full": 540, "tiny": 215}  # the tiny run (the slow-tier test) skips example and profile

ENV_PROBE = r"""
import json, sys, torch
info = {"python": sys.version.split()[0], "executable": sys.executable, "torch": torch.__version__,
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name(0)
    info["gpu_memory_GiB"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    info["bf16_supported"] = torch.cuda.is_bf16_supported()
import transformers, accelerate, safetensors, hf_zero
import hf_zero.integrations.trainer, hf_zero.integrations.accelerate
info.update(transformers=transformers.__version__, accelerate=accelerate.__version__,
            safetensors=safetensors.__version__, hf_zero=hf_zero.__version__, hf_zero_from=hf_zero.__file__)
try:  # only the example phase needs it (from .whl/ on the lent machine)
    import datasets
    info["datasets"] = datasets.__version__
except Exception as e:  # noqa: BLE001 - reported, not fatal here
    info["datasets"] = f"not importable: {type(e).__name__}: {e}"
print("ENV " + json.dumps(info))
want_cuda, root = sys.argv[1] == "cuda", sys.argv[2]
if want_cuda and not torch.cuda.is_available():
    sys.exit("torch sees no CUDA GPU")
if not hf_zero.__file__.startswith(root):
    sys.exit(f"hf_zero was imported from {hf_zero.__file__}, not from this working tree {root}")
"""


@dataclass
class Phase:
    name: str
    budget: float
    ok: bool = False
    seconds: float = 0.0
    timed_out: bool = False
    cases: list[dict[str, object]] = field(default_factory=list)
    tail: str = ""

    @property
    def within_budget(self) -> bool:
        return self.seconds <= self.budget


@dataclass
class Check:
    """The run: where it runs, what it found, and each phase as it ends."""

    mode: str  # "gpu" or "rehearsal (cpu)"
    size: str
    budget: float
    python: str
    out: Path
    wheels: list[str] = field(default_factory=list)  # the wheel files given
    installed: list[str] = field(default_factory=list)  # the distributions the wheels phase installed
    env: dict[str, object] = field(default_factory=dict)
    phases: list[Phase] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.started)

    def write(self) -> None:
        total = round(time.perf_counter() - self.started, 1)
        record = {"mode": self.mode, "size": self.size, "budget_s": self.budget, "total_s": total,
                  "wheels": self.wheels, "installed": self.installed,
                  "python": self.python, "env": self.env, "phases": [asdict(p) | {"within_budget": p.within_budget}
                                                                     for p in self.phases]}
        _atomic(self.out / "report.json", json.dumps(record, indent=1) + "\n")
        _atomic(self.out / "report.md", render(record))


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def render(record: dict) -> str:
    """The report as Markdown: versions, the phases' table, each case, the speed table, failing tails."""
    env = record["env"]
    lines = [f"# hf_zero GPU check ({record['mode']}, size {record['size']})", "",
             f"- device: {env.get('gpu', 'cpu')} ({env.get('gpu_memory_GiB', '-')} GiB), CUDA {env.get('cuda')}, "
             f"NCCL {env.get('nccl', '-')}",
             f"- python {env.get('python')} ({record['python']}); torch {env.get('torch')}, transformers "
             f"{env.get('transformers')}, accelerate {env.get('accelerate')}, safetensors {env.get('safetensors')}, "
             f"datasets {env.get('datasets')}",
             f"- hf_zero {env.get('hf_zero')} from {env.get('hf_zero_from')}; wheels from .whl/: "
             f"{', '.join(record['wheels']) or 'none'}",
             f"- total {record['total_s']} s of a {record['budget_s']} s budget", "",
             "| phase | result | seconds | budget |", "|---|---|---|---|"]
    for p in record["phases"]:
        result = "ok" if p["ok"] else ("TIMED OUT" if p["timed_out"] else "FAILED")
        lines.append(f"| {p['name']} | {result} | {p['seconds']:.1f} | {p['budget']:.0f}"
                     f"{'' if p['within_budget'] else ' (over)'} |")
    for p in record["phases"]:
        if not p["cases"]:
            continue
        lines += ["", f"## {p['name']}", "", "| case | result | seconds | figures |", "|---|---|---|---|"]
        for c in p["cases"]:
            figures = ", ".join(f"{k}={_short(v)}" for k, v in c["figures"].items())
            lines.append(f"| {c['name']} | {'ok' if c['ok'] else 'FAILED'} | {c['seconds']} | {figures} |")
    lines += speed_table(record)
    for p in record["phases"]:
        if not p["ok"]:
            lines += ["", f"## {p['name']}: output tail", "", "```", p["tail"].strip()[-3000:], "```"]
    return "\n".join(lines) + "\n"


def _short(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def speed_table(record: dict) -> list[str]:
    """The speed phase's engines and the compiled phase's (labelled), each against eager PyTorch's tokens/s."""
    rows = [(c["name"] + ("" if p["name"] == "speed" else " + compiled"), c["figures"]) for p in record["phases"]
            if p["name"] in ("speed", "compiled") for c in p["cases"] if "tokens_per_s" in c["figures"]]
    if not rows:
        return []
    base = rows[0][1]["tokens_per_s"]
    lines = ["", "## speed, side by side", "", "| engine | tokens/s | vs PyTorch | MFU | max allocated (GiB) | "
             "first loss | last loss |", "|---|---|---|---|---|---|---|"]
    for name, f in rows:
        lines.append(f"| {name} | {f['tokens_per_s']} | {f['tokens_per_s'] / base:.3f} | {f.get('mfu', '-')} | "
                     f"{f.get('max_memory_allocated_GiB', '-')} | {f['first_loss']} | {f['last_loss']} |")
    return lines


def run_phase(check: Check, name: str, cmd: list[str], env: dict[str, str]) -> Phase:
    """Run one phase with its budget (cut to what is left of the whole), kill its process group on timeout,
    read the cases it recorded, and write the report."""
    budget = BUDGETS[check.size][name]
    phase = Phase(name, budget)
    timeout = max(1.0, min(budget, check.left()))
    print(f"[gpu-check] {name} (budget {budget} s): {' '.join(cmd)}", flush=True)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        phase.ok = proc.returncode == 0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        phase.timed_out = True
        output += f"\n[gpu-check] {name} killed after {timeout:.0f} s"
    phase.seconds = round(time.perf_counter() - started, 1)
    phase.tail = output[-6000:]
    record = check.out / f"{name}.json"
    if record.is_file():
        phase.cases = json.loads(record.read_text())["cases"]
    if name == "env":
        line = next((x for x in output.splitlines() if x.startswith("ENV ")), None)
        check.env = json.loads(line[4:]) if line else {}
    check.phases.append(phase)
    check.write()
    verdict = "ok" if phase.ok else "TIMED OUT" if phase.timed_out else "FAILED"
    print(f"[gpu-check] {name}: {verdict} in {phase.seconds:.1f} s", flush=True)
    if not phase.ok:
        print(phase.tail[-3000:], flush=True)
    return phase


def find_python(explicit: str | None, rehearse: bool) -> str | None:
    """The interpreter to run the phases: `explicit`, else this one or the first `python3` on the PATH whose
    torch sees a CUDA GPU (rehearsal: this interpreter, which must import torch)."""
    candidates = [explicit] if explicit else [sys.executable, shutil.which("python3")]
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"
    for python in filter(None, candidates):
        if rehearse:
            return python
        try:
            if subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0:
                return python
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


def python_version(python: str) -> str:
    done = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                          text=True)
    return done.stdout.strip()


def phase_commands(python: str, device: str, size: str, out: Path, site: Path,
                   wheels: list[str]) -> list[tuple[str, list[str]]]:
    torchrun = [python, "-m", "torch.distributed.run", "--standalone"]
    install = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
               "--upgrade", "--target", str(site), "--python-version", WHEELS_PYTHON, "--only-binary=:all:", *wheels]
    phases = [("wheels", install)] if wheels else []
    speed_size = "full" if size == "full" and device == "cuda" else ("cpu" if size == "full" else "tiny")
    common = ["--device", device, "--out", str(out)]
    return phases + [
        ("env", [python, "-c", ENV_PROBE, device, str(ROOT)]),
        ("single", torchrun + ["--nproc_per_node", "1", str(BENCH / "_gpu_phases.py"), "single", "--size", size,
                               *common]),
        ("multi", torchrun + ["--nproc_per_node", "2", str(BENCH / "_gpu_phases.py"), "multi", "--size", size,
                              *common]),
        ("trainer", torchrun + ["--nproc_per_node", "1", str(BENCH / "_gpu_phases.py"), "trainer", "--size", size,
                                *common]),
        ("speed", torchrun + ["--nproc_per_node", "1", str(BENCH / "_gpu_speed.py"), "--size", speed_size, *common]),
        ("example", [python, str(BENCH / "_gpu_example.py"), "--size", size, *common]),
        ("profile", torchrun + ["--nproc_per_node", "1", str(BENCH / "_gpu_profile.py"), "--size", speed_size,
                                *common]),
        ("peers", torchrun + ["--nproc_per_node", "2", str(BENCH / "_gpu_peers.py"), "--size", size, *common]),
        ("io", torchrun + ["--nproc_per_node", "1", str(BENCH / "_gpu_io.py"), "--size", size, *common]),
        ("qlora", torchrun + ["--nproc_per_node", "2", str(BENCH / "_gpu_qlora.py"), "--size", size, *common]),
        ("rank_of_n", [python, str(BENCH / "_gpu_rank_of_n.py"), "--size", size, *common]),
        ("compiled", torchrun + ["--nproc_per_node", "1", str(BENCH / "_gpu_speed.py"), "--size", speed_size,
                                 "--compiled", *common]),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rehearse", action="store_true", help="run every phase on the CPU here (gloo)")
    ap.add_argument("--size", choices=sorted(BUDGETS), default=None, help="full (default) or tiny (the CI test)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "outputs" / "gpu_check"))
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default: the size's)")
    ap.add_argument("--python", default=None, help="the interpreter to run the phases with")
    ap.add_argument("--wheels", default=str(WHEELS), help="folder of wheels to install first (make gpu-wheels)")
    ap.add_argument("--skip", default="", help="comma-separated phases not to run (e.g. example)")
    args = ap.parse_args()
    skip = {name.strip() for name in args.skip.split(",") if name.strip()}
    size = args.size or "full"
    python = find_python(args.python, args.rehearse)
    if python is None:
        print("gpu-check: no python3 here has a torch that sees a CUDA GPU, so there is nothing to check; "
              "`--rehearse` runs the same phases on the CPU.")
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.json"), out / "report.md"]:
        stale.unlink(missing_ok=True)
    wheels = sorted(glob.glob(str(Path(args.wheels) / "*.whl")))
    check = Check(mode="rehearsal (cpu)" if args.rehearse else "gpu", size=size,
                  budget=args.budget or TOTAL_BUDGET[size], python=python, out=out,
                  wheels=[Path(w).name for w in wheels])
    site = Path(tempfile.mkdtemp(prefix="hf_zero_gpu_site_"))
    # The wheels are for the lent machine's Python: an interpreter of another version (a rehearsal here) installs
    # them, which checks the folder and the command, but imports its own copies.
    paths = [str(ROOT)] + ([str(site)] if python_version(python) == WHEELS_PYTHON else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PIP_NO_INDEX": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           # host threads per process: the rehearsal's 2 cores are shared by 2 ranks; the GPU machine has 16
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if args.rehearse else "4")}
    env.pop("ACCELERATE_USE_CPU", None)
    device = "cpu" if args.rehearse else "cuda"
    for name, cmd in phase_commands(python, device, size, out, site, wheels):
        if name in skip:
            continue
        phase = run_phase(check, name, cmd, env)
        if name == "wheels":
            check.installed = sorted(d.name for d in site.glob("*.dist-info"))
            check.write()
        if name in ("wheels", "env") and not phase.ok:
            break  # nothing else can run without them
    shutil.rmtree(site, ignore_errors=True)
    failed = [p.name for p in check.phases if not (p.ok and p.within_budget)]
    print(f"[gpu-check] report: {out / 'report.md'}; total {time.perf_counter() - check.started:.0f} s"
          + (f"; FAILED or over budget: {', '.join(failed)}" if failed else "; all passed within budget"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
