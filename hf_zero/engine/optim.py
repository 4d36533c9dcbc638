"""`ShardedOptimizer`: the user's optimizer, stepping only this rank's shards of the master weights.

[Note: optimizer shards]
The user builds any elementwise `torch.optim.Optimizer` (AdamW, Adam, SGD, ...) over
`model.parameters()`, with its own param groups and per-group hyperparameters. `initialize`
keeps that optimizer object and replaces each group's `params` by the pieces of those
parameters that fall into this rank's shard: 1D views of the units' `sharded_master` (in
chunks of bounded size, [Note: optimizer chunks] in engine.py), whose `.grad` are the matching
views of `sharded_grad`. So the optimizer updates the master shards in
place, with every group's hyperparameters intact, and its state is created for the shards only.
Optimizers that need a parameter's full shape (Adafactor's factored moments, Shampoo) are not
elementwise and are refused for stages 1-3.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .engine import ZeroEngine

_NOT_ELEMENTWISE = ("Adafactor", "Shampoo", "LBFGS", "Muon")


def shard_optimizer(optimizer: torch.optim.Optimizer, engine: ZeroEngine) -> "ShardedOptimizer":
    """Rewrite `optimizer`'s groups onto this rank's shards and wrap it (see [Note: optimizer shards])."""
    by_param = {id(piece.param): piece for piece in engine.pieces}
    group_names: list[list[str]] = []
    for group in optimizer.param_groups:
        pieces, names = [], []
        for param in group["params"]:
            param = engine.compute_param(param)  # built over meta parameters or stand-ins: the engine's own
            piece = by_param.get(id(param))
            if piece is not None:  # in chunks ([Note: optimizer chunks]); `.grad` is bound by each step
                pieces.extend(piece.optim_params)
            names.append(engine.name_of(param))
        group["params"] = pieces
        group_names.append(names)
    optimizer.state.clear()
    return ShardedOptimizer(optimizer, engine, group_names)


def check_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module, stage: int, engine: ZeroEngine | None = None
) -> None:
    """Raise a clear error for an optimizer that `initialize` (or, with the model's `engine`,
    `attach_optimizer`) cannot shard."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"hf_zero.initialize expects a torch.optim.Optimizer built over model.parameters(); got "
            f"{type(optimizer).__name__}."
        )
    if isinstance(optimizer, ShardedOptimizer):
        raise ValueError("This optimizer is already sharded by hf_zero.initialize; pass the original optimizer once.")
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError(
            "The optimizer already holds state (it has taken a step). Call hf_zero.initialize before "
            "training, or load the state afterwards with hf_zero.load_checkpoint."
        )
    if stage > 0 and type(optimizer).__name__ in _NOT_ELEMENTWISE:
        raise ValueError(
            f"{type(optimizer).__name__} needs each parameter's full shape and cannot step on flat shards. "
            "Use an elementwise optimizer (AdamW, Adam, SGD, ...) or zero stage 0."
        )
    model_params = {id(p) for p in model.parameters()}
    if engine is not None:  # the engine's own parameters too: the modules may hold their stand-ins now
        model_params |= {id(p) for unit in engine.units for p in unit.params}
    for i, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in model_params:
                raise ValueError(
                    f"Param group {i} of the optimizer holds a tensor of shape {tuple(param.shape)} that is not "
                    "a parameter of the model. Build the optimizer over model.parameters()."
                )


class ShardedOptimizer(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` whose step updates this rank's shards, then refreshes the parameters.

    `param_groups` are the user's own groups (same dicts, so LR schedulers and the Trainer's
    weight-decay groups act on them directly); each group's `params` holds this rank's shard
    pieces. Returned by `hf_zero.initialize`.

    Example:

    ```python
    >>> model, optimizer = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    >>> scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    >>> model(**batch).loss.backward()
    >>> norm = optimizer.clip_grad_norm_(1.0)
    >>> optimizer.step(); scheduler.step(); optimizer.zero_grad()
    ```
    """

    _is_accelerate_prepared = True  # Accelerate must not wrap it again

    def __init__(self, optimizer: torch.optim.Optimizer, engine: ZeroEngine, group_names: list[list[str]]) -> None:
        self.optimizer = optimizer
        self._engine = engine
        self.group_param_names = group_names  # the parameter names of each group, on every rank
        self._initializing = True
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._initializing = False
        self.param_groups = optimizer.param_groups  # one list, shared with the inner optimizer
        self.state = optimizer.state
        self.step_was_skipped = False
        engine.optimizer = optimizer

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._initializing:
            return super().add_param_group(param_group)
        raise NotImplementedError(
            "hf_zero cannot add a param group after initialize: build the optimizer with every group first."
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update this rank's shards and gather the new parameters. Skipped (returns early) when no
        gradient was reduced since `zero_grad`, or when an fp16 overflow was found."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_attached("step")
        self.step_was_skipped = not self._engine.step(self.optimizer)
        return loss

    def _check_attached(self, what: str) -> None:
        if self._engine.optimizer is not self.optimizer:
            raise RuntimeError(
                f"[rank {self._engine.world.rank}] hf_zero: optimizer.{what}() on an optimizer that was released "
                "when another one was attached to the same model (a second ZeroTrainer, hf_zero.initialize or "
                "hf_zero.attach_optimizer); use the optimizer that call returned."
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the sharded (and any held unsharded) gradients of the model."""
        self._check_attached("zero_grad")
        self._engine.zero_grad()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over every rank's shards; returns that norm (equal to the unsharded one).

        Example:

        ```python
        >>> total_norm = optimizer.clip_grad_norm_(1.0)
        ```
        """
        return self._engine.clip_grad_norm_(max_norm, norm_type)

    def state_dict(self) -> dict[str, Any]:
        self._refuse_on_disk("state_dict")
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._refuse_on_disk("load_state_dict")
        self.optimizer.load_state_dict(state_dict)

    def _refuse_on_disk(self, what: str) -> None:
        if self._engine.disk is not None:
            raise ValueError(
                f"optimizer.{what}() cannot hold the optimizer state of a run with ZeroConfig.offload_dir: the "
                "state lives in the offload files ([Note: disk offload]); use hf_zero.save_checkpoint / "
                "hf_zero.load_checkpoint, which stream it from and to the files."
            )
