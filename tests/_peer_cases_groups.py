"""Peer scenarios, continued: param groups added to the optimizer after `initialize` ([Note: param group added later]
in hf_zero/engine/step/optim.py), gradual unfreezing as torch code writes it (`optimizer.add_param_group`), on the
flat and the whole-parameter path; and a resume of such a run. Registered in the same `SCENARIOS` when
tests/_peer_cases.py imports this module."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from tests._peer_cases_state import steps_saved_once, straight_and_resumed
from tests._peer_harness import Loop, _steps, scenario


@scenario(freeze=("blocks.0.",), trainable_only=True)
def group_added_when_unfreezing(loop: Loop) -> None:
    """Block 0 frozen at set-up and left out of the optimizer; after the first step unfrozen and added as a group of
    its own (its parameters as a generator), with a smaller learning rate and no weight decay."""

    def before(step: int) -> None:
        if step == 1:
            loop.model.blocks[0].requires_grad_(True)
            loop.opt.add_param_group({"params": loop.model.blocks[0].parameters(), "lr": 0.003, "weight_decay": 0.0})

    _steps(loop, before=before)


def _all_but_block_0(model: torch.nn.Module) -> list[dict[str, Any]]:
    return [{"params": [p for n, p in model.named_parameters() if not n.startswith("blocks.0.")]}]


@scenario(groups=_all_but_block_0)
def group_added_for_parameters_left_out(loop: Loop) -> None:
    """Block 0 trainable from the start but left out of the optimizer, added as a group of its own after the second
    step: `optimizer.zero_grad()` left its gradients to add up until then ([Note: gradients no optimizer holds]), and
    the first step after applies all of them, as torch does."""

    def before(step: int) -> None:
        if step == 2:
            loop.opt.add_param_group({"params": loop.model.blocks[0].parameters(), "lr": 0.003})

    _steps(loop, n=4, before=before)


@scenario(left_out=("inp.", "blocks.1.norm."))
def left_out_and_clipped(loop: Loop) -> None:
    """The input layer and block 1's norm trainable but in no group, torch's `clip_grad_norm_` over
    `model.parameters()` every step, `optimizer.zero_grad()`: their gradients add up from step to step and the norm
    counts them ([Note: gradients no optimizer holds])."""
    _steps(loop, n=4, clip=0.05)


@scenario(left_out=("inp.", "blocks.1.norm."), adafactor=True)
def left_out_and_clipped_whole_parameter(loop: Loop) -> None:
    """The same with Adafactor, stepped on whole parameters ([Note: whole-parameter step])."""
    left_out_and_clipped(loop)


@scenario(left_out=("blocks.2.",))
def left_out_through_accumulation(loop: Loop) -> None:
    """Block 2 in no group, two micro-batches a step (the first under `no_sync`), torch's clipping over the model,
    `optimizer.zero_grad()`: block 2's unreduced and reduced gradients both add up."""
    for step in range(3):
        with loop.model.no_sync() if loop.sharded else contextlib.nullcontext():
            loss = loop.loss(2 * step)
            loop.note("loss", loss)
            loss.backward()
        loss = loop.loss(2 * step + 1)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.note("norm", torch.nn.utils.clip_grad_norm_(loop.model.parameters(), 0.05))
        loop.opt.step()
        loop.opt.zero_grad()


@scenario(freeze=("blocks.0.",), trainable_only=True, adafactor=True)
def group_added_when_unfreezing_whole_parameter(loop: Loop) -> None:
    """The same with Adafactor, stepped on whole parameters ([Note: whole-parameter step]): the new group's
    parameters dealt to the ranks after the others."""
    group_added_when_unfreezing(loop)


@scenario(freeze=("blocks.0.", "blocks.1."), trainable_only=True)
def groups_added_from_the_top(loop: Loop) -> None:
    """ULMFiT's gradual unfreezing: block 1 added (as a list) and unfrozen after the first step, block 0 added as a
    tuple while still frozen after the second and unfrozen a step later; every group's learning rate
    halved by hand after the third step (the group dicts are the optimizer's)."""

    def before(step: int) -> None:
        if step == 1:
            loop.model.blocks[1].requires_grad_(True)
            loop.opt.add_param_group({"params": list(loop.model.blocks[1].parameters()), "lr": 0.005})
        if step == 2:
            loop.opt.add_param_group({"params": tuple(loop.model.blocks[0].parameters()), "lr": 0.002})
        if step == 3:
            loop.model.blocks[0].requires_grad_(True)
        if step == 4:
            for group in loop.opt.param_groups:
                group["lr"] *= 0.5

    _steps(loop, n=5, before=before)


@scenario(trainable_only=True, adafactor=True, freeze=("blocks.1.", "head."))
def groups_added_from_the_top_whole_parameter(loop: Loop) -> None:
    """Adafactor with the head and block 1 frozen at set-up, each added as its own group a step apart (the second
    deal goes after the first's): whole parameters from three groups stepped round by round."""

    def before(step: int) -> None:
        if step == 1:
            loop.model.head.requires_grad_(True)
            loop.opt.add_param_group({"params": loop.model.head.weight, "lr": 0.02})
            loop.opt.add_param_group({"params": [loop.model.head.bias]})
        if step == 2:
            loop.model.blocks[1].requires_grad_(True)
            loop.opt.add_param_group({"params": loop.model.blocks[1].parameters(), "lr": 0.005})

    _steps(loop, n=4, before=before)


def resumed_after_a_group_was_added(stage: int, path: str, whole: bool, add_on_resume: bool) -> dict[str, Any]:
    """Block 0 frozen at set-up and out of the optimizer, unfrozen and added as a group after step 0; four steps
    straight, a checkpoint saved after step 1. Then a fresh model (the same script: block 0 frozen, the optimizer
    over the rest) unfreezes block 0 and adds its group (`add_on_resume`, or not) and loads the checkpoint, and takes
    steps 2-3. Each run's record and full state, or the resumed run's error."""
    import hf_zero
    from tests._peer_harness import Block, Idle, _build, _optimizer

    build: dict[str, Any] = {"freeze": ("blocks.0.",), "trainable_only": True, "adafactor": whole}
    config = hf_zero.ZeroConfig(stage=stage, wrap=(Block.__name__,), bucket_size_mb=0)

    def run(steps: range, resume: bool) -> dict[str, Any]:
        model = _build(build)
        model, opt = hf_zero.initialize(model, _optimizer(model, build), config)
        loop = Loop(model, opt, Idle(), dist.get_rank(), stage, sharded=True)

        def unfreeze() -> None:
            model.blocks[0].requires_grad_(True)
            opt.add_param_group({"params": model.blocks[0].parameters(), "lr": 0.003})

        if resume and add_on_resume:
            unfreeze()
        if resume:
            hf_zero.load_checkpoint(path, model, opt)
        return steps_saved_once(loop, path, steps, resume, lambda step: unfreeze() if step == 1 and not resume else None)

    return straight_and_resumed(run)


def refused_groups(stage: int) -> dict[str, str]:
    """What `add_param_group` after `initialize` refuses, as torch does or by name: a parameter already in a group, a
    tensor that is not the model's, a set; and whether a step after the refusals equals one of a run never asking."""
    import hf_zero
    from tests._peer_harness import Block, Idle, _build, _optimizer

    build: dict[str, Any] = {"freeze": ("blocks.0.",), "trainable_only": True}
    out: dict[str, Any] = {}
    losses = []
    for attempt in (True, False):
        model = _build(build)
        model, opt = hf_zero.initialize(model, _optimizer(model, build), hf_zero.ZeroConfig(stage=stage, wrap=(Block.__name__,)))
        if attempt:
            for key, group in {
                "taken": {"params": [model.head.weight]},
                "twice": {"params": [model.blocks[0].lin.weight, model.blocks[0].lin.weight]},
                "foreign": {"params": [torch.nn.Parameter(torch.zeros(3))]},
                "set": {"params": set(model.blocks[0].parameters())},
                "not_a_dict": [model.blocks[0].lin.weight],
            }.items():
                try:
                    opt.add_param_group(group)  # type: ignore[arg-type]
                    out[key] = ""
                except (ValueError, TypeError) as e:
                    out[key] = f"{type(e).__name__}: {e}"
            out["groups"] = len(opt.param_groups)
        loop = Loop(model, opt, Idle(), dist.get_rank(), stage, sharded=True)
        _steps(loop, n=2)
        losses.append(loop.record["loss"])
    out["same_losses"] = losses[0] == losses[1]
    return out



@scenario(left_out=("blocks.1.",))
def left_out_frozen_and_clipped(loop: Loop) -> None:
    """Block 1 in no group: its gradients add up for two steps, then it is frozen (torch keeps its `.grad`: the
    clipping over `model.parameters()` counts them, the one over what requires grad does not), then unfrozen and
    added as a group, whose first step applies the sum."""
    for step in range(5):
        loop.model.blocks[1].requires_grad_(step not in (2, 3))
        if step == 4:
            loop.opt.add_param_group({"params": loop.model.blocks[1].parameters(), "lr": 0.003})
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        params = [p for p in loop.model.parameters() if p.requires_grad or step != 3]
        loop.note("norm", torch.nn.utils.clip_grad_norm_(params, 0.05))
        loop.opt.step()
        loop.opt.zero_grad()


@scenario(groups=lambda model: list(model.named_parameters()))
def named_parameters_in_the_optimizer(loop: Loop) -> None:
    """torch's named parameters (`AdamW(model.named_parameters())`, torch 2.6+: the groups keep `param_names`), with
    the optimizer's own state dict loaded back between steps, as a rewind does."""

    def before(step: int) -> None:
        if step == 2:
            loop.opt.load_state_dict(loop.opt.state_dict())

    _steps(loop, n=4, before=before, clip=0.05)


@scenario()
def frozen_after_zeros_were_kept(loop: Loop) -> None:
    """Block 1 trained two steps with `zero_grad(set_to_none=False)`, then frozen: torch keeps its zero `.grad`, so
    AdamW still steps it (its moments and weight decay move it) while it is frozen ([Note: zero gradients kept])."""
    for step in range(4):
        loop.model.blocks[1].requires_grad_(step < 2)
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad(set_to_none=False)
