"""Reuse of the flat buffers that stages 2-3 allocate and free many times per iteration.

[Note: buffer reuse]
At stage 3 every unit's parameters are gathered into a fresh buffer twice per iteration (forward
and backward) and freed after use, and at stages 2-3 every unit's unsharded gradients get a
fresh buffer in each backward pass. On CUDA the caching allocator hands such buffers back
without cost; on the host the default allocator returns large blocks to the kernel at once and
every new one is paid again in page faults (a fresh zeroed 50 MB buffer costs 33 ms on one core
here, re-zeroing a held one 9 ms). A `BufferPool` keeps the memory of freed buffers whose size
recurs (the repeated transformer blocks) and hands it to the next unit of that size.

Buffers keep their identity: a unit's parameter views, and the tensors autograd saved from
them, point into one storage for the unit's whole life; the pool exchanges the memory *behind*
that storage (`UntypedStorage._swap_data_ptr_`), as resizing it to zero and back would, minus
the allocation. Memory stays bounded: at most `per_size` buffers of each size wait in the pool,
and `clear()` (called at the end of every forward and backward pass) returns them all, so
between passes the pool holds nothing. Within a pass, each unit's hooks first `retain` only the
sizes that it and the next few units use: idle blocks' buffers are not kept while the embedding
or the head, the largest units, compute.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from .collectives.quant import gather_workspace_numels
from .layout import FlatLayout

_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def _libc_function(name: str) -> Any:
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return None


_TRIM = _libc_function("malloc_trim")
_MALLOPT = _libc_function("mallopt")
_M_MMAP_THRESHOLD = -3
_FIXED: list[int] = []  # the threshold `map_large_host_allocations` fixed for the process, once it has


@contextlib.contextmanager
def mapped_temporaries(threshold: int = 1 << 20) -> Iterator[None]:
    """[Note: host heap] inside, host allocations of `threshold` bytes or more are mapped on their own and
    unmapped when freed; afterwards the threshold is the one the process fixed (`map_large_host_allocations`), else
    glibc's 32 MiB ceiling (where its dynamic threshold settles in a training process).

    Example:

    ```python
    >>> with mapped_temporaries():
    ...     optimizer.step()  # its per-chunk temporaries leave no holes in the heap
    ```
    """
    if _MALLOPT is not None:
        _MALLOPT(_M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        if _MALLOPT is not None:
            _MALLOPT(_M_MMAP_THRESHOLD, _FIXED[-1] if _FIXED else 32 << 20)


def map_large_host_allocations(threshold: int = 1 << 20) -> None:
    """[Note: host heap] from now on, host allocations of `threshold` bytes or more in this process are mapped on
    their own and unmapped when freed (glibc's mmap threshold fixed, no longer raised to 32 MiB as blocks are
    freed). `initialize` calls it for two kinds of run on the CPU. Sequence parallelism: its activations come in
    sizes the unsplit model does not make (a rank's part of the sequence, the whole sequence over a part of the
    heads after the all-to-all), and under glibc's dynamic threshold the freed ones stayed in the heap as holes the
    next step's could not use: 0.84B at 8192 tokens, SP 2, peaked 1 GiB higher per rank than without SP; a 87M
    model at 8192 tokens, 2.31 GB per rank with the dynamic threshold, 1.73 GB with this (the unsplit run: 2.16),
    at 0.97x the tokens/s (benchmarks/results/sequence_heap.md). A frozen base (LoRA, QLoRA): each block's
    gathered weights (and a 4-bit base's dequantized ones) are freed between the adapters' small gradients and
    optimizer states, which pin the holes: a QLoRA step on LLaMA blocks of 2048 x 5632 grew the peak by 28 MB per
    block with the dynamic threshold, 18 MB with this (benchmarks/results/capacity_qlora_fp32.md). A no-op where
    the C library is not glibc.

    Example:

    ```python
    >>> map_large_host_allocations()  # a CPU run's large temporaries go back to the system when freed
    ```
    """
    if _MALLOPT is not None:
        _MALLOPT(_M_MMAP_THRESHOLD, threshold)
        _FIXED[:] = [threshold]


def fixed_mmap_threshold() -> int | None:
    """The host allocation size from which this process maps each allocation on its own (`map_large_host_allocations`
    fixed it), or None where glibc's dynamic threshold rules."""
    return _FIXED[-1] if _FIXED else None


def release_free_host_memory() -> None:
    """[Note: host heap]
    glibc serves allocations below its mmap threshold (which grows to 32 MiB as such blocks are freed)
    from heaps it keeps when they are freed: an offloaded optimizer step's chunk-sized temporaries (AdamW's
    `denom`, a first step's new moments) leave freed memory in the heap that the next large allocation
    (a gradient slab, a gathered unit) cannot use, and the backward's peak would stand on top of it
    (glibc held 1.8 GB more at 0.3B with disk offload). So the engine hands such memory back to the system
    after each optimizer step on offloaded state. During a disk-offload step (`mapped_temporaries`) the
    temporaries are mapped one by one instead: its windows' chunks differ in size, so freed temporaries leave
    holes the next ones do not fit and the heap would grow within the step; there the disk sets the step's
    time, so the page faults of fresh mappings cost nothing visible. An in-memory step keeps the heap, where
    mapping each temporary would double its time. A step in memory on a CPU-only run is not trimmed: what it
    frees (the last backward's activations, the step's temporaries) is what the next forward allocates again,
    and trimming it would make every step fault it back in (small preset, ZeRO-3: 220k page faults per step
    against 120k, 0.2-0.3 s more system time in a 3.5 s step) for a peak 2-3% lower. Measurements:
    docs/performance.md, Capacity.

    Example:

    ```python
    >>> release_free_host_memory()  # a no-op where the C library has no malloc_trim
    ```
    """
    if _TRIM is not None:
        _TRIM(0)


class BufferPool:
    """Freed buffer memory of recurring sizes, handed to the next buffer of the same size.

    Args:
        sizes (`set[int]`):
            The buffer sizes in bytes worth keeping (those of which the model has several units).
        per_size (`int`):
            At most this many freed buffers of one size wait in the pool.

    Example:

    ```python
    >>> pool = BufferPool({64}, per_size=2)
    >>> t = torch.empty(16)                  # 64 bytes
    >>> pool.release(t.untyped_storage())    # t's memory now waits in the pool; t holds 0 bytes
    >>> pool.fill(t.untyped_storage(), 64)   # and comes back, without an allocation
    >>> t.untyped_storage().nbytes()
    64
    ```
    """

    def __init__(self, sizes: set[int], per_size: int) -> None:
        self.sizes = sizes if _CAN_SWAP else set()
        self.per_size = per_size
        self._free: dict[tuple[torch.device, int], list[torch.UntypedStorage]] = {}
        self.reused = 0  # buffers filled from the pool (counts for tests and benchmarks)
        self.allocated = 0  # buffers filled by a fresh allocation

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty `storage` `nbytes` of memory: a pooled buffer's, or a new allocation."""
        if storage.nbytes() != 0:
            raise RuntimeError(f"hf_zero: BufferPool.fill on a storage that holds {storage.nbytes()} bytes")
        free = self._free.get((storage.device, nbytes))
        if free:
            storage._swap_data_ptr_(free.pop())  # type: ignore[attr-defined]  # torch's private swap, not in its stubs
            self.reused += 1
        else:
            storage.resize_(nbytes)
            self.allocated += 1

    def new_tensor(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1D tensor of `numel` elements (uninitialized) on pooled memory when some is free."""
        t = torch.empty(0, dtype=dtype, device=device)
        self.fill(t.untyped_storage(), numel * t.element_size())
        return t.set_(t.untyped_storage(), 0, (numel,), (1,))

    def release(self, storage: torch.UntypedStorage) -> None:
        """Free `storage`'s memory (it keeps its identity and holds 0 bytes), into the pool if its
        size recurs and the pool has room."""
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        free = self._free.setdefault((storage.device, nbytes), [])
        if nbytes in self.sizes and len(free) < self.per_size:
            empty = torch.UntypedStorage(0, device=storage.device)
            storage._swap_data_ptr_(empty)  # type: ignore[attr-defined]  # torch's private swap; `empty` now owns the memory
            free.append(empty)
        else:
            storage.resize_(0)

    def retain(self, sizes: frozenset[int]) -> None:
        """Return the pooled buffers of every size not in `sizes` to the allocator (the units about to
        run need none of them), so idle memory does not add to the peak of the units that follow."""
        for key in [k for k in self._free if k[1] not in sizes]:
            del self._free[key]

    def clear(self) -> None:
        """Return every pooled buffer to the allocator."""
        self._free.clear()

    @property
    def pooled_bytes(self) -> int:
        return sum(s.nbytes() for free in self._free.values() for s in free)


def transient_nbytes(
    layout: FlatLayout,
    group_size: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    weight_quant_block: int | None,
) -> frozenset[int]:
    """[Note: buffer reuse] the sizes of the buffers a unit with this layout takes from the pool and gives
    back within a pass: gathered parameters, unsharded gradients and their cast for the reduction, the
    reduced shard in the reduce dtype, and with int8 weight gathers the blocks and scales received."""
    sizes = {layout.padded_numel * dt.itemsize for dt in (param_dtype, reduce_dtype)}
    sizes |= {layout.shard_numel * dt.itemsize for dt in (param_dtype, reduce_dtype)}  # + the cast on gather
    if weight_quant_block is not None:
        blocks, scales = gather_workspace_numels(layout.shard_numel, weight_quant_block, group_size)
        sizes |= {blocks, scales * 4}
    return frozenset(sizes)


def pool_for(
    layouts: list[FlatLayout],
    dtypes: list[tuple[torch.dtype, torch.dtype, torch.dtype]],
    shards: int,
    weight_block: int | None,
    per_size: int,
) -> BufferPool:
    """[Note: buffer reuse] pool the buffer sizes of which there are several units (the repeated
    blocks): gathered parameters and unsharded gradients (and their cast for the reduction). At
    most the units that can be live at once (the running one, the prefetched ones and the one
    whose reduction is in flight) wait in the pool per size. `dtypes`: each part's compute, master and reduce
    dtypes; `weight_block`: int8 weight gathers' block, if any."""
    by_size: dict[tuple[int, torch.dtype, torch.dtype], FlatLayout] = {}  # the blocks of one model share a size
    counts: Counter[tuple[int, torch.dtype, torch.dtype]] = Counter()
    for layout, (compute, _, reduce) in zip(layouts, dtypes):
        key = (layout.padded_numel, compute, reduce)
        by_size.setdefault(key, layout)
        counts[key] += 1
    sizes = {
        n
        for key, c in counts.items()
        if c > 1
        for n in transient_nbytes(by_size[key], shards, key[1], key[2], weight_block)
    }
    return BufferPool(sizes, per_size=per_size)
