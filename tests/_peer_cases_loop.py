"""Peer scenarios, continued (tests/_peer_cases.py has the runner, the refusals and the first ones): the loop
around the optimizer step as users write it under DDP, and what they do with the model between steps: autocast,
gradient hooks, `.grad` read or edited between backward and step, optimizers hf_zero never saw, a closure,
schedulers, evaluation under `inference_mode`, copies of the model for an EMA, state dicts, moves and casts.
Registered in the same `SCENARIOS` when tests/_peer_cases.py imports this module."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from torch import nn

import hf_zero
from tests import _peer_harness
from tests._peer_harness import D_OUT, Loop, _steps, scenario


@scenario()
def user_autocast(loop: Loop) -> None:
    """`torch.autocast(device_type, dtype=torch.bfloat16)` around the forward and loss of an fp32 model (Accelerate's
    `mixed_precision` in a plain loop): autocast casts per operation, the weights and gradients stay fp32."""
    for step in range(3):
        with torch.autocast(device_type=_peer_harness.DEVICE.type, dtype=torch.bfloat16):
            loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def module_full_backward_hook(loop: Loop) -> None:
    """`block.register_full_backward_hook(...)` recording the gradient of the block's output (a probe users add to
    watch gradients flow)."""
    seen: list[float] = []
    loop.model.blocks[1].register_full_backward_hook(lambda m, gin, gout: seen.append(float(gout[0].abs().sum())))
    _steps(loop)
    for value in seen:
        loop.note("output_grad", value)


@scenario()
def optimizer_step_with_closure(loop: Loop) -> None:
    """`optimizer.step(closure)`, the closure zeroing, computing the loss and its backward (LBFGS' and SAM's form)."""
    for step in range(3):

        def closure() -> torch.Tensor:
            loop.opt.zero_grad()
            loss = loop.loss(step)
            loop.backward(loss)
            return loss

        loop.note("loss", loop.opt.step(closure))
        loop.opt.zero_grad()


@scenario()
def backward_twice_with_retain_graph(loop: Loop) -> None:
    """`loss.backward(retain_graph=True)`, then a second backward through the same graph before the step."""
    for step in range(3):
        loss = loop.loss(step)
        loop.note("loss", loss)
        loss.backward(retain_graph=True)
        loop.backward(loss * 0.5)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def lr_scheduler_one_cycle(loop: Loop) -> None:
    """`OneCycleLR` stepped after the optimizer, the learning rate read back."""
    scheduler = torch.optim.lr_scheduler.OneCycleLR(loop.opt, max_lr=0.05, total_steps=3)
    for step in range(3):
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        scheduler.step()
        loop.opt.zero_grad()
        loop.note("lr", loop.opt.param_groups[0]["lr"])


@scenario()
def grad_rows_zeroed_before_step(loop: Loop) -> None:
    """Rows of a gradient zeroed between backward and step, guarded by `if p.grad is not None` (training only some
    rows: new token embeddings). DDP's `.grad` is the averaged gradient; a sharded model's is a stand-in that
    refuses by name ([Note: resting gradients]): left None, the guard skipped the edit and training went silently
    different."""
    for step in range(3):
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        grad = loop.model.head.weight.grad
        if grad is not None:
            grad[:2].zero_()
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def grad_norms_logged_from_p_grad(loop: Loop) -> None:
    """Per-step gradient norm summed from `p.grad` with the usual guard (left None, it logged 0 on every step)."""
    for step in range(3):
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        total = sum(float(p.grad.norm()) ** 2 for p in loop.model.parameters() if p.grad is not None)
        loop.note("grad_norm", total**0.5)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def grad_norm_logged_under_no_sync(loop: Loop) -> None:
    """Accumulation with DDP's idiom (the first micro-batch's backward under no_sync), the local gradient norm logged
    from `p.grad` with the usual guard in between. DDP's `.grad` there is this rank's own sum; a sharded model's is
    the stand-in that refuses by name (left None where no_sync defers the reduction, the guard logged 0)."""
    for step in range(3):
        for micro in range(2):
            loss = loop.loss(10 * step + micro) / 2
            loop.note("loss", loss)
            if micro == 1:
                loop.backward(loss)
                continue
            with loop.model.no_sync() if loop.sharded else contextlib.nullcontext():
                loss.backward()
            total = sum(float(p.grad.norm()) ** 2 for p in loop.model.parameters() if p.grad is not None)
            loop.note("local_grad_norm", total**0.5)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def grad_rows_zeroed_in_a_hook(loop: Loop) -> None:
    """The way that works on a sharded model: `p.register_hook` before the backward zeroes the rows (on each rank's
    gradient before the mean, which masking commutes with)."""
    mask = torch.ones(D_OUT, 1, device=_peer_harness.DEVICE)
    mask[:2] = 0
    loop.model.head.weight.register_hook(lambda grad: grad * mask)
    _steps(loop)


@scenario()
def eval_under_inference_mode(loop: Loop) -> None:
    """An evaluation forward under `torch.inference_mode()` before each training step (Lightning's validation,
    transformers' pipelines): the buffers it gathers into are not inference tensors the training forward reuses."""
    for step in range(3):
        loop.model.eval()
        x, y = loop.batch(100 + step)
        with torch.inference_mode():
            loop.note("eval_loss", nn.functional.mse_loss(loop.model(x), y))
        loop.model.train()
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def optimizer_built_after_initialize(loop: Loop) -> None:
    """A second optimizer over the head built after `initialize` and never given to hf_zero (a probe's, a GAN's):
    under DDP it steps the head again from `.grad`; on a sharded model it is refused at its first step, naming
    `hf_zero.attach_optimizer` (its `.grad` was None: it stepped nothing, silently)."""
    head_optimizer = torch.optim.SGD(loop.model.head.parameters(), lr=0.1)
    for step in range(3):
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        head_optimizer.step()
        loop.opt.zero_grad()
        head_optimizer.zero_grad()


@scenario()
def deepcopy_for_an_ema(loop: Loop) -> None:
    """`torch.optim.swa_utils.AveragedModel(model)` after wrapping (it deep-copies the model, as an EMA or a frozen
    reference model does); refused by name, with the recipe of the next scenario."""
    ema = torch.optim.swa_utils.AveragedModel(loop.model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    for step in range(3):
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()
        ema.update_parameters(loop.model)
        x, y = loop.batch(50 + step)
        with torch.no_grad():
            loop.note("ema_loss", nn.functional.mse_loss(ema(x), y))


@scenario(twin=True)
def ema_copied_before_initialize(loop: Loop) -> None:
    """An EMA of the weights kept in a copy made before sharding, updated after every step from the full weights
    (`hf_zero.full_state_dict(model, rank0_only=False)` on every rank: the fp32 masters), and evaluated."""
    ema = loop.twin
    assert ema is not None
    for step in range(3):
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()
        if loop.sharded:
            full = hf_zero.full_state_dict(loop.model, rank0_only=False, device=_peer_harness.DEVICE)
        else:
            full = loop.model.state_dict()
        with torch.no_grad():
            for name, p in ema.named_parameters():
                p.lerp_(full[name], 0.1)
            x, y = loop.batch(50 + step)
            loop.note("ema_loss", nn.functional.mse_loss(ema(x), y))


@scenario()
def state_dict_round_trip(loop: Loop) -> None:
    """`model.load_state_dict(model.state_dict())` between steps."""
    for step in range(3):
        if step == 1:
            loop.model.load_state_dict({k: v.clone() for k, v in loop.model.state_dict().items()})
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def read_params_between_steps(loop: Loop) -> None:
    """A parameter read inside `hf_zero.gathered_parameters` (stage 3) or directly: a weight norm per step."""
    for step in range(3):
        loss = loop.loss(step)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()
        if loop.sharded:
            with hf_zero.gathered_parameters(loop.model):
                loop.note("weight", loop.model.head.weight.norm())
        else:
            loop.note("weight", loop.model.head.weight.norm())


@scenario()
def move_to_its_own_device_between_steps(loop: Loop) -> None:
    """`model.to(device)`, `.to(dtype)` to the dtype it has and `.float()` between steps, as DDP loops and Accelerate
    do (changing nothing)."""
    device = next(loop.model.parameters()).device
    _steps(loop, before=lambda step: loop.model.to(device).to(torch.float32).float())


@scenario()
def cast_to_bf16_for_evaluation(loop: Loop) -> None:
    """`model.to(torch.bfloat16)` after training, then an evaluation forward in bf16 (DDP's model is plain bf16
    from then on); a sharded model's dtype is the engine's: refused, naming mixed_precision."""
    _steps(loop, n=2)
    loop.model.to(torch.bfloat16)
    x, y = loop.batch(2)
    with torch.no_grad():
        loop.note("eval_loss", nn.functional.mse_loss(loop.model(x.to(torch.bfloat16)).float(), y))


@scenario()
def forward_called_directly(loop: Loop) -> None:
    """`model.forward(x)` instead of `model(x)` (DDP does its work inside `forward`, so such loops train under it): the
    sharded model's forward goes through its `__call__` ([Note: forward called directly])."""
    for step in range(3):
        x, y = loop.batch(step)
        loop.dp.before_forward()
        loss = nn.functional.mse_loss(loop.model.forward(x), y)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


class RenormBlock(_peer_harness.Block):
    """A block whose forward renormalizes its weight's rows in place (what `nn.Embedding(max_norm=...)` does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            norms = self.lin.weight.norm(dim=1, keepdim=True)
            self.lin.weight.mul_(norms.clamp(max=0.5) / norms)
        return super().forward(x)


@scenario(block=RenormBlock)
def weight_changed_in_forward(loop: Loop) -> None:
    """Weights changed in place inside the forward: kept under DDP; at stage 3 the gathered copy the change went
    to is freed after the forward, so it is refused ([Note: changed in forward])."""
    _steps(loop)


@scenario()
def root_weight_changed_in_forward(loop: Loop) -> None:
    """The same in the root's own module, from a forward pre-hook on it (the root unit holds embeddings)."""

    def renorm(module: nn.Module, args: object) -> None:
        with torch.no_grad():
            module.weight.clamp_(-0.2, 0.2)

    loop.model.inp.register_forward_pre_hook(renorm)
    _steps(loop)


@scenario()
def hyperparameters_changed_between_steps(loop: Loop) -> None:
    """`group["weight_decay"]` and `group["betas"]` changed between steps (schedules written by hand)."""

    def change(step: int) -> None:
        for group in loop.opt.param_groups:
            group["weight_decay"], group["betas"] = (0.5, (0.5, 0.9)) if step == 1 else (0.1, (0.9, 0.999))

    _steps(loop, before=change)


@scenario()
def optimizer_step_hooks(loop: Loop) -> None:
    """`optimizer.register_step_pre_hook` / `register_step_post_hook` (an EMA or a logger driven by the step)."""
    calls: list[int] = []
    loop.opt.register_step_pre_hook(lambda opt, args, kwargs: calls.append(1))
    loop.opt.register_step_post_hook(lambda opt, args, kwargs: calls.append(2))
    _steps(loop)
    loop.note("hook_calls", float(len(calls)))


@scenario()
def gradients_never_zeroed(loop: Loop) -> None:
    """No `zero_grad()` at all: each step adds this backward's gradient to the last ones, as torch does."""
    for step in range(3):
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()


class WeightNormBlock(_peer_harness.Block):
    """A block whose linear layer is reparametrized by `torch.nn.utils.parametrizations.weight_norm` (its
    parameters are `parametrizations.weight.original0/1`, the weight computed from them at each use)."""

    def __init__(self) -> None:
        super().__init__()
        torch.nn.utils.parametrizations.weight_norm(self.lin)


@scenario(block=WeightNormBlock)
def weight_norm_parametrization(loop: Loop) -> None:
    """A parametrized weight (weight normalization): the originals are what shards, trains and saves."""
    _steps(loop)


def _clip_groups(loop: Loop, pick: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> None:
    for step in range(3):
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        tensors = pick([p for group in loop.opt.param_groups for p in group["params"]])
        loop.note("norm", torch.nn.utils.clip_grad_norm_(tensors, 0.05))
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def clip_through_optimizer_groups(loop: Loop) -> None:
    """`torch.nn.utils.clip_grad_norm_` over the tensors of `optimizer.param_groups` (Lightning's clipping): the
    sharded optimizer's tensors are pieces of this rank's shard, taken as their groups' parameters ([Note: torch
    clipping]); before, a norm of 0 and nothing clipped."""
    _clip_groups(loop, lambda tensors: tensors)


@scenario(adafactor=True)
def clip_through_optimizer_groups_whole(loop: Loop) -> None:
    """The same with an optimizer stepped on whole parameters, each held by the rank that owns it."""
    _clip_groups(loop, lambda tensors: tensors)


@scenario()
def clip_through_part_of_a_group(loop: Loop) -> None:
    """Some tensors of a group: a different part of the parameters on each rank once sharded, refused."""
    _clip_groups(loop, lambda tensors: tensors[:2])


@scenario()
def grad_norm_logged_through_optimizer_groups(loop: Loop) -> None:
    """A gradient norm logged from the tensors of `optimizer.param_groups` (`if p.grad is not None`), as DDP code
    does: those tensors are pieces of this rank's shard, their `.grad` a stand-in that refuses the read by name
    ([Note: optimizer tensors at rest]); before, None (a norm of 0, silently)."""
    for step in range(2):
        loss = loop.loss(step)
        loop.backward(loss)
        grads = [p.grad for group in loop.opt.param_groups for p in group["params"] if p.grad is not None]
        loop.note("grad_norm", torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def optimizer_state_read_by_parameter(loop: Loop) -> None:
    """`optimizer.state[p]["exp_avg"]` logged per parameter (DDP's optimizer keys its state by parameter): a
    sharded optimizer's is per piece of this rank's shard, so a parameter as the key is refused by name ([Note:
    optimizer state by parameter]); before, a KeyError on the read and a silent no-op on `state[p] = {}`."""
    for step in range(2):
        loss = loop.loss(step)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()
        loop.note("moment", loop.opt.state[loop.model.head.weight]["exp_avg"].norm())


@scenario(dtype=torch.float64)
def float64_model(loop: Loop) -> None:
    """A model in float64 (scientific models, numerical checks): two micro-batches per step (the first under
    no_sync), clipped by torch's 2-norm, then a step clipped by the max-norm. DDP keeps every number in float64, and
    so must the masters, the norms and their reductions."""
    clip = torch.nn.utils.clip_grad_norm_
    for step in range(3):
        for micro in range(2):
            loss = loop.loss(10 * step + micro) / 2
            loop.note("loss", loss)
            with loop.model.no_sync() if micro == 0 and loop.sharded else contextlib.nullcontext():
                loss.backward()
        loop.dp.after_backward()
        loop.note("norm", clip(loop.model.parameters(), 0.05))
        loop.opt.step()
        loop.opt.zero_grad()
    loop.backward(loop.loss(7))
    loop.note("norm", clip(loop.model.parameters(), 0.01, norm_type=math.inf))
    loop.opt.step()
    loop.opt.zero_grad()
