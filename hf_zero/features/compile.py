"""`torch.compile` where Accelerate's dynamo settings ask for it, on a model hf_zero sharded.

[Note: compile]
Accelerate compiles a model in `prepare_model`, and the Trainer's `--torch_compile` (`--torch_compile_backend`,
`--torch_compile_mode`) and `accelerate launch`'s dynamo settings reach it there, as a dynamo plugin. A sharded model
never goes through `prepare_model` (it is marked prepared: Accelerate must not wrap it in DDP or autocast), where
the request would be dropped without a word, as the Trainer once dropped it under DeepSpeed (transformers#23095).
So the integrations compile the sharded model themselves, in place (`nn.Module.compile`: the model the Trainer
saves, the engine and the user's references stay the same objects): the whole model, or, with regional compilation
(`use_regional_compilation`), the forward of each of the engine's units but the root (the repeated blocks: one
compilation reused; the units' hooks run outside the compiled code, so their graphs do not break there).

Compiling the whole model, the engine's hooks run inside the compiled frames, and dynamo breaks the graph at them
(gathers, reductions, the graph-task checks of [Note: double backward]). Either way the numbers are the eager
model's (tested with the `eager` and `aot_eager` backends against the stock Trainer compiled the same way). Two
settings cannot hold and are refused at once, naming them: `fullgraph=True` on the whole model (the graph breaks at
every unit's hooks; regional compilation holds it) and, at stage 3, the CUDA-graph modes (`"reduce-overhead"`,
`"max-autotune"`), which replay fixed addresses where every gather gives a unit's parameters new memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..engine.facade import facade_of

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_as_requested(model: nn.Module, plugin: Any, stage: int) -> bool:
    """Compile the sharded `model` in place as Accelerate's `plugin` (a `TorchDynamoPlugin`, or None) asks; whether
    anything is compiled. A model compiled before is left as it is.

    Raises:
        ValueError: `fullgraph=True` on the whole model, or a CUDA-graph mode at stage 3 ([Note: compile]).
    """
    kwargs = check_compile_request(plugin, stage)
    if kwargs is None:
        return False
    if not plugin.use_regional_compilation:
        if getattr(model, "_compiled_call_impl", None) is None:
            model.compile(**kwargs)
        return True
    for unit in facade_of(model).units:
        for module in _modules(unit.spec) if unit.spec.name else ():
            if not hasattr(module.forward, "_torchdynamo_orig_callable"):  # its forward only: the hooks stay eager
                module.forward = torch.compile(module.forward, **kwargs)
    return True


def check_compile_request(plugin: Any, stage: int) -> dict[str, Any] | None:
    """The `torch.compile` arguments `plugin` asks for (None: no compilation), refused where they cannot hold on a
    sharded model ([Note: compile]).

    Raises:
        ValueError: `fullgraph=True` without regional compilation, or a CUDA-graph mode at stage 3.
    """
    from accelerate.utils import DynamoBackend

    if plugin is None or plugin.backend == DynamoBackend.NO:
        return None
    kwargs: dict[str, Any] = plugin.to_kwargs()
    if kwargs.get("fullgraph") and not plugin.use_regional_compilation:
        raise ValueError(
            "torch.compile with fullgraph=True cannot compile a whole model sharded by hf_zero: its hooks (the "
            "gathers and reductions of each unit) break the graph at every unit. Compile each block instead "
            "(regional compilation: use_regional_compilation=True, ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=true), "
            "whose forward holds no hooks, or drop fullgraph (dynamo_use_fullgraph)."
        )
    if stage == 3 and kwargs.get("mode") in CUDA_GRAPH_MODES:
        raise ValueError(
            f"torch.compile mode={kwargs['mode']!r} records CUDA graphs, which replay fixed memory addresses; at ZeRO "
            "stage 3 every gather gives a unit's parameters new memory. Use mode='default' or "
            "'max-autotune-no-cudagraphs' (--torch_compile_mode), or stage 1-2."
        )
    return kwargs


def _modules(spec: Any) -> tuple[nn.Module, ...]:
    return tuple(spec.modules) or (spec.module,)
