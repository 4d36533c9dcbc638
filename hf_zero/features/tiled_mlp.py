"""The decoder's MLPs computed over the sequence in tiles, each tile recomputed in its own backward.

[Note: tiled MLP]
At long sequences the largest activations of a decoder layer are its MLP's: the gate and up projections, the
activation and their product, each tokens x intermediate (2.7x to 4x the hidden size), all kept for the backward
(with gradient checkpointing: in the layer's recompute). An MLP computes each token alone, so with
`ZeroConfig(tiled_mlp=True)` each decoder MLP (a submodule named `mlp`, as in LLaMA, Mistral, Qwen2, Gemma,
Falcon, GPT-NeoX) runs, in a training forward over more tokens than one tile holds, on tiles of the sequence, each
under a non-reentrant checkpoint: only the tile's input is kept, and the tile's intermediates exist again only
during that tile's backward. The peak of the MLP is one tile's (`TILE_BYTES` of intermediates) instead of the
whole sequence's; the cost is one more forward of the MLP per step. Outputs and gradients are those of the untiled
MLP (per-token arithmetic; sums over tokens taken tile by tile). It composes with sequence parallelism (tiles of
the rank's tokens) and with the model's own gradient checkpointing. Evaluation and `no_grad` forwards run untiled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

TILE_BYTES = 16 << 20  # of one tile's widest intermediate


def check(model: nn.Module) -> None:
    """Raise `ValueError` where the model has no decoder MLP to tile."""
    if not _mlps(model):
        raise ValueError(
            f"ZeroConfig.tiled_mlp: {type(model).__name__} has no decoder MLP (a submodule named 'mlp' with Linear "
            "layers, as Hugging Face decoders have); train it without tiled_mlp."
        )


def enable(model: nn.Module) -> int:
    """Tile every decoder MLP of `model` ([Note: tiled MLP]); how many. `check` first."""
    mlps = _mlps(model)
    for mlp in mlps:
        own = mlp.forward  # the module's, or a forward something else installed on it (Accelerate's hooks): kept
        if isinstance(own, functools.partial) and own.func is _tiled_forward:
            own = own.args[1]  # enabled before: not tiled twice
        width = max(m.out_features for m in mlp.modules() if isinstance(m, nn.Linear))
        mlp.forward = functools.partial(_tiled_forward, mlp, own, width)
    return len(mlps)


def _mlps(model: nn.Module) -> list[nn.Module]:
    return [
        module
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] == "mlp" and any(isinstance(m, nn.Linear) for m in module.modules())
    ]


def tile_tokens(hidden: torch.Tensor, width: int) -> int:
    """Tokens per tile for an MLP `width` wide (its widest Linear) on `hidden` (batch, tokens, hidden)."""
    per_token = hidden.shape[0] * width * hidden.element_size()
    return max(1, TILE_BYTES // per_token)


def _tiled_forward(mlp: nn.Module, own: Callable[..., Any], width: int, hidden: Any, *args: Any, **kwargs: Any) -> Any:
    if args or kwargs or not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        return own(hidden, *args, **kwargs)
    if not (mlp.training and torch.is_grad_enabled()):
        return own(hidden)
    tokens = tile_tokens(hidden, width)
    if hidden.shape[1] <= tokens:
        return own(hidden)
    outputs = []
    for tile in hidden.split(tokens, dim=1):
        out = checkpoint(own, tile, use_reentrant=False)
        if not isinstance(out, torch.Tensor):
            raise ValueError(
                f"ZeroConfig.tiled_mlp: {type(mlp).__name__} returns {type(out).__name__}, not one tensor (a mixture "
                "of experts routes over the whole batch); train this model without tiled_mlp."
            )
        outputs.append(out)
    return torch.cat(outputs, dim=1)
