"""The bulk collectives of ZeRO on this machine's backend: native vs composed, and all-reduce.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/collectives.py
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/collectives.py --backend nccl

Times hf_zero's `all_gather_into` and `reduce_scatter_into` with `collectives="native"` (the
backend's own all-gather / reduce-scatter) and `"composed"` (broadcasts / an all-reduce), next to
the backend's all-reduce of the same buffer (what DDP runs), for several buffer sizes; prints a
markdown table of milliseconds and MB/s (buffer bytes per second). This is the measurement behind
`ZeroConfig.collectives="auto"` (see [Note: composed collectives] in
hf_zero/engine/collectives.py) and behind the `bucket_size_mb` default.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import torch
import torch.distributed as dist

from hf_zero.engine.collectives import CommGroup, Pending, all_gather_into, all_reduce_, reduce_scatter_into


def timed(fn: Callable[[], Pending], repeats: int) -> float:
    """Median seconds of `fn` (issued and waited), every rank in step."""
    fn().wait()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn().wait()
        if torch.cuda.is_available() and dist.get_backend() == "nccl":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[3, 6, 12, 25, 50, 100])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(args.backend)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = CommGroup.world()
    native, pairwise = world.using("native"), world.using("composed")
    rows = ["| buffer (MB) | all-gather native (ms) | all-gather composed (ms) | reduce-scatter native (ms) | "
            "reduce-scatter composed (ms) | all-reduce (ms) | composed MB/s (gather, reduce) |", "|---|---|---|---|---|---|---|"]
    for mb in args.sizes_mb:
        n = int(mb * 2**20) // 4 // world.size * world.size
        full = torch.randn(n, device=device)
        shard = torch.randn(n // world.size, device=device)
        out = torch.empty(n // world.size, device=device)
        t = {
            "agn": timed(lambda: all_gather_into(full, shard, native, async_op=True), args.repeats),
            "agp": timed(lambda: all_gather_into(full, shard, pairwise, async_op=True), args.repeats),
            "rsn": timed(lambda: reduce_scatter_into(out, full, native, async_op=True), args.repeats),
            "rsp": timed(lambda: reduce_scatter_into(out, full, pairwise, async_op=True), args.repeats),
            "ar": timed(lambda: all_reduce_(full, world, async_op=True), args.repeats),
        }
        ms = {k: v * 1000 for k, v in t.items()}
        rows.append(f"| {mb:g} | {ms['agn']:.1f} | {ms['agp']:.1f} | {ms['rsn']:.1f} | {ms['rsp']:.1f} | {ms['ar']:.1f} | "
                    f"{mb / t['agp']:.0f}, {mb / t['rsp']:.0f} |")
    if world.rank == 0:
        print(f"{args.backend}, {world.size} ranks, fp32, median of {args.repeats}\n")
        print("\n".join(rows))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
