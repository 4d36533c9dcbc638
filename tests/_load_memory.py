"""Run under torchrun: peak RSS growth of one rank while it loads a model (sharded or ordinary way), above its
peak once the modeling code is imported and built on the meta device.

Rank 0 prints `rank peak_growth_bytes` for every rank. Not a test by itself: tests/test_pretrained_loading.py runs it.
"""

import os
import resource
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hf_zero


def main() -> None:
    path, mode = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = hf_zero.ZeroConfig(stage=3)
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    with init_empty_weights():  # the modeling code imported and built once on the meta device: not loading's cost
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if mode == "sharded":
        model, _ = hf_zero.from_pretrained(AutoModelForCausalLM, path, config)
    else:
        model, _ = hf_zero.initialize(AutoModelForCausalLM.from_pretrained(path), None, config)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    growth = [None] * dist.get_world_size()
    dist.all_gather_object(growth, peak - baseline)
    if dist.get_rank() == 0:  # one writer: two ranks printing to one stdout can interleave their lines
        print("\n".join(f"{rank} {g}" for rank, g in enumerate(growth)), flush=True)
    dist.destroy_process_group()
    # Leave without interpreter shutdown: the figures are out, and there a gloo worker thread that is still
    # releasing the last collective's tensors can abort the process (torch 2.13, pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
