"""The causal-LM loss computed from the hidden states in tiles: no (tokens x vocabulary) logits tensor exists whole.

[Note: tiled loss]
A model's LM head turns each token's hidden state into a row of vocabulary logits, and the loss upcasts them
to fp32 and takes log-probabilities: per token 10 bytes per vocabulary entry under bf16 (4 in fp32 twice, plus
the bf16 logits), 320 KB per token for a 32k vocabulary, more than a 0.84B LLaMA's checkpointed layers keep per
token. Under sequence parallelism ([Note: sequence parallelism]) in training with labels, the head's forward
is replaced for the call by `tiled_cross_entropy`: tiles of `tile_rows` tokens go through the head and the
cross-entropy one at a time, only their summed loss is kept; the backward recomputes each tile's logits and
gives the hidden states and the head's weight their gradients. The engine's hooks see the head's module called
as usual (gathered for the forward and again for the backward at stage 3). The result is the sum over the
rank's labelled tokens divided by the micro-batch's count, as transformers' loss with `num_items_in_batch`.
The model returns it as its logits and computes no loss of its own (it was given no labels); the model's
output must be the head's output itself (a model that scales or caps its logits after the head is refused).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE = -100
TILE_BYTES = 256 << 20  # fp32 logits of one tile


def tile_rows(vocab: int) -> int:
    """Tokens per tile: `TILE_BYTES` of fp32 logits."""
    return max(1, TILE_BYTES // (4 * vocab))


class _TiledCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        count: torch.Tensor,
        rows: int,
    ) -> torch.Tensor:
        flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).to(hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for lo in range(0, flat.shape[0], rows):
            logits = F.linear(flat[lo : lo + rows], weight, bias).float()
            total += F.cross_entropy(logits, targets[lo : lo + rows], ignore_index=IGNORE, reduction="sum")
        ctx.save_for_backward(hidden, weight, bias, labels, count)
        ctx.rows = rows
        return total / count.to(total.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, labels, count = ctx.saved_tensors
        rows = ctx.rows
        flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).to(hidden.device)
        scale = grad.float() / count.to(grad.device)
        d_hidden = torch.empty_like(flat)
        d_weight = torch.zeros_like(weight, dtype=torch.float32)
        d_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None else None
        for lo in range(0, flat.shape[0], rows):
            part, target = flat[lo : lo + rows], targets[lo : lo + rows]
            probs = torch.softmax(F.linear(part, weight, bias).float(), dim=-1)
            kept = target != IGNORE
            probs[kept, target[kept]] -= 1.0  # d(cross-entropy)/d(logits) of a labelled token
            probs[~kept] = 0.0
            g = (probs * scale).to(weight.dtype)
            d_hidden[lo : lo + rows] = g @ weight
            d_weight += (g.t() @ part).float()
            if d_bias is not None:
                d_bias += g.float().sum(0)
        return (
            d_hidden.view_as(hidden),
            d_weight.to(weight.dtype),
            None if d_bias is None else d_bias.to(bias.dtype),
            None,
            None,
            None,
        )


def tiled_cross_entropy(
    hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """Sum over the tokens of `hidden` (batch, tokens, hidden) of the cross-entropy of `head`'s logits against
    `labels` (already shifted; `-100` ignored), divided by `count`, in tiles ([Note: tiled loss])."""
    weight = head.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"hf_zero's tiled loss needs an LM head with a weight tensor; {type(head).__name__} has none.")
    bias = getattr(head, "bias", None)
    out: torch.Tensor = _TiledCrossEntropy.apply(hidden, weight, bias, labels, count, tile_rows(int(weight.shape[0])))
    return out
