"""A `from_pretrained` directory written by every rank at once: each tensor by the one rank that owns it.

[Note: owned tensors]
No rank gathers the model. The tensors (parameters under the names `save_pretrained` keeps, then
persistent buffers) are dealt largest first, each to the rank with the fewest bytes so far, so each
rank writes about 1/N of the bytes into its own files (`model-0000k-of-0000N.safetensors`, rank 0's
files first). Rank r's k-th tensor is written in round k. A round moves its tensors window by window:
one all-to-all per window of `W = PIECE_NUMEL / world size` elements, in which every rank sends
what its master shards hold of each owner's window (cast to the written dtype, packed into one send
buffer of at most `PIECE_NUMEL` elements) and each owner receives its window in element order (the
ranks of a shard group hold a tensor's elements in rank order) and appends it to its file at once.
So beyond its model states a rank holds one send buffer and one window while it saves, whatever the
size of the model or of its largest tensor. Tensors every rank holds whole (buffers; parameters at
stages 0-2 written in their compute dtype) take no exchange: their owner writes its own copy.

Every file is written under a temporary name; the ranks agree that all of them were written before
any is renamed, and rank 0 writes the index last, so a failed save leaves no weight file behind.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..engine.collectives import CommGroup, all_to_all_uneven, comm_device, gather_objects, raise_if_any_failed
from ..engine.facade import EngineFacade
from ..engine.flat import FlatPart
from ..engine.step.pieces import Piece
from ..engine.step.whole import deal
from .background import frozen
from .format import fsync_file, write_bytes_atomically
from .shared import require_shared
from .stream import PIECE_NUMEL, Entry, FileLayout, host_pieces, write_streamed
from .writer import INDEX_FILE, WEIGHT_FILE, make_directory


@dataclass(frozen=True)
class FolderTensor:
    """One tensor of the folder: a parameter of a unit (`unit`, `slot`), or a tensor held whole (`value`)."""

    name: str
    shape: tuple[int, ...]
    numel: int
    part: FlatPart | None = None
    slot: int = 0
    value: torch.Tensor | None = None
    parameter: bool = True
    dtype: torch.dtype | None = None  # written in this dtype, whatever the folder's ([Note: parameters kept in ...])

    @property
    def exchanged(self) -> bool:
        return self.part is not None


@dataclass(frozen=True)
class OwnerPlan:
    """Who writes what, computed alike on every rank from the model alone.

    Example:

    ```python
    >>> tensors = [FolderTensor("a", (4,), 4), FolderTensor("b", (2,), 2)]
    >>> plan = OwnerPlan.deal(tensors, torch.float32, world_size=2, max_bytes=10**9)
    >>> plan.owned, plan.files
    ([[0], [1]], [[[0]], [[1]]])
    ```
    """

    tensors: list[FolderTensor]
    dtype: torch.dtype  # what the folder is written in; a tensor kept in its own dtype is written in that
    owned: list[list[int]]  # per rank: its tensors' indices, in the order it writes them (round k: the k-th)
    files: list[list[list[int]]]  # per rank: its files, each a list of tensor indices

    @staticmethod
    def deal(tensors: list[FolderTensor], dtype: torch.dtype, world_size: int, max_bytes: int) -> OwnerPlan:
        nbytes = [t.numel * _itemsize(t, dtype) for t in tensors]
        owned = deal(nbytes, world_size)  # largest first, to the rank with the fewest bytes so far
        files: list[list[list[int]]] = []
        for mine in owned:
            groups: list[list[int]] = []
            size = 0
            for i in mine:
                if not groups or (groups[-1] and size + nbytes[i] > max_bytes):
                    groups.append([])
                    size = 0
                groups[-1].append(i)
                size += nbytes[i]
            files.append(groups)
        return OwnerPlan(tensors, dtype, owned, files)

    def file_names(self) -> list[list[str]]:
        """Per rank, the names of its files: `model.safetensors` when there is one file in all, else
        `model-0000k-of-0000N.safetensors` numbered rank by rank."""
        total = sum(len(f) for f in self.files)
        names, k = [], 0
        for groups in self.files:
            names.append(
                [
                    "model.safetensors" if total == 1 else f"model-{k + j + 1:05d}-of-{total:05d}.safetensors"
                    for j in range(len(groups))
                ]
            )
            k += len(groups)
        return names

    @property
    def exchange_dtype(self) -> torch.dtype:
        """What the exchange sends: the widest dtype any exchanged tensor is written in."""
        kept = [t.dtype for t in self.tensors if t.dtype is not None and t.exchanged]
        return max([self.dtype, *kept], key=lambda d: d.itemsize)

    @property
    def rounds(self) -> int:
        return max((len(mine) for mine in self.owned), default=0)


def _itemsize(t: FolderTensor, dtype: torch.dtype) -> int:
    return written_dtype(t, dtype).itemsize


def written_dtype(t: FolderTensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype `t` is written in, in a folder written in `dtype`: its own where it keeps one, an integer buffer's
    own, else `dtype`."""
    if t.dtype is not None:
        return t.dtype
    value_dtype = t.value.dtype if t.value is not None else dtype
    return dtype if value_dtype.is_floating_point else value_dtype


def folder_tensors(engine: EngineFacade, dtype: torch.dtype) -> list[FolderTensor]:
    """The tensors of the model folder in `state_dict` order: each parameter once (tied names under the first),
    then the persistent buffers. A parameter every rank holds whole in `dtype` is taken as it is; one kept in its
    own dtype is written in that ([Note: parameters kept in their own dtype] in engine/unit.py)."""
    tensors: list[FolderTensor] = []
    for part in engine.parts:
        kept = part.spec.dtype
        for index, slot in enumerate(part.layout.slots):
            if part.persistent and part.param_dtype == (kept or dtype):
                value = part.unsharded_param[slot.offset : slot.offset + slot.numel].view(slot.shape)
                tensors.append(FolderTensor(slot.name, tuple(slot.shape), slot.numel, value=value, dtype=kept))
            else:
                shape = tuple(slot.shape)
                tensors.append(FolderTensor(slot.name, shape, slot.numel, part=part, slot=index, dtype=kept))
    for name, buf in engine.module_state(with_params=False).items():
        kept = buf.dtype if engine.keeps_dtype(buf) else None
        value = buf.detach()
        tensors.append(FolderTensor(name, tuple(buf.shape), buf.numel(), value=value, parameter=False, dtype=kept))
    return tensors


class Exchange:
    """The rounds of [Note: owned tensors] on this rank: `windows(k)` runs round k and yields this rank's
    tensor of the round piece by piece; `drain()` runs every round not yet run (a rank that stopped writing
    keeps serving the others)."""

    def __init__(
        self, engine: EngineFacade, plan: OwnerPlan, on_round: Callable[[int, int], None] | None = None
    ) -> None:
        self.engine, self.plan, self.on_round = engine, plan, on_round
        self.world = engine.world
        # every rank's (replica, shard rank): an owner takes its tensor from the ranks of its own shard group
        self.places: list[tuple[int, int]] = gather_objects((engine.replica_rank, engine.shard_rank), self.world)
        for replica in {p[0] for p in self.places}:
            shard_ranks = [s for r, s in self.places if r == replica]
            if shard_ranks != list(range(len(shard_ranks))):
                raise RuntimeError(
                    f"[rank {self.world.rank}] hf_zero: the shard group of replica {replica} is not in "
                    f"global rank order ({shard_ranks}); the owned-tensor save needs it"
                )
        self.width = max(1, PIECE_NUMEL // self.world.size)
        self.pieces: dict[tuple[int, int], Piece] = {(id(p.part), p.slot_index): p for p in engine.pieces}
        self.device = comm_device(self.world)
        self.round, self.window = 0, 0  # the next window to run
        self.error: Exception | None = None  # a failed read: the windows still run (with zeros), then it is raised
        self.draining = False
        self._send = torch.empty(0, dtype=plan.exchange_dtype, device=self.device)
        self._recv = torch.empty(0, dtype=plan.exchange_dtype, device=self.device)

    def _of_round(self, rank: int, k: int) -> FolderTensor | None:
        owned = self.plan.owned[rank]
        return self.plan.tensors[owned[k]] if k < len(owned) else None

    def _windows_in(self, k: int) -> int:
        sizes = [t.numel for r in range(self.world.size) if (t := self._of_round(r, k)) is not None and t.exchanged]
        return max((-(-n // self.width) for n in sizes), default=0)

    def windows(self, k: int) -> Iterator[torch.Tensor]:
        """Run round `k` (every rank must, in order) and yield this rank's tensor of the round, in pieces."""
        if k != self.round:
            raise RuntimeError(f"[rank {self.world.rank}] hf_zero: owned-tensor save ran round {self.round}, not {k}")
        mine, count = self._of_round(self.world.rank, k), self._windows_in(k)
        while self.window < count:
            received = self._run_window(k, self.window)
            self.window += 1
            if self.error is not None and not self.draining:
                raise self.error
            if received is not None and received.numel():
                yield received
        self.round, self.window = k + 1, 0
        if self.on_round is not None:
            self.on_round(self.round, self.plan.rounds)
        if mine is not None and mine.value is not None:
            yield from host_pieces(mine.value.to(written_dtype(mine, self.plan.dtype)))()

    def drain(self) -> None:
        self.draining = True
        while self.round < self.plan.rounds:
            for _ in self.windows(self.round):
                pass

    def _span(self, t: FolderTensor, rank: int, window: int) -> tuple[int, int]:
        """The elements `[a, b)` of `t` in `window` that `rank`'s shard holds (a == b: none)."""
        layout = _part(t).layout
        slot = layout.slots[t.slot]
        lo, hi = layout.shard_range(self.places[rank][1])
        a = max(window * self.width, lo - slot.offset, 0)
        b = min((window + 1) * self.width, hi - slot.offset, t.numel)
        return a, max(a, b)

    def _run_window(self, k: int, window: int) -> torch.Tensor | None:
        me, size = self.world.rank, self.world.size
        replica = self.places[me][0]
        send_splits, recv_splits, reads = [0] * size, [0] * size, []
        for owner in range(size):
            t = self._of_round(owner, k)
            if t is None or not t.exchanged or self.places[owner][0] != replica:
                continue
            a, b = self._span(t, me, window)
            send_splits[owner] = b - a
            if b > a:
                reads.append((t, a, b))
        mine = self._of_round(me, k)
        if mine is not None and mine.exchanged:
            for rank in range(size):
                if self.places[rank][0] == replica:
                    a, b = self._span(mine, rank, window)
                    recv_splits[rank] = b - a
        send = self._buffer("_send", sum(send_splits))
        try:
            at = 0
            for t, a, b in reads:
                for part in self._read(t, a, b):
                    send[at : at + part.numel()].copy_(part)
                    at += part.numel()
        except Exception as e:  # noqa: BLE001 - raised after the window: the others are waiting in it
            send.zero_()
            self.error = self.error or e
        recv = self._buffer("_recv", sum(recv_splits))
        all_to_all_uneven(recv, send, recv_splits, send_splits, self.world)
        return recv if mine is not None and mine.exchanged else None

    def _buffer(self, attr: str, numel: int) -> torch.Tensor:
        buf: torch.Tensor = getattr(self, attr)
        if buf.numel() < numel:
            dtype = self.plan.exchange_dtype
            buf = torch.empty(max(numel, min(PIECE_NUMEL, buf.numel() * 2)), dtype=dtype, device=self.device)
            setattr(self, attr, buf)
        return buf[:numel]

    def _read(self, t: FolderTensor, a: int, b: int) -> Iterator[torch.Tensor]:
        """Elements `[a, b)` of `t` from this rank's master shard, where it lives (memory or the offload files)."""
        part = _part(t)
        piece = self.pieces.get((id(part), t.slot))
        if piece is None or not piece.start <= a <= b <= piece.end:
            raise RuntimeError(f"[rank {self.world.rank}] hf_zero: {t.name}[{a}:{b}] is not in this rank's shard")
        yield from part.store.read_range(piece.local[0] + a - piece.start, b - a)  # [Note: master stores]


def _part(t: FolderTensor) -> FlatPart:
    if t.part is None:
        raise RuntimeError(f"hf_zero: {t.name} is held whole and has no shards to read")
    return t.part


def write_owned(
    engine: EngineFacade,
    directory: Path,
    dtype: torch.dtype,
    max_bytes: int,
    on_round: Callable[[int, int], None] | None = None,
    layout: FileLayout | None = None,
) -> list[str]:
    """Write the model's tensors into `directory` as [Note: owned tensors] says; a collective. Returns every
    file written (on every rank). The side files (config, tokenizer) are the caller's. `on_round(done, total)`
    is called after each round (a progress bar); `layout` names tensors stored otherwise ([Note: file layout])."""
    require_shared(directory, engine.world, f"model.save_pretrained ({directory})")  # [Note: shared directory]
    plan, names, exchange, files = _prepare(engine, dtype, max_bytes, on_round, layout or {})
    written, error = _write_files(directory, files, engine.world.rank)  # pulls the rounds as it writes
    exchange.drain()
    return _publish(directory, plan, names, written, error or exchange.error, engine.world, layout or {})


def snapshot_owned(
    engine: EngineFacade,
    directory: Path,
    dtype: torch.dtype,
    max_bytes: int,
    pin: bool,
    layout: FileLayout | None = None,
) -> Callable[[CommGroup], list[str]]:
    """[Note: owned tensors] in two halves, for an asynchronous save ([Note: asynchronous save]): every round is
    run now (a collective) and this rank's tensors copied to host memory (pinned for an accelerator); the
    returned work writes, renames and indexes the files, agreeing on the group it is given (the save thread's)."""
    require_shared(directory, engine.world, f"model.save_pretrained ({directory})")  # [Note: shared directory]
    plan, names, exchange, files = _prepare(engine, dtype, max_bytes, None, layout or {})
    copies: list[tuple[str, list[Entry]]] = []
    error: Exception | None = None
    try:
        for name, entries in files:
            copies.append((name, [replace(e, pieces=frozen(e.pieces(), pin)) for e in entries]))
    except Exception as e:  # noqa: BLE001 - agreed on below, after serving the other ranks' rounds
        error = e
    exchange.drain()
    raise_if_any_failed(error or exchange.error, engine.world, f"model.save_pretrained ({directory})")
    rank = engine.world.rank

    def work(group: CommGroup) -> list[str]:
        written, failure = _write_files(directory, copies, rank)
        return _publish(directory, plan, names, written, failure, group, layout or {})

    return work


def _prepare(
    engine: EngineFacade,
    dtype: torch.dtype,
    max_bytes: int,
    on_round: Callable[[int, int], None] | None,
    layout: FileLayout,
) -> tuple[OwnerPlan, list[list[str]], Exchange, list[tuple[str, list[Entry]]]]:
    """The plan, every rank's file names, the exchange, and this rank's files: their entries pull the rounds."""
    engine.refresh_masters()  # [Note: edits between steps]
    plan = OwnerPlan.deal(folder_tensors(engine, dtype), dtype, engine.world.size, max_bytes)
    names = plan.file_names()
    rank = engine.world.rank
    exchange = Exchange(engine, plan, on_round)
    files: list[tuple[str, list[Entry]]] = []
    k = 0
    for name, group in zip(names[rank], plan.files[rank]):
        entries = []
        for i in group:
            t = plan.tensors[i]
            out = written_dtype(t, dtype)
            pieces = functools.partial(_cast_to, out, functools.partial(exchange.windows, k))
            entries.append(Entry(t.name, out, t.shape, pieces, layout.get(t.name, ())))
            k += 1
        files.append((name, entries))
    return plan, names, exchange, files


def _cast_to(dtype: torch.dtype, pieces: Callable[[], Iterator[torch.Tensor]]) -> Iterator[torch.Tensor]:
    """The pieces in `dtype` (the exchange sends the widest dtype written: [Note: parameters kept in ...])."""
    for piece in pieces():
        yield piece if piece.dtype == dtype else piece.to(dtype)


def _write_files(
    directory: Path, files: list[tuple[str, list[Entry]]], rank: int
) -> tuple[list[Path], Exception | None]:
    """Each file under a temporary name, flushed; the temporary paths written and the first error (the caller
    agrees on it: a rank that failed still serves the others' rounds)."""
    written: list[Path] = []
    try:
        make_directory(directory)
        for name, entries in files:
            tmp = directory / f".{name}.partial"
            written.append(tmp)
            write_streamed(tmp, entries, {"format": "pt", "hf_zero_rank": str(rank)})
            fsync_file(tmp)
    except Exception as e:  # noqa: BLE001 - agreed on by the caller
        return written, e
    return written, None


def _publish(
    directory: Path,
    plan: OwnerPlan,
    names: list[list[str]],
    written: list[Path],
    error: Exception | None,
    group: CommGroup,
    layout: FileLayout,
) -> list[str]:
    """Agree that every file was written, rename them into place, and (rank 0) drop stale weight files and write
    the index last; on any rank's failure every rank removes its temporary files and raises."""
    if error is not None:
        for tmp in written:
            with contextlib.suppress(OSError):  # what could not be written may not be a file
                tmp.unlink(missing_ok=True)
    raise_if_any_failed(error, group, f"model.save_pretrained ({directory})")
    for tmp, name in zip(written, names[group.rank]):
        os.replace(tmp, directory / name)
    all_names = [n for mine in names for n in mine]
    error = None
    if group.rank == 0:
        try:
            for old in directory.iterdir():
                if (WEIGHT_FILE.match(old.name) and old.name not in all_names) or old.name == INDEX_FILE:
                    old.unlink()
            if len(all_names) > 1:
                write_bytes_atomically(directory / INDEX_FILE, _index(plan, names, layout))
        except Exception as e:  # noqa: BLE001 - agreed on below
            error = e
    raise_if_any_failed(error, group, f"model.save_pretrained ({directory})")
    return all_names


def _index(plan: OwnerPlan, names: list[list[str]], layout: FileLayout) -> bytes:
    weight_map = {
        stored: name
        for rank_names, groups in zip(names, plan.files)
        for name, group in zip(rank_names, groups)
        for i in group
        for stored, _ in layout.get(plan.tensors[i].name, ((plan.tensors[i].name, ()),))
    }
    parameters = sum(t.numel for t in plan.tensors if t.parameter)
    total = sum(t.numel * _itemsize(t, plan.dtype) for t in plan.tensors)
    index = {
        "metadata": {"total_parameters": parameters, "total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
