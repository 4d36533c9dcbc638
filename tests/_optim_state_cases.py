"""Rank functions for tests/test_optimizer_state_dict.py: `optimizer.state_dict()` / `load_state_dict` as DDP code
writes them ([Note: optimizer state dicts]), against plain data parallelism (tests/_peer_harness.py's `PlainDP`) in
the same processes."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hf_zero
from tests._peer_harness import Block, Idle, Loop, PlainDP, _build, _optimizer, _steps

def _sharded(stage: int, build: dict[str, Any]) -> tuple[nn.Module, Any]:
    model = _build(build)
    config = hf_zero.ZeroConfig(stage=stage, wrap=[Block.__name__], bucket_size_mb=0)
    return hf_zero.initialize(model, _optimizer(model, build), config)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in hf_zero.full_state_dict(model, rank0_only=False).items()}


def _plain_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-12)) for k in b)


def saved_by_one_rank(stage: int, path: str) -> dict[str, Any]:
    """Rank 0's `optimizer.state_dict()` saved alone and loaded on every rank (DDP's checkpoint idiom): refused on
    every rank, no rank's state changed."""
    rank = dist.get_rank()
    model, opt = _sharded(stage, {})
    _steps(Loop(model, opt, Idle(), rank, stage, sharded=True), n=2)
    if rank == 0:
        torch.save(opt.state_dict(), path)
    dist.barrier()
    before = _state_copy(opt)
    error = None
    try:
        opt.load_state_dict(torch.load(path, weights_only=False))
    except Exception as e:  # noqa: BLE001 - the refusal goes back to the test
        error = f"{type(e).__name__}: {e}"
    after = _state_copy(opt)
    return {"error": error, "unchanged": before.keys() == after.keys() and all(
        torch.equal(before[k], after[k]) for k in before)}


def own_files_resume(stage: int, path: str) -> dict[str, Any]:
    """Every rank saves its own `optimizer.state_dict()` and the model's; a fresh model and optimizer load them and
    train on: the same losses and weights as the run that went on without stopping."""
    rank = dist.get_rank()
    model, opt = _sharded(stage, {})
    loop = Loop(model, opt, Idle(), rank, stage, sharded=True)
    _steps(loop, n=2)
    weights = model.state_dict()
    torch.save(opt.state_dict(), f"{path}-rank{rank}.pt")
    _steps_from(loop, 2, 4)

    model2, opt2 = _sharded(stage, {})
    model2.load_state_dict(weights)
    opt2.load_state_dict(torch.load(f"{path}-rank{rank}.pt", weights_only=False))
    resumed = Loop(model2, opt2, Idle(), rank, stage, sharded=True)
    _steps_from(resumed, 2, 4)
    return {"losses": (loop.record["loss"][2:], resumed.record["loss"]),
            "weights": _worst(_weights(model2), _weights(model))}


def from_plain_optimizer(stage: int, build: dict[str, Any]) -> dict[str, Any]:
    """A plain optimizer's state dict (a DDP run's) loaded into a sharded one built over the same parameters: each
    rank takes its pieces, and training goes on as the plain run goes on."""
    rank = dist.get_rank()
    ref = _build(build)
    ref_opt = _optimizer(ref, build)
    ref_loop = Loop(ref, ref_opt, PlainDP(ref), rank, stage, sharded=False)
    _steps(ref_loop, n=2)
    plain_state, plain_weights = copy.deepcopy(ref_opt.state_dict()), _plain_weights(ref)  # torch's holds the state
    _steps_from(ref_loop, 2, 4)

    model, opt = _sharded(stage, build)
    model.load_state_dict(plain_weights)
    opt.load_state_dict(plain_state)
    loop = Loop(model, opt, Idle(), rank, stage, sharded=True)
    _steps_from(loop, 2, 4)
    return {"losses": (ref_loop.record["loss"][2:], loop.record["loss"]),
            "weights": _worst(_weights(model), _plain_weights(ref))}


def _steps_from(loop: Loop, first: int, end: int) -> None:
    for step in range(first, end):
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


def _state_copy(opt: Any) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()
            if isinstance(v, torch.Tensor)}


def other_pieces(stage: int, path: str) -> dict[str, Any]:
    """A rank's own `optimizer.state_dict()` loaded into an optimizer over other param groups (the same model):
    refused on every rank, the state unchanged."""
    rank = dist.get_rank()
    model, opt = _sharded(stage, {})
    _steps(Loop(model, opt, Idle(), rank, stage, sharded=True), n=1)
    torch.save(opt.state_dict(), f"{path}-rank{rank}.pt")
    model2 = _build({})
    head = list(model2.head.parameters())
    rest = [p for p in model2.parameters() if all(p is not h for h in head)]
    groups = [{"params": rest}, {"params": head, "lr": 0.001}]
    config = hf_zero.ZeroConfig(stage=stage, wrap=[Block.__name__], bucket_size_mb=0)
    model2, opt2 = hf_zero.initialize(model2, torch.optim.AdamW(groups, lr=0.01), config)
    _steps(Loop(model2, opt2, Idle(), rank, stage, sharded=True), n=1)
    before = _state_copy(opt2)
    try:
        opt2.load_state_dict(torch.load(f"{path}-rank{rank}.pt", weights_only=False))
        error = None
    except Exception as e:  # noqa: BLE001 - the refusal goes back to the test
        error = f"{type(e).__name__}: {e}"
    after = _state_copy(opt2)
    return {"error": error, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def checkpoint_resumed_as_torch_loads(stage: int, path: str, build: dict[str, Any]) -> dict[str, Any]:
    """Two steps, a checkpoint (`hf_zero.save_checkpoint`), a fresh model and optimizer loading it, two more steps;
    beside it plain data parallelism resuming from rank 0's model and optimizer state dicts as DDP code does
    (torch's `load_state_dict` gives each floating-point state entry its parameter's dtype). The loaded sharded
    optimizer's state dtypes, and how far the final weights are apart."""
    rank = dist.get_rank()
    ref = _build(build)
    ref_opt = _optimizer(ref, build)
    _steps(Loop(ref, ref_opt, PlainDP(ref), rank, stage, sharded=False, dtype=build["dtype"]), n=2)
    saved = [copy.deepcopy((ref.state_dict(), ref_opt.state_dict()))]
    dist.broadcast_object_list(saved, 0)
    ref = _build(build)
    ref_opt = _optimizer(ref, build)
    ref.load_state_dict(saved[0][0])
    ref_opt.load_state_dict(saved[0][1])
    _steps_from(Loop(ref, ref_opt, PlainDP(ref), rank, stage, sharded=False, dtype=build["dtype"]), 2, 4)

    model, opt = _sharded(stage, build)
    _steps(Loop(model, opt, Idle(), rank, stage, sharded=True, dtype=build["dtype"]), n=2)
    hf_zero.save_checkpoint(path, model, opt)
    model, opt = _sharded(stage, build)
    hf_zero.load_checkpoint(path, model, opt)
    dtypes = sorted({f"{k}: {v.dtype}" for s in opt.optimizer.state.values() for k, v in s.items() if k != "step"})
    _steps_from(Loop(model, opt, Idle(), rank, stage, sharded=True, dtype=build["dtype"]), 2, 4)
    return {"dtypes": dtypes, "weights": _worst(_weights(model), _plain_weights(ref))}
