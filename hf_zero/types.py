"""The types a user of hf_zero meets, in one place: what `initialize` returns for an optimizer
(`ShardedOptimizer`), what an asynchronous save returns (`AsyncSave`), what `model_state_memory` returns
(`ModelStateMemory`), and the settings (`ZeroConfig`).

Example:

```python
>>> from hf_zero.types import AsyncSave, ShardedOptimizer
>>> handle: AsyncSave = hf_zero.save_checkpoint("ckpt", model, optimizer, async_save=True)
>>> handle.wait()
```
"""

from .checkpoint import AsyncSave
from .config import ZeroConfig
from .engine import ModelStateMemory, ShardedOptimizer

__all__ = ["AsyncSave", "ModelStateMemory", "ShardedOptimizer", "ZeroConfig"]
