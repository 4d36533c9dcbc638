"""Dynamic loss scaling for fp16 compute.

Users call `loss.backward()` themselves, so the scale is applied where the gradient enters the
model: the root unit's outputs pass through an identity autograd node whose backward multiplies
by the scale. Each gradient path into the model crosses exactly one such node, so every
parameter gradient is scaled exactly once; the reduction divides the scale out again in fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...config import ZeroConfig
from ..collectives import CommGroup, all_reduce_, comm_device

if TYPE_CHECKING:
    from ..flat import FlatPart


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class LossScaler:
    """Owns the fp16 loss scale: halves it on overflow (skipping the step), doubles it after a clean window."""

    def __init__(self, config: ZeroConfig) -> None:
        self.scale = float(config.initial_loss_scale)
        self.window = config.loss_scale_window
        self._clean_steps = 0

    def scale_outputs(self, output: Any) -> Any:
        """Route every floating-point output that requires grad through the scaling node."""
        if isinstance(output, torch.Tensor):
            return (
                _ScaleGrad.apply(output, self.scale) if output.requires_grad and output.is_floating_point() else output
            )
        if isinstance(output, tuple):
            return (
                type(output)(*map(self.scale_outputs, output))
                if hasattr(output, "_fields")
                else tuple(map(self.scale_outputs, output))
            )
        if isinstance(output, list):
            return [self.scale_outputs(o) for o in output]
        if isinstance(output, dict):
            for key in list(output.keys()):
                output[key] = self.scale_outputs(output[key])
            return output
        return output

    def check_and_update(self, parts: list[FlatPart], world: CommGroup) -> bool:
        """Whether the reduced gradients are finite on every rank; updates the scale either way."""
        shards = [part.grads.shard for part in parts if part.has_trainable and not part.grads.is_zero] or [
            torch.zeros(1)
        ]
        local = torch.stack([(~torch.isfinite(g)).any().cpu() for g in shards]).any().float()
        found = local.reshape(1).to(comm_device(world))  # the shards may be on the host (offload)
        all_reduce_(found, world, op=dist.ReduceOp.MAX)
        if found.item() > 0:
            self.scale /= 2.0
            self._clean_steps = 0
            return False
        self._clean_steps += 1
        if self._clean_steps % self.window == 0:
            self.scale *= 2.0
        return True
