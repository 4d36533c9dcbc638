"""`EngineFacade`: what the code beside the engine (checkpoints, integrations, features) uses of it.

[Note: engine facade]
Checkpoints read and write a rank's shards, and the integrations ask where the model computes; neither needs the
engine's plan, hooks, loss scaler, disk store or call-order record, which change with the engine. They take the
engine through this facade (`facade_of(model)`): named facts (the ranks of the shard and replica groups, the loss
scale, whether masters live in offload files), named verbs (a call's header, waiting for the reductions, settling
the masters, gathering units) and the two records a checkpoint is made of: this rank's `pieces` (a parameter's
slice of the shard: name, range, master views, optimizer tensors) and the flat `parts` holding them. A test
checks that nothing under `checkpoint/`, `integrations/` or `features/` reaches past it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch
from torch import nn

from .checks.call_order import Call
from .collectives import CommGroup
from .module import get_engine

if TYPE_CHECKING:
    from .engine import ZeroEngine
    from .flat import FlatPart
    from .step.pieces import Piece
    from .unit import Unit


def facade_of(model: nn.Module) -> EngineFacade:
    """The facade of the engine of `model` (a model `hf_zero.initialize` returned); `ValueError` for any other."""
    return EngineFacade(get_engine(model))


class EngineFacade:
    """The engine as checkpoints and integrations see it ([Note: engine facade]).

    Example:

    ```python
    >>> engine = facade_of(model)
    >>> engine.shard_rank, engine.shard_size, [p.name for p in engine.pieces][:2]
    (0, 2, ['model.embed_tokens.weight', 'model.layers.0.self_attn.q_proj.weight'])
    ```
    """

    __slots__ = ("_engine",)

    def __init__(self, engine: ZeroEngine) -> None:
        self._engine = engine

    @property
    def key(self) -> int:
        """The same number for every facade of one engine (asynchronous saves are kept by it)."""
        return id(self._engine)

    # ---- where and how it computes ----------------------------------------------------------
    @property
    def world(self) -> CommGroup:
        return self._engine.world

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def stage(self) -> int:
        return self._engine.config.stage

    @property
    def param_dtype(self) -> torch.dtype:
        return self._engine.param_dtype

    @property
    def master_dtype(self) -> torch.dtype:
        return self._engine.master_dtype

    @property
    def host_pinned(self) -> bool:
        return self._engine.host_pinned

    @property
    def shard_rank(self) -> int:
        return self._engine.plan.shard_group.rank

    @property
    def shard_size(self) -> int:
        return self._engine.plan.shard_group.size

    @property
    def replica_rank(self) -> int:
        return self._engine.plan.replicate_group.rank

    @property
    def writes_shards(self) -> bool:
        return self._engine.writes_shards

    @property
    def save_group(self) -> CommGroup:
        return self._engine.save_group

    @property
    def masters_on_disk(self) -> bool:
        """Whether the masters and the optimizer's state live in offload files ([Note: disk offload])."""
        return self._engine.disk is not None

    @property
    def loss_scale(self) -> float | None:
        """The fp16 loss scale, or None without one."""
        scaler = self._engine.scaler
        return None if scaler is None else scaler.scale

    def set_loss_scale(self, scale: float) -> None:
        """Resume the fp16 loss scale (a no-op without one)."""
        if self._engine.scaler is not None:
            self._engine.scaler.scale = scale

    # ---- what a checkpoint is made of -------------------------------------------------------------
    @property
    def pieces(self) -> tuple[Piece, ...]:
        """This rank's slice of each parameter in its shards, in the units' order."""
        return tuple(self._engine.pieces)

    @property
    def parts(self) -> tuple[FlatPart, ...]:
        """The flat parts that hold the shards, in the units' order."""
        return tuple(self._engine.parts)

    @property
    def units(self) -> tuple[Unit, ...]:
        return tuple(self._engine.units)

    def slot_shapes(self) -> dict[str, list[int]]:
        """Every parameter's shape, by its first name."""
        return {slot.name: list(slot.shape) for part in self._engine.parts for slot in part.layout.slots}

    def owns_params(self, params: list[torch.Tensor]) -> bool:
        """Whether each of `params` (or what a module holds in its place) is one of the engine's parameters."""
        ours = {id(p) for part in self._engine.parts for p in part.params}
        return all(id(self._engine.compute_param(p)) in ours for p in params)

    def module_state(self, *, with_params: bool) -> dict[str, torch.Tensor]:
        return self._engine.module_state(with_params=with_params)

    def keeps_dtype(self, buffer: torch.Tensor) -> bool:
        return self._engine.keeps_dtype(buffer)

    def name_of(self, param: torch.Tensor) -> str:
        return self._engine.name_of(param)

    def compute_param(self, param: torch.Tensor) -> torch.Tensor:
        return self._engine.compute_param(param)

    # ---- verbs ----------------------------------------------------------------------------------
    def begin_call(self, call: Call) -> None:
        """The header of a collective call ([Note: call order]), read at once."""
        self._engine.calls.begin(call, read_now=True)

    def wait_reductions(self) -> None:
        """Wait for every gradient reduction in flight."""
        self._engine.hooks.wait_reductions()

    def refresh_masters(self) -> None:
        self._engine.refresh_masters()

    def loaded_masters(self, dtypes: Mapping[str, str]) -> None:
        """A checkpoint's masters were loaded, each parameter saved in `dtypes[name]` ([Note: requires_grad after
        initialize] in unfreeze.py)."""
        self._engine.frozen.loaded(dtypes)

    def zero_grad(self, *, abandon_pass: bool = False) -> None:
        self._engine.zero_grad(abandon_pass=abandon_pass)

    def use_directly(self, module: nn.Module) -> None:
        """[Note: direct use] in hooks.py: `module`'s unit is read without its forward being called."""
        self._engine.use_directly(module)

    def as_unwrapped(self) -> AbstractContextManager[None]:
        return self._engine.as_unwrapped()

    @property
    def generation_needs_sync(self) -> bool:
        return self._engine.generation_needs_sync

    @property
    def in_root_forward(self) -> bool:
        """Whether the model's forward is running inside its `__call__` ([Note: forward called directly])."""
        return self._engine.hooks.current.in_root_forward

    @property
    def gathers_each_forward(self) -> bool:
        """Whether every forward gathers the parameters (stage 3: they rest as shards between uses)."""
        return self._engine.plan.params.uses_gather

    def gather_units(
        self, *, rank0_only: bool = True, device: torch.device | str = "cpu", trainable_only: bool = False
    ) -> Iterator[list[tuple[str, nn.Parameter, torch.Tensor]]]:
        return self._engine.gather_units(rank0_only=rank0_only, device=device, trainable_only=trainable_only)
