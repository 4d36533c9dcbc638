"""The flat layout of one unit: where each parameter lives in the unit's 1D buffer, and each rank's shard.

See [Note: flat layout] in flat.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its unit's flat buffer."""

    name: str
    shape: torch.Size
    offset: int
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """The flat layout of one unit for a given number of shards (metadata only)."""

    slots: tuple[ParamSlot, ...]
    numel: int  # sum of the parameters' numels
    shard_numel: int  # elements each rank holds
    num_shards: int

    @staticmethod
    def build(names: tuple[str, ...], shapes: list[torch.Size], num_shards: int, align: int = 1) -> FlatLayout:
        """Parameters end to end; each shard holds a multiple of `align` elements (quantized collectives)."""
        slots, offset = [], 0
        for name, shape in zip(names, shapes):
            n = math.prod(shape)
            slots.append(ParamSlot(name, torch.Size(shape), offset, n))
            offset += n
        shard = max(1, math.ceil(offset / num_shards))
        return FlatLayout(tuple(slots), offset, math.ceil(shard / align) * align, num_shards)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.num_shards

    def shard_range(self, shard_rank: int) -> tuple[int, int]:
        start = shard_rank * self.shard_numel
        return start, start + self.shard_numel

    def local_pieces(self, shard_rank: int) -> list[tuple[int, int, int]]:
        """`(slot index, start, end)` in flat coordinates of each parameter piece this rank holds."""
        lo, hi = self.shard_range(shard_rank)
        pieces = []
        for i, slot in enumerate(self.slots):
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < end:
                pieces.append((i, start, end))
        return pieces
