"""The causal-LM loss computed from the hidden states in tiles: no (tokens x vocabulary) logits tensor exists whole.

[Note: tiled loss]
A model's LM head turns each token's hidden state into a row of vocabulary logits, and the loss upcasts them
to fp32 and takes log-probabilities: per token 10 bytes per vocabulary entry under bf16 (4 in fp32 twice, plus
the bf16 logits), 320 KB per token for a 32k vocabulary, more than a 0.84B LLaMA's checkpointed layers keep per
token. Under sequence parallelism ([Note: sequence parallelism]) in training with labels, the head's forward
is replaced for the call by `tiled_cross_entropy`: tiles of `tile_rows` tokens go through the head and the
cross-entropy one at a time, and while a tile's logits exist their gradient (softmax minus the label, in the
logits' memory) is turned into the gradients of the hidden states and the head's weight and bias; only the
summed loss and those gradients are kept, and the backward scales them by the gradient it receives. So the
vocabulary matmul runs three times per token (as without tiles), not four, and the gradients are held from the
head's forward to its backward, which the model's backward reaches first. Under `no_grad` only the loss is
computed, and a frozen head (LoRA) gets no weight gradient computed or held. The engine's hooks see the head's
module called as usual (gathered for the forward and again for the backward at stage 3). The result is the sum
over the rank's labelled tokens divided by the micro-batch's count, as transformers' loss with
`num_items_in_batch`.
The model returns it as its logits and computes no loss of its own (it was given no labels); the model's
output must be the head's output itself (a model that scales or caps its logits after the head is refused).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE = -100
TILE_BYTES = 64 << 20  # fp32 logits of one tile


def tile_rows(vocab: int) -> int:
    """Tokens per tile: `TILE_BYTES` of fp32 logits."""
    return max(1, TILE_BYTES // (4 * vocab))


class _TiledCrossEntropy(torch.autograd.Function):
    """Forward: the loss and, when a gradient is wanted, the gradients of the hidden states and the head's
    weight and bias per unit of loss, from the same tile of logits (no second pass over the vocabulary in the
    backward); backward: those gradients times the incoming scalar."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        count: torch.Tensor,
        rows: int,
        grads: bool,
    ) -> torch.Tensor:
        flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).to(hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        wants = [grads and bool(ctx.needs_input_grad[i]) for i in range(3)]  # a frozen head (LoRA): none for it
        d_hidden = torch.empty_like(flat) if wants[0] else None
        d_weight = torch.zeros_like(weight, dtype=torch.float32) if wants[1] else None
        d_bias = torch.zeros_like(bias, dtype=torch.float32) if wants[2] and bias is not None else None
        for lo in range(0, flat.shape[0], rows):
            part, target = flat[lo : lo + rows], targets[lo : lo + rows]
            logits = F.linear(part, weight, bias).float()
            kept = target != IGNORE
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += torch.where(kept, lse - picked, 0.0).sum()
            if not any(wants):
                continue
            probs = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in the logits' memory
            probs[kept, target[kept]] -= 1.0  # d(cross-entropy)/d(logits) of a labelled token
            probs[~kept] = 0.0
            g = probs.to(weight.dtype)
            if d_hidden is not None:
                d_hidden[lo : lo + rows] = g @ weight
            if d_weight is not None:
                d_weight += (g.t() @ part).float()
            if d_bias is not None:
                d_bias += g.float().sum(0)
        ctx.save_for_backward(
            d_hidden.view_as(hidden) if d_hidden is not None else None,
            d_weight.to(weight.dtype) if d_weight is not None else None,
            d_bias.to(bias.dtype) if d_bias is not None and bias is not None else None,
            count,
        )
        return total / count.to(total.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        d_hidden, d_weight, d_bias, count = ctx.saved_tensors
        scale = grad.float() / count.to(grad.device)
        return tuple(None if d is None else (d * scale).to(d.dtype) for d in (d_hidden, d_weight, d_bias)) + (
            None,
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
    params = (hidden, weight) if bias is None else (hidden, weight, bias)
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in params)  # no gradients under no_grad
    rows = tile_rows(int(weight.shape[0]))
    out: torch.Tensor = _TiledCrossEntropy.apply(hidden, weight, bias, labels, count, rows, grads)
    return out
