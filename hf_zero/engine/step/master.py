"""Where a part's master shard lives, and how the optimizer steps the flat shards: each chosen once.

[Note: master stores]
A part's master shard (what the optimizer updates, fp32 under mixed precision) lives either in memory
(`MemoryMaster`: a tensor on the master device) or in this rank's offload files (`DiskMaster`, [Note: disk
offload] in disk.py). The part gets its store when it is built and keeps it; every question about the master
goes to the store, never to a test of whether a disk exists:

- `read()` / `write(values)`: the whole shard (`state_dict`, `load_state_dict`, loading a checkpoint);
- `read_range(start, numel)` / `values(start, numel)` / `write_range(start, values)`: part of it, in the
  shard's own coordinates (streamed saves, whole-parameter steps);
- `piece_tensors(...)`: the tensors the optimizer steps ([Note: optimizer chunks]): views of the master, or
  empty tensors a window points at buffers while it steps;
- `gather_source()`: what a stage-3 gather sends ([Note: cast on gather], [Note: parameters on disk]);
- `publish(values)`: bring the parameters up to the master after it changed; `replace(values)`: `write`, then
  `publish` (at stages 0-2 an all-gather: every rank calls it);
- `bind_grads(piece, used)`: point the piece's optimizer tensors at their gradients before a step;
- `state_reader(key, ...)` / `take_state(...)`: optimizer state kept beside the master (only the files keep any).

The flat optimizer step is likewise one object chosen at `initialize` (`FlatStep`): `MemoryStep` calls the
optimizer's own `step()`; `DiskOffload` steps window by window over the files. Both expose `step`, `build`
(after the pieces exist), `account` (bytes outside memory), `refuse_state_access` and `close`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..collectives import Pending
from ..store import GradBinding, MasterStore

if TYPE_CHECKING:
    from ..flat import FlatPart
    from .pieces import Piece


class MemoryMaster:
    """A master shard held as a tensor (`part.sharded_master`) on the master device."""

    def __init__(self, part: FlatPart) -> None:
        self.part = part

    def read(self) -> torch.Tensor:
        """The shard itself (changes to it change the master)."""
        return self.part.sharded_master

    def write(self, values: torch.Tensor) -> None:
        master = self.part.sharded_master
        if values.data_ptr() != master.data_ptr():
            master.copy_(values)

    def read_range(self, start: int, numel: int) -> Iterator[torch.Tensor]:
        yield self.part.sharded_master[start : start + numel]

    def values(self, start: int, numel: int) -> torch.Tensor:
        """Elements `[start, start + numel)` of the shard: a view."""
        return self.part.sharded_master[start : start + numel]

    def write_range(self, start: int, values: torch.Tensor) -> None:
        """Into the master only: `publish` brings the parameters up to it."""
        self.part.sharded_master[start : start + values.numel()].copy_(values)

    def piece_tensors(
        self, start: int, end: int, bounds: tuple[tuple[int, int], ...]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        master = self.part.sharded_master[start:end]
        return master, tuple(master[a:b] for a, b in bounds)

    def gather_source(self) -> torch.Tensor:
        return _param_shard(self.part)

    def publish(self, async_op: bool = False, values: torch.Tensor | None = None) -> Pending:
        return self.part.publish_master(async_op, values)

    def replace(self, values: torch.Tensor) -> None:
        """Make `values` (from `read`, changed) the master and publish it into the parameters."""
        _replace(self, values)

    def bind_grads(self, piece: GradBinding, used: bool) -> None:
        piece.bind_grads(used)

    def state_reader(self, key: str, start: int, numel: int) -> Callable[[], Iterator[torch.Tensor]] | None:
        """None: the optimizer holds this part's state itself."""
        return None

    def take_state(self, start: int, whole: dict[str, Any], flat: set[str]) -> bool:
        """False: the optimizer holds this part's state itself."""
        return False


class MasterFiles(Protocol):
    """What a `DiskMaster` asks of the offload files (`DiskOffload`, disk.py, which builds it)."""

    master_key: str

    @property
    def state_keys(self) -> list[str]: ...
    def read_master(self, offset: int, numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor: ...
    def read_range(self, key: str, offset: int, numel: int, piece_numel: int = ...) -> Iterator[torch.Tensor]: ...
    def write_range(self, key: str, offset: int, values: torch.Tensor) -> None: ...


class DiskMaster:
    """A master shard held at `offset` in this rank's offload files (`DiskOffload`), with the elementwise
    optimizer state at the same offsets ([Note: disk offload]); with `params_on_disk`, the files are also each
    gather's source ([Note: parameters on disk])."""

    def __init__(self, part: FlatPart, disk: MasterFiles, offset: int, params_on_disk: bool) -> None:
        self.part = part
        self._disk = weakref.ref(disk)  # the engine owns the files; a part left over must not keep them open
        self.offset = offset  # element offset of the shard in the files
        self.params_on_disk = params_on_disk

    @property
    def disk(self) -> MasterFiles:
        disk = self._disk()
        if disk is None:
            raise RuntimeError(
                f"[rank {self.part.shard_group.global_rank}] hf_zero: unit '{self.part.spec.name}' reads its master "
                "from offload files that were already released"
            )
        return disk

    def read(self) -> torch.Tensor:
        """A fresh host tensor with the shard as the files hold it."""
        return self.disk.read_master(self.offset, self.part.layout.shard_numel, self.part.master_dtype)

    def write(self, values: torch.Tensor) -> None:
        self.disk.write_range(self.disk.master_key, self.offset, values)

    def read_range(self, start: int, numel: int) -> Iterator[torch.Tensor]:
        """Host tensors read into one reused buffer (each overwritten by the next)."""
        return self.disk.read_range(self.disk.master_key, self.offset + start, numel)

    def values(self, start: int, numel: int) -> torch.Tensor:
        """Elements `[start, start + numel)` of the shard: a fresh host tensor."""
        return self.disk.read_master(self.offset + start, numel, self.part.master_dtype)

    def write_range(self, start: int, values: torch.Tensor) -> None:
        """Into the files and, unless the files are the gather source, into the parameter shard: the master
        on disk publishes as it is written."""
        self.disk.write_range(self.disk.master_key, self.offset + start, values)
        if not self.params_on_disk:
            self.part.param_shard()[start : start + values.numel()].copy_(values)

    def piece_tensors(
        self, start: int, end: int, bounds: tuple[tuple[int, int], ...]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Tensors of no elements, pointed at a window's buffers while it steps."""
        part = self.part

        def empty() -> torch.Tensor:
            return torch.empty(0, dtype=part.master_dtype, device=part.master_device)

        return empty(), tuple(empty() for _ in bounds)

    def gather_source(self) -> torch.Tensor:
        if self.params_on_disk:  # [Note: parameters on disk]: read for this gather, pinned beside an accelerator
            return self.disk.read_master(
                self.offset, self.part.layout.shard_numel, self.part.master_dtype, pin=self.part.placement.host_pinned
            )
        return _param_shard(self.part)

    def publish(self, async_op: bool = False, values: torch.Tensor | None = None) -> Pending:
        """`values` (the whole shard, just written): into the parameters; None (after a step, whose windows
        published as they went): only the all-gather of stages 0-2."""
        if self.params_on_disk:
            return Pending()  # the gathers read the files
        if values is not None:
            return self.part.publish_master(async_op, values)
        return self.part.gather_persistent(async_op)

    def replace(self, values: torch.Tensor) -> None:
        """Make `values` (from `read`, changed) the master and publish it into the parameters."""
        _replace(self, values)

    def bind_grads(self, piece: GradBinding, used: bool) -> None:
        """Nothing: each window binds its chunks' gradients while it steps."""

    def state_reader(self, key: str, start: int, numel: int) -> Callable[[], Iterator[torch.Tensor]] | None:
        """The elementwise state `key` of elements `[start, start + numel)`, streamed from its file."""
        if key not in self.disk.state_keys:
            return None
        return functools.partial(self.disk.read_range, key, self.offset + start, numel)

    def take_state(self, start: int, whole: dict[str, Any], flat: set[str]) -> bool:
        """Write the elementwise entries (`flat`) of a loaded state into the files, leaving empty tensors in
        `whole` in their place."""
        for key in flat:
            self.disk.write_range(key, self.offset + start, whole[key])
            whole[key] = torch.empty(0, dtype=whole[key].dtype)
        return True


def _param_shard(part: FlatPart) -> torch.Tensor:
    """The compute-dtype shard a stage-3 gather sends ([Note: cast on gather])."""
    source = part.sharded_param
    if source is None:
        raise RuntimeError(
            f"[rank {part.shard_group.global_rank}] hf_zero: unit '{part.spec.name}' keeps its parameters whole "
            "and has no gather source"
        )
    return source


def _replace(store: MasterStore, values: torch.Tensor) -> None:
    store.write(values)
    store.publish(values=values).wait()


class FlatStep(Protocol):
    """How the optimizer steps the flat shards ([Note: master stores])."""

    def build(self, pieces: list[Piece]) -> None: ...
    def step(self, optimizer: torch.optim.Optimizer, used: dict[int, list[bool]]) -> None: ...
    def account(self, memory: dict[str, dict[str, int]]) -> None: ...
    def refuse_state_access(self, what: str, remedy: str) -> None: ...
    def close(self) -> None: ...


class MemoryStep:
    """Every master in memory: the optimizer's own step over its tensors."""

    def build(self, pieces: list[Piece]) -> None:
        """Nothing to build."""

    def step(self, optimizer: torch.optim.Optimizer, used: dict[int, list[bool]]) -> None:
        optimizer.step()

    def account(self, memory: dict[str, dict[str, int]]) -> None:
        """Nothing outside memory."""

    def refuse_state_access(self, what: str, remedy: str) -> None:
        """Nothing to refuse: the optimizer holds its state."""

    def close(self) -> None:
        """Nothing to release."""
