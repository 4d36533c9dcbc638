"""Where a unit's initial values come from: the model's own parameters, or elsewhere (files).

A source fills this rank's master shard of one unit (`out`, 1D, padded positions zeroed); the
unit then derives its compute parameters from that shard (all-gather for persistent stages, a
cast at stage 3). So a source that reads files touches only this rank's ranges of the weights.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from .collectives import CommGroup, broadcast_
from .layout import FlatLayout


class ShardSource(Protocol):
    """Fills one unit's master shard for `shard_rank` into `out`; told first which units it will fill, in order."""

    def prepare(self, units: list[tuple[FlatLayout, tuple[nn.Parameter, ...], int]]) -> None: ...

    def fill(
        self, layout: FlatLayout, params: tuple[nn.Parameter, ...], shard_rank: int, out: torch.Tensor
    ) -> None: ...


class LiveParams:
    """Values from the model's materialized parameters; with `sync_from`, rank 0's (broadcast)."""

    def __init__(self, sync_from: CommGroup | None) -> None:
        self.sync_from = sync_from

    def prepare(self, units: list[tuple[FlatLayout, tuple[nn.Parameter, ...], int]]) -> None:
        """Nothing to read ahead: the values are in memory."""

    def fill(self, layout: FlatLayout, params: tuple[nn.Parameter, ...], shard_rank: int, out: torch.Tensor) -> None:
        full = torch.zeros(layout.padded_numel, dtype=out.dtype, device=out.device)  # one unit at a time
        for slot, p in zip(layout.slots, params):
            full[slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))
        if self.sync_from is not None:
            broadcast_(full, self.sync_from)
        lo, hi = layout.shard_range(shard_rank)
        out.copy_(full[lo:hi])
