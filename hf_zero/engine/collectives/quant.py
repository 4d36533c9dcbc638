"""Quantized collectives: int8 with per-block scales for stage 3's weight gathers and for gradient
reductions (DeepSpeed's ZeRO++ qwZ and qgZ), built on the collectives of `collectives/ops.py`.

[Note: block quantization]
A 1D tensor is cut into blocks of `block` elements (the last one zero-padded); each block keeps
one fp32 scale, its largest magnitude / 127, and its values as `round(x / scale)` in int8
(symmetric: zero stays exactly zero, a block of zeros gets scale 0 and dequantizes to zeros).
The error of an element is at most half a step, `scale / 2`: about 0.4% of the block's largest
magnitude. Only what travels is rounded: master weights, optimizer state and gradient shards
stay in their own dtypes, so the rounding of one step does not carry into the next.

- Weights (`gather_int8`): every rank quantizes its shard, the int8 blocks and the scales are
  all-gathered (two collectives, 1 + 4/block bytes per element), and each rank dequantizes the
  whole into the unsharded parameter, its own shard included, so every rank computes with the
  same weights.
- Gradients (`reduce_scatter_int8`): a reduce-scatter cannot add int8 numbers of different
  scales, so each rank quantizes the row every other rank owns and an all-to-all delivers the
  rows to their owners, which dequantize and sum in fp32.
"""

from __future__ import annotations

import math

import torch

from .group import CommGroup, Pending
from .ops import all_gather_into, all_to_all_into

_HOST_PIECE = 1 << 20  # elements quantized per pass on the host


def quantize_blocks(
    x: torch.Tensor,
    block: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (1D, or 2D with rows quantized separately) as int8 blocks and fp32 scales.

    Returns `(q, scales)`: `q` of shape `(rows, blocks * block)` int8 and `scales` `(rows, blocks)` fp32,
    written into `out` (contiguous tensors of those numbers of elements) when given. A row whose length
    is a multiple of `block` (what the engine's aligned layouts give) is read in place; others are
    zero-padded first.

    Example:
        >>> x = torch.tensor([1.0, -0.5, 0.25, 0.0, 0.0])
        >>> q, s = quantize_blocks(x, block=2)
        >>> q.shape, s.shape
        (torch.Size([1, 6]), torch.Size([1, 3]))
        >>> bool(((dequantize_blocks(q, s, 5, torch.float32) - x).abs() <= s.repeat_interleave(2)[:5] / 2).all())
        True
    """
    rows = x.reshape(1, -1) if x.dim() == 1 else x
    n = rows.shape[1]
    blocks = max(1, math.ceil(n / block))
    if n != blocks * block or not rows.is_contiguous():
        padded = rows.new_zeros(rows.shape[0], blocks * block)
        padded[:, :n] = rows
        rows = padded
    flat = rows.view(-1, block)  # every block of every row
    if out is None:
        q = torch.empty(flat.shape, dtype=torch.int8, device=x.device)
        scales = torch.empty(flat.shape[0], dtype=torch.float32, device=x.device)
    else:
        q, scales = out[0].view(flat.shape), out[1].view(flat.shape[0])
    # On the host, work through cache-sized pieces with one reused temporary (a fresh full-size one
    # costs more in page faults than the arithmetic); an accelerator takes the whole tensor at once.
    step = flat.shape[0] if x.device.type != "cpu" else max(1, _HOST_PIECE // block)
    scratch = torch.empty(min(step, flat.shape[0]), block, dtype=torch.float32, device=x.device)
    for i in range(0, flat.shape[0], step):
        part = flat[i : i + step]
        scale = torch.maximum(part.amin(dim=1).neg_(), part.amax(dim=1)).float().div_(127.0)
        scales[i : i + step] = scale
        inverse = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
        scaled = torch.mul(part, inverse.unsqueeze(1), out=scratch[: part.shape[0]])
        q[i : i + step].copy_(scaled.round_().clamp_(-127, 127))
    return q.view(rows.shape[0], blocks * block), scales.view(rows.shape[0], blocks)


def dequantize_blocks(
    q: torch.Tensor, scales: torch.Tensor, numel: int, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The inverse of `quantize_blocks`: `(rows, numel)` values in `dtype`, written into `out` when given."""
    rows, blocks = scales.shape
    block = q.shape[1] // blocks
    if out is not None and numel == blocks * block and out.is_contiguous():
        target = out.view(rows, blocks, block)
        target.copy_(q.view(rows, blocks, block))  # int8 -> dtype, then one in-place scaling: two fast passes
        target.mul_(scales.to(dtype).unsqueeze(2))
        return out.view(rows, numel)
    values = (q.view(rows, blocks, block).to(torch.float32) * scales.unsqueeze(2)).view(rows, -1)[:, :numel].to(dtype)
    if out is not None:
        out.view(rows, numel).copy_(values)
        return out.view(rows, numel)
    return values


def gather_workspace_numels(shard_numel: int, block: int, group_size: int) -> tuple[int, int]:
    """The elements of the int8 blocks and of the fp32 scales that `gather_int8` receives."""
    blocks = max(1, math.ceil(shard_numel / block))
    return group_size * blocks * block, group_size * blocks


def gather_int8(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: CommGroup,
    block: int,
    async_op: bool = False,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Pending:
    """All-gather `shard` into the 1D `output` in int8 ([Note: block quantization]); `output` is filled,
    dequantized into its dtype, when the returned `Pending` is waited on.

    `workspace`: the int8 and fp32 buffers the blocks and scales are gathered into (1D, of
    `gather_workspace_numels` elements), e.g. from a pool; fresh ones when None. The shard is quantized
    straight into this rank's part of them.
    """
    n = shard.numel()
    numel_q, numel_scales = gather_workspace_numels(n, block, group.size)
    if workspace is None:
        workspace = (
            torch.empty(numel_q, dtype=torch.int8, device=shard.device),
            torch.empty(numel_scales, dtype=torch.float32, device=shard.device),
        )
    all_q, all_scales = workspace[0].view(group.size, -1), workspace[1].view(group.size, -1)
    q, scales = quantize_blocks(shard, block, out=(all_q[group.rank], all_scales[group.rank]))

    def dequantize() -> None:
        dequantize_blocks(all_q, all_scales, n, output.dtype, out=output)

    pending = Pending.join(
        all_gather_into(all_q.view(-1), q.view(-1), group, async_op=True),
        all_gather_into(all_scales.view(-1), scales.view(-1), group, async_op=True),
        then=dequantize,
    )
    if not async_op:
        pending.wait()
    return pending


def reduce_scatter_int8(
    output: torch.Tensor, full: torch.Tensor, group: CommGroup, block: int, async_op: bool = False
) -> Pending:
    """Sum `full` (1D, `group.size * output.numel()`) over the group, this rank's row into `output`, with
    int8 traffic ([Note: block quantization]): an all-to-all of quantized rows, summed in fp32 by the owner."""
    n = output.numel()
    q, scales = quantize_blocks(full.view(group.size, n), block)
    got_q, got_scales = torch.empty_like(q), torch.empty_like(scales)

    def accumulate() -> None:  # fp32 sum of every rank's dequantized row
        blocks = got_scales.shape[1]
        total = torch.empty(blocks, got_q.shape[1] // blocks, dtype=torch.float32, device=got_q.device)
        scratch = torch.empty_like(total)
        for i in range(group.size):
            target = total if i == 0 else scratch
            target.copy_(got_q[i].view(blocks, -1)).mul_(got_scales[i].unsqueeze(1))
            if i:
                total.add_(scratch)
        output.copy_(total.view(-1)[:n])

    pending = Pending.join(
        all_to_all_into(got_q, q, group, async_op=True),
        all_to_all_into(got_scales, scales, group, async_op=True),
        then=accumulate,
    )
    if not async_op:
        pending.wait()
    return pending
