"""What one flat part and its gradients are built with: one record that both read.

The engine makes one `PartSettings` per part (engine.py, `ZeroEngine._part`); `FlatPart` (flat.py) keeps it and
hands the same record to its `FlatGrads` (grads.py), so a setting has one source and the two never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .collectives import CommGroup
from .layout import FlatLayout
from .placement import Placement
from .pool import BufferPool


@dataclass(frozen=True)
class PartSettings:
    """The settings of one flat part.

    Args:
        name: the qualified name of the part's unit (`""` for the root), for errors and accounting.
        layout: where each parameter lives in the flat buffer, and each rank's shard ([Note: flat layout]).
        shard_group: the ranks one shard of the part is spread over.
        replicate_group: the ranks holding the same shard (hybrid sharding; a group of one otherwise).
        placement: where the compute copy, the master and its optimizer state live ([Note: placement]).
        param_dtype: the compute dtype of the gathered parameters and their gradients.
        master_dtype: the dtype of the master shard the optimizer updates (the compute dtype for a frozen part).
        reduce_dtype: the dtype gradients are reduced in.
        pool: the memory of freed gathered parameters and gradients ([Note: buffer reuse]).
        persistent: stages 0-2: the unsharded parameters are kept whole, never freed.
        weight_quant_block: int8 gathers at stage 3 with this block ([Note: block quantization]); `None`: exact.
        grad_quant_block: int8 gradient reductions with this block; `None`: exact.
    """

    name: str
    layout: FlatLayout
    shard_group: CommGroup
    replicate_group: CommGroup
    placement: Placement
    param_dtype: torch.dtype
    master_dtype: torch.dtype
    reduce_dtype: torch.dtype
    pool: BufferPool
    persistent: bool
    weight_quant_block: int | None = None
    grad_quant_block: int | None = None


class ReadsPartSettings:
    """The fields of a `PartSettings` record, read-only, for a class that keeps one as `settings` (`FlatPart`,
    `FlatGrads`): each setting is stored once, in the record, and read the same way everywhere."""

    settings: PartSettings

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def layout(self) -> FlatLayout:
        return self.settings.layout

    @property
    def shard_group(self) -> CommGroup:
        return self.settings.shard_group

    @property
    def replicate_group(self) -> CommGroup:
        return self.settings.replicate_group

    @property
    def placement(self) -> Placement:
        return self.settings.placement

    @property
    def param_dtype(self) -> torch.dtype:
        return self.settings.param_dtype

    @property
    def master_dtype(self) -> torch.dtype:
        return self.settings.master_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.settings.reduce_dtype

    @property
    def pool(self) -> BufferPool:
        return self.settings.pool

    @property
    def persistent(self) -> bool:
        return self.settings.persistent

    @property
    def weight_quant_block(self) -> int | None:
        return self.settings.weight_quant_block

    @property
    def grad_quant_block(self) -> int | None:
        return self.settings.grad_quant_block

    @property
    def device(self) -> torch.device:
        """The compute device."""
        return self.settings.placement.device

    @property
    def master_device(self) -> torch.device:
        """Where the master shard, its gradient and the optimizer state live."""
        return self.settings.placement.master_device
