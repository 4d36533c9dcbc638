"""One unit's storage: the flat layout of its parameters and its sharded / unsharded tensors.

[Note: flat layout]
A unit's parameters are laid end to end in one 1D buffer, padded to `shard_numel * num_shards`
elements. Rank r of the shard group owns elements `[r * shard_numel, (r + 1) * shard_numel)`.
The model's own `nn.Parameter` objects stay in place (the user's optimizer, tied weights and
`named_parameters()` keep seeing them); their `.data` is set once to a view of
`unsharded_param` (a model built on the meta device gets new parameters that are such views).
Freeing a unit (stage 3) shrinks that buffer's storage to zero bytes, and gathering it grows the
storage back: the views keep their shapes and see the new data, so autograd's saved tensors
follow and no attribute is written on a parameter. While the storage is empty the modules hold
stand-ins instead of the views ([Note: resting parameters] in resting.py).

[Note: cast on gather]
At stage 3 a rank's master shard (fp32 under mixed precision) is what it gathers from when it lives
in memory on the compute device: each gather first casts it into a pooled shard of the compute
dtype, sends that, and gives it back. A standing copy in the compute dtype would cost 2Ψ/N bytes
(bf16) at every moment, for one cast per gather saved (FSDP2 casts the same way). With the master
elsewhere (host offload, disk) the compute-dtype shard is kept on the device: it is what the device
gathers from without a host round-trip.

[Note: gradients]
While a unit's backward runs, each trainable parameter's `.grad` is a view of the unit's
`unsharded_grad` buffer (zeroed when it is created), so autograd accumulates in place. After the
unit's backward the buffer is reduce-scattered into this rank's `sharded_grad` (fp32 master dtype
by default) and the `.grad` views are detached again.
[Note: gradient shard lifetime]
A unit's fp32 gradient shard holds memory only from the first reduction that lands in it to
`zero_grad` (PyTorch's `set_to_none`): the reduce-scatter writes into freshly allocated memory,
and `zero_grad` releases it (the tensor object, which the optimizer's pieces view, stays). So
during a backward pass only the units already reduced hold gradient shards: the largest moment of
the pass (the head's backward, its parameters and gradients whole) comes before any shard exists,
and evaluation between steps holds none. The optimizer steps only the pieces of units that got a
reduction (the others have `.grad = None`, as with `set_to_none`).
The shards of the units trainable at set-up are views of one buffer (`grad_slab`), allocated by the
first reduction of a step and freed by `zero_grad`: host memory is only made resident where a
reduction writes, and one large block returns to the system at once, where per-unit blocks of
tens of MB would be left in (and fragment) the allocator's heap.

A unit of one parameter without padding (an embedding, an LM head) skips the buffer when it has
none yet: autograd's own gradient tensor, which it hands to `.grad` without a copy, is adopted as
`unsharded_grad` (`collect_grads`). Accumulating into a view would cost a second full-size
tensor for the moment of the add: 131 MB for a 32000 x 1024 head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .collectives import (
    CommGroup,
    Pending,
    all_gather_into,
    all_gather_rows,
    all_reduce_,
    issue_after,
    max_ints,
    reduce_scatter_into,
)
from .layout import FlatLayout
from .placement import Placement
from .pool import BufferPool, transient_nbytes
from .quant import gather_int8, gather_workspace_numels, reduce_scatter_int8
from .resting import ModuleSlots
from .sparse import coalesced_rows, scatter_rows_
from .wrap import UnitSpec

if TYPE_CHECKING:
    from .sources import ShardSource


@dataclass
class GradReduction:
    """An issued gradient reduction of one unit; `FlatPart.finish_reduction` consumes it."""

    pending: Pending
    output: torch.Tensor  # 1D (shard_numel,), reduce dtype; may be `sharded_grad` itself
    source: torch.Tensor  # the unsharded input, kept alive until the collective is done
    buffer: torch.Tensor  # the unit's unsharded gradients (`source` itself, or what it was cast from)
    into_accumulator: bool  # output is `sharded_grad` (no copy needed after the wait)


class FlatPart:
    """The sharded and unsharded storage of one unit, and the primitive moves between them.

    Which moves happen when is the stage's business (`stages.py`); this class only knows how.
    """

    def __init__(
        self,
        spec: UnitSpec,
        *,
        shard_group: CommGroup,
        replicate_group: CommGroup,
        placement: Placement,
        param_dtype: torch.dtype,
        master_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        persistent_params: bool,
        source: ShardSource,
        pool: BufferPool,
        weight_quant_block: int | None = None,
        grad_quant_block: int | None = None,
        master_on_disk: bool = False,
    ) -> None:
        self.spec = spec
        # [Note: block quantization] in quant.py: int8 gathers (stage 3) / reductions, None for exact ones
        self.weight_quant_block = weight_quant_block
        self.grad_quant_block = grad_quant_block
        self.pool = pool  # [Note: buffer reuse] memory of freed gathered parameters and gradients
        self.placement = placement  # [Note: placement] in placement.py
        self.master_device = placement.master_device  # where the master shard, its gradient and the optimizer live
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.device = placement.device
        self.param_dtype = param_dtype
        self.master_dtype = master_dtype
        self.reduce_dtype = reduce_dtype
        align = max(weight_quant_block or 1, grad_quant_block or 1)  # whole int8 blocks per shard
        self.layout = FlatLayout.build(spec.param_names, [p.shape for p in spec.params], shard_group.size, align)
        lo, hi = self.layout.shard_range(shard_group.rank)
        self.unsharded_param: torch.Tensor  # 1D (padded_numel,), param dtype; storage freed when resharded
        self.sharded_param: torch.Tensor | None  # 1D (shard_numel,); stage 3 gather source ([Note: cast on gather])
        self.sharded_master: torch.Tensor  # 1D (shard_numel,), master dtype; what the optimizer updates
        self.unsharded_param = torch.empty(self.layout.padded_numel, dtype=param_dtype, device=self.device)
        if persistent_params and param_dtype == master_dtype and not placement.offloaded:
            self.sharded_master = self.unsharded_param[lo:hi]  # fp32 stages 0-2: the master is the parameter
        else:
            self.sharded_master = placement.alloc(self.layout.shard_numel, master_dtype, self.master_device)
        with torch.no_grad():
            source.fill(self.layout, spec.params, shard_group.rank, self.sharded_master)
        self.sharded_param = None
        # Stages 0-2: the unsharded parameters are the only whole copy, never freed ([Note: unit lifecycle]).
        self.persistent = persistent_params
        # [Note: parameters on disk] in disk.py: set by DiskOffload.adopt_master; fills a gather's source
        self.shard_reader: Callable[[], torch.Tensor] | None = None
        if not persistent_params:
            shard_device = placement.gather_source_device
            if master_on_disk and placement.offload_params:
                self.sharded_param = self.sharded_master  # a stand-in: each gather reads the files
            elif (
                self.sharded_master.device == shard_device
                and (param_dtype == master_dtype or not placement.offloaded)
                and not master_on_disk
            ):
                # [Note: cast on gather] the master, in memory on the compute device, is the gather source
                self.sharded_param = self.sharded_master
            else:
                self.sharded_param = placement.alloc(self.layout.shard_numel, param_dtype, shard_device)
                self.sharded_param.copy_(self.sharded_master)
        self.params = self._bind_params(spec.params)
        # [Note: resting parameters] in resting.py: what the modules hold while the unit is resharded
        self.module_slots = None if persistent_params else ModuleSlots(self.params, spec.param_names, spec.slots)
        if persistent_params:
            self.publish_master().wait()  # every rank's shard into the unsharded parameters
        else:
            self.free()

        self._sharded_grad: torch.Tensor | None = (
            None  # 1D (shard_numel,), master dtype; held from the first reduction to zero_grad
        )
        self._grad_storage_nbytes = 0  # bytes of the storage `_sharded_grad` views (a shared slab, or its own)
        self.grad_is_zero = True  # sharded_grad holds no reduced gradient yet (a lazy zero)
        self.unsharded_grad: torch.Tensor | None = None  # 1D (padded_numel,), param dtype
        self.sparse_grad: torch.Tensor | None = None  # a lookup's sparse COO gradient, not yet reduced
        self.used = [False] * len(self.params)  # per parameter: got a gradient on this rank since zero_grad
        self._index = {id(p): i for i, p in enumerate(self.params)}

    def mark_used(self, param: torch.Tensor) -> None:
        """Record that `param` received a gradient ([Note: unused parameters] in engine.py)."""
        self.used[self._index[id(param)]] = True

    def _bind_params(self, originals: tuple[nn.Parameter, ...]) -> tuple[nn.Parameter, ...]:
        """Make each parameter a view of `unsharded_param`: in place (`.data`) for materialized
        parameters, so their identity is kept; as a new `nn.Parameter` for meta ones (the engine
        swaps those into the modules and remaps optimizers built over the originals)."""
        bound = []
        for slot, p in zip(self.layout.slots, originals):
            view = self.unsharded_param[slot.offset : slot.offset + slot.numel].view(slot.shape)
            if p.is_meta:
                # A fresh leaf bound through `.data` (not nn.Parameter(view)): it must keep a version
                # counter of its own, or gathering into the buffer would look like an in-place edit
                # of tensors saved for backward.
                p = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device), requires_grad=p.requires_grad)
            p.data = view
            bound.append(p)
        return tuple(bound)

    @property
    def buffer_nbytes(self) -> frozenset[int]:
        """The sizes of the transient buffers this unit takes from the pool (see `transient_nbytes`)."""
        return transient_nbytes(
            self.layout, self.shard_group.size, self.param_dtype, self.reduce_dtype, self.weight_quant_block
        )

    @property
    def param_nbytes(self) -> int:
        """Bytes of the gathered parameters."""
        return self.layout.padded_numel * self.param_dtype.itemsize

    @property
    def grad_nbytes(self) -> int:
        """Bytes of the unsharded gradients while the unit's backward runs and its reduction is in
        flight (with the copy cast to the reduce dtype); 0 for a frozen unit."""
        if not self.has_trainable:
            return 0
        cast = self.layout.padded_numel * self.reduce_dtype.itemsize if self.reduce_dtype != self.param_dtype else 0
        return self.param_nbytes + cast

    # ---- parameters: raw moves, run by the unit that owns this part ([Note: unit lifecycle]) -------------
    def _illegal(self, verb: str, why: str) -> RuntimeError:
        return RuntimeError(
            f"[rank {self.shard_group.global_rank}] hf_zero: {verb} on a part of unit '{self.spec.name}': {why}"
        )

    def gather(self) -> Pending:
        """Allocate the unsharded buffer and issue the gather of every rank's shard into it (asynchronous). The
        owning `Unit` calls it only from SHARDED; a persistent part (stages 0-2) has nothing to gather and
        refuses."""
        if self.persistent or self.sharded_param is None:
            raise self._illegal("gather", "stages 0-2 keep the parameters whole; there is nothing to gather")
        storage = self.unsharded_param.untyped_storage()
        self.pool.fill(storage, self.layout.padded_numel * self.unsharded_param.element_size())
        source = self.sharded_param if self.shard_reader is None else self.shard_reader()
        if source.device != self.device:  # the shard lives on the host: stage it on the device for the gather
            source = torch.empty_like(source, device=self.device).copy_(source, non_blocking=True)
        cast = None
        if source.dtype != self.param_dtype:  # [Note: cast on gather]
            cast = source = self.pool.new_tensor(source.numel(), self.param_dtype, self.device).copy_(source)
        if self.weight_quant_block is not None:
            pending = self._gather_int8(source, self.weight_quant_block)
        else:
            pending = all_gather_into(self.unsharded_param, source, self.shard_group, async_op=True)
        if cast is not None:
            pending.and_then(lambda: self.pool.release(cast.untyped_storage()))
        return pending

    def _gather_int8(self, source: torch.Tensor, block: int) -> Pending:
        """[Note: block quantization] the gather as int8 blocks, its workspace from the pool."""
        blocks, scales = gather_workspace_numels(source.numel(), block, self.shard_group.size)
        workspace = (
            self.pool.new_tensor(blocks, torch.int8, self.device),
            self.pool.new_tensor(scales, torch.float32, self.device),
        )
        pending = gather_int8(self.unsharded_param, source, self.shard_group, block, async_op=True, workspace=workspace)

        def release_workspace() -> None:
            for t in workspace:
                self.pool.release(t.untyped_storage())

        return pending.and_then(release_workspace)

    def bind(self, real: bool) -> None:
        """Register the real parameters (gathered) or their stand-ins (freed) in the modules ([Note: resting
        parameters])."""
        if self.module_slots is not None:
            self.module_slots.bind(real=real)

    def free(self) -> None:
        """Give the modules the stand-ins and the unsharded buffer back to the pool (stage 3). A persistent part
        refuses: freeing it would lose the only whole copy of its parameters."""
        if self.persistent:
            raise self._illegal("free", "stages 0-2 keep the parameters whole; nothing may free them")
        self.bind(real=False)
        self.pool.release(self.unsharded_param.untyped_storage())

    def param_shard(self) -> torch.Tensor:
        """This rank's shard of the compute parameters: the gather source (stage 3), or this rank's
        chunk of the whole parameters (stages 0-2)."""
        if not self.persistent and self.sharded_param is not None:
            return self.sharded_param
        lo, hi = self.layout.shard_range(self.shard_group.rank)
        return self.unsharded_param[lo:hi]

    def publish_master(self, async_op: bool = False, master: torch.Tensor | None = None) -> Pending:
        """After an optimizer step, make the compute parameters equal to the updated master shard
        (`master`, by default `sharded_master`): copy it into this rank's parameter shard, then
        (stages 0-2) gather every rank's."""
        if self.shard_reader is not None:
            return Pending()  # [Note: parameters on disk]: the gathers read the master from the files
        master = self.sharded_master if master is None else master
        own = self.param_shard()
        if own.data_ptr() != master.data_ptr():
            own.copy_(master, non_blocking=True)
        return self.gather_persistent(async_op)

    def gather_persistent(self, async_op: bool = False) -> Pending:
        """Stages 0-2: all-gather every rank's chunk of the parameters after they were updated (stage 3:
        nothing; the next use gathers)."""
        if not self.persistent:
            return Pending()
        return all_gather_into(self.unsharded_param, self.param_shard(), self.shard_group, async_op)

    # ---- gradients --------------------------------------------------------------------------
    @property
    def sharded_grad(self) -> torch.Tensor:
        """This rank's reduced gradient shard (master dtype); zeros while no reduction reached it
        since `zero_grad` ([Note: gradient shard lifetime])."""
        grad = self._grad_shard()
        if self.grad_is_zero:
            grad.zero_()
        return grad

    def _grad_shard(self) -> torch.Tensor:
        """The gradient shard's memory, allocated on first use and again after `zero_grad` released
        it; its values are meaningless while `grad_is_zero`."""
        if self._sharded_grad is None:
            self._sharded_grad = self.placement.alloc(self.layout.shard_numel, self.master_dtype, self.master_device)
            self._grad_storage_nbytes = self._sharded_grad.untyped_storage().nbytes()
        storage = self._sharded_grad.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self._grad_storage_nbytes)  # the whole shared slab, when the shard is in one
        return self._sharded_grad

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.params if p.requires_grad]

    @property
    def has_trainable(self) -> bool:
        """Whether any parameter of the unit can get a gradient (a frozen unit holds no gradient memory)."""
        return any(p.requires_grad for p in self.params)

    @property
    def adopts_grads(self) -> bool:
        """Whether autograd's gradient tensor can serve as `unsharded_grad` ([Note: gradients]): one
        trainable parameter filling the whole flat buffer."""
        return len(self.params) == 1 and self.params[0].requires_grad and self.layout.padded_numel == self.layout.numel

    def attach_grads(self) -> None:
        """Point each trainable parameter's `.grad` at its view of `unsharded_grad` (zeros when new);
        a unit that adopts autograd's gradient and has no buffer yet leaves `.grad` unset."""
        if not self.has_trainable:
            return  # a frozen unit gets no gradient buffer
        if self.unsharded_grad is None and (self.sparse_lookup or self.adopts_grads) and self.params[0].grad is None:
            return
        if self.unsharded_grad is None:
            self.unsharded_grad = self.pool.new_tensor(self.layout.padded_numel, self.param_dtype, self.device).zero_()
        for slot, p in zip(self.layout.slots, self.params):
            if p.requires_grad:
                view = self.unsharded_grad[slot.offset : slot.offset + slot.numel].view(slot.shape)
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    if p.grad is not None:  # a gradient from outside the engine: keep it
                        view.add_(p.grad.to(view.dtype))
                    p.grad = view

    @property
    def sparse_lookup(self) -> bool:
        """Whether the unit is a plain embedding lookup whose gradient travels as rows
        ([Note: sparse lookup gradients] in sparse.py)."""
        return not self.spec.backward_reads_params and len(self.params) == 1 and self.params[0].requires_grad

    def collect_grads(self) -> None:
        """After the unit's backward: keep a lookup's sparse gradient, or adopt autograd's dense one as
        `unsharded_grad` when no buffer was attached ([Note: gradients]; zeros when the parameter got
        none), then detach every `.grad`."""
        if self.unsharded_grad is None and (self.adopts_grads or self.sparse_lookup):
            grad = self.params[0].grad
            if grad is not None and grad.is_sparse:
                grad = grad.detach()
                self.sparse_grad = grad if self.sparse_grad is None else self.sparse_grad + grad
            elif grad is not None or not self.sparse_lookup:
                self.unsharded_grad = self._dense_grad(grad)
        self.detach_grads()

    def _dense_grad(self, grad: torch.Tensor | None) -> torch.Tensor:
        """`grad` (dense, sparse or absent) as a flat buffer: autograd's own tensor when it fits as is."""
        if (
            grad is not None
            and not grad.is_sparse
            and grad.is_contiguous()
            and grad.dtype == self.param_dtype
            and grad.numel() == self.layout.padded_numel
        ):
            return grad.detach().view(-1)
        buffer = self.pool.new_tensor(self.layout.padded_numel, self.param_dtype, self.device).zero_()
        self._add_into(buffer, grad)
        return buffer

    def _add_into(self, buffer: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Add the single parameter's `grad` (dense or sparse) into the flat `buffer`."""
        if grad is not None:
            buffer[: self.layout.numel].view(self.params[0].shape).add_(grad.to(self.param_dtype))

    def detach_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def reduce_grads(self, async_op: bool = True, buffer_is_free: bool = False) -> GradReduction:
        """Issue the reduce-scatter (and cross-replica all-reduce) of `unsharded_grad`, or a lookup's row
        exchange ([Note: sparse lookup gradients]). Sums, not means.

        `buffer_is_free`: nothing reads `unsharded_grad` after this call (stages 2-3); when the reduction
        runs on a cast copy, the collective may then receive into the buffer's memory."""
        if self.sparse_lookup:
            rows = self._reduce_rows(async_op)
            if rows is not None:
                return rows
        if self.unsharded_grad is None:
            raise RuntimeError(
                f"[rank {self.shard_group.global_rank}] hf_zero: unit '{self.spec.name}' reduces gradients "
                "it never allocated"
            )
        source = buffer = self.unsharded_grad
        block = self.grad_quant_block
        quantized = block is not None and self.shard_group.size > 1  # from the buffer as is: no cast
        if not quantized and source.dtype != self.reduce_dtype:
            source = self.pool.new_tensor(source.numel(), self.reduce_dtype, self.device).copy_(source)
        into_acc = self._reduces_into_shard
        if into_acc:
            output = self._grad_shard()
        elif self.shard_group.size == 1 and source is not self.unsharded_grad:
            output = source  # a fresh cast copy: reduce it in place
        else:  # pooled: released with the unsharded gradients once the sum is in the shard
            output = self.pool.new_tensor(self.layout.shard_numel, self.reduce_dtype, self.device)
        if quantized and block is not None:
            pending = reduce_scatter_int8(output, source, self.shard_group, block, async_op=async_op)
        else:
            scratch = None
            if buffer_is_free and source is not buffer and buffer.element_size() >= source.element_size():
                scratch = buffer.view(source.dtype)[: source.numel()]  # the gradients were cast: memory to receive into
            pending = reduce_scatter_into(output, source, self.shard_group, async_op=async_op, scratch=scratch)
        if self.replicate_group.size > 1:  # the cross-replica sum follows the shard-group sum
            pending = issue_after(
                pending, lambda: all_reduce_(output, self.replicate_group, async_op=True), self.shard_group
            )
            if not async_op:
                pending.wait()
        return GradReduction(pending, output, source, buffer, into_acc)

    @property
    def _reduces_into_shard(self) -> bool:
        """Whether a reduction can write straight into the (empty) gradient shard: no sum to add to, no
        cast and no host copy after it."""
        return self.grad_is_zero and self.reduce_dtype == self.master_dtype and not self.placement.offloaded

    def _reduce_rows(self, async_op: bool) -> GradReduction | None:
        """A lookup's reduction as a row exchange, or None after densifying when the ranks agree that the
        dense path is cheaper or some rank holds a dense gradient. Every rank takes the same path."""
        dim = self.params[0].shape[-1]
        sparse, self.sparse_grad = self.sparse_grad, None
        rows, values = coalesced_rows(sparse, dim, self.reduce_dtype, self.device)
        capacity, any_dense = max_ints([rows.numel(), int(self.unsharded_grad is not None)], self.shard_group)
        if any_dense or 2 * capacity * self.shard_group.size * (dim + 1) > self.layout.padded_numel:
            if self.unsharded_grad is None:
                self.unsharded_grad = self._dense_grad(sparse)
            else:
                self._add_into(self.unsharded_grad, sparse)
            return None
        into_acc = self._reduces_into_shard
        if into_acc:
            output = self._grad_shard().zero_()
        else:
            output = torch.zeros(self.layout.shard_numel, dtype=self.reduce_dtype, device=self.device)
        pending, all_rows, all_values = all_gather_rows(rows, values, capacity, self.shard_group, async_op=True)
        lo, _ = self.layout.shard_range(self.shard_group.rank)
        pending.and_then(lambda: scatter_rows_(output, lo, all_rows, all_values))
        if self.replicate_group.size > 1:
            pending.wait()
            pending = all_reduce_(output, self.replicate_group, async_op=True)
        if not async_op:
            pending.wait()
        return GradReduction(pending, output, all_values, all_values, into_acc)

    def finish_reduction(self, reduction: GradReduction, divisor: float) -> None:
        """Wait for a reduction and add its mean into `sharded_grad`."""
        reduction.pending.wait()
        out = reduction.output
        if divisor != 1.0:
            out.div_(divisor)
        if not reduction.into_accumulator:
            if self.grad_is_zero:
                self._grad_shard().copy_(out, non_blocking=True)  # to the host when offloaded
            else:
                self.sharded_grad.add_(out.to(self.master_device))
        self.grad_is_zero = False

    def release_reduced(self, reduction: GradReduction) -> None:
        """Free a finished reduction's unsharded gradients and cast copy (stages 2-3), into the pool."""
        for t in {id(reduction.buffer): reduction.buffer, id(reduction.source): reduction.source}.values():
            self.release_unsharded_grad(t)
        if not reduction.into_accumulator and reduction.output is not reduction.source:
            self.pool.release(reduction.output.untyped_storage())

    def release_unsharded_grad(self, grad: torch.Tensor) -> None:
        """Free unsharded gradients (stages 2-3), into the pool when it has room."""
        if grad is self.unsharded_grad:
            self.unsharded_grad = None
        self.pool.release(grad.untyped_storage())

    @property
    def releases_grad_memory(self) -> bool:
        """Whether `zero_grad` frees the gradient shard's memory: not for a pinned host shard
        (offload from an accelerator), as pinning memory again each step is slow."""
        return not self.placement.keeps_grad_shard_memory

    def use_grad_slab(self, slab: torch.Tensor) -> None:
        """Keep the gradient shard in `slab`, a 1D view of `shard_numel` elements of one buffer shared
        by every unit ([Note: gradient shard lifetime])."""
        self._sharded_grad = slab
        self._grad_storage_nbytes = slab.untyped_storage().nbytes()

    def zero_grad(self) -> None:
        """Forget the gradients: the shard's memory is released ([Note: gradient shard lifetime])."""
        self.grad_is_zero = True
        self.sparse_grad = None
        self.used = [False] * len(self.params)
        if self._sharded_grad is not None and self.releases_grad_memory:
            self._sharded_grad.untyped_storage().resize_(0)
        if self.unsharded_grad is not None:
            self.unsharded_grad.zero_()
        self.detach_grads()

    # ---- accounting -------------------------------------------------------------------------
    def storages(self) -> list[tuple[str, torch.Tensor, str]]:
        """`(category, tensor, placement)` of what this unit holds, placement `"host"` for offloaded
        tensors (even on a CPU-only machine) and the device otherwise. Views and aliases are
        deduplicated by the caller, in this order."""

        where, offloaded = self.placement.label, self.placement.offloaded
        held = [("parameters", self.unsharded_param, where(self.unsharded_param, False))]
        if self.sharded_param is not None:
            held.append(("parameters", self.sharded_param, where(self.sharded_param, self.placement.offload_params)))
        for g, on_host in ((self._sharded_grad, offloaded), (self.unsharded_grad, False)):
            if g is not None:
                held.append(("gradients", g, where(g, on_host)))
        held.append(("optimizer_states", self.sharded_master, where(self.sharded_master, offloaded)))
        return held


def grad_slab(units: list[FlatPart]) -> None:
    """Give every unit that has trainable parameters a gradient shard in one shared buffer, holding no
    memory until the first reduction ([Note: gradient shard lifetime])."""
    trainable = [u for u in units if u.has_trainable]
    if not trainable or not all(u.releases_grad_memory for u in trainable):
        return  # pinned host shards stay per unit, allocated on first use
    first = trainable[0]
    slab = first.placement.alloc(sum(u.layout.shard_numel for u in trainable), first.master_dtype, first.master_device)
    offset = 0
    for unit in trainable:
        unit.use_grad_slab(slab[offset : offset + unit.layout.shard_numel])
        offset += unit.layout.shard_numel
    slab.untyped_storage().resize_(0)
