"""Disk offload (ZeRO-Infinity): the master shards and the optimizer state live in files.

[Note: disk offload]
With `ZeroConfig(offload_optimizer=True, offload_dir=PATH)` each rank keeps, in a folder of its
own under PATH, one preallocated file with the master shards of its trainable units end to end
(`master.bin`) and one file per elementwise optimizer state (`state-exp_avg.bin`, ..., at the
same offsets). In memory stay: the compute-dtype parameter shards (what stage 3 gathers from,
unless [Note: parameters on disk]; the whole parameters at stages 1-2), the gradient shards
(written by the reductions, read by clipping and the step), the optimizer's non-elementwise
state (Adam's `step`), and a fixed set of host buffers (pinned when the compute device is an
accelerator).

The optimizer steps in windows of at most `WINDOW_NUMEL` consecutive elements of the files, made
of its chunks ([Note: optimizer chunks] in pieces.py). A window's master and state are read into
host buffers `READ_AHEAD` windows ahead of the one being stepped, on background threads; the
optimizer's chunk tensors of that window are pointed at the buffers (`Tensor.set_`), and so are
their state entries and gradients; the user's optimizer steps just those (every window starts
from the param groups' values of before the step, so a counter an optimizer keeps in its group
advances once per step); the new values are copied into the compute-dtype parameters, and the
window is written back behind, at most `WRITE_BEHIND` writes in flight. Between windows the
chunk tensors and their state entries hold no elements. After a step the kernel is asked to read
the files again (`POSIX_FADV_WILLNEED`): the next step's reads are then issued during its forward
and backward into the page cache, which the system reclaims under memory pressure. Where the
compute device is the CPU, the last writes are waited for and the host buffers freed at the end of
the step, so forward and backward run without them; pinned buffers (an accelerator) stay, in the
pinned-memory cache, and the last writes overlap the next forward.

[Note: parameters on disk]
With `offload_params=True` too (stage 3), no compute-dtype parameter shard is kept: the master file
is each gather's source. `FlatPart.gather` asks its store (`DiskMaster.gather_source`, master.py), which
waits for the writes in flight and reads the part's master shard into a fresh host tensor (pinned on an
accelerator); the gather casts it as in [Note: cast on gather] and frees it. The step publishes
nothing for such units: its written windows are what the next gathers read. What that saves is
2Ψ/N bytes of host memory (bf16) per rank, the largest model state left in memory after the
gradient shards; what it costs is reading 4Ψ/N bytes more per forward and per backward (the
page cache serves them when it can hold the files).

The folder is removed when the engine is released (or at interpreter exit); a process killed
outright leaves it behind, named `hf_zero-offload-<host>-<pid>-<token>-rank<r>`.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import socket
import time
import uuid
import weakref
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...dtypes import AT_ONCE_NUMEL
from ..collectives import CommGroup, raise_if_any_failed
from ..layout import FlatLayout
from ..placement import Placement
from ..pool import mapped_temporaries
from .master import DiskMaster

if TYPE_CHECKING:
    from ..flat import FlatPart
    from ..wrap import UnitSpec
    from .pieces import Piece

WINDOW_NUMEL = AT_ONCE_NUMEL  # elements stepped at once: 16 MiB of fp32 master per buffer
READ_AHEAD = 2  # windows read ahead of the one being stepped
WRITE_BEHIND = 2  # window writes in flight behind it
IO_PIECE_BYTES = 1 << 26  # one system call reads or writes at most this much
RESERVED_STATES = 2  # state files counted in the free-space check at initialize (Adam's two moments)
MASTER = "master"


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy (the tensor must outlive the view).

    Example:

    ```python
    >>> len(host_bytes(torch.ones(4)))
    16
    ```
    """
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


class OffloadFiles:
    """One rank's offload files: the master shards and each elementwise optimizer state, one file each.

    Example:

    ```python
    >>> files = OffloadFiles.create(Path("/nvme/offload"), rank=0, numel=1024, dtype=torch.float32)
    >>> files.write(MASTER, 0, torch.ones(8)); out = torch.empty(8); files.read(MASTER, 0, out)
    >>> files.remove()
    ```
    """

    def __init__(self, directory: Path, numel: int) -> None:
        self.directory = directory
        self.numel = numel  # elements per file
        self.dtypes: dict[str, torch.dtype] = {}
        self._fds: dict[str, int] = {}

    @staticmethod
    def create(root: Path, *, rank: int, numel: int, dtype: torch.dtype) -> OffloadFiles:
        """Make this rank's folder under `root` and its preallocated master file; `OSError` with the cause
        and the bytes needed when `root` cannot be written or has too little free space."""
        directory = root / f"hf_zero-offload-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}-rank{rank:05d}"
        need = numel * dtype.itemsize * (1 + RESERVED_STATES)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(
                f"ZeroConfig.offload_dir {root} cannot be written ({e.strerror or e}); choose a folder "
                "this process can create files in."
            ) from e
        free = shutil.disk_usage(directory).free
        files = OffloadFiles(directory, numel)
        try:
            if free < need:
                raise OSError(
                    f"ZeroConfig.offload_dir {root} has {free / 2**30:.2f} GiB free; this rank needs "
                    f"{need / 2**30:.2f} GiB (master weights and {RESERVED_STATES} optimizer states of "
                    f"{numel} elements). Free space or point offload_dir at a larger disk."
                )
            files.add(MASTER, dtype)
        except OSError:
            files.remove()
            raise
        return files

    def add(self, key: str, dtype: torch.dtype) -> None:
        """Create and preallocate the file of `key` (`OSError` when the disk is full)."""
        path = self.directory / f"{'' if key == MASTER else 'state-'}{key}.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._fds[key] = fd
        self.dtypes[key] = dtype
        nbytes = self.numel * dtype.itemsize
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError as e:
            if e.errno not in (95, 22):  # EOPNOTSUPP / EINVAL: a filesystem without fallocate
                raise OSError(
                    f"hf_zero could not preallocate {nbytes / 2**30:.2f} GiB for {path}: {e.strerror}. "
                    "Free space in ZeroConfig.offload_dir."
                ) from e
            os.ftruncate(fd, nbytes)

    def read(self, key: str, offset: int, out: torch.Tensor) -> None:
        """Read `out.numel()` elements of `key` at element `offset` into the contiguous host tensor `out`."""
        view, pos, fd = host_bytes(out), offset * out.element_size(), self._fds[key]
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done : done + IO_PIECE_BYTES]], pos + done)
            if n <= 0:
                raise OSError(f"hf_zero: short read of {self.directory / key} at byte {pos + done}")
            done += n

    def write(self, key: str, offset: int, src: torch.Tensor) -> None:
        """Write the contiguous host tensor `src` into `key` at element `offset`."""
        view, pos, fd = host_bytes(src), offset * src.element_size(), self._fds[key]
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done : done + IO_PIECE_BYTES], pos + done)

    def advise_willneed(self) -> None:
        """Ask the kernel to read every file ahead, into the page cache (a hint; no memory of ours)."""
        for fd in list(self._fds.values()):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)

    @property
    def nbytes(self) -> int:
        return sum(self.numel * dt.itemsize for dt in self.dtypes.values())

    def remove(self) -> None:
        """Close and delete the files and the folder (idempotent)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


@dataclass(frozen=True)
class Chunk:
    """One optimizer tensor of a disk-offloaded unit: elements `[a, b)` of `piece`'s master."""

    param: torch.Tensor  # what the optimizer steps; 0 elements outside its window
    piece: Piece
    a: int
    b: int
    offset: int  # element offset in the files

    @property
    def numel(self) -> int:
        return self.b - self.a


@dataclass(frozen=True)
class Window:
    chunks: tuple[Chunk, ...]
    offset: int  # element offset in the files of the first chunk
    numel: int


class DiskOffload:
    """The owner of one rank's offload files, its host buffers and its I/O threads ([Note: disk offload]).

    Args:
        files (`OffloadFiles`): this rank's files, already holding room for the masters.
        device (`torch.device`): the compute device; host buffers are pinned when it is an accelerator.
        offsets (`dict[str, int]`): each trained part's place in the files (element offset of its shard), by its
            unit's name: planned whole before any part exists.
    """

    def __init__(self, files: OffloadFiles, device: torch.device, offsets: dict[str, int]) -> None:
        self.files = files
        self.offsets = offsets
        self.device = device
        self.host_pinned = Placement(device).host_pinned  # [Note: placement]: host buffers pinned beside an accelerator
        self._stores: dict[int, DiskMaster] = {}  # id(part) -> its store: where its shard is in the files
        self.windows: list[Window] = []
        self.chunk_ids: set[int] = set()
        self.capacity = 0
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}  # idle host buffers of `capacity` elements
        self.buffers_made = 0  # host buffers allocated so far (bounded: [Note: disk offload])
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hf_zero-disk")
        self._writes: deque[tuple[Future[None], list[torch.Tensor], Any]] = deque()
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self.read_bytes = 0  # bytes read and written so far, the seconds the I/O threads spent on them, and the
        self.written_bytes = 0  # seconds the step waited for them (exposed I/O): for benchmarks
        self.read_s = 0.0
        self.write_s = 0.0
        self.waited_s = 0.0
        self._finalizer = weakref.finalize(self, _shutdown, self._io, files)

    # ---- layout -------------------------------------------------------------------------------
    master_key = MASTER

    def adopt(self, part: FlatPart, params_on_disk: bool) -> DiskMaster:
        """Write `part`'s freshly filled master shard at its planned place in the files and free the shard's memory
        (the tensor stays, holding 0 bytes): the part's store from now on ([Note: master stores])."""
        offset = self.offsets.get(place_key(part.spec))
        if offset is None or any(store.offset == offset for store in self._stores.values()):
            raise RuntimeError(
                f"[rank {part.shard_group.global_rank}] hf_zero: unit '{part.name}' has no place of its own in the "
                "offload files"
            )
        self.files.write(MASTER, offset, part.sharded_master)
        part.sharded_master.untyped_storage().resize_(0)
        store = DiskMaster(part, self, offset, params_on_disk)
        self._stores[id(part)] = store
        return store

    def build(self, pieces: list[Piece]) -> None:
        """Group the chunks of the disk units' pieces into windows of consecutive elements."""
        chunks = [
            Chunk(t, piece, a, b, self._stores[id(piece.part)].offset + piece.local[0] + a)
            for piece in pieces
            if id(piece.part) in self._stores
            for t, (a, b) in zip(piece.optim_params, piece.bounds)
        ]
        chunks.sort(key=lambda c: c.offset)
        current: list[Chunk] = []
        for chunk in chunks:
            if current and chunk.offset + chunk.numel - current[0].offset > WINDOW_NUMEL:
                self._close_window(current)
                current = []
            current.append(chunk)
        if current:
            self._close_window(current)
        self.chunk_ids = {id(c.param) for w in self.windows for c in w.chunks}
        self.capacity = max((w.numel for w in self.windows), default=0)  # elements per host buffer

    def _close_window(self, chunks: list[Chunk]) -> None:
        last = chunks[-1]
        self.windows.append(Window(tuple(chunks), chunks[0].offset, last.offset + last.numel - chunks[0].offset))

    # ---- whole shards (checkpoints, gathers, loads) -----------------------------------------
    def read_master(self, offset: int, numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
        """A fresh host tensor (pinned with `pin`) with `numel` master elements from `offset` as the files hold them."""
        self.drain()
        out = torch.empty(numel, dtype=dtype, pin_memory=pin)
        self.files.read(MASTER, offset, out)
        self.read_bytes += out.numel() * out.element_size()
        return out

    def read_range(self, key: str, offset: int, numel: int, piece_numel: int = WINDOW_NUMEL) -> Iterator[torch.Tensor]:
        """`numel` elements of `key` from element `offset` on, as host tensors of at most `piece_numel`
        elements, read into one reused buffer (each is overwritten by the next)."""
        self.drain()
        dtype = self.files.dtypes[key]
        buf = torch.empty(min(numel, piece_numel), dtype=dtype)
        for start in range(0, numel, piece_numel):
            part = buf[: min(piece_numel, numel - start)]
            self.files.read(key, offset + start, part)
            yield part

    def write_range(self, key: str, offset: int, values: torch.Tensor) -> None:
        self.drain()
        if key not in self.files.dtypes:
            self.files.add(key, values.dtype)
        self.files.write(key, offset, values.to("cpu").contiguous())

    def account(self, memory: dict[str, dict[str, int]]) -> None:
        """Count the files' bytes (masters and elementwise optimizer state) as optimizer state on "disk"."""
        memory["optimizer_states"]["disk"] = self.files.nbytes

    def refuse_state_access(self, what: str, remedy: str) -> None:
        """`ValueError` for `what`, which needs the optimizer state in memory ([Note: master stores])."""
        raise ValueError(
            f"{what} needs the optimizer state in memory; with ZeroConfig.offload_dir it lives in the offload "
            f"files ([Note: disk offload]): {remedy}"
        )

    @property
    def state_keys(self) -> list[str]:
        return [k for k in self.files.dtypes if k != MASTER]

    # ---- the optimizer step -------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, used: dict[int, list[bool]]) -> None:
        """Step `optimizer` window by window over the files and publish each window's new values into its
        units' compute parameters ([Note: disk offload]); `used` as in `OptimizerSteps._used_anywhere` (stepping.py)."""
        with mapped_temporaries():  # [Note: host heap]
            self._step(optimizer, used)

    def _step(self, optimizer: torch.optim.Optimizer, used: dict[int, list[bool]]) -> None:
        self.drain()
        groups = optimizer.param_groups
        full = [g["params"] for g in groups]
        before = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        group_of = {id(t): i for i, g in enumerate(groups) for t in g["params"]}
        ahead: deque[Future[dict[str, torch.Tensor]]] = deque()
        try:
            in_memory = [[t for t in ps if id(t) not in self.chunk_ids] for ps in full]
            if any(t.grad is not None for ps in in_memory for t in ps):
                for g, ps in zip(groups, in_memory):
                    g["params"] = ps
                optimizer.step()
            for window in self.windows[:READ_AHEAD]:
                ahead.append(self._read_window(window))
            first = True
            for i, window in enumerate(self.windows):
                began = time.perf_counter()
                buffers = ahead.popleft().result()
                self.waited_s += time.perf_counter() - began
                if i + READ_AHEAD < len(self.windows):
                    ahead.append(self._read_window(self.windows[i + READ_AHEAD]))
                grads = [_grad_of(c, used) for c in window.chunks]
                stepped = [c for c, g in zip(window.chunks, grads) if g is not None and id(c.param) in group_of]
                if not stepped:
                    self._recycle(list(buffers.values()))
                    continue
                self._install(window, buffers, optimizer.state)
                for c, grad in zip(window.chunks, grads):
                    c.param.grad = grad
                if not first:
                    for g, values in zip(groups, before):
                        g.update(values)
                first = False
                for gi, g in enumerate(groups):
                    g["params"] = [c.param for c in stepped if group_of[id(c.param)] == gi]
                optimizer.step()
                self._adopt_state(window, buffers, optimizer.state)
                self._publish(window, buffers[MASTER])
                self._write_window(window, buffers)
        finally:
            for g, ps in zip(groups, full):
                g["params"] = ps
            for future in ahead:
                self._recycle(list(future.result().values()))
        self._io.submit(self.files.advise_willneed)
        if not self.host_pinned:  # host buffers are plain memory: none is held through forward and backward
            self.drain()
            self._free.clear()

    def _read_window(self, window: Window) -> Future[dict[str, torch.Tensor]]:
        keys = [MASTER, *self.state_keys]
        buffers = {k: self._take(self.files.dtypes[k]) for k in keys}

        def read() -> dict[str, torch.Tensor]:
            began = time.perf_counter()
            for k, buf in buffers.items():
                self.files.read(k, window.offset, buf[: window.numel])
            self.read_s += time.perf_counter() - began
            return buffers

        self.read_bytes += sum(window.numel * b.element_size() for b in buffers.values())
        return self._io.submit(read)

    def _install(self, window: Window, buffers: dict[str, torch.Tensor], state: dict[Any, Any]) -> None:
        """Point each chunk tensor, and its state entries, at the window's buffers."""
        for c in window.chunks:
            at = c.offset - window.offset
            master = buffers[MASTER]
            c.param.set_(master.untyped_storage(), at, (c.numel,), (1,))
            entries = state.get(c.param)
            if entries:
                for key in self.state_keys:
                    if key in entries and key in buffers:
                        entries[key] = buffers[key][at : at + c.numel]

    def _adopt_state(self, window: Window, buffers: dict[str, torch.Tensor], state: dict[Any, Any]) -> None:
        """Move state tensors the optimizer created in this step (its first) into the window's buffers, making
        a file for each new elementwise key; then leave every chunk and state entry without elements."""
        for c in window.chunks:
            entries = state.get(c.param) or {}
            at = c.offset - window.offset
            for key, value in list(entries.items()):
                if not isinstance(value, torch.Tensor) or value.shape != c.param.shape:
                    continue  # not elementwise (a step count, a scalar): stays in memory
                if key not in self.files.dtypes:
                    self.files.add(key, value.dtype)
                if key not in buffers:
                    buffers[key] = self._take(value.dtype)
                    self.files.read(key, window.offset, buffers[key][: window.numel])  # keep the others' values
                target = buffers[key][at : at + c.numel]
                if value.data_ptr() != target.data_ptr():
                    target.copy_(value)
                entries[key] = self._placeholder(value.dtype)
            c.param.grad = None
            c.param.set_()  # type: ignore[call-overload]  # no arguments: an empty storage, valid at runtime

    def _publish(self, window: Window, master: torch.Tensor) -> None:
        for c in window.chunks:
            if self._stores[id(c.piece.part)].params_on_disk:
                continue  # [Note: parameters on disk]: the next gather reads the written window
            at = c.offset - window.offset
            lo = c.piece.local[0]
            c.piece.part.param_shard()[lo + c.a : lo + c.b].copy_(master[at : at + c.numel], non_blocking=True)

    def _write_window(self, window: Window, buffers: dict[str, torch.Tensor]) -> None:
        copied = None
        if self.host_pinned:  # the buffers are read by asynchronous copies to the device
            copied = torch.Event(device=self.device)
            copied.record()

        def write() -> None:
            began = time.perf_counter()
            for k, buf in buffers.items():
                self.files.write(k, window.offset, buf[: window.numel])
            self.write_s += time.perf_counter() - began

        self.written_bytes += sum(window.numel * b.element_size() for b in buffers.values())
        self._writes.append((self._io.submit(write), list(buffers.values()), copied))
        while len(self._writes) > WRITE_BEHIND:
            self._finish_write()

    def _finish_write(self) -> None:
        future, buffers, copied = self._writes.popleft()
        began = time.perf_counter()
        future.result()
        self.waited_s += time.perf_counter() - began
        if copied is not None:
            copied.synchronize()
        self._recycle(buffers)

    def drain(self) -> None:
        """Wait for every write in flight (its buffers return to the pool)."""
        while self._writes:
            self._finish_write()

    # ---- buffers ------------------------------------------------------------------------------
    def _take(self, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of `capacity` elements of `dtype` (the largest window): one size per dtype, so the
        buffers of finished windows serve the next ones and the set stays fixed."""
        free = self._free.get(dtype)
        if free:
            return free.pop()
        self.buffers_made += 1
        return torch.empty(self.capacity, dtype=dtype, pin_memory=self.host_pinned)

    def _recycle(self, buffers: list[torch.Tensor]) -> None:
        for b in buffers:
            self._free.setdefault(b.dtype, []).append(b)

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        return self._placeholders.setdefault(dtype, torch.empty(0, dtype=dtype))

    @property
    def buffer_bytes(self) -> int:
        """Host memory held by idle buffers."""
        return sum(b.numel() * b.element_size() for free in self._free.values() for b in free)

    def close(self) -> None:
        """Finish the writes, stop the threads and remove the files."""
        self.drain()
        self._io.shutdown(wait=True)
        self._finalizer()


def _grad_of(chunk: Chunk, used: dict[int, list[bool]]) -> torch.Tensor | None:
    """The chunk's gradient: None for a parameter no rank's backward reached since the last step; zeros (the shard
    allocated) for one whose gradient `zero_grad(set_to_none=False)` kept as zeros ([Note: zero gradients kept] in
    stepping.py), as `Piece.bind_grads` gives in memory."""
    piece = chunk.piece
    if not used[id(piece.part)][piece.slot_index]:
        return None
    return piece.grad[chunk.a : chunk.b]


def _shutdown(io: ThreadPoolExecutor, files: OffloadFiles) -> None:
    """[Note: no join in a finalizer]
    The finalizer of a `DiskOffload` nobody closed runs where its last reference goes: in the garbage collector,
    which runs in whichever thread allocates, or in an I/O thread that drops the last task holding it. Joining
    threads there deadlocks: a thread starting up collects garbage while it holds `threading`'s own lock that every
    join takes to finish (seen as a hang of one rank in a save), and an I/O thread cannot join itself. So the threads
    are told to stop and not waited for (`close()` waits first). No read or write can be in flight: each task holds
    the store, so none is queued or running once it is garbage; at most a read-ahead hint (`posix_fadvise`) is."""
    io.shutdown(wait=False)
    files.remove()


def place_key(spec: UnitSpec) -> str:
    """A trained part's place in the files: its unit's name, and the dtype of a part kept in its own ([Note:
    parameters kept in their own dtype] in unit.py: BatchNorm's float32 part beside a unit's bf16 one)."""
    return spec.name if spec.dtype is None else f"{spec.name}#{spec.dtype}"


def refuse_kept_on_disk(specs: list[UnitSpec], masters: list[torch.dtype], files: torch.dtype) -> None:
    """[Note: parameters kept in their own dtype] the disk's files hold one master dtype (`files`): a trained part
    whose master is in another (`masters`, one per spec) has no place there."""
    kept = [name for s, d in zip(specs, masters) if d != files and not s.frozen for name in s.param_names]
    if kept:
        raise ValueError(
            f"hf_zero: offload_dir keeps every master shard in one file layout, and {kept[:3]} are kept in their own "
            "dtype (transformers' `_keep_in_fp32_modules`; BatchNorm's under mixed precision). Offload them to host "
            "memory instead (offload_optimizer without offload_dir), or, for `_keep_in_fp32_modules`, load the whole "
            "model in float32 and train with mixed_precision='bf16'."
        )


def disk_for(
    layouts: dict[str, FlatLayout],
    offload_dir: str | None,
    world: CommGroup,
    device: torch.device,
    master_dtype: torch.dtype,
) -> DiskOffload | None:
    """This rank's offload files when `offload_dir` is set, created (with the free-space check) on every
    rank before any unit: a failure on one rank raises on every rank. `layouts`: the trained parts' layouts by
    `place_key`; their master shards lie end to end in the files, each place planned here."""
    if offload_dir is None:
        return None
    starts = itertools.accumulate((layout.shard_numel for layout in layouts.values()), initial=0)
    offsets = dict(zip(layouts, starts))
    numel = sum(layout.shard_numel for layout in layouts.values())
    files, error = None, None
    try:
        files = OffloadFiles.create(Path(offload_dir), rank=world.rank, numel=numel, dtype=master_dtype)
    except OSError as e:
        error = e
    try:
        raise_if_any_failed(error, world, "hf_zero.initialize (offload_dir)")
    except BaseException:
        if files is not None:  # another rank failed: leave nothing behind here either
            files.remove()
        raise
    if files is None:
        raise RuntimeError(f"[rank {world.global_rank}] hf_zero: no offload files after a successful creation")
    return DiskOffload(files, device, offsets)
