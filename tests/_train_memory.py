"""Run under torchrun: the peak of allocated memory on one rank during a training step, next to
hf_zero's estimate for the same model, stage, world size and batch (tests/test_estimate.py).

Method: after one warm-up step (so the optimizer state exists), a second step runs under
torch.profiler with memory profiling; its CPU allocator reports a running "Total Allocated" of
the memory allocated since profiling started. Peak = the model states present at the start
(what hf_zero.model_state_memory reports) + the maximum of that running total: the CPU
counterpart of torch.cuda.max_memory_allocated. Rank 0 prints `rank measured estimated` for every rank.
"""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import hf_zero
from hf_zero.estimate import Workload, estimate


def main() -> None:
    path, stage, batch, seq, checkpointing = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = hf_zero.ZeroConfig(stage=stage)
    model, opt = hf_zero.from_pretrained(AutoModelForCausalLM, path, config,
                                         optimizer_fn=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4))
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    states = hf_zero.model_state_memory(model).total()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    trace = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(trace)
    events = json.load(open(trace))["traceEvents"]
    extra = max(e["args"].get("Total Allocated", 0) for e in events if e.get("name") == "[memory]")

    hf_config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config)
    attention = "eager" if model.config._attn_implementation == "eager" else "sdpa"  # what the model ran
    rows = estimate(meta, hf_config, world_size=world, workload=Workload(batch, seq, checkpointing, attention=attention),
                    mixed_precision="no")
    row = next(r for r in rows if r.stage == stage and r.offload == "none")
    # One writer: two ranks printing to one pipe can interleave their lines.
    figures = [None] * world
    dist.all_gather_object(figures, (rank, states + extra, row.device_total))
    if rank == 0:
        for r, measured, estimated in figures:
            print(f"{r} {measured} {estimated}", flush=True)
    dist.destroy_process_group()
    # Leave without interpreter shutdown: the figures are out, and there a gloo worker thread that is still
    # releasing the last collective's tensors can abort the process (torch 2.13, pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
