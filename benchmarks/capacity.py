"""Capacity: the largest LLaMA each engine trains (2 steps, bf16 mixed precision, AdamW) and checkpoints
once, on 2 ranks within a per-rank memory budget this script enforces.

    python benchmarks/capacity.py --out benchmarks/results                      # the ladder, every engine
    python benchmarks/capacity.py --compare 16 --steps 4 --out benchmarks/results  # 0.84B: memory vs disk

Models: LLaMA with hidden 2048, intermediate 5632, 32 heads, 4 KV heads, vocabulary 32000 (TinyLlama's
shapes) and L layers: 0.13B + 44.0M x L parameters (L=16: 0.84B, L=22: 1.10B, L=66: 3.04B). Each rank
trains one sequence of 128 tokens per step. Engines:
- `ddp`: DDP, fp32 weights under `torch.autocast(bfloat16)`, the model loaded whole on every rank;
  its checkpoint is rank 0's `torch.save` of the model and optimizer state dicts.
- `fsdp2`: as Accelerate's FSDP2 plugin sets it up (`_peers.fsdp2_setup`: `fully_shard` per decoder layer and
  the root, `MixedPrecisionPolicy(bf16, bf16, bf16)`), built on the meta device and initialized shard by shard;
  checkpoint: `torch.distributed.checkpoint.save`. `fsdp2_reduce_fp32`: the same with the plugin's
  `mixed_precision_policy` reducing in fp32 (the setting of the README's current FSDP2 row).
- `ds3`: DeepSpeed ZeRO-3 (bf16) as the HF Trainer configures it (`_peers.deepspeed_config`, the documented
  ZeRO-3 file with "auto" filled from the model), built under `deepspeed.zero.Init`; checkpoint: its
  `save_checkpoint`. `ds3_raw`: DeepSpeed's own defaults (`{"stage": 3}`): larger buckets, fewer collectives.
  `ds3_nvme`: ZeRO-Infinity as documented: parameters and optimizer state on NVMe (`aio`), DeepSpeedCPUAdam.
  `ds3_nvme_lean`: the same with the documented memory knobs turned down (`sub_group_size`, `max_in_cpu` 1e8).
  Each run records its peer's configuration (`peer_config`).
- `hf_zero3`: hf_zero ZeRO-3 in memory, loaded with `hf_zero.from_pretrained` (each rank reads its slices);
  `hf_zero3_disk`: the same with `offload_optimizer=True, offload_dir=...`; `hf_zero3_disk_params`: with
  `offload_params=True` too (no parameter shard kept: gathers read the master file). Checkpoint: `save_checkpoint`.
Every run is a fresh `torchrun` job. The script polls every rank's resident set (VmRSS) 20 times a second
and kills the job as soon as one rank passes the per-rank budget (9 GiB) or the job's processes together pass
18 GiB (counted as proportional set sizes, so that pages a forked helper shares with its rank count once): a
size that does not fit fails cleanly, long before the kernel's OOM killer would act (2 x 9 GiB of a
24 GiB machine leaves room for the system, the page cache and the benchmark itself). Peak resident memory (VmHWM) is reported as it is, process
baseline included, for training and for the save separately.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _capacity_model import GIB, SEQ, SHAPE, hf_config, n_params

HERE = Path(__file__).resolve().parent
# Layer counts each engine tries, in order, until the first that does not fit: one smaller size, then the
# largest that fit and the next one of the finer ladders run before (git history of this file), so one run
# compares every engine at its limit within about an hour.
PLAN = {"ddp": [4, 6, 8], "fsdp2": [12, 16, 17, 18], "fsdp2_reduce_fp32": [12, 16, 17], "ds3_raw": [4, 8, 10],
        "ds3": [4, 8, 10],
        "ds3_nvme": [4, 8, 10],  # DeepSpeed's AIO op needs libaio-dev: `ensure_libaio` installs it
        "ds3_nvme_lean": [4, 8, 16],
        "hf_zero3": [16, 20, 21], "hf_zero3_disk": [32, 52, 55],
        "hf_zero3_disk_params": [52, 66]}  # 66 layers (3.04B) is what this disk holds: offload files + checkpoint
# fp32 (`--precision fp32`, for CPUs without bf16 matrix instructions): no bf16 copies anywhere, so DDP and FSDP2
# hold their fp32 weights whole / gathered; `fsdp2_reduce_fp32` is `fsdp2` there and is not run.
PLAN_FP32 = {"ddp": [4, 6, 8], "fsdp2": [12, 16, 18], "ds3_raw": [4, 8, 12], "ds3": [4, 6, 8, 10, 12],
             "ds3_nvme": [4, 8, 16, 32], "ds3_nvme_lean": [8, 12, 16], "hf_zero3": [16, 19, 20, 21],
             "hf_zero3_disk": [32, 40, 44, 48],
             "hf_zero3_disk_params": [52, 66]}
ENGINES = list(PLAN)
# `--qlora` (benchmarks/_capacity_qlora.py): LoRA on a 4-bit base, against hf_zero's LoRA on the unquantized base
PLAN_QLORA = {"hf_zero3_lora": [76, 80, 84], "fsdp_qlora": [320, 384], "hf_zero3_qlora": [480, 528],
              "ds3_qlora": [256, 320]}


# ---- the driver ---------------------------------------------------------------------------------

def write_weights(layers: int, directory: Path) -> None:
    """A `save_pretrained`-style directory of random bf16 weights, written one tensor at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_zero.checkpoint.stream import Entry, write_streamed

    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config(layers)
    config.torch_dtype = "float32"
    config.save_pretrained(directory)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)

    def values(name: str, shape: tuple[int, ...]):  # noqa: ANN202
        def pieces():  # noqa: ANN202
            if name.endswith("norm.weight"):
                yield torch.ones(shape, dtype=torch.bfloat16)
            else:
                yield torch.empty(shape).normal_(0.0, 0.02, generator=g).to(torch.bfloat16)
        return pieces

    entries = [Entry(k, torch.bfloat16, s, values(k, s)) for k, s in shapes.items()]
    write_streamed(directory / "model.safetensors", entries, {"format": "pt"})


def run_job(engine: str, layers: int, weights: Path, work: Path, budget: int, total_budget: int, steps: int,
            timeout: int, drop_weights: bool, precision: str = "bf16") -> dict:
    out = work / f"{engine}-{layers}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--worker", "--engine", engine, "--layers", str(layers), "--weights", str(weights), "--work", str(work),
           "--steps", str(steps), "--result", str(out), "--precision", precision]
    cmd += ["--drop-weights"] if drop_weights else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent), "HF_HUB_OFFLINE": "1"}
    if engine.startswith("ds"):
        env["DS_ACCELERATOR"] = "cpu"
    log = work / f"{engine}-{layers}.log"
    started = time.time()
    with open(log, "w") as f:
        job = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        peak, over = 0, None
        while job.poll() is None:
            rss = _tree_rss(job.pid)
            peak = max([peak, *rss.values()])
            if any(v > budget for v in rss.values()) or (
                sum(rss.values()) > total_budget and sum(_pss(pid) for pid in rss) > total_budget
            ):
                over = max(rss.values())
                _kill(job)
                break
            if time.time() - started > timeout:
                _kill(job)
                return {"engine": engine, "layers": layers, "ok": False, "why": f"timeout after {timeout}s"}
            time.sleep(0.05)
    time.sleep(1)  # the ranks are gone; their files may still be closing
    shutil.rmtree(work / "ckpt", ignore_errors=True)
    shutil.rmtree(work / "offload", ignore_errors=True)
    if over is not None:
        phases = [line for line in log.read_text().splitlines() if line.startswith("[capacity phase]")]
        phase = phases[-1].split("] ", 1)[1] if phases else "start"
        return {"engine": engine, "layers": layers, "ok": False, "why": f"over budget ({over / GIB:.2f} GiB) in {phase}",
                "polled_peak_gib": peak / GIB}
    if job.returncode != 0 or not out.exists():
        tail = log.read_text()[-1500:]
        return {"engine": engine, "layers": layers, "ok": False, "why": f"exit {job.returncode}", "log_tail": tail}
    result = json.loads(out.read_text())
    result.update(ok=True, polled_peak_gib=peak / GIB, wall_s=time.time() - started)
    return result


def _kill(job: subprocess.Popen) -> None:
    """Kill the launcher and every rank: torchrun starts each rank in a session of its own, so killing the
    launcher's process group alone would leave the ranks running."""
    ranks = list(_tree_rss(job.pid))
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    while any(os.path.exists(f"/proc/{pid}") and not _zombie(pid) for pid in ranks):
        time.sleep(0.1)


def _pss(pid: int) -> int:
    """Proportional resident bytes of a process: pages shared with others (a forked child's copy-on-write pages,
    which its RSS counts in full again) counted once across the processes that share them."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _tree_rss(root: int) -> dict[int, int]:
    """Resident bytes of every descendant of `root` (the ranks under torchrun)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/statm") as f:
                out[pid] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
    return out


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX-512 BF16 or AMX): without them torch's bf16 matmul
    takes a reference path and a step of this ladder's sizes takes minutes (measured: a 0.22B step of FSDP2 or
    DeepSpeed did not finish 2 steps in 5 minutes on an AVX2-only EPYC)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def ensure_libaio() -> None:
    """DeepSpeed's `async_io` op (ZeRO-Infinity's NVMe path) compiles against libaio: install `libaio-dev` with
    apt when it is missing and this process may (root), else say what to run."""
    if Path("/usr/include/libaio.h").exists():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SystemExit("ds3_nvme needs libaio's headers for DeepSpeed's async_io op: run "
                         "`sudo apt-get install -y libaio-dev` (or drop ds3_nvme from --engines)")
    print("installing libaio-dev for DeepSpeed's async_io op (ds3_nvme)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "libaio-dev"], check=True, env=env)


def disk_bandwidth(directory: Path, nbytes: int = 4 * GIB) -> dict:
    """Sequential write (fsync'd) and read (page cache dropped with posix_fadvise) of one file, in GB/s."""
    path = directory / "bandwidth.bin"
    block = os.urandom(1 << 26)
    start = time.time()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write = nbytes / (time.time() - start)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    start = time.time()
    while os.read(fd, 1 << 26):
        pass
    read = nbytes / (time.time() - start)
    os.close(fd)
    path.unlink()
    return {"write_gb_s": write / 1e9, "read_gb_s": read / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", default="hf_zero3")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ladder", default=None, help="layer counts every engine tries, in order (default: PLAN)")
    ap.add_argument("--compare", type=int, default=None, help="only run hf_zero3 and hf_zero3_disk at this depth")
    ap.add_argument("--budget-gib", type=float, default=9.0, help="resident memory allowed per rank")
    ap.add_argument("--total-budget-gib", type=float, default=18.0, help="resident memory allowed to both ranks")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                    help="bf16: every engine's mixed precision (needs a CPU with bf16 matrix instructions to run at "
                         "speed); fp32: no mixed precision anywhere (results go to capacity_fp32.*)")
    ap.add_argument("--qlora", action="store_true",
                    help="LoRA on a 4-bit base (NF4) for hf_zero and the peers' QLoRA setups, and LoRA on the "
                         "unquantized base for hf_zero (results go to capacity_qlora*)")
    ap.add_argument("--timeout", type=int, default=2400)
    ap.add_argument("--weights", default=None)
    ap.add_argument("--work", default=None, help="scratch folder (weights, offload files, checkpoints)")
    ap.add_argument("--drop-weights", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--report-from", nargs="+", default=None, metavar="JSON",
                    help="only write the report of these runs' JSON files, merged (e.g. engines run separately)")
    args = ap.parse_args()
    if args.worker:
        from _capacity_worker import work

        return work(args)
    if args.report_from:
        from _capacity_report import write_report

        reports = [json.loads(Path(p).read_text()) for p in args.report_from]
        merged = {**reports[0], "runs": [r for rep in reports for r in rep["runs"]],
                  "disk_all": [d for rep in reports for d in rep.get("disk_all", [rep["disk"]])]}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = ("capacity_compare" if args.compare else "capacity_qlora" if args.qlora else "capacity") + (
            "_fp32" if merged.get("precision") == "fp32" else "")
        (Path(args.out) / f"{name}.json").write_text(json.dumps(merged, indent=1))
        return write_report(merged, Path(args.out), name)
    work_dir = Path(args.work or tempfile.mkdtemp(prefix="hf_zero_capacity-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    budget = int(args.budget_gib * GIB)
    name = ("capacity_compare" if args.compare else "capacity_qlora" if args.qlora else "capacity") + (
        "_fp32" if args.precision == "fp32" else "")
    engines = ["hf_zero3", "hf_zero3_disk"] if args.compare else args.engines.split(",")
    if args.qlora:
        engines = [e for e in (args.engines.split(",") if args.engines != ",".join(ENGINES) else PLAN_QLORA)]
    if args.precision == "fp32":
        engines = [e for e in engines if e != "fsdp2_reduce_fp32"]  # the same as fsdp2 without bf16
    if any(e.startswith("ds3_nvme") for e in engines):
        ensure_libaio()
    if args.precision == "bf16" and not cpu_has_bf16():
        print("warning: this CPU has no bf16 matrix instructions (AVX-512 BF16 / AMX): every engine's bf16 steps "
              "take torch's reference path here, and runs may hit --timeout; compare on a machine that has them "
              "or with --precision fp32",
              flush=True)
    report = {"cpu_bf16": cpu_has_bf16(), "precision": args.precision, "budget_gib": args.budget_gib, "total_budget_gib": args.total_budget_gib, "seq": SEQ, "steps": args.steps, "shape": SHAPE,
              "disk": disk_bandwidth(work_dir), "runs": []}
    print(f"disk: {report['disk']}", flush=True)
    plans = PLAN_QLORA if args.qlora else PLAN_FP32 if args.precision == "fp32" else PLAN
    plan = {e: ([int(x) for x in args.ladder.split(",")] if args.ladder else plans.get(e, [])) for e in engines}
    if args.compare:
        plan = {e: [args.compare] for e in engines}
    total_budget = int(args.total_budget_gib * GIB)
    for engine in engines:
        for layers in plan[engine]:
            four_bit = args.qlora and engine.endswith("_qlora")
            weights = work_dir / f"weights{'-4bit' if four_bit else ''}-{layers}"
            if not weights.exists():
                if four_bit:
                    from _capacity_qlora import write_4bit_weights

                    write_4bit_weights(hf_config(layers), weights)
                else:
                    write_weights(layers, weights)
            r = run_job(engine, layers, weights, work_dir, budget, total_budget, args.steps, args.timeout,
                        drop_weights=engine == engines[-1] and not args.compare,  # room on disk for the save
                        precision=args.precision)
            r["params"] = n_params(layers)
            report["runs"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "log_tail"}), flush=True)
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"{name}.json").write_text(json.dumps(report, indent=1))
            if not r["ok"]:
                print(r.get("log_tail", ""), flush=True)
                break
        if not args.compare:
            for stale in work_dir.glob("weights-*"):
                shutil.rmtree(stale, ignore_errors=True)
    from _capacity_report import write_report

    write_report(report, Path(args.out), name)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
