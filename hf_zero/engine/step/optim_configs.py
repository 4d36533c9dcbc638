"""Per-parameter settings that optimizers key by the parameter object, carried to the tensors hf_zero steps.

[Note: per-parameter optimizer configs]
`initialize` replaces each group's parameters by the tensors this rank steps (flat chunks or whole
stand-ins, [Note: optimizer shards]). A setting an optimizer keeps by parameter identity or position
would then miss its parameter, silently: bitsandbytes' 8-bit optimizers look up overrides
(`GlobalOptimManager`: by `id(param)`, by (group, position), and by module attribute, which the Trainer
uses to keep embeddings' state in 32 bits) when they step. Each override of an original parameter is
given, by identity, to every tensor stepped for it, and the position-keyed ones of the optimizer's old
layout are dropped, so each tensor steps with its own parameter's settings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def carry_configs(
    optimizer: torch.optim.Optimizer,
    moved: list[tuple[int, int, torch.Tensor, list[torch.Tensor]]],
    own: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Carry `optimizer`'s per-parameter overrides to the tensors that now stand for each parameter. `moved`:
    (group index, position, original parameter, tensors stepped for it) for every original parameter; `own` maps
    a parameter, or what a module holds in its place now, to the engine's own parameter."""
    manager: Any = getattr(optimizer, "mng", None)
    if manager is None or not all(
        hasattr(manager, a) for a in ("pid2config", "index2config", "module_weight_config_triple")
    ):
        return  # not a bitsandbytes optimizer
    by_module = {
        id(own(t)): config
        for module, attr, config in manager.module_weight_config_triple
        if isinstance(t := getattr(module, attr, None), torch.Tensor)
    }
    configs = {}
    for g, j, original, _ in moved:
        config: dict[str, Any] = {}
        for found in (
            by_module.get(id(own(original))),
            manager.index2config.get((g, j)),
            manager.pid2config.get(id(original)),
        ):
            config.update(found or {})
        if config:
            configs[id(original)] = config
    for g, j, _, _ in moved:
        manager.index2config.pop((g, j), None)  # positions of the old layout mean other tensors now
    for _, _, original, tensors in moved:
        for t in tensors:
            if id(original) in configs:
                manager.pid2config[id(t)] = dict(configs[id(original)])
