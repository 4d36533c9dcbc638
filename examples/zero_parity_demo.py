"""Train a small LLaMA with hf_zero across ranks and print its losses beside unsharded training.

Run on 2 CPU processes (what `make demo` does):

    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/zero_parity_demo.py --zero_stage 3

Each rank trains on its slice of every global batch (gradient accumulation 2, clipping at 1.0).
Afterwards rank 0 trains the same model on the whole global batches in a single process and
prints both loss curves, their relative difference, and the model-state bytes each rank held.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_zero


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq, tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config)


def build_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr)


def synthetic_corpus(args: argparse.Namespace, world: int) -> torch.Tensor:
    """Token sequences with learnable structure (a noisy repeating pattern), fixed by seed."""
    g = torch.Generator().manual_seed(1234)
    n = args.steps * world * args.accum * args.micro_batch
    base = torch.randint(0, args.vocab, (n, 1), generator=g)
    stride = torch.randint(1, 7, (n, 1), generator=g)
    seq = (base + stride * torch.arange(args.seq)) % args.vocab
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq[noise] = torch.randint(0, args.vocab, (int(noise.sum()),), generator=g)
    return seq.view(args.steps, world * args.accum * args.micro_batch, args.seq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zero_stage", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--mixed_precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--micro_batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max_rel_diff", type=float, default=None,
                        help="exit with an error when a step's loss differs from the unsharded one by more than this")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank, world = dist.get_rank(), dist.get_world_size()
    data = synthetic_corpus(args, world)

    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    config = hf_zero.ZeroConfig(stage=args.zero_stage, mixed_precision=args.mixed_precision)
    model, optimizer = hf_zero.initialize(model, build_optimizer(model, args.lr), config)

    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        micro = []
        for a in range(args.accum):
            rows = slice((a * world + rank) * args.micro_batch, (a * world + rank + 1) * args.micro_batch)
            batch = data[step, rows].to(next(model.parameters()).device)
            sync = contextlib.nullcontext() if a == args.accum - 1 else model.no_sync()
            with sync:
                loss = model(input_ids=batch, labels=batch).loss
                (loss / args.accum).backward()
            micro.append(loss.detach().float())
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = torch.stack(micro).mean()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    elapsed = time.perf_counter() - start
    memory = hf_zero.model_state_memory(model)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, memory.total())

    if rank == 0:
        reference = build_model(args)
        ref_opt = build_optimizer(reference, args.lr)
        ref_losses = []
        for step in range(args.steps):
            loss = reference(input_ids=data[step], labels=data[step]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(loss.item())
        print(f"\nhf_zero ZeRO-{args.zero_stage} ({args.mixed_precision}) on {world} ranks ({backend}), "
              f"LLaMA with {n_params / 1e6:.2f}M parameters, {elapsed:.1f}s")
        print(f"{'step':>4}  {'hf_zero loss':>12}  {'unsharded loss':>14}  {'rel. diff':>9}")
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            print(f"{i:>4}  {a:>12.6f}  {b:>14.6f}  {abs(a - b) / abs(b):>9.1e}")
        full = 16 * n_params
        print("model-state bytes per rank: " + ", ".join(f"rank {r}: {b / 2**20:.2f} MiB" for r, b in enumerate(per_rank))
              + f" (unsharded fp32 Adam: {full / 2**20:.2f} MiB)")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) if rank == 0 else 0.0
    dist.destroy_process_group()
    if args.max_rel_diff is not None and worst > args.max_rel_diff:
        raise SystemExit(f"losses differ from unsharded training by up to {worst:.1e} relative "
                         f"(allowed: {args.max_rel_diff:.0e})")


if __name__ == "__main__":
    main()
