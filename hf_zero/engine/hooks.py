"""Forward/backward hooks: the units' verbs run in order, on every rank ([Note: lifecycle] in lifecycle.py; the
running pass's state: passes.py)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .buckets import OpenBucket, bucket_callers
from .checks.changed_in_forward import ChangedInForward
from .checks.double_backward import GraphPins
from .checks.units_run import UnitsCheck
from .collectives import CommGroup
from .flat import FlatPart
from .grads import UnitReduction
from .lifecycle import TrainingState
from .order import plan_prefetches
from .pass_events import PassListener
from .passes import Pass, in_backward
from .pool import BufferPool
from .registration import keep_last, members, register_first_pre_hook, weakly
from .stages import StagePlan
from .tree import cast_floating_inputs, flatten, tensors
from .unit import Unit

MAX_PENDING_REDUCTIONS = 1  # issued reduce-scatters left in flight while the next unit's backward runs


class _EndOfBackward(torch.autograd.Function):
    """[Note: backward end]
    The identity on a unit's forward inputs that require grad; its backward runs when the gradient
    of those inputs is complete, i.e. when every operation of the unit that they feed has run its
    backward, and autograd runs the parameters' gradient accumulation (the highest priority in its
    queue) before it. That is the end of the unit's backward, decided by the graph's structure,
    which is the same on every rank, and not by which parameters received gradients."""

    @staticmethod
    def forward(ctx: Any, hooks: UnitHooks, unit: Unit, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hooks, ctx.unit = hooks, unit
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hooks._on_end_signal(ctx.unit)
        return (None, None, *grads)


@dataclass(frozen=True)
class HookSettings:
    """What the hooks are told at construction, and never again.

    `prefetch`: units gathered ahead of the running one (stage 3). `gate_on_reductions`: [Note:
    reduction-gated prefetch], the shard group's backend completes collectives on the host (gloo), not on a
    device stream (`CommGroup.stream_ordered`). `grad_divisor`: what each reduced sum is divided by (the
    data-parallel size, times the fp16 loss scale). `listeners`: told of the pass's events, in this order ([Note:
    pass events] in pass_events.py). `root_output_fn`: rewrites the root's outputs (the fp16 loss scale), or None.
    `world`: the group whose ranks must agree on which units ran ([Note: units run on some ranks]), or None to skip
    that check.
    """

    prefetch: int
    gate_on_reductions: bool
    grad_divisor: Callable[[], float]
    listeners: tuple[PassListener, ...] = ()
    root_output_fn: Callable[[Any], Any] | None = None
    world: CommGroup | None = None
    input_dtype: torch.dtype | None = None  # [Note: input dtype] the root's floating inputs' dtype, or None


class UnitHooks:
    """Registers the hooks of every unit and runs the pass: the units' verbs, in order, on every rank."""

    def __init__(self, units: list[Unit], plan: StagePlan, pool: BufferPool, settings: HookSettings) -> None:
        self.units = units  # inner units in module order, the root last
        self.root = units[-1]
        self.plan = plan
        self.pool = pool  # emptied at the end of every pass ([Note: buffer reuse])
        self.settings = settings
        self.current = Pass(rank=self.root.rank)  # the running pass, and the accumulation across passes
        self._forward_order: list[Unit] = []  # inner units in the order the first forward ran them
        self._order_known = False
        self.direct: list[Unit] = []  # [Note: direct use] units gathered with the root's forward
        self.graph = GraphPins(pins=plan.params.uses_gather)  # [Note: double backward] in checks/double_backward.py
        changes = ChangedInForward()  # [Note: changed in forward] in checks/changed_in_forward.py
        # [Note: units run on some ranks] in checks/units_run.py: last, so that the headers are read before it waits
        units_check = UnitsCheck(units, settings.world, plan.params.uses_gather, changes, self.current)
        self.listeners = (*settings.listeners, self.graph, changes, units_check)  # [Note: pass events]: in this order
        self._handles: list[RemovableHandle] = []
        self._post_hooks: dict[int, tuple[nn.Module, RemovableHandle]] = {}  # [Note: hook order] by id(unit)
        self._watched: set[int] = set()  # ids of the parameters whose gradients are hooked (`watch_grads`)
        self._unwatched: dict[int, tuple[Unit, FlatPart, int]] = {}  # by id: left for when they require grad
        self._open_bucket = OpenBucket()  # [Note: bucket blocks skipped or repeated] in buckets.py
        self._register()

    def _tell(self, event: Callable[[PassListener], None]) -> None:
        """Tell every listener of an event it may refuse (`event(listener)`, [Note: pass events]): a refusal (the
        `ValueError` a check raises) forgets the pass on its way out. Other errors (a collective that failed) go on
        untouched, as they would from anywhere in the pass."""
        try:
            for listener in self.listeners:
                event(listener)
        except ValueError:
            self.reset()
            raise

    def _resolve_units_check(self) -> None:
        """[Note: units run on some ranks] in checks/units_run.py: where what follows depends on the forward's check, if
        one is in flight, the listeners wait for what they issued (the forward's call-order header first, [Note: call
        order]) and act on it."""
        if self.current.units_check_in_flight:
            self._tell(lambda listener: listener.before_waiting())

    # ---- registration -----------------------------------------------------------------------
    def _register(self) -> None:
        for unit in self.units:
            modules = unit.spec.all_modules  # one module, or a bucket of blocks
            first, last = modules[0], modules[-1]
            pre = partial(self._pre_forward, unit)
            self._handles.append(register_first_pre_hook(first, pre, with_kwargs=True))  # [Note: hook order]
            post = last.register_forward_hook(partial(self._post_forward, unit), with_kwargs=True)
            self._handles.append(post)
            self._post_hooks[id(unit)] = (last, post)
            for member in modules[1:]:  # [Note: recomputation] a bucket's block may be replayed alone, or run first
                member_pre = partial(self._member_pre_forward, unit)
                self._handles.append(register_first_pre_hook(member, member_pre, with_kwargs=True))
            for member in modules[:-1]:
                self._handles.append(member.register_forward_hook(partial(self._member_post_forward, unit)))
            self.watch_grads(unit)
        callers = bucket_callers(self.root.spec.module, self.units)  # [Note: bucket blocks skipped or repeated]
        self._handles += self._open_bucket.hook_callers(callers, self._close_bucket)
        for member in members(self.root):  # [Note: direct calls]
            self._handles.append(register_first_pre_hook(member, partial(self._pre_direct_call, self.root)))
            end = partial(self._post_direct_call, self.root)
            self._handles.append(member.register_forward_hook(end, always_call=True))

    def watch_grads(self, unit: Unit) -> None:
        """Hook, once each, the parameters of the unit's trainable part (which got gradients; the prefetch polls).
        One that does not require grad yet (a unit frozen at `initialize` started training with some of its
        parameters still frozen: [Note: requires_grad after initialize]) is hooked when it does (`watch_unfrozen`)."""
        for part in unit.trainable_parts:
            for i, p in enumerate(part.params):
                if id(p) in self._watched:
                    continue
                if not p.requires_grad:
                    self._unwatched[id(p)] = (unit, part, i)
                    continue
                self._unwatched.pop(id(p), None)
                self._watch(unit, p)

    def watch_unfrozen(self) -> None:
        """At a forward with grad: hook the parameters `watch_grads` left for later that now require grad."""
        for unit, part, i in list(self._unwatched.values()):
            if part.held_params[i].requires_grad:
                part.params[i].requires_grad_(True)  # as the next gather would ([Note: resting parameters])
                self.watch_grads(unit)

    def _watch(self, unit: Unit, p: torch.Tensor) -> None:
        self._watched.add(id(p))
        # Through a weak reference: a hook a parameter holds is invisible to the garbage collector,
        # so a strong one would keep the hooks, the engine and the model (its offload files) alive.
        hook = partial(weakly, weakref.WeakMethod(self._on_grad_ready), weakref.ref(unit))
        self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- forward ----------------------------------------------------------------------------
    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: Any) -> Any:
        keep_last(*self._post_hooks[id(unit)])  # [Note: hook order]
        if in_backward():  # [Note: recomputation] in passes.py
            return self._pre_recompute(unit, args, kwargs)
        if self._open_bucket.holds(unit):  # [Note: bucket blocks skipped or repeated] in buckets.py
            return None  # a block of the open bucket run again: still gathered, its inputs' signal carried
        self._close_bucket()
        if unit is self.root:
            self._begin_root_forward()
            self.current.enter_root(False)  # [Note: forward called directly] the forward runs inside its __call__
        elif not self._order_known and unit not in self._forward_order:
            self._forward_order.append(unit)  # [Note: prefetch] learned from the first forward
        unit.begin_forward()
        if unit is not self.root and torch.is_grad_enabled():
            self.current.ran_forward(unit)
        if self.current.gated is not None and self._forward_gathers(unit, recompute=False):
            self._open_gate()
        planned = self._order_known and self.settings.prefetch > 0  # [Note: units run on some ranks]
        self._tell(lambda listener: listener.before_gather(unit, planned))
        unit.before_compute()
        for listener in self.listeners:
            listener.unit_gathered(unit)
        self._prefetch_after(unit, forward=True)
        cast_any = False
        if unit is self.root and self.settings.input_dtype is not None:
            args, kwargs, cast_any = cast_floating_inputs(args, kwargs, self.settings.input_dtype)
        return self._inputs(unit, args, kwargs, cast_any, recompute=False)

    def _pre_recompute(self, unit: Unit, args: Any, kwargs: Any) -> Any:
        """[Note: recomputation] a unit's forward replayed inside backward: the forward's units check acted on
        first, the unit gathered (a deferred prefetch goes out before, [Note: reduction-gated prefetch]); no listener
        hears of it, nothing is prefetched and the inputs are the first forward's, already cast."""
        self._resolve_units_check()
        if unit is self.root:
            self.current.enter_root(True)
        if self.current.gated is not None and self._forward_gathers(unit, recompute=True):
            self._open_gate()
        unit.before_compute()
        return self._inputs(unit, args, kwargs, False, recompute=True)

    def _inputs(self, unit: Unit, args: Any, kwargs: Any, cast_any: bool, recompute: bool) -> Any:
        """What a pre-forward returns: the inputs that carry the unit's end signal with grad ([Note: backward end]),
        or the cast ones, or None where neither changed them."""
        if unit.sparse_lookup:
            cast(Any, unit.spec.module).sparse = True  # [Note: sparse lookup gradients]; switched back after forward
        if not torch.is_grad_enabled():
            return (args, kwargs) if cast_any else None
        args, kwargs, wrapped = self._carry_end_signal(unit, args, kwargs)
        if wrapped and not recompute:
            unit.expect_signal()
        return (args, kwargs) if wrapped or cast_any else None

    def _begin_root_forward(self) -> None:
        """The root's pre-forward: forget a pass an exception stopped, free a unit no backward used, learn the
        order after the first forward, gather the units used directly."""
        self._resolve_units_check()  # a forward with grad that no backward followed
        if not self.current.idle or any(u.training_state is not TrainingState.IDLE for u in self.units):
            self.reset()  # a previous forward or backward was interrupted by an exception
        self.release_held()  # no backward used it: gather it afresh in this forward
        if not self._order_known and self._forward_order:
            self._order_known = True
            plan_prefetches(self._forward_order, self.settings.prefetch)
        self.current.begin_forward()
        for listener in self.listeners:
            listener.root_forward()
        for direct in self.direct:  # [Note: direct use]
            direct.before_compute()

    def _member_pre_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: Any) -> Any:
        """A block of a bucketed unit other than its first: replayed alone inside backward, gather the unit;
        in a forward, the unit's forward begins here if the blocks before it did not run ([Note: bucket blocks
        skipped or repeated] in buckets.py), else the unit is already gathered."""
        if in_backward():
            unit.before_compute()
            return None
        if self._open_bucket.holds(unit):
            return None
        return self._pre_forward(unit, module, args, kwargs)

    def _member_post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        """A block of a bucketed unit other than its last: replayed inside backward, its outputs' gradients
        begin the unit's backward, as the last block's do after a forward; in a forward, the unit stays open with
        this output ([Note: bucket blocks skipped or repeated] in buckets.py)."""
        if in_backward():
            if torch.is_grad_enabled():
                self._hook_outputs(unit, output)
            return
        if unit.training_state is not TrainingState.FORWARD:
            return
        self._open_bucket.keep_open(unit, output)
        if not (self.current.in_root_forward or self._open_bucket.caller_running()):
            self._close_bucket()  # a block called on its own

    def _close_bucket(self) -> None:
        """The open bucket's forward ends, if one is open ([Note: bucket blocks skipped or repeated] in buckets.py)."""
        taken = self._open_bucket.take()
        if taken is not None:
            self._end_forward(*taken)

    def _pre_direct_call(self, unit: Unit, module: nn.Module, args: Any) -> None:
        """[Note: direct calls]
        A module holding the root's parameters called outside the model's forward: `inputs_embeds =
        model.get_input_embeddings()(input_ids)` then `model(inputs_embeds=...)` (image features or soft prompts
        merged into the embeddings), or `model.lm_head(hidden)` on hidden states the model returned. Under DDP both
        train (DDP's reduction hooks sit on the parameters). Here the call is a forward of the root unit: at
        stage 3 a header ([Note: call order]) and a gather before, a free after (each call gathers afresh); with
        grad, its outputs begin the root's backward when their gradient arrives, and the root's backward ends in
        the final callback only, not at the end signal of its forward's inputs, which the gradient of a direct
        call before the forward (the embeddings') follows. A change the call makes to the parameters in place
        (`nn.Embedding(max_norm=...)`) is refused at stage 3, as in a forward without grad ([Note: changed in
        forward]). Calls inside the root's forward, or inside another direct call, do nothing here."""
        if unit.training_state is TrainingState.FORWARD:
            return
        if in_backward():  # a recomputation: the backward gathered the root
            unit.before_compute()
            return
        if unit.training_state is not TrainingState.IDLE:
            self.reset()  # an exception interrupted a backward pass
        for listener in self.listeners:
            listener.direct_call()
        unit.begin_forward()
        self.current.begin_direct_call(unit, module)
        unit.before_compute()
        for listener in self.listeners:
            listener.unit_gathered(unit)

    def _post_direct_call(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        """[Note: direct calls] the end of a direct call (also after an exception in it: `always_call`)."""
        if not self.current.end_direct_call(module):
            return
        unit.end_forward()
        self._tell_forward_ended(unit, direct=True)
        unit.after_forward()
        if torch.is_grad_enabled():
            self._hook_outputs(unit, output)

    def _carry_end_signal(self, unit: Unit, args: Any, kwargs: Any) -> tuple[Any, Any, bool]:
        """Pass the unit's top-level tensor inputs that require grad through `_EndOfBackward`
        ([Note: backward end]); returns the new args and kwargs and whether any was wrapped."""
        leaves, rebuild = flatten((args, kwargs))  # [Note: containers] in tree.py
        positions = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not positions:
            return args, kwargs, False
        carried = _EndOfBackward.apply(self, unit, *(leaves[i] for i in positions))
        for i, t in zip(positions, carried):
            leaves[i] = t
        args, kwargs = rebuild(leaves)
        return tuple(args), kwargs, True

    def _trim_pool(self, unit: Unit, forward: bool) -> None:
        """[Note: buffer reuse] after `unit` freed its buffers, keep pooled only the sizes that the
        next units take."""
        targets = unit.prefetch_targets
        sizes = targets.pooled_after_forward if forward else targets.pooled_after_backward
        if sizes is not None:
            self.pool.retain(sizes)
        elif not self._order_known:  # the first iteration: which units follow is not known yet, keep nothing
            self.pool.retain(frozenset())

    def _keeps_for_backward(self, unit: Unit) -> bool:
        """The last unit of a forward that will have a backward is the first unit of that backward:
        it stays gathered in between (one all-gather saved per iteration, no extra peak)."""
        return (
            torch.is_grad_enabled()
            and self._order_known
            and unit is self._forward_order[-1]
            and unit.spec.backward_reads_params
            and self.plan.params.keeps_last_unit_for_backward
        )

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if unit is self.root:
            self.current.leave_root()
        if unit.sparse_lookup:
            cast(Any, unit.spec.module).sparse = False
        if in_backward():  # [Note: recomputation]: the unit's backward follows, keep it gathered
            if torch.is_grad_enabled():
                self._hook_outputs(unit, output)
            return None
        if self._open_bucket.holds(unit):
            self._open_bucket.forget()  # its last block ran: it ends here
        self._close_bucket()  # one whose last blocks did not run ends before the model's forward does
        if unit is not self.root:
            self._end_forward(unit, output)
            return None
        self._end_forward(unit, None)
        self.pool.clear()
        self.current.end_forward()
        if not torch.is_grad_enabled():
            return None
        self._resolve_units_check()  # a second forward before a backward: the first one's check goes first
        self._tell(lambda listener: listener.forward_ended())  # the units check issued (or, at one rank, a refusal)
        if self.settings.root_output_fn is not None:
            output = self.settings.root_output_fn(output)
        self._hook_outputs(unit, output)
        return output

    def _end_forward(self, unit: Unit, output: Any) -> None:
        """A unit's forward ends: freed (or held for its backward), the listeners told, its outputs (None: none
        here) hooked to begin its backward."""
        unit.end_forward()
        self._tell_forward_ended(unit, direct=False)
        if self._keeps_for_backward(unit):
            unit.hold()
        else:
            unit.after_forward()
        self._trim_pool(unit, forward=True)
        if output is not None and torch.is_grad_enabled():
            self._hook_outputs(unit, output)

    def _tell_forward_ended(self, unit: Unit, direct: bool) -> None:
        """The listeners hear that `unit`'s forward (or a direct call) ended; one may refuse it."""
        self._tell(lambda listener: listener.unit_forward_ended(unit, direct))

    def _hook_outputs(self, unit: Unit, output: Any) -> None:
        for t in tensors(output):  # [Note: containers] in tree.py
            if t.requires_grad:
                t.register_hook(partial(self._on_output_grad, unit))

    # ---- backward ---------------------------------------------------------------------------
    @property
    def in_backward(self) -> bool:
        return self.current.in_backward

    def _on_output_grad(self, unit: Unit, grad: torch.Tensor) -> None:
        self._pre_backward(unit)

    def _pre_backward(self, unit: Unit) -> None:
        if not self.current.in_backward:
            for listener in self.listeners:
                listener.backward()  # [Note: resting gradients]: autograd must not meet the stand-ins
        if unit is not self.root:
            self._resolve_units_check()  # before anything this unit issues
        if not unit.begin_backward():
            return
        self._open_gate()  # a deferred prefetch goes out before anything this unit issues
        if not self.current.in_backward:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            self.current.begin_backward()
            self._begin_backward_pass()
        if unit.spec.backward_reads_params:
            unit.before_compute()
            for listener in self.listeners:
                listener.unit_backward(unit, self.current.create_graph)  # [Note: double backward]
        if not unit.prefetch_targets.late:
            if self.settings.gate_on_reductions and self.current.has_pending and self._prefetches(unit, forward=False):
                self.current.gate(unit)  # [Note: reduction-gated prefetch]
            else:
                self._prefetch_after(unit, forward=False)
        unit.attach_grads()

    def _prefetch_after(self, unit: Unit, forward: bool) -> None:
        """[Note: prefetch] issue the gathers of the units that follow `unit` (see `plan_prefetches` in order.py),
        so they overlap its compute. At most the root, the running unit and `prefetch` more are
        whole at a time."""
        for nxt in self._prefetches(unit, forward):
            nxt.prefetch()

    def _forward_gathers(self, unit: Unit, recompute: bool) -> bool:
        """Whether `unit`'s forward issues a gather (its own, or, outside backward, a prefetch); the
        same on every rank."""
        own = self.plan.params.uses_gather and unit.needs_gather
        return own or (not recompute and any(u.needs_gather for u in self._prefetches(unit, forward=True)))

    def _prefetches(self, unit: Unit, forward: bool) -> tuple[Unit, ...]:
        """The units `_prefetch_after(unit, forward)` gathers."""
        if not self.plan.params.prefetches:
            return ()
        return unit.prefetch_targets.forward if forward else unit.prefetch_targets.backward

    def _open_gate(self) -> None:
        """[Note: reduction-gated prefetch]
        During a unit's backward its parameters and gradients are whole, and so are either the previous unit's gradients
        (their reduction in flight) or the next unit's parameters (the prefetch), not both: the prefetch is issued once
        the reduction is done (polled at each of the running unit's gradients, a query that never blocks), or at the
        latest before the next collective any hook issues (a unit's pre-forward, pre-backward or post-backward), so
        every rank issues its collectives in the same order. Three units' buffers instead of four, and the gather still
        overlaps the rest of the backward.
        This holds where completion is observed by the host (gloo). Where collectives are ordered on a device stream
        (NCCL: `gate_on_reductions` False), polling from the host would almost never see the reduction done (the host
        runs ahead of the device), so the gather would wait for the next hook and be exposed; there the prefetch is
        issued at the unit's pre-backward, queued on the communication stream behind the reduce-scatter, and neither the
        host nor the compute stream waits. Gathered units stay bounded by `prefetch`; one more gradient buffer (the
        reduction's input) can be alive."""
        unit = self.current.open_gate()
        if unit is None:
            return
        while self.current.has_pending:
            self._finish(*self.current.oldest())
        self._prefetch_after(unit, forward=False)

    def _on_grad_ready(self, unit: Unit, param: torch.Tensor) -> None:
        if unit.training_state is TrainingState.REDUCING:
            raise ValueError(
                f"[rank {unit.rank}] hf_zero: a gradient of unit '{unit.name}' arrived after the gradient of the "
                "unit's inputs, i.e. after its reduction ([Note: backward end]): one of its parameters is used outside "
                "the unit's forward: by a submodule of the unit called directly (`model.layers[1].mlp(x)`; call it "
                "inside the unit's forward, or call the unit's module), or by another module (put the two in one "
                "unit: ZeroConfig.wrap)."
            )
        self._pre_backward(unit)  # a no-op, unless a gradient reached the unit without passing its outputs
        unit.mark_used(param)
        if self.current.gated is not None and self.current.reductions_done():
            self._open_gate()

    def _on_end_signal(self, unit: Unit) -> None:
        """[Note: backward end] the gradient of the unit's inputs is complete."""
        self._pre_backward(unit)  # a no-op, unless no output of the unit got a gradient before
        if unit.signal() and not self.current.deferred and not self.current.was_called_directly(unit):
            self._post_backward(unit)

    def _post_backward(self, unit: Unit) -> None:
        if not unit.end_backward():
            return
        self._open_gate()  # before this unit's reduction is issued
        unit.collect_grads()
        if self.current.reduces and unit.has_trainable:
            self.current.issue(unit, unit.reduce_grads(async_op=True))
            # [Note: bounded reductions] finish older reductions as new ones are issued: each holds its
            # unit's unsharded gradients, so letting them pile up until the end of the backward pass
            # would keep every unit's full gradients alive at once (what stages 2-3 exist to avoid).
            while self.current.pending_count > MAX_PENDING_REDUCTIONS:
                self._finish(*self.current.oldest())
        unit.after_backward()
        self._trim_pool(unit, forward=False)
        if unit.prefetch_targets.late:
            self._prefetch_after(unit, forward=False)

    def _finalize(self) -> None:
        self._resolve_units_check()
        anywhere = self.current.ran_anywhere
        catch_up = self.current.reduces and self.current.unsynced
        for unit in reversed(self.units):
            if unit.training_state is TrainingState.IDLE and (unit in anywhere or (catch_up and unit.has_trainable)):
                # [Note: units run on some ranks]: it ran on another rank, reduce zeros; [Note: accumulation]: it ran
                # in a micro-batch under no_sync only, reduce what it accumulated
                unit.begin_backward()
            if unit.training_state is TrainingState.IN_BACKWARD:
                self._post_backward(unit)
        self.current.backward_done()
        self.wait_reductions()
        if self.current.unsynced:
            for listener in self.listeners:
                listener.deferred()  # [Note: resting gradients]: accumulated, not reduced, `.grad` a stand-in too
        for unit in self.units:
            unit.end_pass()
        for listener in self.listeners:
            listener.backward_ended(self.current.create_graph)  # [Note: double backward]
        self.current.renew()
        self.pool.clear()

    def _finish(self, unit: Unit, reduction: UnitReduction) -> None:
        unit.finish_reduction(reduction, self.settings.grad_divisor())
        self.current.reduced(unit)

    def wait_reductions(self) -> None:
        """Wait for every issued reduction and add its mean into the gradient shards."""
        while self.current.has_pending:
            self._finish(*self.current.oldest())
        finished = self.current.take_reduced()
        if not finished:
            return
        first = finished[0]
        if first.placement.offloaded and first.placement.host_pinned:
            torch.accelerator.synchronize(first.device)  # the host may now read the shards copied asynchronously
        for listener in self.listeners:
            listener.reduced()

    def use_directly(self, unit: Unit) -> None:
        """[Note: direct use]
        Some code reads a unit's parameters without calling its module: TRL's fused loss computes
        log-probabilities a slice of tokens at a time from `lm_head.weight` and the backbone's hidden states, so the
        head's forward hooks never run. Such a unit is gathered at the root's pre_forward (its
        parameters are then the real ones) and stays gathered through the forward; its backward
        begins at its first parameter gradient (pre_backward keeps the gradient autograd made) and
        ends in the final callback, after which it is freed as usual. The cost is that unit's
        parameters during the whole forward."""
        if unit not in self.direct:
            self.direct.append(unit)

    def release_held(self) -> None:
        """Free the unit a forward kept gathered for its backward, when no backward will use it."""
        for unit in self.units:
            if unit.held:
                unit.unhold()
                unit.release()

    def settle(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) for the issued reductions and forget them ([Note: clean exit] in teardown.py);
        issues nothing. True when they all finished."""
        pending = self.current.pending_reductions()
        self.current.renew()
        return all([r.pending.settle(timeout_s) for r in pending])

    def reset(self) -> None:
        """Forget an interrupted forward or backward pass: wait for issued work, free gathered units, detach grads."""
        for reduction in self.current.pending_reductions():
            reduction.pending.wait()
        self.current.renew()
        self._open_bucket.forget()
        for listener in self.listeners:
            listener.forget()  # what any listener kept for the pass goes ([Note: double backward], ...)
        for unit in self.units:
            unit.abandon()
        if not self._order_known:  # a first forward that did not finish: learn the order from the next one
            self._forward_order.clear()
        self.pool.clear()

    # ---- passes off the plan --------------------------------------------------------------------
    def _begin_backward_pass(self) -> None:
        """The first pre_backward of a backward pass: whether it builds a graph, and whether it goes through one an
        earlier backward built ([Note: double backward] in checks/double_backward.py)."""
        self.current.begin_backward_pass(torch.is_grad_enabled(), self.graph.built)
        for listener in self.listeners:
            listener.backward_begun(self.current.create_graph)

    def weights_changed(self) -> None:
        """A step, a load or a change between passes moved the weights: the listeners hear it ([Note: double
        backward] in checks/double_backward.py: a graph built before is stale)."""
        for listener in self.listeners:
            listener.weights_changed()
