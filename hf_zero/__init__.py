"""hf_zero: ZeRO stages 1-3 for Hugging Face models, on torch.distributed.

Example:

```python
>>> import hf_zero
>>> model, optimizer = hf_zero.initialize(model, optimizer, hf_zero.ZeroConfig(stage=3))
```
"""

from .api import (
    full_state_dict,
    gathered_parameters,
    initialize,
    model_state_memory,
    state_dict_options,
)
from .checkpoint import (
    consolidate,
    last_complete_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from .config import ZeroConfig
from .engine.step.whole import register_elementwise
from .integrations.from_pretrained import from_pretrained

__version__ = "0.1.0"


def _library_logger() -> None:
    """hf_zero's messages (the start-up line on rank 0, a CPU launch taken as multi-process) on stderr at INFO, as
    transformers gives its own logger a handler; configure `logging.getLogger("hf_zero")` to change that."""
    import logging

    root = logging.getLogger("hf_zero")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False


_library_logger()


_LAZY = {
    "ZeroTrainer": "trainer",
    "ZeroTrainerMixin": "trainer",
    "ZeroTrainingArguments": "training_args",
    "ZeroArgumentsMixin": "training_args",
    "ZeroAccelerator": "accelerate",
    "ZeroPlugin": "accelerate",
    "PREEMPTED_EXIT_CODE": "preemption",
}


# Names that left the top level: they keep working for one release, with a FutureWarning naming the replacement.
_MOVED = {
    "attach_optimizer": (".api", "hf_zero.initialize(model, optimizer) (on a sharded model it attaches the optimizer)"),
    "wait_for_saves": (
        ".checkpoint",
        "the AsyncSave that save_checkpoint(..., async_save=True) returned: handle.wait()",
    ),
    "AsyncSave": (".types", "hf_zero.types.AsyncSave"),
    "ModelStateMemory": (".types", "hf_zero.types.ModelStateMemory"),
    "ShardedOptimizer": (".types", "hf_zero.types.ShardedOptimizer"),
    "save_pretrained": (
        ".checkpoint",
        "model.save_pretrained(output_dir, dtype=..., parallel=...) on every rank, and tokenizer.save_pretrained("
        "output_dir) for the tokenizer",
    ),
}


def __getattr__(name: str) -> object:
    import importlib

    # The integrations import transformers / accelerate: load them only when asked for.
    if name in _LAZY:
        return getattr(importlib.import_module(f".integrations.{_LAZY[name]}", __name__), name)
    if name in _MOVED:
        import warnings

        module, replacement = _MOVED[name]
        warnings.warn(
            f"hf_zero.{name} is deprecated and will be removed in the next release; use {replacement}.",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module, __name__), name)
    raise AttributeError(f"module 'hf_zero' has no attribute {name!r}")


__all__ = [
    "PREEMPTED_EXIT_CODE",
    "ZeroAccelerator",
    "ZeroArgumentsMixin",
    "ZeroConfig",
    "ZeroPlugin",
    "ZeroTrainer",
    "ZeroTrainerMixin",
    "ZeroTrainingArguments",
    "consolidate",
    "from_pretrained",
    "full_state_dict",
    "gathered_parameters",
    "initialize",
    "last_complete_checkpoint",
    "load_checkpoint",
    "model_state_memory",
    "save_checkpoint",
    "register_elementwise",
    "state_dict_options",
]
