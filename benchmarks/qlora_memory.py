"""Where a QLoRA rank's host memory goes, phase by phase: hf_zero ZeRO-3 on 2 ranks, the capacity benchmark's model
(`benchmarks/_capacity_qlora.py`: LLaMA blocks of 2048 x 5632, NF4 with double quantization, LoRA r=8 on every
linear layer, activation checkpointing, fp32 compute) at L layers.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/qlora_memory.py --layers 72 --steps 1

Rank 0 prints, in GiB above the process's baseline: the resident set after the load, then after each step's
forward, backward and optimizer step (resident now, and the peak since the step began), the bytes autograd saved
in the forward (outside the checkpointed blocks), and the resident set by kind (anonymous, file-backed, shared) at
the end. Two sizes side by side give the cost per block of each phase.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _capacity_model import SEQ, SHAPE, hf_config  # noqa: E402
from _capacity_qlora import CHECKPOINTING, _adamw, _lora, write_4bit_weights  # noqa: E402

GIB = 2**30


def _status(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024 / GIB
    return 0.0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--work", default="/var/tmp", help="where the 4-bit model directory is written (kept)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    weights = Path(args.work) / f"qlora-memory-{args.layers}"
    if dist.get_rank() == 0 and not weights.exists():
        write_4bit_weights(hf_config(args.layers), weights)
    dist.barrier()
    from transformers import AutoModelForCausalLM

    import hf_zero

    base = _status("VmRSS:")
    model, opt = hf_zero.from_pretrained(AutoModelForCausalLM, str(weights), hf_zero.ZeroConfig(stage=3),
                                         dtype=torch.float32, peft_config=_lora(),
                                         optimizer_fn=lambda m: _adamw([p for p in m.parameters() if p.requires_grad]))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINTING)
    model.train()
    record: dict = {"layers": args.layers, "loaded": round(_status("VmRSS:") - base, 3)}
    x = torch.randint(0, SHAPE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(dist.get_rank()))
    for i in range(args.steps):
        _reset_peak()
        saved: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(0 if t.is_meta else t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=x, labels=x).loss
        phases = {"forward": _phase(base), "saved_gib": round(sum(saved) / GIB, 3)}
        loss.backward()
        phases["backward"] = _phase(base)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        phases["step"] = _phase(base)
        record[f"step {i + 1}"] = phases
        del loss
    record["kinds_gib"] = {k: round(_status(f"{k}:"), 3) for k in ("RssAnon", "RssFile", "RssShmem")}
    if dist.get_rank() == 0:
        print(json.dumps(record), flush=True)
    dist.barrier()


def _phase(base: float) -> dict[str, float]:
    return {"now": round(_status("VmRSS:") - base, 3), "peak": round(_status("VmHWM:") - base, 3)}


if __name__ == "__main__":
    main()
