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

The gradients of a part live in its `FlatGrads` (grads.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..dtypes import AT_ONCE_NUMEL
from .collectives import (
    Pending,
    all_gather_into,
)
from .collectives.quant import gather_int8, gather_workspace_numels
from .grads import FlatGrads, SlabShard
from .lifecycle import illegal_call
from .part_settings import PartSettings, ReadsPartSettings
from .pool import transient_nbytes
from .resting import ModuleHolders, ShardedGrad
from .store import MasterStore
from .wrap import UnitSpec

if TYPE_CHECKING:
    from .sources import ShardSource


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bit-for-bit comparisons


class FlatPart(ReadsPartSettings):
    """The sharded and unsharded storage of one unit, and the primitive moves between them.

    Which moves happen when is the stage's business (`stages.py`); this class only knows how.
    """

    def __init__(
        self,
        spec: UnitSpec,
        settings: PartSettings,
        *,
        source: ShardSource,
        grad_shard: SlabShard | None = None,
        store: Callable[[FlatPart], MasterStore],
        on_disk: bool = False,
    ) -> None:
        """`store` builds the part's master store once its shards exist ([Note: master stores] in step/master.py);
        `on_disk`: the store is the offload files (the master is not compared with the shard: a fingerprint)."""
        self.spec = spec
        self.settings = settings  # one record, shared with the gradients (part_settings.py)
        placement, shard_group = settings.placement, settings.shard_group
        param_dtype, master_dtype, persistent = settings.param_dtype, settings.master_dtype, settings.persistent
        lo, hi = self.layout.shard_range(shard_group.rank)
        self.unsharded_param: torch.Tensor  # 1D (padded_numel,), param dtype; storage freed when resharded
        self.sharded_param: torch.Tensor | None  # 1D (shard_numel,); stage 3 gather source ([Note: cast on gather])
        self.sharded_master: torch.Tensor  # 1D (shard_numel,), master dtype; what the optimizer updates
        self.unsharded_param = torch.empty(self.layout.padded_numel, dtype=param_dtype, device=self.device)
        if persistent and param_dtype == master_dtype and not placement.offloaded:
            self.sharded_master = self.unsharded_param[lo:hi]  # fp32 stages 0-2: the master is the parameter
        else:
            self.sharded_master = placement.alloc(self.layout.shard_numel, master_dtype, self.master_device)
        with torch.no_grad():
            source.fill(self.layout, spec.params, shard_group.rank, self.sharded_master)
        self.sharded_param = None
        # Stages 0-2: the unsharded parameters are the only whole copy, never freed ([Note: unit lifecycle]).
        if not persistent:
            self.sharded_param = self._gather_shard(on_disk=on_disk)
        self.params = self._bind_params(spec.params)
        # [Note: edits between steps]: the master in another device's memory or in files is not compared with the
        # shard; a fingerprint of the shard, taken at each publish, tells whether it changed since
        self.fingerprinted = persistent and placement.offloaded and (on_disk or self.master_device != self.device)
        self._published: torch.Tensor | None = None  # at the last publish
        self._current: torch.Tensor | None = None  # at the last `fingerprint_changed`
        # [Note: resting parameters] in resting.py: what the modules hold while the unit is resharded
        self.module_holders = None if persistent else ModuleHolders(self.params, spec.param_names, spec.holders)
        if persistent:
            self.publish_master().wait()  # every rank's shard into the unsharded parameters
        else:
            self.free()
        # [Note: master stores] in step/master.py: chosen by the engine, once; the files take the master from now on
        self.store: MasterStore = store(self)

        # [Note: gradients] in grads.py: the unsharded buffer, a lookup's sparse gradient, the reduced shard
        self.grads = FlatGrads(settings, self.params, spec.backward_reads_params, grad_shard)
        self._grad_stand_ins: list[tuple[tuple[torch.Tensor, ShardedGrad], ...]] | None = None
        # [Note: replaced data] in checks/forward.py: where each parameter's values live, while the part is persistent
        self.param_data_ptrs = tuple(p.data_ptr() for p in self.params) if self.persistent else ()

    def _gather_shard(self, on_disk: bool) -> torch.Tensor:
        """Stage 3: the shard a gather sends ([Note: cast on gather]), taken before the master's store is chosen."""
        placement = self.placement
        if on_disk and placement.offload_params:
            return self.sharded_master  # a stand-in, 0 bytes once on disk: each gather reads the files
        if (
            self.sharded_master.device == placement.gather_source_device
            and (self.param_dtype == self.master_dtype or not placement.offloaded)
            and not on_disk
        ):
            return self.sharded_master  # [Note: cast on gather] the master, in memory on the compute device
        shard = placement.alloc(self.layout.shard_numel, self.param_dtype, placement.gather_source_device)
        return shard.copy_(self.sharded_master)

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
        return illegal_call(self.shard_group.global_rank, verb, f"a part of unit '{self.spec.name}'", why=why)

    def gather(self) -> Pending:
        """Allocate the unsharded buffer and issue the gather of every rank's shard into it (asynchronous). The
        owning `Unit` calls it only from SHARDED; a persistent part (stages 0-2) has nothing to gather and
        refuses."""
        if self.persistent or self.sharded_param is None:
            raise self._illegal("gather", "stages 0-2 keep the parameters whole; there is nothing to gather")
        storage = self.unsharded_param.untyped_storage()
        self.pool.fill(storage, self.layout.padded_numel * self.unsharded_param.element_size())
        source = self.store.gather_source()
        if source.device != self.device:  # the shard lives on the host: stage it on the device for the gather
            source = torch.empty_like(source, device=self.device).copy_(source, non_blocking=True)
        if self.shard_group.size == 1:  # [Note: a shard group of one] in stages.py: the copy casts, nothing travels
            return all_gather_into(self.unsharded_param, source, self.shard_group)
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

    @property
    def grad_stand_ins(self) -> list[tuple[tuple[torch.Tensor, ShardedGrad], ...]]:
        """Per parameter, each object users reach it by (the parameter, and at stage 3 its stand-in) with the
        `ShardedGrad` its `.grad` holds at rest ([Note: resting gradients]); made once."""
        if self._grad_stand_ins is None:
            mh = self.module_holders
            holders = [(p,) for p in self.params] if mh is None else list(zip(self.params, mh.resting))
            self._grad_stand_ins = [
                tuple((obj, ShardedGrad(obj, name)) for obj in objs)
                for objs, name in zip(holders, self.spec.param_names)
            ]
        return self._grad_stand_ins

    def rest_grads(self) -> None:
        """[Note: resting gradients] the gradients reached the engine: `.grad` stand-ins for trainable parameters."""
        self.grads.rest(self.grad_stand_ins)

    def wake_grads(self) -> None:
        """[Note: resting gradients] remove the `.grad` stand-ins."""
        if self._grad_stand_ins is not None:
            FlatGrads.wake(self._grad_stand_ins)

    def bind(self, real: bool) -> None:
        """Register the real parameters (gathered) or their stand-ins (freed) in the modules ([Note: resting
        parameters])."""
        if self.module_holders is not None:
            self.module_holders.bind(real=real)

    def free(self) -> None:
        """Give the modules the stand-ins and the unsharded buffer back to the pool (stage 3). A persistent part
        refuses: freeing it would lose the only whole copy of its parameters."""
        if self.persistent:
            raise self._illegal("free", "stages 0-2 keep the parameters whole; nothing may free them")
        self.bind(real=False)
        self.pool.release(self.unsharded_param.untyped_storage())

    def param_shard(self) -> torch.Tensor:
        """This rank's shard of the compute parameters: the gather source (stage 3), or this rank's
        shard of the whole parameters (stages 0-2)."""
        if not self.persistent and self.sharded_param is not None:
            return self.sharded_param
        lo, hi = self.layout.shard_range(self.shard_group.rank)
        return self.unsharded_param[lo:hi]

    def publish_master(self, async_op: bool = False, master: torch.Tensor | None = None) -> Pending:
        """After an optimizer step, make the compute parameters equal to the updated master shard
        (`master`, by default `sharded_master`): copy it into this rank's parameter shard, then
        (stages 0-2) gather every rank's."""
        master = self.sharded_master if master is None else master
        own = self.param_shard()
        if own.data_ptr() != master.data_ptr():
            own.copy_(master, non_blocking=True)
        return self.gather_persistent(async_op)

    @property
    def master_apart(self) -> bool:
        """Whether this rank's master is a tensor of its own in the compute device's memory, beside its shard of the
        whole parameters (stages 0-2 under mixed precision, or offloaded where the device is the host): compared
        element by element in [Note: edits between steps]."""
        return (
            self.persistent
            and not self.fingerprinted
            and self.param_shard().data_ptr() != (self.sharded_master.data_ptr())
        )

    def edited(self, cast: torch.Tensor, differs: torch.Tensor) -> torch.Tensor:
        """[Note: edits between steps]
        At stages 0-2 every parameter is whole on every rank, and code written for DDP changes it in place between
        steps (`p.mul_(0.5)`, `p.data.clamp_(-c, c)`, a row of an embedding zeroed). Where the master is the
        parameter itself (fp32, in memory) the change is the master's. Where it is apart (bf16 or fp16 mixed
        precision) the change reached only the compute parameters, and the next step's publish wrote the fp32
        masters over it, without a word. So before the masters are read (a step, a state dict, a save), the
        engine asks each part whether its shard still holds, bit for bit, its master's cast (a span at a time through
        `cast` and `differs`, memory it keeps; a 0-d bool on the device, all parts answered in one sync) and has the
        parts that changed take the changed elements into their masters (`take_edits`), the others keeping their
        exact fp32 value, as `gathered_parameters` does on leaving its block. The comparison holds only while the
        masters are as last published: not where an optimizer moved them outside a step (schedulefree's `eval()`,
        published by `publish_masters` without it).

        Where the master is in another device's memory (offloaded from an accelerator to the host) or in files,
        comparing would move every shard each step. There the part takes a fingerprint of its shard at each publish
        (`gather_persistent`: the shard is then its master's cast) and again before the masters are read
        (`fingerprint_changed`); only a part whose fingerprint moved reads its master and takes the changed elements
        (`take_edits`), as above. A fingerprint that is stale (a path that wrote the shard without publishing)
        costs one needless comparison, never a value."""
        new, master = self.param_shard(), self.sharded_master
        bits = _SAME_SIZE_INT[new.element_size()]
        found = torch.zeros((), dtype=torch.bool, device=new.device)
        for start in range(0, new.numel(), cast.numel()):
            n = min(cast.numel(), new.numel() - start)
            cast[:n].copy_(master[start : start + n])
            torch.ne(new[start : start + n].view(bits), cast[:n].view(bits), out=differs[:n])
            found |= differs[:n].any()
        return found

    def fingerprint_changed(self) -> torch.Tensor:
        """[Note: edits between steps] whether the shard's fingerprint moved since the last publish (a 0-d bool on
        the device); the new fingerprint is kept for `take_edits`."""
        self._current = current = fingerprint(self.param_shard())
        if self._published is None:
            return torch.ones((), dtype=torch.bool, device=current.device)
        return current != self._published

    def take_edits(self) -> None:
        """[Note: edits between steps] the elements of this rank's shard that differ from its master's cast, into it
        (through the store where the master is elsewhere: read whole, changed, written back)."""
        master = self.store.read()
        new = self.param_shard().to(master.device)
        bits = _SAME_SIZE_INT[new.element_size()]
        changed = new.view(bits) != master.to(self.param_dtype).view(bits)
        master[changed] = new[changed].to(master.dtype)
        self.store.write(master)
        if self.fingerprinted:
            self._published = self._current

    def gather_persistent(self, async_op: bool = False) -> Pending:
        """Stages 0-2: all-gather every rank's shard of the parameters after they were updated (stage 3:
        nothing; the next use gathers)."""
        if not self.persistent:
            return Pending()
        if self.fingerprinted:  # [Note: edits between steps]: the shard is its master's cast now
            self._published = fingerprint(self.param_shard())
        return all_gather_into(self.unsharded_param, self.param_shard(), self.shard_group, async_op)

    def start_training(self, settings: PartSettings) -> bool:
        """[Note: requires_grad after initialize] in unfreeze.py: this part, frozen at `initialize`, takes a trainable
        part's `settings` (its placement and master dtype): where they differ from its own, its master is made from
        its compute shard (the caller checked that it holds the values it was frozen with) where a trainable part's
        lives, and at stage 3 its gather source is a trainable part's. Returns whether the master moved (the
        pieces' tensors are to follow it)."""
        moved = (settings.placement, settings.master_dtype) != (self.placement, self.master_dtype)
        if moved and self.grads.shard_memory is not None:
            raise self._illegal("start_training", "a part with a gradient shard was trainable at initialize")
        self.settings = self.grads.settings = settings
        if not moved:
            return False
        shard = self.param_shard()
        self.sharded_master = self.placement.alloc(self.layout.shard_numel, self.master_dtype, self.master_device)
        self.sharded_master.copy_(shard)
        if not self.persistent:
            self.sharded_param = self._gather_shard(on_disk=False)
        self.fingerprinted = self.persistent and self.placement.offloaded and self.master_device != self.device
        self._published = self._current = None
        return True

    # ---- what the gradients are for --------------------------------------------------------------
    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.params if p.requires_grad]

    @property
    def has_trainable(self) -> bool:
        """Whether any parameter of the part can get a gradient (a frozen part holds no gradient memory)."""
        return self.grads.has_trainable

    @property
    def held_params(self) -> tuple[torch.Tensor, ...]:
        """What the modules hold for the part's parameters now: the real ones, or (stage 3, resharded) their
        stand-ins, whose `requires_grad` is the one user code sets between passes ([Note: resting parameters])."""
        mh = self.module_holders
        return self.params if mh is None or mh.holds_real else mh.resting

    @property
    def sparse_lookup(self) -> bool:
        """Whether the part is a plain embedding lookup whose gradient travels as rows
        ([Note: sparse lookup gradients] in sparse.py)."""
        return self.grads.sparse_lookup

    # ---- accounting -------------------------------------------------------------------------
    def storages(self) -> list[tuple[str, torch.Tensor, str]]:
        """`(category, tensor, placement)` of what this unit holds, placement `"host"` for offloaded
        tensors (even on a CPU-only machine) and the device otherwise. Views and aliases are
        deduplicated by the caller, in this order."""

        where, offloaded = self.placement.label, self.placement.offloaded
        held = [("parameters", self.unsharded_param, where(self.unsharded_param, False))]
        if self.sharded_param is not None:
            held.append(("parameters", self.sharded_param, where(self.sharded_param, self.placement.offload_params)))
        for g, on_host in ((self.grads.shard_memory, offloaded), (self.grads.unsharded, False)):
            if g is not None:
                held.append(("gradients", g, where(g, on_host)))
        held.append(("optimizer_states", self.sharded_master, where(self.sharded_master, offloaded)))
        return held


EditScratch = dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]]


def take_edits(apart: list[FlatPart], fingerprinted: list[FlatPart], scratch: EditScratch) -> EditScratch:
    """[Note: edits between steps] have each part in `apart` (masters apart, compared) and in `fingerprinted`
    (masters elsewhere) that changed take its changes, with one sync for all; returns the scratch memory of the
    comparisons, one per compute dtype (a part kept in its own dtype beside the model's: [Note: parameters kept in
    their own dtype] in unit.py), made at the first call and kept (a fresh buffer's first touch would cost more
    than the comparison)."""
    if not apart and not fingerprinted:
        return scratch
    for part in apart:
        shard = part.param_shard()
        if shard.dtype not in scratch:
            span = min(
                AT_ONCE_NUMEL, max(p.param_shard().numel() for p in apart if p.param_shard().dtype == shard.dtype)
            )
            scratch[shard.dtype] = (
                torch.empty(span, dtype=shard.dtype, device=shard.device),
                torch.empty(span, dtype=torch.bool, device=shard.device),
            )
    answers = [part.edited(*scratch[part.param_shard().dtype]) for part in apart]
    answers += [part.fingerprint_changed() for part in fingerprinted]  # on the compute device, as the comparisons
    found = torch.stack(answers).tolist()
    for part, edited in zip(apart + fingerprinted, found):
        if edited:
            part.take_edits()
    return scratch


@functools.lru_cache(maxsize=4)
def _print_weights(device: torch.device) -> torch.Tensor:
    """The fixed pseudo-random int32 weights of `fingerprint`, made once per device."""
    g = torch.Generator().manual_seed(0x5EED)
    return torch.randint(-(2**31), 2**31 - 1, (AT_ONCE_NUMEL,), generator=g, dtype=torch.int32).to(device)


def fingerprint(values: torch.Tensor) -> torch.Tensor:
    """[Note: edits between steps] a 0-d int64 on `values`' device that changes with any change of its bits (a
    value, or a value moved to another place) but a contrived one: sum over pieces k of m_k * sum_i b_ki * w_i,
    wrapping, with b the bits of the elements as integers, w fixed pseudo-random weights and m_k odd multipliers
    per piece. No sync."""
    weights = _print_weights(values.device)
    bits = values.view(_SAME_SIZE_INT[values.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=values.device)
    for k, start in enumerate(range(0, bits.numel(), AT_ONCE_NUMEL)):
        piece = bits[start : start + AT_ONCE_NUMEL]
        multiplier = ((k + 1) * 0x9E3779B97F4A7C15) % (1 << 62) | 1
        total += torch.mul(piece, weights[: piece.numel()]).sum() * multiplier
    return total
