"""Sharded safetensors checkpoints: save without gathering, load at any world size, consolidate."""

from .background import AsyncSave, wait_for_saves
from .consolidate import consolidate, save_pretrained
from .format import last_complete_checkpoint
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = [
    "AsyncSave",
    "consolidate",
    "last_complete_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "save_pretrained",
    "wait_for_saves",
]
