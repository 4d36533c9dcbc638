"""`ZeroEngine`: the owner of a sharded model's units, hooks and gradient shards."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..config import ZeroConfig
from .accounting import ModelStateMemory
from .buffers import BufferSync
from .checks.call_order import Call, CallOrder
from .checks.forward import ForwardChecks
from .collectives import (
    CommGroup,
    all_gather_into,
    all_reduce_,
    comm_device,
    host_side_group,
    max_scalar_,
)
from .flat import EditScratch, FlatPart, take_edits
from .grads import SlabShard, grad_slab
from .hooks import HookSettings, UnitHooks
from .layout import FlatLayout
from .norms import power_sum
from .part_settings import PartSettings
from .pass_events import PassListener
from .placement import Placement, kept_in_float32, main_dtype, move_buffers
from .pool import pool_for
from .resting import at_c_speed
from .sources import LiveParams, ShardSource
from .stages import StagePlan, plan_for_stage
from .step.disk import DiskOffload, disk_for, place_key, refuse_kept_on_disk
from .step.master import FlatStep, MemoryMaster, MemoryStep
from .step.pieces import Piece, pieces_of
from .step.scaler import LossScaler
from .step.stepping import OptimizerSteps
from .step.torch_clip import register
from .store import MasterStore
from .teardown import track
from .unfreeze import FrozenParts
from .unit import Unit, split_parts
from .wrap import UnitSpec


@dataclass(frozen=True)
class StateDictOptions:
    """What `model.state_dict()` of a sharded model returns (set with `hf_zero.state_dict_options`).

    `rank0_only`: only rank 0 gets the tensors, the others `{}` (every rank still takes part).
    `device`: where the tensors live; `None` is the compute device, like an unsharded model's.
    """

    rank0_only: bool = False
    device: torch.device | str | None = None


class _EngineEvents(PassListener):
    """[Note: pass events] in pass_events.py: what the engine itself does at a pass's events."""

    def __init__(self, engine: ZeroEngine) -> None:
        self.engine = engine

    def root_forward(self) -> None:
        self.engine._before_forward()

    def direct_call(self) -> None:
        self.engine._before_direct_call()

    def backward(self) -> None:
        self.engine._before_backward()

    def reduced(self) -> None:
        self.engine._mark_has_grads()

    def deferred(self) -> None:
        self.engine._rest_grads()


class ZeroEngine:
    """Shards a model in place and runs its units' lifecycle; built by `hf_zero.initialize`."""

    def __init__(
        self,
        model: nn.Module,
        specs: list[UnitSpec],
        config: ZeroConfig,
        world: CommGroup,
        device: torch.device,
        source: ShardSource | None = None,
    ) -> None:
        """Shard `model` in one pass: the stage's plan, in which dtypes it computes on `device` (decided once, by
        `validate_model`), its flat parts (which take their shards from `source`), the units that own them, the
        hooks that run them, and the optimizer pieces over this rank's shards."""
        self.model, self.config, self.world = model, config, world
        self.plan: StagePlan = plan_for_stage(
            config.stage,
            world,
            config.shard_group_size,
            config.group_timeout_s,
            config.collectives,
            offload_params=config.offload_params,
            casts_params=config.param_dtype not in (None, torch.float32),  # [Note: a shard group of one]
        )
        self.device = device
        self.host_pinned = Placement(self.device).host_pinned  # [Note: placement]: host copies pinned (checkpoints too)
        self.model_dtype = main_dtype(model)  # the dtype the model had before sharding: what save_pretrained writes
        self.param_dtype = config.param_dtype or self.model_dtype
        self.master_dtype = torch.float32 if config.param_dtype is not None else self.model_dtype
        self.reduce_dtype = config.resolved_reduce_dtype or self.param_dtype
        self.save_group = host_side_group(world, config.group_timeout_s)  # background saves agree on it
        sync_from = world if config.sync_module_states and world.size > 1 else None
        move_buffers(model, self.device, sync_from)
        keep = kept_in_float32(model, self.param_dtype) if config.param_dtype is not None else frozenset()
        grouped = [split_parts(spec, self.model_dtype, keep) for spec in specs]  # [Note: frozen parameters] in unit.py
        parts_specs = [part for parts in grouped for part in parts]
        size, align = self.plan.shard_group.size, config.shard_alignment  # each part's layout, computed once
        layouts = [FlatLayout.build(s.param_names, [p.shape for p in s.params], size, align) for s in parts_specs]
        dtypes = [self._dtypes(s) for s in parts_specs]  # compute, master, reduce: each part's
        block = config.quantization_block if config.quantized_weights else None
        self.pool = pool_for(layouts, dtypes, size, block, per_size=config.prefetch + 2)
        source = source or LiveParams(sync_from)  # [Note: read ahead] in checkpoint/pretrained.py: from here on
        source.prepare([(layout, s.params, self.plan.shard_group.rank) for s, layout in zip(parts_specs, layouts)])
        # [Note: master stores] in step/master.py: the offload files' owner (if any) and the flat step, chosen once
        trained = {place_key(s): layout for layout, s in zip(layouts, parts_specs) if not s.frozen}
        if config.offload_dir is not None:
            refuse_kept_on_disk(parts_specs, [d[1] for d in dtypes], self.master_dtype)
        self.disk = disk_for(trained, config.offload_dir, world, self.device, self.master_dtype)
        self.flat_step: FlatStep = self.disk or MemoryStep()
        # [Note: gradient shard lifetime] in grads.py: the trainable parts' gradient shards, one slab built whole
        # (a part kept in another dtype has a shard of its own: [Note: parameters kept in their own dtype])
        trains = [bool(s.params) and not s.frozen and d[1] == self.master_dtype for s, d in zip(parts_specs, dtypes)]
        slab = iter(grad_slab([lt for lt, t in zip(layouts, trains) if t], self._placement(False), self.master_dtype))
        rounded = [next((p.dtype for p in s.params if p.dtype != d[0]), None) for s, d in zip(parts_specs, dtypes)]
        self.parts = [
            self._part(s, layout, source, next(slab) if t else None)
            for s, layout, t in zip(parts_specs, layouts, trains)
        ]
        # Parameters built on the meta device were replaced by views (see FlatPart._bind_params).
        self.replaced: dict[int, nn.Parameter] = {
            id(old): new for part in self.parts for old, new in zip(part.spec.params, part.params) if old is not new
        }
        _swap_parameters(model, self.replaced)
        self.scaler = LossScaler(config) if config.mixed_precision == "fp16" else None
        self.pool.clear()
        parts = iter(self.parts)
        self.units = [Unit([next(parts) for _ in split], self.plan.params, self.plan.grads) for split in grouped]
        self._edit_scratch: EditScratch = {}  # [Note: edits between steps]
        self.state_dict_options = StateDictOptions()  # what model.state_dict() returns (a runtime setting)
        self.steps = OptimizerSteps(self)  # the optimizers attached, and how they step ([Note: several optimizers])
        self._names, self._real = _name_index(self.parts, self.replaced)
        self.buffers = BufferSync(model, world, config.broadcast_buffers)  # [Note: buffer broadcast] in buffers.py
        self.calls = CallOrder(world, self.plan.params.uses_gather, self.buffers)  # [Note: call order]
        self.hooks = UnitHooks(self.units, self.plan, self.pool, self._hook_settings())
        self.pieces: list[Piece] = [piece for part in self.parts for piece in pieces_of(part)]
        self.flat_step.build(self.pieces)
        self.frozen = FrozenParts(  # [Note: requires_grad after initialize] in unfreeze.py
            [part for part in self.parts if part.spec.frozen],
            {id(part): dtype for part, dtype in zip(self.parts, rounded) if part.spec.frozen and dtype is not None},
            self._trainable_settings,
            config.offload_dir is not None,
        )
        track(self)  # [Note: clean exit] in teardown.py
        register(self)  # [Note: torch clipping] in torch_clip.py

    def _hook_settings(self) -> HookSettings:
        """What the hooks run the pass with; its listeners in order ([Note: pass events] in pass_events.py): the
        forward's checks (their refusals before any collective), the call order (each call's header before its first
        collective), then the engine's own events."""
        config = self.config
        checks = ForwardChecks(self.model, self._names, self.parts, self.plan.params.uses_gather, self.buffers)
        return HookSettings(
            prefetch=config.prefetch,
            gate_on_reductions=not self.plan.shard_group.stream_ordered,
            grad_divisor=self._grad_divisor,
            listeners=(checks, self.calls, _EngineEvents(self)),
            root_output_fn=self.scaler.scale_outputs if self.scaler else None,
            world=self.world,
            input_dtype=self.param_dtype if config.mixed_precision != "no" else None,  # [Note: input dtype]
        )

    def _placement(self, frozen: bool) -> Placement:
        """A part's placement; frozen parts stay on the device ([Note: frozen parameters], [Note: placement])."""
        config = self.config
        offloaded = config.offload_optimizer and not frozen
        return Placement(self.device, torch.device("cpu") if offloaded else None, config.offload_params and offloaded)

    def _part(self, spec: UnitSpec, layout: FlatLayout, source: ShardSource, grad_shard: SlabShard | None) -> FlatPart:
        """The flat part of `spec`, its shard taken from `source`, its gradient shard in the slab (`grad_shard`);
        frozen parts keep their shard in the compute dtype ([Note: frozen parameters])."""
        config = self.config
        block = config.quantization_block
        placement = self._placement(spec.frozen)
        param_dtype, master_dtype, reduce_dtype = self._dtypes(spec)
        settings = PartSettings(
            name=spec.name,
            layout=layout,
            shard_group=self.plan.shard_group,
            replicate_group=self.plan.replicate_group,
            placement=placement,
            param_dtype=param_dtype,
            master_dtype=master_dtype,
            reduce_dtype=reduce_dtype,
            pool=self.pool,
            persistent=self.plan.params.keeps_whole,
            weight_quant_block=block if config.quantized_weights and spec.dtype is None else None,  # kept: exact
            grad_quant_block=block if config.quantized_gradients else None,
        )
        disk = self.disk if placement.offloaded else None
        store = functools.partial(_store_for, disk, config.offload_params)  # [Note: master stores] in step/master.py
        return FlatPart(spec, settings, source=source, grad_shard=grad_shard, store=store, on_disk=disk is not None)

    def _dtypes(self, spec: UnitSpec) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        """A part's compute, master and reduce dtypes: the config's, or for parameters kept in their own dtype that
        dtype throughout (float32 masters under mixed precision: [Note: parameters kept in their own dtype]); a
        frozen part's master is its compute copy ([Note: frozen parameters])."""
        if spec.dtype is None:
            compute, master, reduce = self.param_dtype, self.master_dtype, self.reduce_dtype
        else:
            compute, reduce = spec.dtype, spec.dtype
            master = torch.float32 if self.config.param_dtype is not None else spec.dtype
        return compute, compute if spec.frozen else master, reduce

    def keeps_dtype(self, buffer: torch.Tensor) -> bool:
        """Whether a floating-point buffer is in another dtype than the model's: written in its own, as transformers
        saves it ([Note: parameters kept in their own dtype] in unit.py)."""
        return buffer.is_floating_point() and buffer.dtype != self.model_dtype

    @property
    def uses_host_backend(self) -> bool:
        """Whether any of the engine's groups runs on a host backend (gloo): its collectives complete on worker
        threads ([Note: clean exit])."""
        groups = (self.world, self.plan.shard_group, self.plan.replicate_group)
        return any(g.size > 1 and g.comm_kind == "cpu" for g in groups)

    def finish_in_flight(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s` each) for every collective this engine issued and has not waited for, and
        drop its transient buffers; local, issues nothing ([Note: clean exit]). True when all finished."""
        ok = self.hooks.settle(timeout_s)
        ok = all([unit.settle(timeout_s) for unit in self.units]) and ok
        self.pool.clear()
        return ok

    def name_of(self, param: torch.Tensor) -> str:
        """The first qualified name of one of the model's parameters (or of its stand-in)."""
        return self._names[id(param)]

    def use_directly(self, module: nn.Module) -> None:
        """Keep the unit of `module`'s parameters gathered through every forward of the model, for code
        that reads them without calling `module` ([Note: direct use] in hooks.py). Stages 0-2: nothing to do."""
        owned = {id(self.compute_param(p)) for p in module.parameters()}  # stand-ins map to the real ones
        for group in self.units:
            if any(id(p) in owned for p in group.params) and group is not self.units[-1]:
                self.hooks.use_directly(group)

    @property
    def generation_needs_sync(self) -> bool:
        """Whether every rank must run every forward of `generate` (stage 3, several ranks): each
        forward gathers parameters, so a rank that stopped early would leave the others waiting."""
        return self.plan.params.uses_gather and self.world.size > 1

    @property
    def writes_shards(self) -> bool:
        """Whether this rank's shards are the ones to save (replicas of a shard save nothing)."""
        return self.plan.replicate_group.rank == 0

    # ---- gradients --------------------------------------------------------------------------
    def _grad_divisor(self) -> float:
        scale = self.scaler.scale if self.scaler is not None else 1.0
        return float(self.plan.data_parallel_size) * scale

    @property
    def has_grads(self) -> bool:
        """Whether some reduced gradient reached the shards since the last `zero_grad` ([Note: pass state])."""
        return self.hooks.current.has_grads

    @property
    def in_no_sync(self) -> bool:
        """Inside `no_sync()`: DDP's gradient sync is off (and the buffers' broadcast not due)."""
        return self.hooks.current.in_no_sync

    def _mark_has_grads(self) -> None:
        self.hooks.current.grads_reduced()
        self.steps.on_reduced()
        self._rest_grads()

    def _rest_grads(self) -> None:
        """[Note: resting gradients] after a backward pass, reduced or (under no_sync) only accumulated (the stand-ins'
        `.grad` read and set `at_c_speed`)."""
        for part in self.parts:
            at_c_speed(part.rest_grads)
        self.steps.rest_grads()  # [Note: optimizer tensors at rest]
        self.hooks.current.grads_rested()

    def _before_backward(self) -> None:
        """As a backward pass begins (after its header, [Note: call order]): the gradients woken for autograd ([Note:
        resting gradients])."""
        self._wake_grads()

    def _wake_grads(self) -> None:
        """[Note: resting gradients] before a forward with grad or a backward pass, and at `zero_grad`."""
        if self.hooks.current.wake_grads():
            for part in self.parts:
                at_c_speed(part.wake_grads)
            self.steps.wake_grads()  # [Note: optimizer tensors at rest]

    @property
    def defers_reduction_in_no_sync(self) -> bool:
        """[Note: accumulation]
        Whether `no_sync()` skips the reduction: stages 0-1 (the unsharded gradient buffer exists anyway), or
        stages 2-3 with `ZeroConfig.no_sync_keeps_grads`. The backward that synchronises then reduces every
        unit's accumulated buffer, also of the units it did not run itself (a block that ran only in an earlier
        micro-batch: its gradient is in the buffer, as DDP keeps it in `.grad`), in its final callback."""
        return self.plan.grads.keeps_unsharded or self.config.no_sync_keeps_grads

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """The backward passes run inside accumulate without reduction where that costs no memory
        ([Note: accumulation]); see `ZeroModel.no_sync`."""
        previous = self.hooks.current.enter_no_sync(defer=self.defers_reduction_in_no_sync)
        try:
            yield
        finally:
            self.hooks.current.leave_no_sync(previous)

    def as_unwrapped(self) -> contextlib.AbstractContextManager[None]:
        """Forwards inside run as on the module a DDP wrapper holds ([Note: buffer broadcast] in buffers.py): no
        buffer broadcast, DDP's flag left as it was. The stock Trainer evaluates `self.model`, not its DDP wrapper."""
        return self.buffers.as_unwrapped()

    def _before_forward(self) -> None:
        """As each forward of the model begins (not a recomputation), after its checks (`ForwardChecks` in
        checks/forward.py) and its header ([Note: call order]): with grad, the gradients woken and units unfrozen
        since `initialize` started; and the buffers broadcast where DDP would ([Note: buffer broadcast] in
        buffers.py)."""
        grad = torch.is_grad_enabled()
        broadcast = self.buffers.begin_forward(grad, self.in_no_sync)  # [Note: buffer broadcast] in buffers.py
        if grad:
            self._wake_grads()
            self._start_unfrozen_units()
        if broadcast:
            self.buffers.broadcast()

    def _start_unfrozen_units(self) -> None:
        """[Note: requires_grad after initialize] in unfreeze.py: parts frozen at `initialize`, unfrozen since."""
        for _, unit in self.frozen.start_unfrozen(self.units, self.pieces, self.steps.attached):
            self.hooks.watch_grads(unit)
        self.hooks.watch_unfrozen()

    def _trainable_settings(self, part: FlatPart) -> PartSettings:
        """The settings of `part` had it been trainable at `initialize` (its placement and master dtype)."""
        _, master, _ = self._dtypes(replace(part.spec, frozen=False))
        return replace(part.settings, placement=self._placement(False), master_dtype=master)

    def _before_direct_call(self) -> None:
        """As a module of the root is called outside the model's forward ([Note: direct calls] in hooks.py), after its
        header ([Note: call order]): with grad, the gradients woken."""
        if torch.is_grad_enabled():
            self._wake_grads()

    def zero_grad(
        self, *, abandon_pass: bool = False, set_to_none: bool = True, keep: frozenset[int] = frozenset()
    ) -> None:
        """Drop every gradient; `abandon_pass`: first forget a forward or backward that an exception stopped (its
        gathered units freed, its reductions waited for), e.g. after an out-of-memory error the caller survived.
        `set_to_none=False`: the next step gives a zero gradient to every parameter that had one ([Note: zero
        gradients kept] in stepping.py). `keep`: ids of parameters whose gradients stay ([Note: gradients no
        optimizer holds] in stepping.py)."""
        if abandon_pass:
            self.hooks.reset()
        self.hooks.wait_reductions()
        self._wake_grads()
        flags = {id(part): [id(p) in keep for p in part.params] for part in self.parts} if keep else {}
        kept = bool(keep) and any(part.grads.keeps(flags[id(part)]) for part in self.parts)  # then the slab stays
        for part in self.parts:
            if not part.grads.zero(flags.get(id(part), ()), release=not kept):
                self.plan.grads.drop(part)
        for piece in self.pieces:
            piece.unbind_grads()
        self.steps.wake_grads()  # [Note: optimizer tensors at rest], also after a step no backward preceded
        self.hooks.current.grads_zeroed()
        self.steps.on_zero_grad()
        self.steps.keep_zeros(set_to_none)

    def model_params_of(self, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """[Note: torch clipping] the model parameters that tensors of the attached optimizers' groups stand for."""
        return self.steps.model_params_of(tensors)

    def owns(self, param: torch.Tensor) -> bool:
        """Whether `param` is one of this engine's parameters or stand-ins."""
        return id(param) in self._names

    def _grad_shards(self, params: Iterable[torch.Tensor] | None) -> list[torch.Tensor]:
        """The gradient shards this rank holds (views of the pieces of `params` only, when given): what clipping
        reads and scales. Units no reduction reached since `zero_grad` hold none; a frozen parameter's gradients are
        zeros, or those it kept from before it was frozen, which torch's clipping counts too ([Note: gradients no
        optimizer holds] in step/stepping.py)."""
        self.hooks.wait_reductions()
        reduced = [part for part in self.parts if not part.grads.is_zero]
        if params is None:
            return [part.grads.shard for part in reduced]
        chosen = at_c_speed(lambda: {id(self.compute_param(p)) for p in params})
        every = {id(p) for part in reduced for p in part.params}
        if every <= chosen:
            return [part.grads.shard for part in reduced]
        return [piece.grad for piece in self.pieces if id(piece.param) in chosen and not piece.part.grads.is_zero]

    def clip_grad_value_(self, clip_value: float, params: Iterable[torch.Tensor] | None = None) -> None:
        """Clamp the gradient shards (of `params` only, when given) to `[-clip_value, clip_value]`, in place."""
        for g in self._grad_shards(params):
            g.clamp_(-float(clip_value), float(clip_value))

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, params: Iterable[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Clip the sharded gradients (of `params` only, when given: [Note: torch clipping]) by their global norm;
        returns the norm of the unsharded gradients. A collective."""
        norm_type = float(norm_type)
        shards = self._grad_shards(params)
        group = self.plan.shard_group
        if not shards:  # nothing trainable: the norm is zero on every rank
            shards = [torch.zeros(1, device=self.device)]
        comm = comm_device(group)  # the shards may be on the host (offload); the collective is not
        # fp32 holds any norm of fp32/bf16/fp16 gradients; fp64 gradients (an fp64 model) keep fp64, as torch's does
        dtype = torch.float64 if any(g.dtype == torch.float64 for g in shards) else torch.float32
        if math.isinf(norm_type):
            local = torch.stack([g.detach().abs().max().to(dtype) for g in shards]).max()
            total = max_scalar_(local.reshape(1).to(comm), group)[0]
        else:
            local = torch.stack([power_sum(g.detach(), norm_type) for g in shards]).sum()
            summed = local.to(dtype).reshape(1).to(comm)
            all_reduce_(summed, group)
            total = summed[0] ** (1.0 / norm_type)
        if max_norm is not None and not math.isinf(float(max_norm)):
            coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
            for g in shards:
                g.mul_(coef.to(device=g.device, dtype=g.dtype))
        return total

    def release_gathered(self) -> None:
        """Finish the reductions in flight and free every gathered unit (stage 3, prefetches included),
        so no copy of the parameters gathered before a change of the master weights is used after it."""
        self.hooks.wait_reductions()
        self.hooks.release_held()
        self.hooks.weights_changed()  # [Note: double backward]: a step invalidates the graph they served
        for unit in self.units:
            unit.release()

    # ---- gathering --------------------------------------------------------------------------
    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Before the masters are read: the gradients reduced into their shards, and the parameters' changes since
        the last publish taken into the masters ([Note: edits between steps] in flat.py)."""
        self.hooks.wait_reductions()
        apart = [part for part in self.parts if part.master_apart]
        fingerprinted = [part for part in self.parts if part.fingerprinted]
        self._edit_scratch = take_edits(apart, fingerprinted, self._edit_scratch)

    def gather_units(
        self,
        *,
        rank0_only: bool = True,
        device: torch.device | str = "cpu",
        trainable_only: bool = False,
    ) -> Iterator[list[tuple[str, nn.Parameter, torch.Tensor]]]:
        """Gather the master parameters one unit at a time: yields `[(name, param, full value), ...]`.

        A collective: every rank must exhaust the iterator. With `rank0_only`, the other ranks
        take part in each gather but get empty lists; with `trainable_only`, units without a
        trainable parameter are skipped and only trainable parameters are yielded (e.g. a LoRA
        adapter). Peak memory: one unit, plus what the caller keeps.
        """
        self.calls.begin(Call.GATHER_WEIGHTS, read_now=True)  # [Note: call order]
        self.refresh_masters()
        is_writer = self.world.rank == 0 or not rank0_only
        for part in self.parts:
            if trainable_only and not part.has_trainable:
                continue
            full = torch.empty(part.layout.padded_numel, dtype=part.master_dtype, device=part.device)
            all_gather_into(full, part.store.read(), part.shard_group)
            if not is_writer:
                yield []
                continue
            full = full.to(device)
            yield [
                (slot.name, p, full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone())
                for slot, p in zip(part.layout.slots, part.params)
                if p.requires_grad or not trainable_only
            ]
            del full

    def full_state_dict(
        self,
        *,
        rank0_only: bool = True,
        device: torch.device | str = "cpu",
        trainable_only: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Gather the master parameters unit by unit, keyed like an unsharded `state_dict()`; a collective.
        `trainable_only`: only the parameters that require grad (no buffers)."""
        values: dict[str, torch.Tensor] = {}
        for gathered in self.gather_units(rank0_only=rank0_only, device=device, trainable_only=trainable_only):
            values.update({name: value for name, _, value in gathered})
        if rank0_only and self.world.rank != 0:
            return {}
        out: dict[str, torch.Tensor] = {}
        for key, t in self.module_state(with_params=True).items():
            name = self._names.get(id(t))
            if name is not None and name in values:
                out[key] = values[name]
            elif name is None and not trainable_only:
                out[key] = t.detach().to(device).clone()
        return out

    def module_state(self, *, with_params: bool) -> dict[str, torch.Tensor]:
        """The model's own `state_dict(keep_vars=True)` (parameters as the modules hold them now, real or
        stand-ins), or only its persistent buffers."""
        state = nn.Module.state_dict(self.model, keep_vars=True)
        return state if with_params else {k: v for k, v in state.items() if id(v) not in self._names}

    def compute_param(self, param: torch.Tensor) -> torch.Tensor:
        """The engine's own parameter behind `param` (itself, or the one a stand-in or a meta original stands for)."""
        return self._real.get(id(param), param)

    # ---- accounting -------------------------------------------------------------------------
    def memory(self) -> ModelStateMemory:
        """The bytes of parameters, gradients and optimizer state this rank holds now."""
        seen: set[int] = set()
        parts: dict[str, dict[str, int]] = {"parameters": {}, "gradients": {}, "optimizer_states": {}}

        def count(category: str, t: torch.Tensor, placement: str) -> None:
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                return
            seen.add(storage.data_ptr())
            parts[category][placement] = parts[category].get(placement, 0) + storage.nbytes()

        held = [item for part in self.parts for item in part.storages()]
        order = {"parameters": 0, "gradients": 1, "optimizer_states": 2}  # an alias counts where it is first seen
        for category, t, placement in sorted(held, key=lambda item: order[item[0]]):
            count(category, t, placement)
        self.flat_step.account(parts)  # [Note: disk offload]: masters and elementwise optimizer state in files
        for entry in self.steps.attached:
            offloaded = self.config.offload_optimizer
            for state in entry.optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        count("optimizer_states", v, "host" if offloaded and v.device.type == "cpu" else str(v.device))
        return ModelStateMemory(**parts)


def _store_for(disk: DiskOffload | None, params_on_disk: bool, part: FlatPart) -> MasterStore:
    """A part's master store: its place in the offload files, or its own tensor in memory."""
    return disk.adopt(part, params_on_disk) if disk is not None else MemoryMaster(part)


def _swap_parameters(model: nn.Module, replaced: dict[int, nn.Parameter]) -> None:
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in replaced:
                module._parameters[name] = replaced[id(param)]


def _name_index(
    parts: list[FlatPart], replaced: dict[int, nn.Parameter]
) -> tuple[dict[int, str], dict[int, nn.Parameter]]:
    """`id(tensor) -> name` of every engine parameter and stand-in ([Note: resting parameters]), and
    `id(tensor) -> engine parameter` for stand-ins and replaced meta originals."""
    names = {id(p): n for part in parts for p, n in zip(part.params, part.spec.param_names)}
    real: dict[int, nn.Parameter] = dict(replaced)
    for part in parts:
        if part.module_holders is not None:
            for stand_in, p, n in zip(part.module_holders.resting, part.params, part.spec.param_names):
                real[id(stand_in)] = p
                names[id(stand_in)] = n
    return names, real
