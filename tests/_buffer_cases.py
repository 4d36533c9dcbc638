"""Buffers against torch's own DDP: BatchNorm's running statistics through training with accumulation
(`no_sync`), forwards without grad in train mode, and evaluation before, between and after steps.

The same program runs twice on each rank, in the same process: under `DistributedDataParallel` (its defaults,
`broadcast_buffers=True`, and `find_unused_parameters=True` for the spare head) and under hf_zero at a stage.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hf_zero
from tests._peer_harness import D_IN, D_OUT, Net


def _batch(step: int, rank: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, D_IN, generator=g) * (1 + rank), torch.randn(n, D_OUT, generator=g)


def _program(model: nn.Module, opt: torch.optim.Optimizer, no_sync: Any, rank: int) -> dict[str, list[float]]:
    """Evaluation first; 3 steps of 2 micro-batches (the first under no_sync), each followed by two evaluation
    forwards; a forward without grad in train mode (which updates the running statistics) before step 2."""
    record: dict[str, list[float]] = {"eval": [], "loss": []}

    def evaluate() -> None:
        model.eval()
        with torch.no_grad():
            for k in (0, 1):
                x, y = _batch(500 + k, rank)
                record["eval"].append(float(nn.functional.mse_loss(model(x), y)))
        model.train()

    evaluate()
    for step in range(3):
        if step == 2:
            with torch.no_grad():
                model(_batch(700, rank)[0])
        for micro in range(2):
            x, y = _batch(10 * step + micro, rank)
            with no_sync() if micro == 0 else contextlib.nullcontext():
                loss = nn.functional.mse_loss(model(x), y) / 2
                loss.backward()
            record["loss"].append(float(loss))
        opt.step()
        opt.zero_grad()
        evaluate()
    return record


def batchnorm_against_ddp(stage: int) -> dict[str, Any]:
    """Run `_program` under torch DDP and under hf_zero at `stage`; both records and both final states."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = Net(batchnorm=True)
    ddp = DistributedDataParallel(ref, find_unused_parameters=True)
    reference = _program(ddp, torch.optim.AdamW(ref.parameters(), lr=0.01), ddp.no_sync, rank)
    torch.manual_seed(0)
    net = Net(batchnorm=True)
    config = hf_zero.ZeroConfig(stage=stage, wrap=("Block",), bucket_size_mb=0)
    model, opt = hf_zero.initialize(net, torch.optim.AdamW(net.parameters(), lr=0.01), config)
    record = _program(model, opt, model.no_sync, rank)
    state = hf_zero.full_state_dict(model, rank0_only=False)
    return {
        "reference": reference,
        "record": record,
        "ref_state": {k: v.detach().clone() for k, v in ref.state_dict().items()},
        "state": {k: v.detach().clone() for k, v in state.items()},
    }
