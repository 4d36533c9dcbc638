"""Which optimizers step with torch's fused kernel once their tensors are the flat chunks ([Note: fused step])."""

from __future__ import annotations

import torch

_FUSABLE = (torch.optim.Adam, torch.optim.AdamW)  # torch's fused kernels for the elementwise optimizers users reach for


def fuse_where_it_applies(optimizer: torch.optim.Optimizer, asleep: frozenset[int] = frozenset()) -> bool:
    """[Note: fused step]
    torch's Adam and AdamW built without `fused` or `foreach` leave the implementation to torch, which picks
    `foreach` on CUDA and a loop over the tensors on the host; its fused kernel (one pass over each tensor, no
    temporaries) is faster on both, and what transformers' Trainer asks for by default (`adamw_torch_fused`). On the
    flat chunks hf_zero steps, every tensor is contiguous, on one device. So such an optimizer steps fused once
    sharded where its masters are float32: on the host, 100M fp32 elements in 16 MiB chunks step in 0.06 s
    against 0.33 s for the loop (2 threads). The math is AdamW's, in another order of operations (fp32 rounding
    apart: about 1 ulp a step). Masters in bf16 or fp16 keep the loop: the kernel computes in float32 and rounds
    once, where the loop rounds each operation (a bf16 DeepSeek-V3 moved 1.7% away from DDP's weights in 3 steps).
    A group whose `fused` or `foreach` the user set (`fused=False` keeps the loop), a `differentiable` optimizer or
    a subclass (its own `step`) is left as built. Returns whether it now steps fused.
    A load puts the saved groups' choice back, then chooses again (`ShardedOptimizer.choose_kernel`). `asleep`: ids
    of the tensors of parts frozen at `initialize`, left out of the choice (in the compute dtype under mixed
    precision, they step only once their part started training, in the master's dtype then: [Note: requires_grad
    after initialize] in unfreeze.py)."""
    if type(optimizer) not in _FUSABLE:
        return False
    groups = [g for g in optimizer.param_groups if g.get("fused") is None and g.get("foreach") is None]
    tensors = [t for g in groups for t in g["params"] if id(t) not in asleep]
    supported = set(torch.utils._foreach_utils._get_fused_kernels_supported_devices())
    if not groups or any(g.get("differentiable") for g in groups):
        return False
    if not {t.device.type for t in tensors} <= supported or any(t.dtype != torch.float32 for t in tensors):
        return False  # bf16 or fp16 masters: the kernel's fp32 arithmetic is not the loop's (each op rounded)
    for group in groups:  # each group as built (torch copies the constructor's choice into every group)
        group["fused"] = True
    return True
