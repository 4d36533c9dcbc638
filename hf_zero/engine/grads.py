"""One part's gradients: the unsharded buffer its parameters' `.grad` views during backward, a lookup's
sparse gradient, this rank's reduced shard, and the reductions between them.

[Note: gradients]
While a unit's backward runs, each trainable parameter's `.grad` is a view of the unit's
`unsharded` buffer (zeroed when it is created), so autograd accumulates in place. After the
unit's backward the buffer is reduce-scattered into this rank's `shard` (fp32 master dtype
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
`unsharded` (`collect`). Accumulating into a view would cost a second full-size
tensor for the moment of the add: 131 MB for a 32000 x 1024 head.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .collectives import (
    Pending,
    all_gather_rows,
    all_reduce_,
    issue_after,
    max_ints,
    reduce_scatter_into,
)
from .collectives.quant import reduce_scatter_int8
from .collectives.sparse import coalesced_rows, scatter_rows_, summed
from .layout import FlatLayout
from .lifecycle import GradState, illegal_call
from .part_settings import PartSettings, ReadsPartSettings
from .placement import Placement
from .resting import ShardedGrad


@dataclass
class GradReduction:
    """An issued gradient reduction of one unit; `FlatGrads.finish` consumes it."""

    pending: Pending
    output: torch.Tensor  # 1D (shard_numel,), reduce dtype; may be `shard` itself
    source: torch.Tensor  # the unsharded input, kept alive until the collective is done
    buffer: torch.Tensor  # the unit's unsharded gradients (`source` itself, or what it was cast from)
    into_accumulator: bool  # output is `shard` (no copy needed after the wait)


class FlatGrads(ReadsPartSettings):
    """The gradients of one flat part ([Note: gradients]); the part's `Unit` orders when each move happens."""

    def __init__(
        self,
        settings: PartSettings,
        params: tuple[nn.Parameter, ...],
        backward_reads_params: bool,
        shard: SlabShard | None = None,
    ) -> None:
        """`shard`: this part's view of the shared gradient slab (`grad_slab`), or `None` to allocate its own."""
        self.settings = settings  # shared with the part (part_settings.py)
        self.params = params
        self.backward_reads_params = backward_reads_params
        # 1D (shard_numel,), master dtype; holds memory from the first reduction to zero
        self._shard: torch.Tensor | None = None if shard is None else shard.view
        self._shard_nbytes = 0 if shard is None else shard.slab_nbytes  # of the whole slab, or of its own
        self._state = GradState.EMPTY  # [Note: gradient states] in lifecycle.py: moved only by the verbs below
        self._in_flight: list[GradReduction] = []  # which reductions IN_FLIGHT stands for (not a second truth)
        self._unsharded: torch.Tensor | None = None  # 1D (padded_numel,), param dtype
        self.sparse: torch.Tensor | None = None  # a lookup's sparse COO gradient, not yet reduced
        self.used = [False] * len(params)  # per parameter: got a gradient on this rank since zero
        self._index = {id(p): i for i, p in enumerate(params)}

    # ---- state ([Note: gradient states]) ------------------------------------------------------------
    @property
    def state(self) -> GradState:
        return self._state

    @property
    def is_zero(self) -> bool:
        """Whether the shard holds no reduced gradient since `zero` (a lazy zero)."""
        return GradState.SUMMED not in self._state

    @property
    def unsharded(self) -> torch.Tensor | None:
        """The unsharded gradient buffer (1D, param dtype), while held."""
        return self._unsharded

    def _illegal(self, verb: str, why: str) -> RuntimeError:
        subject = f"the gradients of unit '{self.name or '<root>'}'"
        return illegal_call(self.shard_group.global_rank, verb, subject, self._state.describe(), why)

    def _check_buffer_free(self, verb: str) -> None:
        """A reduction in flight that reads the kept buffer (stages 0-1) must land before the buffer changes."""
        if (
            GradState.IN_FLIGHT in self._state
            and self._unsharded is not None
            and any(r.buffer is self._unsharded for r in self._in_flight)
        ):
            raise self._illegal(verb, "a reduction in flight still reads this buffer; finish it first")

    def _accumulating(self, verb: str) -> None:
        self._check_buffer_free(verb)
        self._state |= GradState.HELD

    @property
    def has_trainable(self) -> bool:
        """Whether any parameter can get a gradient (a frozen part holds no gradient memory)."""
        return any(p.requires_grad for p in self.params)

    @property
    def sparse_lookup(self) -> bool:
        """Whether the part is a plain embedding lookup whose gradient travels as rows
        ([Note: sparse lookup gradients] in sparse.py)."""
        return not self.backward_reads_params and len(self.params) == 1 and self.params[0].requires_grad

    @property
    def shard_memory(self) -> torch.Tensor | None:
        """The gradient shard's tensor as it is (for accounting), or None before the first use."""
        return self._shard

    def spare_shard_memory(self) -> torch.Tensor | None:
        """The gradient shard's memory while it holds nothing (no gradient since `zero`, nothing in flight) and
        is kept across `zero_grad` (a pinned host shard): scratch for a caller done with it before the next
        backward (the next reduction overwrites it). None otherwise: the memory is released, or in use."""
        if self._state is not GradState.EMPTY or self.releases_memory:
            return None
        if self._shard is None or self._shard.untyped_storage().nbytes() == 0:
            return None
        return self._shard

    def holds(self, param: torch.Tensor) -> bool:
        """Whether `param` is one of this part's parameters."""
        return id(param) in self._index

    def mark_used(self, param: torch.Tensor) -> None:
        """Record that `param` received a gradient ([Note: unused parameters] in step/stepping.py)."""
        self.used[self._index[id(param)]] = True

    @property
    def shard(self) -> torch.Tensor:
        """This rank's reduced gradient shard (master dtype); zeros while no reduction reached it
        since `zero_grad` ([Note: gradient shard lifetime])."""
        grad = self._shard_storage()
        if self.is_zero:
            grad.zero_()
        return grad

    def _shard_storage(self) -> torch.Tensor:
        """The gradient shard's memory, allocated on first use and again after `zero_grad` released
        it; its values are meaningless while `is_zero`."""
        if self._shard is None:
            self._shard = self.placement.alloc(self.layout.shard_numel, self.master_dtype, self.master_device)
            self._shard_nbytes = self._shard.untyped_storage().nbytes()
        storage = self._shard.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self._shard_nbytes)  # the whole shared slab, when the shard is in one
        return self._shard

    @property
    def adopts(self) -> bool:
        """Whether autograd's gradient tensor can serve as `unsharded` ([Note: gradients]): one
        trainable parameter filling the whole flat buffer."""
        return len(self.params) == 1 and self.params[0].requires_grad and self.layout.padded_numel == self.layout.numel

    def attach(self) -> None:
        """Point each trainable parameter's `.grad` at its view of `unsharded` (zeros when new);
        a unit that adopts autograd's gradient and has no buffer yet leaves `.grad` unset."""
        if not self.has_trainable:
            return  # a frozen unit gets no gradient buffer
        self._accumulating("attach")
        if self.sparse_lookup or (self.adopts and self._unsharded is None and self.params[0].grad is None):
            return  # a lookup's gradient comes from autograd (as rows), also beside a kept buffer: `collect`
        if self._unsharded is None:
            self._unsharded = self.pool.new_tensor(self.layout.padded_numel, self.param_dtype, self.device).zero_()
        for slot, p in zip(self.layout.slots, self.params):
            if p.requires_grad:
                view = self._unsharded[slot.offset : slot.offset + slot.numel].view(slot.shape)
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    if p.grad is not None:  # a gradient from outside the engine: keep it
                        view.add_(p.grad.to(view.dtype))
                    p.grad = view

    def rest(self, stand_ins: list[tuple[tuple[torch.Tensor, ShardedGrad], ...]]) -> None:
        """[Note: resting gradients] after a backward pass whose gradients reached this part: give every trainable
        parameter's `.grad`, on each object users reach it by, its `ShardedGrad` stand-in (`stand_ins[i]`: the
        (object, stand-in) pairs of parameter i, made once)."""
        if not self.has_trainable or (self.is_zero and self._unsharded is None):
            return
        for p, pairs in zip(self.params, stand_ins):
            if p.requires_grad:
                for obj, stand_in in pairs:
                    if obj.grad is None:
                        obj.grad = stand_in

    @staticmethod
    def wake(stand_ins: list[tuple[tuple[torch.Tensor, ShardedGrad], ...]]) -> None:
        """[Note: resting gradients] remove the stand-ins: back to `.grad = None`."""
        for pairs in stand_ins:
            for obj, _ in pairs:
                if isinstance(obj.grad, ShardedGrad):
                    obj.grad = None

    def collect(self) -> None:
        """After the unit's backward: keep a lookup's sparse gradient (a dense one added into the kept buffer), or
        adopt autograd's dense one as `unsharded` when no buffer was attached ([Note: gradients]; zeros when the
        parameter got none), then detach every `.grad`."""
        if self.has_trainable:
            self._accumulating("collect")
        grad = self.params[0].grad if self.sparse_lookup or self.adopts else None
        if self.sparse_lookup and grad is not None and grad.is_sparse:
            grad = grad.detach()
            self.sparse = grad if self.sparse is None else self.sparse + grad
        elif self.sparse_lookup and grad is not None and self._unsharded is not None:  # a dense one beside a kept
            self._add_into(self._unsharded, grad)  # buffer (stages 0-1)
        elif self._unsharded is None and (grad is not None or (self.adopts and not self.sparse_lookup)):
            self._unsharded = self._dense(grad)
        self.detach()

    def _dense(self, grad: torch.Tensor | None) -> torch.Tensor:
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
        """Add the single parameter's `grad` (dense, or sparse: each token's rows summed first, `summed`) into the
        flat `buffer`."""
        if grad is not None:
            grad = summed(grad, self.param_dtype) if grad.is_sparse else grad.to(self.param_dtype)
            buffer[: self.layout.numel].view(self.params[0].shape).add_(grad)

    def detach(self) -> None:
        for p in self.params:
            p.grad = None

    def reduce(self, async_op: bool = True, buffer_is_free: bool = False) -> GradReduction:
        """Issue the reduce-scatter (and cross-replica all-reduce) of `unsharded`, or a lookup's row
        exchange ([Note: sparse lookup gradients]). Sums, not means.

        `buffer_is_free`: nothing reads `unsharded` after this call (stages 2-3); when the reduction
        runs on a cast copy, the collective may then receive into the buffer's memory."""
        self._check_buffer_free("reduce")
        reduction = self._issue(async_op, buffer_is_free)
        self._in_flight.append(reduction)
        self._state = (self._state & ~GradState.HELD) | GradState.IN_FLIGHT  # what was held is in flight now
        return reduction

    def _issue(self, async_op: bool, buffer_is_free: bool) -> GradReduction:
        if self.sparse_lookup:
            rows = self._reduce_rows(async_op)
            if rows is not None:
                return rows
        if self._unsharded is None:  # no parameter required grad in this backward (frozen for a step): zeros
            self._unsharded = self._dense(None)
        source = buffer = self._unsharded
        block = self.grad_quant_block
        quantized = block is not None and self.shard_group.size > 1  # from the buffer as is: no cast
        if not quantized and source.dtype != self.reduce_dtype:
            source = self.pool.new_tensor(source.numel(), self.reduce_dtype, self.device).copy_(source)
        into_acc = self._reduces_into_shard
        if into_acc:
            output = self._shard_storage()
        elif self.shard_group.size == 1 and source is not self._unsharded:
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
        return self.is_zero and self.reduce_dtype == self.master_dtype and not self.placement.offloaded

    def _reduce_rows(self, async_op: bool) -> GradReduction | None:
        """A lookup's reduction as a row exchange, or None after densifying when the ranks agree that the
        dense path is cheaper or some rank holds a dense gradient. Every rank takes the same path."""
        dim = self.params[0].shape[-1]
        sparse, self.sparse = self.sparse, None
        sparse = summed(sparse, self.param_dtype) if sparse is not None else None  # as the dense path sums
        rows, values = coalesced_rows(sparse, dim, self.reduce_dtype, self.device)
        capacity, any_dense = max_ints([rows.numel(), int(self._unsharded is not None)], self.shard_group)
        if any_dense or 2 * capacity * self.shard_group.size * (dim + 1) > self.layout.padded_numel:
            if self._unsharded is None:
                self._unsharded = self._dense(sparse)
            else:
                self._add_into(self._unsharded, sparse)
            return None
        into_acc = self._reduces_into_shard
        if into_acc:
            output = self._shard_storage().zero_()
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

    def finish(self, reduction: GradReduction, divisor: float) -> None:
        """Wait for a reduction and add its mean into `shard`."""
        if GradState.IN_FLIGHT not in self._state or not any(r is reduction for r in self._in_flight):
            raise self._illegal("finish", "this reduction is not in flight (finished already, or never issued)")
        reduction.pending.wait()
        out = reduction.output
        if divisor != 1.0:
            out.div_(divisor)
        if not reduction.into_accumulator:
            if self.is_zero:
                self._shard_storage().copy_(out, non_blocking=True)  # to the host when offloaded
            else:
                self.shard.add_(out.to(self.master_device))
        self._in_flight = [r for r in self._in_flight if r is not reduction]
        self._state |= GradState.SUMMED
        if not self._in_flight:
            self._state &= ~GradState.IN_FLIGHT

    def release_reduced(self, reduction: GradReduction) -> None:
        """Free a finished reduction's unsharded gradients and cast copy (stages 2-3), into the pool."""
        for t in {id(reduction.buffer): reduction.buffer, id(reduction.source): reduction.source}.values():
            self.release_unsharded(t)
        if not reduction.into_accumulator and reduction.output is not reduction.source:
            self.pool.release(reduction.output.untyped_storage())

    def release_unsharded(self, grad: torch.Tensor) -> None:
        """Free unsharded gradients (stages 2-3), into the pool when it has room."""
        if grad is self._unsharded:
            self._unsharded = None
        self.pool.release(grad.untyped_storage())

    def let_go(self) -> None:
        """Stages 2-3, after `reduce`: the reduction in flight holds the buffer; the part no longer does."""
        self._unsharded = None

    def clear_buffer(self) -> None:
        """Stages 0-1, after `finish`: zero the kept buffer for the next backward's accumulation."""
        self._check_buffer_free("clear_buffer")
        if self._unsharded is not None:
            self._unsharded.zero_()

    def drop_buffer(self) -> None:
        """Stages 2-3 at `zero_grad`: any unsharded gradients left (an abandoned pass) go."""
        self._check_buffer_free("drop_buffer")
        self._unsharded = None

    @property
    def releases_memory(self) -> bool:
        """Whether `zero_grad` frees the gradient shard's memory: not for a pinned host shard
        (offload from an accelerator), as pinning memory again each step is slow."""
        return not self.placement.keeps_grad_shard_memory

    def zero(self, keep: Sequence[bool] = (), release: bool = True) -> bool:
        """Forget the gradients: the shard's memory is released ([Note: gradient shard lifetime]) unless `release`
        is False (the slab it shares holds another part's kept gradients). `keep`: per parameter, whether its
        gradients stay (a parameter no optimizer holds, [Note: gradients no optimizer holds] in
        step/stepping.py); the others' are zeros then. Returns whether any stayed."""
        if GradState.IN_FLIGHT in self._state:
            raise self._illegal("zero", f"{len(self._in_flight)} reduction(s) in flight; wait for them first")
        if self.keeps(keep):
            self._zero_slots([not k for k in keep])
            self.used = [u and k for u, k in zip(self.used, keep)]
            self.detach()
            return True
        self._state = GradState.EMPTY
        self.sparse = None
        self.used = [False] * len(self.params)
        if self._shard is not None and self.releases_memory and release:
            self._shard.untyped_storage().resize_(0)
        if self._unsharded is not None:
            self._unsharded.zero_()
        self.detach()
        return False

    def keeps(self, keep: Sequence[bool]) -> bool:
        """Whether `zero(keep)` leaves some gradient here: a parameter to keep, and gradients held (reduced into the
        shard, accumulating unreduced, or a lookup's rows)."""
        return any(keep) and (self._state is not GradState.EMPTY or self.sparse is not None)

    def _zero_slots(self, which: Sequence[bool]) -> None:
        """Zero the gradients of the parameters `which` flags, in the shard and in any unsharded buffer."""
        lo, _ = self.layout.shard_range(self.shard_group.rank)
        shard = None if self.is_zero else self.shard
        for i, start, end in self.layout.local_pieces(self.shard_group.rank):
            if which[i] and shard is not None:
                shard[start - lo : end - lo].zero_()
        for slot, zero in zip(self.layout.slots, which):
            if zero and self._unsharded is not None:
                self._unsharded[slot.offset : slot.offset + slot.numel].zero_()
        if which[0] and self.sparse is not None:  # a lookup's part holds its one parameter
            self.sparse = None


UnitReduction = tuple[GradReduction, ...]  # a unit's reductions: one per trainable part, in their order


@dataclass(frozen=True)
class SlabShard:
    """One part's gradient shard in the shared slab: its view, and the bytes the whole slab takes when resident."""

    view: torch.Tensor  # 1D (shard_numel,), master dtype
    slab_nbytes: int


def grad_slab(layouts: list[FlatLayout], placement: Placement, dtype: torch.dtype) -> list[SlabShard | None]:
    """One gradient shard per part of `layouts` (`None` for a part without one), built whole as views of one
    shared buffer that holds no memory until the first reduction ([Note: gradient shard lifetime]). Pinned
    host shards (`placement` keeps their memory) are not shared: each part allocates its own on first use."""
    if not layouts or placement.keeps_grad_shard_memory:
        return [None] * len(layouts)
    slab = placement.alloc(sum(layout.shard_numel for layout in layouts), dtype, placement.master_device)
    bounds = itertools.accumulate((layout.shard_numel for layout in layouts), initial=0)
    nbytes = slab.untyped_storage().nbytes()
    shards: list[SlabShard | None] = [SlabShard(slab[lo:hi], nbytes) for lo, hi in itertools.pairwise(bounds)]
    slab.untyped_storage().resize_(0)
    return shards
