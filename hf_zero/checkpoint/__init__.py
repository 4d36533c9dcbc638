"""Sharded safetensors checkpoints: save without gathering, load at any world size, consolidate."""

from .consolidate import consolidate, save_pretrained
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = ["consolidate", "load_checkpoint", "save_checkpoint", "save_pretrained"]
