"""The hf_zero sharding engine. Imports only torch: no transformers, no accelerate."""

from .engine import ModelStateMemory, ZeroEngine
from .step import amp, torch_clip
from .step.optim import ShardedOptimizer

torch_clip.install()  # [Note: torch clipping]: torch.nn.utils.clip_grad_norm_ on a sharded model's parameters
amp.install()  # [Note: grad scaler]: torch.amp.GradScaler on a sharded optimizer

__all__ = ["ModelStateMemory", "ShardedOptimizer", "ZeroEngine"]
