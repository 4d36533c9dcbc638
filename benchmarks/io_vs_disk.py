"""Checkpoint I/O against the disk's own speed, in one run: the disk first, then hf_zero's four ways of moving a
model's bytes, each as a fraction of what the disk does.

    python benchmarks/io_vs_disk.py --layers 16 --out benchmarks/results     # 0.84B, bf16, 2 ranks

1. **The disk**: two processes (as two ranks) each write, then read, a file of `--disk-gib` GiB with `O_DIRECT`
   in 64 MiB blocks, at once; the aggregate GB/s of each direction is the reference. One process alone is
   measured too and the faster of the two kept, so the reference is the best the disk gave.
2. **The job** (torchrun, 2 ranks, gloo): LLaMA with TinyLlama's shapes and `--layers` layers, ZeRO-3 with bf16
   mixed precision and AdamW, one step of one short sequence (the optimizer state exists), then
   - `save_checkpoint`: bytes of the checkpoint / seconds, against the write speed;
   - `load_checkpoint` into the same model and optimizer, the page cache dropped first: against the read speed;
   - `hf_zero.consolidate` to bf16 (rank 0, the cache dropped): bytes read + bytes written / seconds, against the
     slower of the two speeds;
   - `hf_zero.from_pretrained` of that directory into a new ZeRO-3 model (cache dropped): against the read speed;
     then, its shards still held, the first touch of as many fresh fp32 elements as its master shards have: the
     floor fresh memory sets it on this machine, in the state the call met (on the VMs measured, memory the host
     no longer backs costs several times the disk's time per byte).
   Every phase's time is from the first rank entering it to the last leaving it (barriers around it).
3. **The start of a job** (`benchmarks/_io_fresh.py`), as many rounds: the consolidated directory loaded by
   `hf_zero.from_pretrained` on 2 ranks and by transformers' `from_pretrained` in one process, each in fresh
   processes (as a job meets it: nothing allocated yet), beside plain reads of the same bytes and the first
   fill of the fresh memory the load writes.

The page cache is dropped with `/proc/sys/vm/drop_caches` (needs root); without it the read phases are marked
as possibly cached. The targets (issue 38): save >= 0.8 of write, load and from_pretrained >= 0.8 of read,
consolidation >= 0.7.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _capacity_model import SHAPE, n_params  # noqa: E402

BLOCK = 64 << 20
TARGETS = {"save_checkpoint": 0.8, "load_checkpoint": 0.8, "consolidate": 0.7, "from_pretrained": 0.8}


def drop_caches() -> bool:
    """Write back and drop the page cache, so that reads come from the disk; False where not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def _direct_io(path: str, nbytes: int, write: bool) -> float:
    """Seconds to write (or read) `nbytes` at `path` with O_DIRECT in BLOCK-sized requests."""
    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 20) * (BLOCK >> 20))
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    fd = os.open(path, flags | os.O_DIRECT, 0o644)
    start = time.perf_counter()
    try:
        done = 0
        while done < nbytes:
            n = os.write(fd, buf) if write else os.readv(fd, [buf])
            if n <= 0:
                break
            done += n
        if write:
            os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def disk_speed(work: Path, gib: float) -> dict:
    """Aggregate O_DIRECT write and read GB/s with 1 and 2 processes at once; the best of each kept."""
    nbytes = int(gib * (1 << 30)) // BLOCK * BLOCK
    result: dict = {"file_bytes": nbytes}
    for procs in (1, 2):
        for direction in ("write", "read"):
            drop_caches()
            code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); from io_vs_disk import _direct_io; "
                    f"print(_direct_io(sys.argv[1], {nbytes}, {direction == 'write'}))")
            start = time.perf_counter()
            jobs = [subprocess.Popen([sys.executable, "-c", code, str(work / f"disk{i}")], stdout=subprocess.PIPE,
                                     text=True) for i in range(procs)]
            outs = [j.communicate()[0] for j in jobs]
            wall = time.perf_counter() - start
            if any(j.returncode for j in jobs):
                raise RuntimeError(f"the {direction} probe failed: {outs}")
            result[f"{direction}_{procs}"] = procs * nbytes / 1e9 / max(wall, max(float(o) for o in outs))
    for i in range(2):
        (work / f"disk{i}").unlink(missing_ok=True)
    result["write_gbps"] = max(result["write_1"], result["write_2"])
    result["read_gbps"] = max(result["read_1"], result["read_2"])
    return result


def _read_ranges(ranges: list[tuple[Path, int, int]]) -> int:
    """Read each `(file, start, end)` with O_DIRECT in BLOCK-sized requests (aligned to 4 KiB); bytes read."""
    buf = mmap.mmap(-1, BLOCK)
    total = 0
    for path, start, end in ranges:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            at = start // 4096 * 4096
            while at < end:
                n = os.preadv(fd, [buf], at)
                if n <= 0:
                    break
                total += min(n, end - at)
                at += n
        finally:
            os.close(fd)
    return total


def _my_ranges(files: list[Path], rank: int, world: int) -> list[tuple[Path, int, int]]:
    """This rank's share of `files`: the files named for its rank where the names carry ranks (a checkpoint),
    else its contiguous 1/world of each file's bytes (a model directory every rank reads a part of)."""
    tag = f"rank{rank:05d}"
    if any("-rank" in f.name for f in files):
        return [(f, 0, f.stat().st_size) for f in files if tag in f.name]
    out = []
    for f in files:
        size = f.stat().st_size
        out.append((f, size * rank // world, size * (rank + 1) // world))
    return out


def _dir_bytes(path: Path, suffix: str = "") -> int:
    return sum(p.stat().st_size for p in path.rglob(f"*{suffix}") if p.is_file())


def _write_probe(path: Path, nbytes: int) -> int:
    """Write `nbytes` (rounded up to BLOCK) at `path` with O_DIRECT, fsync, remove it; bytes written."""
    _direct_io(str(path), nbytes, write=True)
    path.unlink()
    return -(-nbytes // BLOCK) * BLOCK


class _Clock:
    """Each phase of one round timed across ranks (barriers around it, the cache dropped first where asked),
    with the bytes each probe moved summed over the ranks."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.seconds: dict[str, float] = {}
        self.probe_bytes: dict[str, float] = {}
        self.cached: dict[str, bool] = {}

    def phase(self, name: str, fn, drop: bool) -> object:  # noqa: ANN001
        import torch.distributed as dist

        dist.barrier()
        if drop:
            ok = drop_caches() if self.rank == 0 else True
            self.cached[name] = not ok
        dist.barrier()
        start = time.perf_counter()
        value = fn()
        dist.barrier()
        self.seconds[name] = time.perf_counter() - start
        if self.rank == 0:
            print(f"{name}: {self.seconds[name]:.2f} s", flush=True)
        return value

    def probe(self, name: str, fn) -> None:  # noqa: ANN001
        """A plain O_DIRECT probe: `fn` returns the bytes this rank moved; the aggregate is kept."""
        import torch
        import torch.distributed as dist

        moved = torch.tensor([float(self.phase(name, fn, drop=True))], dtype=torch.float64)
        dist.all_reduce(moved)
        self.probe_bytes[name] = moved.item()


def _one_round(clock: _Clock, model, opt, work: Path, config, layers: int) -> None:  # noqa: ANN001
    """save, load, consolidate and from_pretrained, each between two plain probes of the same bytes."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_zero

    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt, out = work / "ckpt", work / "consolidated"
    if rank == 0:  # a save into an existing directory would also time removing the old one
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    share = _saved_share(layers, rank, world)
    clock.probe("probe_before_save", lambda: _write_probe(work / f"w{rank}", share))
    clock.phase("save_checkpoint", lambda: hf_zero.save_checkpoint(ckpt, model, opt), drop=False)
    clock.probe("probe_after_save", lambda: _write_probe(work / f"w{rank}", share))
    mine = _my_ranges(sorted(ckpt.glob("*.safetensors")), rank, world)
    clock.probe("probe_before_load", lambda: _read_ranges(mine))
    clock.phase("load_checkpoint", lambda: hf_zero.load_checkpoint(ckpt, model, opt), drop=True)
    clock.probe("probe_after_load", lambda: _read_ranges(mine))
    clock.phase("consolidate", (lambda: hf_zero.consolidate(ckpt, out, dtype="bf16", progress=False))
                if rank == 0 else (lambda: 0), drop=True)
    model_files = [(p, 0, p.stat().st_size) for p in sorted(ckpt.glob("model*.safetensors"))]
    written = _dir_bytes(out, ".safetensors")
    clock.probe("probe_consolidate", (lambda: _read_ranges(model_files) + _write_probe(work / "w", written))
                if rank == 0 else (lambda: 0))
    mine = _my_ranges(sorted(out.glob("*.safetensors")), rank, world)
    clock.probe("probe_before_from_pretrained", lambda: _read_ranges(mine))
    loaded = clock.phase("from_pretrained", lambda: hf_zero.from_pretrained(AutoModelForCausalLM, str(out), config),
                         drop=True)
    # its floor, right after it and with its shards still held: fresh memory in the state the phase met (measured
    # at the start of the round, it met memory just freed by the round before, which the host still backs)
    clock.phase("first_touch", lambda: _first_touch(n_params(layers) // world), drop=False)
    del loaded  # freed outside the timed phases
    gc.collect()
    clock.probe("probe_after_from_pretrained", lambda: _read_ranges(mine))


def _saved_share(layers: int, rank: int, world: int) -> int:
    """This rank's bytes of a ZeRO-3 bf16 AdamW checkpoint: fp32 masters and two moments (12 bytes each)."""
    return 12 * n_params(layers) // world


def _first_touch(numel: int) -> int:
    """Fresh host memory of `numel` fp32 elements written once: what a new master shard's pages cost."""
    import torch

    torch.empty(numel, dtype=torch.float32).zero_()
    return 0


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero

    torch.set_num_threads(4)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    work = Path(args.work)
    config = hf_zero.ZeroConfig(stage=3, mixed_precision="bf16")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=args.layers, **SHAPE))
    model, opt = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-5), config)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    rounds = []
    for i in range(args.rounds):
        if rank == 0:
            print(f"round {i + 1} of {args.rounds}", flush=True)
        clock = _Clock(rank)
        _one_round(clock, model, opt, work, config, args.layers)
        rounds.append({"seconds": clock.seconds, "probe_bytes": clock.probe_bytes, "cached": clock.cached})
    if rank == 0:
        ckpt, out = work / "ckpt", work / "consolidated"
        model_files = [p for p in ckpt.rglob("*") if p.is_file() and p.name.startswith("model")]
        result = {"layers": args.layers, "params": n_params(args.layers), "rounds": rounds,
                  "bytes": {"save_checkpoint": _dir_bytes(ckpt), "load_checkpoint": _dir_bytes(ckpt),
                            "consolidate_read": sum(p.stat().st_size for p in model_files),
                            "consolidate_written": _dir_bytes(out, ".safetensors"),
                            "from_pretrained": _dir_bytes(out, ".safetensors")}}
        Path(args.result).write_text(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


# Each phase: its bytes' key, the run probe's direction, and the plain probes beside it.
PHASES = {
    "save_checkpoint": ("write", ("probe_before_save", "probe_after_save")),
    "load_checkpoint": ("read", ("probe_before_load", "probe_after_load")),
    "consolidate": ("slower", ("probe_consolidate",)),
    "from_pretrained": ("read", ("probe_before_from_pretrained", "probe_after_from_pretrained")),
}


def _phase_bytes(job: dict, name: str) -> int:
    b = job["bytes"]
    return b["consolidate_read"] + b["consolidate_written"] if name == "consolidate" else b[name]


def _round_figures(disk: dict, job: dict, one: dict) -> dict:
    """One round's GB/s per phase, against the run's probe and against the plain probes beside it."""
    reference = {"write": disk["write_gbps"], "read": disk["read_gbps"],
                 "slower": min(disk["write_gbps"], disk["read_gbps"])}
    s, moved = one["seconds"], one["probe_bytes"]
    figures = {}
    for name, (direction, probes) in PHASES.items():
        gbps = _phase_bytes(job, name) / 1e9 / s[name]
        beside = [moved[p] / 1e9 / s[p] for p in probes]
        adjacent = sum(beside) / len(beside)
        figures[name] = {"seconds": s[name], "gbps": gbps, "fraction": gbps / reference[direction],
                         "adjacent_gbps": beside, "adjacent_fraction": gbps / adjacent}
    if "first_touch" in s:  # from_pretrained's other floor: the fresh pages of its fp32 master shards
        read_s = _phase_bytes(job, "from_pretrained") / 1e9 / (sum(figures["from_pretrained"]["adjacent_gbps"]) / 2)
        floor, serial = max(read_s, s["first_touch"]), read_s + s["first_touch"]
        figures["from_pretrained"].update(first_touch_s=s["first_touch"], floor_s=floor, serial_s=serial,
                                          floor_fraction=floor / s["from_pretrained"],
                                          serial_fraction=serial / s["from_pretrained"])
    return figures


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def report(disk: dict, job: dict) -> tuple[str, dict]:
    """Every round's table, the medians over the rounds, and the figures behind them."""
    w, r = disk["write_gbps"], disk["read_gbps"]
    per_round = [_round_figures(disk, job, one) for one in job["rounds"]]
    lines = [f"# Checkpoint I/O against the disk: {job['params'] / 1e9:.2f}B LLaMA, ZeRO-3 bf16, 2 ranks, "
             f"{len(per_round)} rounds", "",
             f"Disk probe at the start (O_DIRECT, 64 MiB blocks, {disk['file_bytes'] / 2**30:.1f} GiB per process, "
             f"written then read back): write {disk['write_1']:.2f} GB/s with 1 process, {disk['write_2']:.2f} with "
             f"2; read {disk['read_1']:.2f} / {disk['read_2']:.2f}. Reference: write {w:.2f} GB/s, read {r:.2f}.", "",
             "Beside each phase, the same bytes moved plainly (O_DIRECT, 64 MiB requests, cache dropped) just before "
             "and just after it, each rank its share: save against writing its share of the checkpoint, load "
             "against reading its checkpoint files, from_pretrained against reading its part of the model file, "
             "consolidate (rank 0) against reading the model files and then writing the consolidated bytes in "
             "series. That reference moves with the shared volume; the run's probe does not.", "",
             "| round | phase | GB moved | seconds | GB/s | fraction of run probe | probes beside (GB/s) | "
             "fraction of them | target |", "|---|---|---|---|---|---|---|---|---|"]
    for i, figures in enumerate(per_round, 1):
        for name, f in figures.items():
            beside = " / ".join(f"{g:.2f}" for g in f["adjacent_gbps"])
            lines.append(f"| {i} | {name} | {_phase_bytes(job, name) / 1e9:.2f} | {f['seconds']:.2f} | "
                         f"{f['gbps']:.2f} | {f['fraction']:.2f} | {beside} | {f['adjacent_fraction']:.2f} | "
                         f"{TARGETS[name]} |")
    medians = {name: {key: _median([fig[name][key] for fig in per_round])
                      for key in ("seconds", "gbps", "fraction", "adjacent_fraction")} for name in PHASES}
    lines += ["", f"Medians over the {len(per_round)} rounds:", "",
              "| phase | seconds | GB/s | fraction of run probe | fraction of the probes beside it | target |",
              "|---|---|---|---|---|---|"]
    for name, m in medians.items():
        lines.append(f"| {name} | {m['seconds']:.2f} | {m['gbps']:.2f} | {m['fraction']:.2f} | "
                     f"{m['adjacent_fraction']:.2f} | {TARGETS[name]} |")
    touches = [fig["from_pretrained"] for fig in per_round if "first_touch_s" in fig["from_pretrained"]]
    if touches:
        for key in ("floor_fraction", "serial_fraction"):
            medians["from_pretrained"][key] = _median([t[key] for t in touches])
        lines += ["", "from_pretrained's floors: its read at the speed beside it, and the first touch of its fresh "
                  "fp32 master shards (each rank its 1/2 of the parameters, both at once, right after the call "
                  "with its shards still held: "
                  + ", ".join(f"{t['first_touch_s']:.2f}" for t in touches) + " s). The call's time against the "
                  f"larger of the two (were they to overlap fully), median: "
                  f"{medians['from_pretrained']['floor_fraction']:.2f}; against their sum (one after the other): "
                  f"{medians['from_pretrained']['serial_fraction']:.2f}."]
    fresh_lines, fresh = fresh_report(disk, job.get("fresh", []))
    return "\n".join(lines + fresh_lines) + "\n", {"rounds": per_round, "medians": medians, "fresh": fresh}


def fresh_report(disk: dict, rounds: list[dict]) -> tuple[list[str], dict]:
    """The start-of-job table (benchmarks/_io_fresh.py): each load against the disk and fresh memory."""
    if not rounds:
        return [], {}
    lines = ["", "## At the start of a job: each load in fresh processes (the page cache dropped before each)", "",
             "Disk: two processes reading their halves of the weight files with O_DIRECT; fresh memory: two "
             "processes writing, for the first time, what the load allocates (half the parameters each, fp32 "
             "masters and bf16 gather source); transformers: one process, the directory's dtype, to the call's "
             "return and to every weight page read (it may map the file); hf_zero: 2 ranks, ZeRO-3 bf16.", "",
             "| round | disk GB/s (run probe) | read beside GB/s | fresh memory GB/s | transformers call s | "
             "transformers all read s | hf_zero s | hf_zero GB/s | fraction of run probe | fraction of read beside "
             "| hf_zero / transformers (all read) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for i, r in enumerate(rounds, 1):
        gb = r["weights_bytes"] / 1e9
        row = {"read_gbps": gb / r["read_s"], "fill_gbps": r["fill_bytes"] / 1e9 / r["fill_s"],
               "gbps": gb / r["hf_zero_s"], "fraction": gb / r["hf_zero_s"] / disk["read_gbps"],
               "adjacent_fraction": r["read_s"] / r["hf_zero_s"],
               "vs_transformers": r["hf_zero_s"] / r["transformers_all_s"], **r}
        rows.append(row)
        lines.append(f"| {i} | {disk['read_gbps']:.2f} | {row['read_gbps']:.2f} | {row['fill_gbps']:.2f} | "
                     f"{r['transformers_call_s']:.2f} | {r['transformers_all_s']:.2f} | {r['hf_zero_s']:.2f} | "
                     f"{row['gbps']:.2f} | {row['fraction']:.2f} | {row['adjacent_fraction']:.2f} | "
                     f"{row['vs_transformers']:.2f} |")
    medians = {k: _median([row[k] for row in rows]) for k in
               ("read_gbps", "fill_gbps", "gbps", "fraction", "adjacent_fraction", "vs_transformers", "hf_zero_s",
                "transformers_call_s", "transformers_all_s")}
    memory = "faster" if medians["fill_gbps"] > disk["read_gbps"] else "slower"
    lines += ["", f"Medians: hf_zero {medians['hf_zero_s']:.2f} s ({medians['gbps']:.2f} GB/s, "
              f"{medians['fraction']:.2f} of the run's read probe, {medians['adjacent_fraction']:.2f} of the reads "
              f"beside it; target 0.8 where fresh memory is faster than the disk: here it is {memory}, "
              f"{medians['fill_gbps']:.2f} GB/s); transformers {medians['transformers_call_s']:.2f} s to return, "
              f"{medians['transformers_all_s']:.2f} s to every page read; hf_zero on 2 ranks / transformers on one: "
              f"{medians['vs_transformers']:.2f} (target <= 1)."]
    return lines, {"rounds": rows, "medians": medians}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16, help="16: 0.84B parameters")
    ap.add_argument("--disk-gib", type=float, default=4.0, help="GiB each disk probe writes and reads")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the four phases, each between its probes")
    ap.add_argument("--out", type=Path, default=None, help="folder for io_vs_disk.json / io_vs_disk.md")
    ap.add_argument("--label", default="", help="appended to the result files' names (io_vs_disk<label>.md)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    work = Path(tempfile.mkdtemp(prefix="hf_zero-io-", dir=os.environ.get("TMPDIR", "/var/tmp")))
    try:
        disk = disk_speed(work, args.disk_gib)
        print(json.dumps(disk), flush=True)
        result_file = work / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
               "--worker", "--layers", str(args.layers), "--rounds", str(args.rounds), "--work", str(work),
               "--result", str(result_file)]
        env = {**os.environ, "OMP_NUM_THREADS": "4", "PYTHONPATH": str(HERE.parent)}
        done = subprocess.run(cmd, env=env)
        if done.returncode != 0 or not result_file.exists():
            sys.exit(f"io_vs_disk: the job failed (exit {done.returncode})")
        job = json.loads(result_file.read_text())
        from _io_fresh import fresh_round  # [the start of a job] each contender in fresh processes

        job["fresh"] = []
        for i in range(args.rounds):
            print(f"fresh processes, round {i + 1} of {args.rounds}", flush=True)
            job["fresh"].append(fresh_round(work / "consolidated", job["params"]))
            print(json.dumps(job["fresh"][-1]), flush=True)
        text, figures = report(disk, job)
        print(text)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            record = {"disk": disk, "job": job, "figures": figures}
            (args.out / f"io_vs_disk{args.label}.json").write_text(json.dumps(record, indent=2))
            (args.out / f"io_vs_disk{args.label}.md").write_text(text)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
