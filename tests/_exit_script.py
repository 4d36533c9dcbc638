"""A user's script, as users write them (tests/test_reliability.py runs it under torchrun on 2 gloo ranks):
train a few steps with hf_zero at stage 3, save a checkpoint, load it back, destroy the process group (unless
`--keep-group`), and return: no os._exit, no cleanup of our own ([Note: clean exit])."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import hf_zero


def main(path: str, destroy: bool) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = hf_zero.initialize(model, opt, hf_zero.ZeroConfig(stage=3))
    batch = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        model(input_ids=batch, labels=batch).loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    hf_zero.save_checkpoint(path, model, opt)
    hf_zero.load_checkpoint(path, model, opt)
    model(input_ids=batch)  # a last forward with no backward: its prefetches are the last collectives
    if destroy:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], destroy="--keep-group" not in sys.argv)
