"""Peer scenarios, continued (tests/_peer_cases.py has the runner): `torch.amp.GradScaler` as DDP users drive it
([Note: grad scaler] in hf_zero/engine/step/amp.py), and its state through a checkpoint. Registered in the same
`SCENARIOS` when tests/_peer_cases.py imports this module."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hf_zero
from tests import _peer_harness
from tests._peer_harness import Idle, Loop, _build, _optimizer, scenario


@scenario()
def grad_scaler(loop: Loop) -> None:
    """`torch.amp.GradScaler` around the loss and the step (the fp16 idiom)."""
    scaler = torch.amp.GradScaler(_peer_harness.DEVICE.type, init_scale=1024.0)
    for step in range(3):
        loss = loop.loss(step)
        loop.note("loss", loss)
        scaler.scale(loss).backward()
        loop.dp.after_backward()
        scaler.step(loop.opt)
        scaler.update()
        loop.opt.zero_grad()


@scenario()
def grad_scaler_overflow_on_one_rank_with_clipping(loop: Loop) -> None:
    """GradScaler with `unscale_` before torch's clipping (the DDP fp16 recipe); in the second step rank 1's loss
    overflows, so every rank skips the step and halves the scale; the others step."""
    scaler = torch.amp.GradScaler(_peer_harness.DEVICE.type, init_scale=2.0**16, growth_interval=2)
    at = {"step": 0}

    def overflow(grad: torch.Tensor) -> torch.Tensor:  # one element of one gradient, on rank 1: after the
        if at["step"] != 1 or loop.rank != 1:  # reduction only the rank owning that element sees the inf
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    loop.model.head.bias.register_hook(overflow)
    for step in range(4):
        at["step"] = step
        loss = loop.loss(step)
        loop.note("loss", loss)
        scaler.scale(loss).backward()
        loop.dp.after_backward()
        scaler.unscale_(loop.opt)
        norm = torch.nn.utils.clip_grad_norm_(loop.model.parameters(), 0.5)
        if step != 1:
            loop.note("norm", norm)
        scaler.step(loop.opt)
        scaler.update()
        loop.note("scale", scaler.get_scale())
        loop.opt.zero_grad()


@scenario(adafactor=True)
def grad_scaler_overflow_with_a_whole_parameter_optimizer(loop: Loop) -> None:
    """The same with torch's Adafactor, which hf_zero steps on whole parameters, each on the rank that owns it
    ([Note: whole-parameter step]): the gradient shards are unscaled and checked before its step gathers them
    whole, so an overflow on one rank skips every rank's step (it was refused)."""
    grad_scaler_overflow_on_one_rank_with_clipping(loop)


# ---- a GradScaler's state through a checkpoint ------------------------------------------------------------------
def grad_scaler_resumed(stage: int, path: str) -> dict[str, Any]:
    """4 steps with a GradScaler (overflow at step 1 on rank 1's head.bias gradient: every rank skips and halves),
    straight and with a save after step 2 (the scaler's state in the checkpoint's metadata) resumed into a fresh
    model, optimizer and scaler: the losses and scales of steps 3-4 and the final weights of both."""

    def run(resume: bool) -> dict[str, Any]:
        model = _build({})
        model, opt = hf_zero.initialize(model, _optimizer(model, {}), hf_zero.ZeroConfig(stage=stage, wrap=("Block",)))
        scaler = torch.amp.GradScaler(_peer_harness.DEVICE.type, init_scale=2.0**16, growth_interval=1)
        record: dict[str, list[float]] = {"loss": [], "scale": []}
        rank, now = dist.get_rank(), [0]
        for step in range(4):
            if resume and step == 2:
                hf_zero.save_checkpoint(path, model, opt, metadata={"scaler": scaler.state_dict()})
                model = _build({})
                model, opt = hf_zero.initialize(model, _optimizer(model, {}),
                                                hf_zero.ZeroConfig(stage=stage, wrap=("Block",)))
                meta = hf_zero.load_checkpoint(path, model, opt)
                scaler = torch.amp.GradScaler(_peer_harness.DEVICE.type)
                scaler.load_state_dict(meta["scaler"])
            if step == 0:  # one element of one gradient overflows on rank 1 at step 1
                model.head.bias.register_hook(
                    lambda g: g.index_fill(0, torch.tensor([0]), float("inf")) if now == [1] and rank == 1 else g)
            now[:] = [step]
            loop = Loop(model, opt, Idle(), rank, stage, sharded=True)
            x, y = loop.batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            record["loss"].append(float(loss.detach()))
            record["scale"].append(scaler.get_scale())
        state = hf_zero.full_state_dict(model, rank0_only=False)
        return {"record": record, "state": {k: v.detach().clone() for k, v in state.items()}}

    return {"straight": run(False), "resumed": run(True)}
