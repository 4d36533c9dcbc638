"""Sharded safetensors checkpoints: save without gathering, load at any world size, consolidate."""

from .load import load_checkpoint
from .save import save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
