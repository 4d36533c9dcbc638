"""One rank of a large job, measured on one machine: torch's fake process group lets one process be rank r of N.

    python benchmarks/rank_of_n.py --out benchmarks/results                              # LLaMA-2-7B, the defaults
    python benchmarks/rank_of_n.py --worlds 8,64,256 --stages 1,2,3 --seq 256 --out benchmarks/results

The fake backend (`torch.testing._internal.distributed.fake_pg`) runs every collective without moving a byte, so
the process allocates, computes and frees exactly what rank r of N would, through hf_zero's own code path for
device backends (native collectives, no gloo composition); only the values it receives are wrong (the losses
mean nothing). Each configuration is a fresh process: the model (LLaMA-2-7B's shape by default) is built on the meta
device and each rank's shards filled with random values unit by unit, so no process holds the whole model. It
trains `--steps` AdamW steps of one sequence of `--seq` tokens (gradient checkpointing on) and reports the
process's peak resident memory (VmHWM) and what it held before the first step, the step's time, and beside them
what `hf-zero estimate` says for the same rank (model states + gathered units + activations + buffers, plus the
process's own baseline, measured before the model is built). fp32 on a CPU without bf16 matrix instructions.

On a GPU (`--device cuda --precision bf16`: the GPU check's `rank_of_n` phase, LLaMA-3-8B at N = 8 and 64) the
rank computes on the one GPU, its peak is `torch.cuda.max_memory_allocated` (the estimate's device total, no process
baseline) and its step's time is the GPU's (synchronized).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GIB = 2**30

PRESETS = {  # name -> LlamaConfig fields
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),  # the GPU check's CPU rehearsal
    "llama-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=4, vocab_size=32000),
}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


class RandomWeights:
    """A shard source ([Note: read ahead] in hf_zero/checkpoint/pretrained.py: the engine asks it for each unit's
    shard in turn) that fills this rank's shards with small random values: a model on the meta device gets real
    shards without any process holding the whole model. Stands in for `PretrainedSource` in `initialize`."""

    def __init__(self, directory: Any, model: Any, conversions: Any) -> None:
        self.directory, self.error = "random weights", None

    def check(self, specs: Any) -> None:
        """Every parameter is filled: nothing to check."""

    def fingerprint(self) -> int:
        return 0

    def load_buffers(self, model: Any) -> None:
        """The rotary tables, built for real (the model was built on the meta device)."""
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        model.model.rotary_emb = LlamaRotaryEmbedding(model.config)

    def prepare(self, units: Any) -> None:
        """Nothing to read ahead."""

    def fill(self, layout: Any, params: Any, shard_rank: int, out: Any) -> None:
        out.normal_(0.0, 0.02)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero
    import hf_zero.api
    from hf_zero.estimate import Workload, estimate

    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    baseline = 0 if cuda else _status("VmRSS")  # on a GPU: the allocator's own count, which starts at 0
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    config = LlamaConfig(**PRESETS[args.preset], max_position_embeddings=max(4096, args.seq), tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mixed = "bf16" if args.precision == "bf16" else "no"
    zc = hf_zero.ZeroConfig(stage=args.stage, offload_optimizer=args.offload == "optimizer", mixed_precision=mixed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    hf_zero.api.PretrainedSource = RandomWeights  # type: ignore[misc,assignment]  # this process only
    start = time.perf_counter()
    device = torch.device("cuda", 0) if cuda else None
    model, opt = hf_zero.initialize(model, opt, zc, weights_from="random weights", device=device)
    init_s = time.perf_counter() - start
    model.train()
    ids = torch.randint(0, config.vocab_size, (1, args.seq), device=device)
    before = torch.cuda.memory_allocated() if cuda else _status("VmRSS")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")
    with torch.device("meta"):
        shape = LlamaForCausalLM(config)
    workload = Workload(seq_len=args.seq, gradient_checkpointing=True, attention="sdpa")
    # the fake group plays the process's accelerator's backend (CommGroup.comm_kind): on the host it is not
    # stream-ordered (the engine gates the backward prefetch on the reductions, as on gloo); on a GPU it is, as NCCL
    rows = estimate(shape, config, world_size=args.world, workload=workload, mixed_precision=mixed,
                    stream_ordered=cuda)
    row = next(r for r in rows if r.stage == args.stage and r.offload == args.offload)
    Path(args.result).write_text(json.dumps({
        "preset": args.preset, "device": args.device, "precision": args.precision, "world": args.world, "rank": args.rank, "stage": args.stage, "offload": args.offload,
        "seq": args.seq, "baseline": baseline, "before_step": before, "peak": peak, "init_s": init_s, "step_s": times,
        "estimate": {"model_states": row.model_states, "gathered_units": row.gathered_units,
                     "activations": row.activations, "buffers": row.buffers, "device_total": row.device_total,
                     "host_per_node": row.host_per_node},
        "model_states_measured": hf_zero.model_state_memory(model).total(),
    }))
    sys.stdout.flush()
    os._exit(0)


def run(args: argparse.Namespace, world: int, stage: int, offload: str, work: Path) -> dict:
    out = work / f"{args.preset}-n{world}-s{stage}-{offload}.json"
    cmd = [sys.executable, __file__, "--worker", "--world", str(world), "--rank", str(args.rank), "--stage",
           str(stage), "--offload", offload, "--seq", str(args.seq), "--steps", str(args.steps), "--preset",
           args.preset, "--threads", str(args.threads), "--device", args.device, "--precision", args.precision,
           "--result", str(out)]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "MALLOC_MMAP_THRESHOLD_": "1048576"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0 or not out.is_file():
        return {"world": world, "stage": stage, "offload": offload, "error": done.stderr[-2000:]}
    return json.loads(out.read_text())


def table(results: list[dict]) -> str:
    lines = [
        "| N | stage | offload | before the step (GiB) | peak (GiB) | estimate + baseline (GiB) | peak / estimate | "
        "states after the step (gradients freed) / estimate's (with them) | step (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['world']} | {r['stage']} | {r['offload']} | failed: {r['error'][-120:]!r} |||||")
            continue
        e = r["estimate"]
        device = e["device_total"] + (e["host_per_node"] if r["offload"] != "none" else 0) // 8
        predicted = device + r["baseline"]
        lines.append(
            f"| {r['world']} | {r['stage']} | {r['offload']} | {r['before_step'] / GIB:.2f} | {r['peak'] / GIB:.2f} | "
            f"{predicted / GIB:.2f} | {r['peak'] / predicted:.3f} | "
            f"{r['model_states_measured'] / e['model_states']:.3f} | {r['step_s'][-1]:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama2-7b")
    ap.add_argument("--worlds", default="8,64,256")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--offloads", default="none")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: mixed precision")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=1, help="which rank of N this process plays (default 1)")
    ap.add_argument("--stage", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--offload", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    work = args.out or Path("/tmp/rank_of_n")
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for world in map(int, args.worlds.split(",")):
        for stage in map(int, args.stages.split(",")):
            for offload in args.offloads.split(","):
                results.append(run(args, world, stage, offload, work))
                print(table(results[-1:]).splitlines()[-1], flush=True)
    stamp = time.strftime("%Y-%m-%d")
    (work / f"rank_of_n_{args.preset}.json").write_text(json.dumps(results, indent=1))
    (work / f"rank_of_n_{args.preset}.md").write_text(
        f"# One rank of N: {args.preset}, seq {args.seq}, rank {args.rank} ({stamp})\n\n"
        f"`python benchmarks/rank_of_n.py --preset {args.preset} --worlds {args.worlds} --stages {args.stages} "
        f"--offloads {args.offloads} --seq {args.seq} --device {args.device} --precision {args.precision}`\n\n"
        + table(results) + "\n"
    )
    print(table(results))


if __name__ == "__main__":
    main()
