"""`torch.amp.GradScaler` on a sharded optimizer, as on a DDP one.

[Note: grad scaler]
The DDP recipe for fp16 on GPUs without bf16 (T4, V100) is `scaler.scale(loss).backward()`, optionally
`scaler.unscale_(optimizer)` before clipping, `scaler.step(optimizer)`, `scaler.update()`. The scaler reads
`.grad` of every tensor of the optimizer's param groups (`GradScaler._unscale_grads_`): it divides them by the
scale in place and records whether any is inf or NaN, then skips `optimizer.step()` where one was, and moves the
scale. Under DDP those gradients are already all-reduced, so an overflow on one rank is an inf on every rank and
they all skip and move the scale alike. A sharded optimizer's tensors are pieces of this rank's shards, their
`.grad` the reduced gradient shards: an inf lands in one rank's shard only. So `install()` (when hf_zero is
imported) gives `_unscale_grads_` a way through for a sharded optimizer: its pieces' gradient shards are
unscaled and checked, and the flag is agreed over every rank (a max) before the scaler reads it, so every rank
skips or steps together and its scale moves as DDP's does. An optimizer stepped on whole parameters ([Note:
whole-parameter step] in whole.py) holds no pieces: its model parameters' gradient shards are unscaled instead,
before its step gathers them whole on their owners. Optimizers that are not sharded go to torch's own code
unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

_original: dict[str, Any] = {}


def _unscale_grads_(
    scaler: Any, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
) -> dict[torch.device, torch.Tensor]:
    unscale = getattr(optimizer, "unscale_grads_", None)
    if unscale is None:
        return _original["_unscale_grads_"](scaler, optimizer, inv_scale, found_inf, allow_fp16)
    return unscale(inv_scale, found_inf)


def install() -> None:
    """Route `GradScaler._unscale_grads_` of sharded optimizers to them ([Note: grad scaler]); once."""
    scaler = torch.amp.GradScaler
    if "_unscale_grads_" not in _original:
        _original["_unscale_grads_"] = scaler._unscale_grads_
        scaler._unscale_grads_ = _unscale_grads_  # type: ignore[method-assign,assignment]
