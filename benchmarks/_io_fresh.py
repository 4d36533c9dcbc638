"""io_vs_disk's start-of-job phase: loading a model directory as a job's first act, each in fresh processes.

A job calls `hf_zero.from_pretrained` once, at its start, in processes that have allocated nothing yet. So this
phase runs each contender in processes of its own, the page cache dropped before each, on the directory the main
job consolidated, one after the other in every round:

- `read`: plain O_DIRECT reads (64 MiB requests) of each rank's half of the weight files, two processes at once:
  the disk's speed for these bytes, beside the loads;
- `fill`: the fresh memory the load writes, two processes at once, each its half of the parameters in fp32 (the
  master shards) and in bf16 (the gather source): the other floor, which on some VMs is slower than the disk;
- `transformers`: `AutoModelForCausalLM.from_pretrained(directory)` in one process (its dtype as saved, bf16),
  timed to its return and to every weight's pages being in memory (transformers may hand back tensors that map
  the file, read on first use: one element of each 4 KiB page is summed);
- `hf_zero`: `hf_zero.from_pretrained(AutoModelForCausalLM, directory, ZeroConfig(stage=3, mixed_precision="bf16"))`
  on 2 ranks (torchrun, gloo), from the first rank entering to the last leaving.

Every process imports torch, transformers' LLaMA modules and hf_zero and reads the config before its clock starts
(a job has done so before it loads).

    python benchmarks/_io_fresh.py --model DIR            # one round, printed as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _drop_caches() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def _warm(model: Path) -> None:
    """What a job has imported before it loads: torch, transformers' LLaMA, hf_zero; the config read."""
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoConfig

    import hf_zero  # noqa: F401

    AutoConfig.from_pretrained(model)


def _transformers(model: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    _warm(model)
    _drop_caches()
    start = time.perf_counter()
    loaded = AutoModelForCausalLM.from_pretrained(model)
    call = time.perf_counter() - start
    with torch.no_grad():  # one element of every 4 KiB page: the pages a mapped tensor has not read yet
        for p in loaded.parameters():
            p.view(-1)[:: max(1, 4096 // p.element_size())].float().sum()
    return {"call_s": call, "all_s": time.perf_counter() - start, "dtype": str(next(loaded.parameters()).dtype)}


def _hf_zero(model: Path, result: Path) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_zero

    _warm(model)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        _drop_caches()
    dist.barrier()
    start = time.perf_counter()
    loaded = hf_zero.from_pretrained(AutoModelForCausalLM, str(model), hf_zero.ZeroConfig(stage=3, mixed_precision="bf16"))
    dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        result.write_text(json.dumps({"seconds": seconds}))
    del loaded
    dist.destroy_process_group()


def _fill(numel: int) -> float:
    import torch

    start = time.perf_counter()
    torch.empty(numel, dtype=torch.float32).zero_()
    torch.empty(numel, dtype=torch.bfloat16).zero_()
    return time.perf_counter() - start


def _read(model: Path, rank: int, world: int) -> float:
    from io_vs_disk import _my_ranges, _read_ranges

    start = time.perf_counter()
    _read_ranges(_my_ranges(sorted(model.glob("*.safetensors")), rank, world))
    return time.perf_counter() - start


def _two_at_once(args: list[str]) -> float:
    """Run `_io_fresh.py <args> --rank r` for r = 0, 1 at once; the slower one's seconds."""
    jobs = [subprocess.Popen([sys.executable, __file__, *args, "--rank", str(r)], stdout=subprocess.PIPE, text=True)
            for r in range(2)]
    outs = [j.communicate()[0] for j in jobs]
    if any(j.returncode for j in jobs):
        raise RuntimeError(f"{args[0]} failed: {outs}")
    return max(float(o.strip().splitlines()[-1]) for o in outs)


def fresh_round(model: Path, params: int) -> dict:
    """One round: plain reads, fresh fills, transformers' load, hf_zero's; seconds each, with the bytes."""
    env = {**os.environ, "PYTHONPATH": f"{HERE.parent}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "4"}
    os.environ.update(env)
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    _drop_caches()
    read_s = _two_at_once(["--mode", "read", "--model", str(model)])
    fill_s = _two_at_once(["--mode", "fill", "--numel", str(params // 2)])
    _drop_caches()
    out = subprocess.run([sys.executable, __file__, "--mode", "transformers", "--model", str(model)], env=env,
                         stdout=subprocess.PIPE, text=True, check=True).stdout
    transformers = json.loads(out.strip().splitlines()[-1])
    result = model.parent / "fresh_hf_zero.json"
    result.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
                    "--mode", "hf_zero", "--model", str(model), "--result", str(result)], env=env, check=True)
    return {"weights_bytes": weights, "fill_bytes": params * 6, "read_s": read_s, "fill_s": fill_s,
            "transformers_call_s": transformers["call_s"], "transformers_all_s": transformers["all_s"],
            "transformers_dtype": transformers["dtype"], "hf_zero_s": json.loads(result.read_text())["seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="round", choices=["round", "read", "fill", "transformers", "hf_zero"])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--numel", type=int, default=0)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--params", type=int, default=0, help="the model's parameter count (round)")
    ap.add_argument("--result", type=Path)
    args = ap.parse_args()
    if args.mode == "read":
        print(_read(args.model, args.rank, 2))
    elif args.mode == "fill":
        print(_fill(args.numel))
    elif args.mode == "transformers":
        print(json.dumps(_transformers(args.model)))
    elif args.mode == "hf_zero":
        _hf_zero(args.model, args.result)
    else:
        print(json.dumps(fresh_round(args.model, args.params)))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
