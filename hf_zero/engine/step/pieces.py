"""`Piece`: the part of one parameter a rank's shard holds, and the chunks the optimizer steps it in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...dtypes import AT_ONCE_NUMEL
from ..flat import FlatPart

OPTIMIZER_CHUNK_NUMEL = AT_ONCE_NUMEL  # [Note: optimizer chunks]: at most 16 MiB of fp32 per optimizer tensor


def chunk_bounds(numel: int) -> tuple[tuple[int, int], ...]:
    """The `[a, b)` ranges a piece of `numel` elements is stepped in ([Note: optimizer chunks]).

    Example:

    ```python
    >>> chunk_bounds(OPTIMIZER_CHUNK_NUMEL + 1)
    ((0, 4194304), (4194304, 4194305))
    ```
    """
    return tuple((a, min(a + OPTIMIZER_CHUNK_NUMEL, numel)) for a in range(0, max(numel, 1), OPTIMIZER_CHUNK_NUMEL))


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that this rank's shard holds: elements `[start, end)` of the
    flattened parameter, as views of the unit's master and gradient shards.

    [Note: optimizer chunks]
    An elementwise optimizer written per tensor (torch's AdamW without `foreach`, the default on
    the CPU) allocates temporaries of the size of the tensor it updates: two for AdamW's
    denominator. Stepping the 62.5 MiB piece of a 32000 x 1024 head would put 125 MiB on top of
    every model state at once, the largest transient of the whole step. So the optimizer gets
    each piece as chunks of at most `OPTIMIZER_CHUNK_NUMEL` elements (`optim_params`, views of
    `master`): the math is the same, elementwise, and the transient is bounded by two chunks.
    Checkpoints stay keyed by parameter: the chunks' states are joined on save and split on load.
    """

    name: str  # the parameter's first qualified name
    param: nn.Parameter
    start: int
    end: int
    master: torch.Tensor  # 1D view of FlatPart.sharded_master (0 elements when it is on disk: ask `part.store`)
    part: FlatPart
    local: tuple[int, int]  # the same range in the unit's shard coordinates
    bounds: tuple[tuple[int, int], ...]  # `chunk_bounds` of the piece, in `master` coordinates
    optim_params: tuple[torch.Tensor, ...]  # views of `master` at `bounds`: what the optimizer steps
    slot_index: int  # the parameter's index in its unit

    @property
    def grad(self) -> torch.Tensor:
        """1D view of the unit's `sharded_grad` (allocating it on first use)."""
        return self.part.grads.shard[self.local[0] : self.local[1]]

    def bind_grads(self, used: bool) -> None:
        """Point each optimizer chunk's `.grad` at its part of the gradient shard, or None when the unit
        got no reduction since `zero_grad` ([Note: gradient shard lifetime]) or the parameter got no
        gradient on any rank (`used`, [Note: unused parameters]); zeros for a parameter `used` whose unit got no
        reduction ([Note: zero gradients kept] in stepping.py)."""
        grad = self.grad if used else None
        for t, (a, b) in zip(self.optim_params, self.bounds):
            t.grad = None if grad is None else grad[a:b]

    def unbind_grads(self) -> None:
        for t in self.optim_params:
            t.grad = None


def pieces_of(part: FlatPart) -> list[Piece]:
    """This rank's pieces of `part`'s parameters ([Note: optimizer chunks]), their tensors from the part's master
    store ([Note: master stores]: views of the master, or empty tensors a disk window points at its buffers)."""
    lo, _ = part.layout.shard_range(part.shard_group.rank)
    pieces = []
    for slot_index, start, end in part.layout.local_pieces(part.shard_group.rank):
        slot = part.layout.slots[slot_index]
        bounds = chunk_bounds(end - start)
        master, chunks = part.store.piece_tensors(start - lo, end - lo, bounds)
        pieces.append(
            Piece(
                name=slot.name,
                param=part.params[slot_index],
                start=start - slot.offset,
                end=end - slot.offset,
                master=master,
                part=part,
                local=(start - lo, end - lo),
                bounds=bounds,
                optim_params=chunks,
                slot_index=slot_index,
            )
        )
    return pieces


def hand_over(inner: torch.optim.Optimizer, piece: Piece, whole: dict[str, Any], flat: set[str]) -> None:
    """Give a piece's state (`whole`: each entry whole over the piece; `flat`: the elementwise keys, cut per chunk;
    a `None` entry: read in place already) to where it lives: the offload files, or the optimizer's chunks. A
    loaded state ([Note: one-pass load] in checkpoint/sequential.py) and one set at construction ([Note: state set at
    construction] in optim.py) go the same way."""
    if piece.part.store.take_state(piece.local[0], whole, flat):  # [Note: master stores]: into the files
        for t in piece.optim_params:
            inner.state[t] = {
                k: v.clone() if isinstance(v, torch.Tensor) and v.numel() else v for k, v in whole.items()
            }
        return
    for t, (a, b) in zip(piece.optim_params, piece.bounds):  # [Note: optimizer chunks]
        kept = inner.state.get(t, {})  # read in place (None in `whole`)
        inner.state[t] = {
            key: kept[key]
            if value is None
            else value[a:b]
            if key in flat
            else value.clone()
            if isinstance(value, torch.Tensor)
            else value
            for key, value in whole.items()
        }
