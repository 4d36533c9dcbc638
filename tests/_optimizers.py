"""Optimizers the tests build by name, including two written here as users write theirs."""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterable

import torch
from torch import nn


class LARS(torch.optim.Optimizer):
    """SGD with momentum whose update of each tensor is scaled by its trust ratio `eta * ‖p‖ / ‖g‖` (LARS):
    a per-tensor norm, which flat shards would compute over the wrong elements."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, momentum: float = 0.9, eta: float = 0.02) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, eta=eta))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                trust = group["eta"] * p.norm() / (p.grad.norm() + 1e-8)
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p)
                state["momentum"].mul_(group["momentum"]).add_(p.grad * trust)
                p.sub_(state["momentum"], alpha=group["lr"])


class MuonAndAdamW(torch.optim.Optimizer):
    """`torch.optim.Muon` over `matrices` and AdamW over `rest` (parameters or groups), as one optimizer (how Muon's
    users pair them; the Trainer takes one): its param groups are the two inner optimizers' own group dicts, so each
    steps what the groups hold, and their state is its own (as `state_dict()` needs). hf_zero steps it on whole
    parameters (Muon orthogonalizes each matrix)."""

    def __init__(self, matrices: Any, rest: Any, muon: dict[str, Any], adamw: dict[str, Any]) -> None:
        self.muon = torch.optim.Muon(matrices, adjust_lr_fn="match_rms_adamw", **muon)
        # the loop, as chosen: as one optimizer it steps whole parameters, as two flat chunks ([Note: fused step])
        self.adamw = torch.optim.AdamW(rest, foreach=False, **adamw)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self.muon.state = self.adamw.state = self.state  # one state, so state_dict() and checkpoints hold both

    def __setstate__(self, state: dict[str, Any]) -> None:
        """torch's `load_state_dict` gives the optimizer new group dicts and a new state: the inner two take them."""
        super().__setstate__(state)
        if "muon" in self.__dict__:
            n = len(self.muon.param_groups)
            self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
            self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        self.muon.step()
        self.adamw.step()


def muon_with_adamw(model: nn.Module, lr: float) -> MuonAndAdamW:
    """Muon on the hidden matrices (not the embeddings or the head), AdamW on the rest."""
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n]
    taken = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in taken]
    return MuonAndAdamW(matrices, rest, dict(lr=lr), dict(lr=lr, eps=1e-6))


class PlainAdamW(torch.optim.AdamW):
    """torch's AdamW under a class hf_zero does not know: it steps on whole parameters unless declared elementwise
    (it is), so one optimizer's state can be saved on one path and loaded on the other."""


def build_optimizer(kind: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """`kind`: "adamw" (the Trainer's two groups, tests._training.make_optimizer), "torch_adafactor",
    "hf_adafactor" (what `--optim adafactor` builds, with a fixed lr), "lars", "muon_adamw", "muon_and_adamw" (a
    list of two optimizers)."""
    from tests._training import make_optimizer

    if kind == "adamw":
        return make_optimizer(model, lr)
    if kind == "torch_adafactor":
        return torch.optim.Adafactor(model.parameters(), lr=lr)
    if kind == "hf_adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(model.parameters(), lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)
    if kind == "lars":
        return LARS(model.parameters(), lr=lr)
    if kind == "muon_adamw":
        return muon_with_adamw(model, lr)
    if kind == "muon_and_adamw":  # the same two as two optimizers, as hf_zero.initialize takes them
        both = muon_with_adamw(model, lr)
        for each in (both.muon, both.adamw):
            each.state = collections.defaultdict(dict)  # each its own state, as two optimizers built apart
        return [both.muon, both.adamw]
    if kind == "plain_adamw":
        return PlainAdamW(model.parameters(), lr=lr)
    raise ValueError(kind)


def sharded_run_on_flat_shards(sc: Any) -> dict[str, Any]:
    """`tests._training.sharded_run` with the whole-parameter path disabled for `sc.optimizer`'s class (declared
    elementwise; for LARS, which is not, wrongly), then restored: the pool's process is reused by later tests."""
    from hf_zero.engine.step import whole
    from tests._training import sharded_run

    cls = {"lars": LARS, "plain_adamw": PlainAdamW, "torch_adafactor": torch.optim.Adafactor}[sc.optimizer]
    key = (cls.__module__, cls.__name__)
    whole.register_elementwise(cls)
    try:
        return sharded_run(sc)
    finally:
        whole.ELEMENTWISE.discard(key)


def load_on_flat_shards_error(sc: Any) -> str:
    """The error of `sharded_run_on_flat_shards(sc)` (a ValueError, on every rank)."""
    try:
        sharded_run_on_flat_shards(sc)
    except ValueError as e:
        return str(e)
    return ""


def whole_step_memory(kind: str = "llama_8") -> dict[str, Any]:
    """Adafactor at stage 3 on this rank ([Note: whole-parameter step]): after 2 steps, this rank's master-weight
    and optimizer-state bytes and the group's totals; during every call of the inner step (a step pre-hook), the
    gradient bytes held (the flat gradient shards plus the `.grad` of the parameter in transit), how many whole
    parameters are materialized, and the largest parameter's bytes."""
    import torch.distributed as dist

    import hf_zero
    from tests._training import make_model

    model = make_model(kind)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    model, opt = hf_zero.initialize(model, torch.optim.Adafactor(model.parameters(), lr=1e-2), hf_zero.ZeroConfig(stage=3))
    engine = model.zero_engine
    seen: dict[str, int] = {"grads": 0, "whole": 0, "calls": 0}

    def during(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        held = [p for g in optimizer.param_groups for p in g["params"]]
        transit = sum(p.grad.numel() * p.grad.element_size() for p in held if p.grad is not None)
        seen["grads"] = max(seen["grads"], sum(engine.memory().gradients.values()) + transit)
        seen["whole"] = max(seen["whole"], sum(p.untyped_storage().nbytes() > 0 for p in held))
        seen["calls"] += 1

    opt.optimizer.register_step_pre_hook(during)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    masters = sum(unit.sharded_master.numel() * unit.sharded_master.element_size() for unit in engine.parts)
    state = sum(v.numel() * v.element_size() for s in opt.optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    shard_grads = sum(unit.layout.shard_numel * unit.master_dtype.itemsize for unit in engine.parts if unit.has_trainable)
    totals = torch.tensor([masters, state], dtype=torch.float64)
    dist.all_reduce(totals)
    return {"masters": masters, "state": state, "total_masters": float(totals[0]), "total_state": float(totals[1]),
            "shard_grads": shard_grads, "largest": largest, "blocks": len(model.model.layers), **seen}


def partial_zero_grad_error() -> str:
    """Two optimizers; after a step, only the first calls zero_grad() before the next backward: the next step
    raises (the gradients are shared flat buffers, dropped once both asked)."""
    import hf_zero
    from tests._training import make_model

    model = make_model("llama")
    model, (first, second) = hf_zero.initialize(model, build_optimizer("muon_and_adamw", model, 1e-2),
                                                hf_zero.ZeroConfig(stage=3))
    x = torch.randint(0, 256, (2, 16))
    model(input_ids=x, labels=x).loss.backward()
    first.step()
    first.zero_grad()
    second.step()  # its gradients are still there: the first one's zero_grad waits for it
    model(input_ids=x, labels=x).loss.backward()
    try:
        first.step()
    except ValueError as e:
        return str(e)
    return ""


def schedule_free_outputs(stage: int | None, mixed_precision: str = "no") -> dict[str, Any]:
    """schedulefree's AdamWScheduleFree (lr 1e-2): 3 steps, then the logits of a fixed batch after `eval()` (the
    weights' average), after `train()` and one more step. `stage=None`: unsharded, in this process (the
    reference); otherwise sharded (the global batch split over the ranks)."""
    import schedulefree
    import torch.distributed as dist

    import hf_zero
    from tests._training import make_model

    model = make_model("llama")
    opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=1e-2, warmup_steps=0)
    rank, world = (0, 1) if stage is None else (dist.get_rank(), dist.get_world_size())
    if stage is not None:
        model, opt = hf_zero.initialize(model, opt, hf_zero.ZeroConfig(stage=stage, mixed_precision=mixed_precision))
    data = torch.randint(0, 256, (5, 4, 16), generator=torch.Generator().manual_seed(0))
    probe = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))

    def train_step(step: int) -> None:
        opt.train()
        batch = data[step].chunk(world)[rank]
        (model(input_ids=batch, labels=batch).loss * batch.shape[0] / data.shape[1] * world).backward()
        opt.step()
        opt.zero_grad()

    for step in range(3):
        train_step(step)
    opt.eval()
    with torch.no_grad():
        evaluated = model(input_ids=probe).logits.float()
    train_step(3)
    with torch.no_grad():
        trained = model(input_ids=probe).logits.float()
    return {"eval": evaluated.numpy(), "train": trained.numpy()}
