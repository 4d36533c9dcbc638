"""The GPU check's `rank_of_n` phase: one rank of a large job on the one GPU (benchmarks/rank_of_n.py).

    python benchmarks/_gpu_rank_of_n.py --device cuda --size full --out DIR

Through torch's fake process group one process is rank 1 of N: it allocates, computes and frees on the GPU what
that rank would (collectives move nothing). LLaMA-3-8B's shape (`full`), ZeRO-3, bf16 mixed precision, one
sequence of 4096 tokens with gradient checkpointing, 2 steps, at N = 8 and 64: the rank's `max_memory_allocated`
against `hf-zero estimate`'s device total for that rank (within 5% passes), its step's compute time, and beside it
the step-time model's compute time on an H200 (`hf_zero.steptime`, the same job with no communication: the fake
group moves nothing). `tiny`: the CPU rehearsal, a small LLaMA at N = 8 in fp32 (its peak is the process's
resident memory: reported, not checked). Results: `<out>/rank_of_n.json`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _gpu_common import Cases, require  # noqa: E402
from rank_of_n import GIB, PRESETS, run  # noqa: E402

TOLERANCE = 0.05  # the bound on peak / estimate


def _modelled_compute_s(preset: str, world: int, seq: int) -> float:
    """The step-time model's compute time for this rank's step on an H200 (its bf16 peak and efficiency)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_zero.steptime import GPUS, Job, ModelShape, predict

    config = LlamaConfig(**PRESETS[preset], tie_word_embeddings=False)
    with torch.device("meta"):
        shape = ModelShape.from_model(LlamaForCausalLM(config), config)
    job = Job(world_size=world, stage=3, seq_len=seq, gradient_checkpointing=True)
    return predict(shape, job, GPUS["h200"]).compute_s


def one_rank(args: SimpleNamespace, world: int, gpu: bool) -> dict[str, Any]:
    result = run(args, world, 3, "none", args.out)  # type: ignore[arg-type]
    require("error" not in result, f"the rank's process failed: {result.get('error', '')[-1500:]}")
    estimate = result["estimate"]["device_total"] + result["baseline"]
    step_s = result["step_s"][-1]
    figures = {"peak_GiB": round(result["peak"] / GIB, 2), "estimate_GiB": round(estimate / GIB, 2),
               "peak_over_estimate": round(result["peak"] / estimate, 3), "step_s": round(step_s, 3),
               "tokens_per_s": round(args.seq / step_s, 1), "init_s": round(result["init_s"], 1)}
    if gpu:
        modelled = _modelled_compute_s(args.preset, world, args.seq)
        figures.update(model_compute_s=round(modelled, 3), measured_over_model=round(step_s / modelled, 2))
        require(abs(result["peak"] / estimate - 1) <= TOLERANCE,
                f"peak {result['peak'] / GIB:.2f} GiB is not within {TOLERANCE:.0%} of the estimate's "
                f"{estimate / GIB:.2f} GiB")
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--size", choices=["full", "tiny"], default="full")
    ap.add_argument("--out", type=Path, required=True)
    cli = ap.parse_args()
    gpu = cli.device == "cuda"
    work = cli.out / "rank_of_n"
    work.mkdir(parents=True, exist_ok=True)
    full = cli.size == "full"
    args = SimpleNamespace(preset="llama3-8b" if full else "tiny", rank=1, seq=4096 if full else 64, steps=2,
                           threads=4 if gpu else 1, device=cli.device, precision="bf16" if gpu else "fp32",
                           timeout=240 if full else 60, out=work)
    cases = Cases("rank_of_n", cli.out)
    for world in (8, 64) if full else (8,):
        cases.run(f"{args.preset} rank 1 of {world}, ZeRO-3 {args.precision}, seq {args.seq}",
                  lambda w=world: one_rank(args, w, gpu))
    return 1 if cases.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
