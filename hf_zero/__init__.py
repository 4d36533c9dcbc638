"""hf_zero: ZeRO stages 1-3 for Hugging Face models, on torch.distributed.

Example:

```python
>>> import hf_zero
>>> model, optimizer = hf_zero.initialize(model, optimizer, hf_zero.ZeroConfig(stage=3))
```
"""

from .api import (
    attach_optimizer,
    full_state_dict,
    gathered_parameters,
    initialize,
    model_state_memory,
    state_dict_options,
)
from .checkpoint import (
    AsyncSave,
    consolidate,
    last_complete_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_pretrained,
    wait_for_saves,
)
from .config import ZeroConfig
from .engine import ModelStateMemory, ShardedOptimizer
from .engine.whole import register_elementwise
from .integrations.pretrained import from_pretrained

__version__ = "0.1.0"


_LAZY = {
    "ZeroTrainer": "trainer",
    "ZeroTrainerMixin": "trainer",
    "ZeroTrainingArguments": "training_args",
    "ZeroArgumentsMixin": "training_args",
    "ZeroAccelerator": "accelerate",
    "ZeroPlugin": "accelerate",
    "PREEMPTED_EXIT_CODE": "preemption",
}


def __getattr__(name: str) -> object:
    # The integrations import transformers / accelerate: load them only when asked for.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".integrations.{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'hf_zero' has no attribute {name!r}")


__all__ = [
    "AsyncSave",
    "ModelStateMemory",
    "PREEMPTED_EXIT_CODE",
    "ShardedOptimizer",
    "ZeroAccelerator",
    "ZeroArgumentsMixin",
    "ZeroConfig",
    "ZeroPlugin",
    "ZeroTrainer",
    "ZeroTrainerMixin",
    "ZeroTrainingArguments",
    "attach_optimizer",
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
    "save_pretrained",
    "state_dict_options",
    "wait_for_saves",
]
