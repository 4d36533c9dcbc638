"""Optimizers the tests build by name, including two written here as users write theirs."""

from __future__ import annotations

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


class MuonWithAdamW(torch.optim.Optimizer):
    """`torch.optim.Muon` on the hidden matrices and AdamW on the rest, as one optimizer (the Trainer takes one):
    its param groups are the two inner optimizers' own group dicts, so each steps what the groups hold."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n]
        taken = {id(p) for p in matrices}
        rest = [p for p in model.parameters() if id(p) not in taken]
        self.muon = torch.optim.Muon(matrices, lr=lr, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(rest, lr=lr, eps=1e-6)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        self.muon.step()
        self.adamw.step()


def build_optimizer(kind: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """`kind`: "adamw" (the Trainer's two groups, tests._training.make_optimizer), "torch_adafactor",
    "hf_adafactor" (what `--optim adafactor` builds, with a fixed lr), "lars", "muon_adamw"."""
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
        return MuonWithAdamW(model, lr)
    raise ValueError(kind)


def sharded_run_on_flat_shards(sc: Any) -> dict[str, Any]:
    """`tests._training.sharded_run` with the whole-parameter path disabled for LARS (declared elementwise, which
    it is not), then restored: the pool's process is reused by later tests."""
    from hf_zero.engine import whole
    from tests._training import sharded_run

    key = (LARS.__module__, LARS.__name__)
    whole.register_elementwise(LARS)
    try:
        return sharded_run(sc)
    finally:
        whole.ELEMENTWISE.discard(key)


def checkpoint_with_adafactor(directory: str) -> dict[str, Any]:
    """save_checkpoint / load_checkpoint with a whole-parameter optimizer: refused with a clear error on every
    rank (not silently without its state); the model alone saves and loads."""
    import hf_zero
    from tests._training import make_model

    model = make_model("llama")
    model, opt = hf_zero.initialize(model, torch.optim.Adafactor(model.parameters(), lr=1e-2), hf_zero.ZeroConfig(stage=3))
    hf_zero.save_checkpoint(directory, model)
    errors = []
    for call in (lambda: hf_zero.save_checkpoint(directory, model, opt),
                 lambda: hf_zero.load_checkpoint(directory, model, opt)):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    hf_zero.load_checkpoint(directory, model)
    return {"errors": errors, "whole": opt.steps_whole_parameters}
