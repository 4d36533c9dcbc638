"""The collectives of sequence parallelism, differentiable: each one's backward is the collective that moves the
gradient back the way the values came ([Note: sequence parallelism] in `hf_zero/features/sequence_parallel.py`).

- `all_to_all_dims(x, group, split_dim, cat_dim)`: `x` cut into `group.size` slices along `split_dim`, slice j
  sent to rank j, the slices received joined along `cat_dim` in rank order. With `split_dim` the heads and
  `cat_dim` the sequence, a rank holding every head of its tokens comes to hold its heads of every token (and
  back). Its backward is the same exchange with the two dimensions swapped.
- `gather_dim(x, group, dim)`: every rank's `x` joined along `dim`; its backward sums the gradients of the
  whole over the ranks and keeps this rank's slice (a reduce-scatter, carried as an all-to-all and a sum).
Both go through `ops` (staged to the communication device where needed).
"""

from __future__ import annotations

from typing import Any

import torch

from .group import CommGroup
from .ops import all_gather_into, all_to_all_into


def _exchange(x: torch.Tensor, group: CommGroup, split_dim: int, cat_dim: int) -> torch.Tensor:
    rows = torch.stack(x.chunk(group.size, dim=split_dim))  # (size, *slice): row j goes to rank j
    received = torch.empty_like(rows)
    all_to_all_into(received.view(group.size, -1), rows.view(group.size, -1), group)
    return torch.cat(received.unbind(0), dim=cat_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup, split_dim: int, cat_dim: int) -> torch.Tensor:
        ctx.group, ctx.split_dim, ctx.cat_dim = group, split_dim, cat_dim
        return _exchange(x.contiguous(), group, split_dim, cat_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad.contiguous(), ctx.group, ctx.cat_dim, ctx.split_dim), None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        x = x.contiguous()
        received = x.new_empty((group.size, *x.shape))
        all_gather_into(received.view(-1), x.view(-1), group)
        return torch.cat(received.unbind(0), dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        group = ctx.group
        rows = torch.stack(grad.contiguous().chunk(group.size, dim=ctx.dim))  # rank j's slice goes to rank j
        received = torch.empty_like(rows)
        all_to_all_into(received.view(group.size, -1), rows.view(group.size, -1), group)
        return received.sum(0), None, None


def all_to_all_dims(x: torch.Tensor, group: CommGroup, split_dim: int, cat_dim: int) -> torch.Tensor:
    """See the module's docstring; `x.shape[split_dim]` must be a multiple of `group.size`."""
    if group.size == 1:
        return x
    if x.shape[split_dim] % group.size:
        raise RuntimeError(
            f"[rank {group.global_rank}] hf_zero: dimension {split_dim} of size {x.shape[split_dim]} does not split "
            f"into {group.size} ranks"
        )
    out: torch.Tensor = _AllToAll.apply(x, group, split_dim, cat_dim)
    return out


def gather_dim(x: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
    """Every rank's `x` (of one shape) joined along `dim`, in rank order; differentiable."""
    if group.size == 1:
        return x
    out: torch.Tensor = _Gather.apply(x, group, dim)
    return out
