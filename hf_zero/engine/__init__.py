"""The hf_zero sharding engine. Imports only torch: no transformers, no accelerate."""

from .engine import ModelStateMemory, ZeroEngine
from .optim import ShardedOptimizer

__all__ = ["ModelStateMemory", "ShardedOptimizer", "ZeroEngine"]
