"""`BufferSync`: the model's persistent buffers, kept as DDP keeps them, and DDP's rule for when.

[Note: buffer broadcast]
DDP's default (`broadcast_buffers=True`), DDP's rule exactly: rank 0's buffers overwrite every rank's, one
broadcast per dtype, at the start of the first forward and of every forward (with grad or without) that
follows a forward with grad outside `no_sync` (DDP's `require_forward_param_sync`, set after each forward).
So the first evaluation forward after a step normalises with rank 0's running statistics on every rank, the
first micro-batch of an accumulated step starts from rank 0's and the later ones (after a `no_sync` forward)
from each rank's own, as under DDP. A forward without grad that broadcasts is a collective, so it begins a
header ([Note: call order] in checks/call_order.py) at every stage. The stock Trainer evaluates the module DDP
wraps, not the wrapper, so its evaluation broadcasts nothing and leaves the flag: `ZeroTrainer` runs its evaluation loop
inside `as_unwrapped()` for the same numbers. `ZeroConfig(broadcast_buffers=False)` keeps each rank's own
(FSDP's behaviour). Unlike DDP, only the persistent buffers (those `state_dict` holds) travel: non-persistent
ones are constants the model derives the same way on every rank (rotary frequencies, position ids), and a LLaMA
or Falcon has no other, so it pays no broadcast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from .collectives import CommGroup, broadcast_tensors


class BufferSync:
    """The owner of the buffers' broadcast state ([Note: buffer broadcast]); the engine asks it at each forward."""

    def __init__(self, model: nn.Module, world: CommGroup, enabled: bool) -> None:
        self.world = world
        self.enabled = enabled and world.size > 1  # ZeroConfig.broadcast_buffers, on more than one rank
        self.persistent = [  # (module, name) of what state_dict holds besides parameters
            (m, name) for m in model.modules() for name in m._buffers if name not in m._non_persistent_buffers_set
        ]
        self._due = True  # the next forward broadcasts (DDP's `require_forward_param_sync`)
        self._unwrapped = False  # forwards run as on the module a DDP wrapper holds

    @property
    def due(self) -> bool:
        """Whether the next forward of the model broadcasts the buffers (asked before it begins; changes nothing)."""
        return self._due and self.enabled and bool(self.persistent) and not self._unwrapped

    def begin_forward(self, grad: bool, in_no_sync: bool) -> bool:
        """A forward of the model begins: whether it broadcasts the buffers; the rule set for the next one."""
        broadcast = self.due
        if not self._unwrapped:
            self._due = grad and not in_no_sync
        return broadcast

    def broadcast(self) -> None:
        """Rank 0's persistent buffers onto every rank (a collective)."""
        buffers = [m._buffers.get(name) for m, name in self.persistent]
        broadcast_tensors([b for b in buffers if b is not None and b.numel()], self.world)

    @contextlib.contextmanager
    def as_unwrapped(self) -> Iterator[None]:
        """Forwards inside run as on the module a DDP wrapper holds: no broadcast, DDP's flag left as it was."""
        previous, self._unwrapped = self._unwrapped, True
        try:
            yield
        finally:
            self._unwrapped = previous
