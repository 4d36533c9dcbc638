"""The hf_zero sharding engine. Imports only torch: no transformers, no accelerate."""

from . import torch_clip
from .engine import ModelStateMemory, ZeroEngine
from .optim import ShardedOptimizer

torch_clip.install()  # [Note: torch clipping]: torch.nn.utils.clip_grad_norm_ on a sharded model's parameters

__all__ = ["ModelStateMemory", "ShardedOptimizer", "ZeroEngine"]
