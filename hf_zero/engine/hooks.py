"""Forward/backward hooks and the per-iteration backward state.

[Note: lifecycle]
For each unit (the root included), in one training iteration ([Note: unit lifecycle] in
lifecycle.py names the states):

1. pre_forward (module forward-pre hook): the stage's `before_compute` (stage 3: gather), the
   forward prefetch, and, with grad mode on, the unit's tensor inputs that require grad are passed
   through `_EndOfBackward`, whose backward is the unit's end-of-backward signal ([Note: backward end]).
2. post_forward (module forward hook): `after_forward` (stage 3: free; but the last unit of a
   forward run with grad mode on stays gathered, since it is the first unit of the backward),
   and, when grad mode is on, a hook on every output tensor that requires grad: the first of
   them to receive its gradient runs pre_backward. The root's post_forward empties the buffer
   pool ([Note: buffer reuse] in pool.py).
3. pre_backward (IDLE -> IN_BACKWARD): gather again (stage 3; not for a unit whose backward reads
   no parameters, an `nn.Embedding`, which ran its forward with `sparse=True`: [Note: sparse lookup
   gradients]) and point the trainable parameters' `.grad` at the unit's unsharded gradient
   buffer. The first pre_backward of a backward pass queues the final callback on the autograd
   engine.
4. post_backward (IN_BACKWARD -> REDUCING), on the unit's end signal: detach the `.grad` views,
   issue the asynchronous reduce-scatter (unless `no_sync()` defers it, stages 0-1 or by opt-in),
   and `after_backward` (stage 3: free; frozen units too, as soon as their backward is through).
5. final callback (end of the backward pass): post_backward for every unit that began but got no
   signal (units whose inputs need no gradient: the root, the embedding), in reverse unit order on
   every rank; wait for every issued reduction, add the means into the fp32 gradient shards,
   every unit back to IDLE, empty the buffer pool.

[Note: recomputation]
Activation checkpointing runs a unit's forward again inside its backward: HF's
`gradient_checkpointing_enable` inside the block's `forward` (the block's own hooks stay outside),
torch's `checkpoint_wrapper` / `checkpoint(layer, ...)` around the block's `__call__` (its hooks run
again). A forward inside a backward (`torch._C._current_graph_task_id() != -1`) gathers what it
needs and nothing more: no forward prefetch (the next unit's backward already ran), no reshard
after it (the unit's backward follows at once) and no new end signal counted (a non-reentrant
recomputation's graph is never backpropagated; a reentrant one's is, and its signal is the only
one the unit gets, as its first forward ran without grad). So a unit is gathered at most twice per
step. `reset()` discards the iteration state after an exception interrupted a backward pass; the
root's pre_forward calls it when it finds one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .flat import GradReduction
from .lifecycle import Phase, TrainingState, UnitRun
from .pool import BufferPool
from .stages import StagePlan
from .unit import Unit

MAX_PENDING_REDUCTIONS = 1  # issued reduce-scatters left in flight while the next unit's backward runs


def _in_backward() -> bool:
    """Whether this runs inside an autograd backward pass (a recomputation, [Note: recomputation])."""
    return torch._C._current_graph_task_id() != -1


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


class UnitHooks:
    """Registers the hooks of every unit and owns the state of the running backward pass."""

    def __init__(
        self,
        units: list[Unit],
        plan: StagePlan,
        pool: BufferPool,
        root_output_fn: Callable[[Any], Any] | None = None,
    ):
        self.units = units  # inner units in module order, the root last (each a group of parts, unit.py)
        self.root = units[-1]
        self.plan = plan
        self.pool = pool  # emptied at the end of every pass ([Note: buffer reuse])
        self.requires_grad_sync = True  # False inside no_sync(): keep unsharded grads, no reduction
        self.grad_divisor: Callable[[], float] = lambda: float(plan.data_parallel_size)
        self.on_reduced: Callable[[], None] = lambda: None  # told when fresh gradients reached the shards
        self._root_output_fn = root_output_fn  # rewrites the root's outputs (the fp16 loss scale)
        self.prefetch = 0  # units gathered ahead of the running one (stage 3)
        # [Note: reduction-gated prefetch]: True on host-completed backends (gloo); False where collectives are
        # ordered on a device stream (NCCL), set by the engine from the backend at initialize
        self.gate_on_reductions = True
        self._forward_order: list[Unit] = []  # inner units in the order the first forward ran them
        self._next_forward: dict[int, list[Unit]] = {}  # id(unit) -> the units to prefetch as it starts
        self._next_backward: dict[int, list[Unit]] = {}
        self._pool_sizes: dict[tuple[int, bool], frozenset[int]] = {}  # (id(unit), forward) -> sizes to keep pooled
        self._late_prefetch: set[int] = set()  # id(unit) whose backward prefetch waits for its post_backward
        self._gated: Unit | None = None  # [Note: reduction-gated prefetch] the running unit's deferred prefetch
        self._order_known = False
        self._held: Unit | None = None  # the last unit of the forward, kept gathered for the backward
        self.direct: list[Unit] = []  # [Note: direct use] units gathered with the root's forward
        self._handles: list[RemovableHandle] = []
        # Per iteration ([Note: unit lifecycle]):
        self.state = TrainingState.IDLE
        rank = plan.shard_group.global_rank
        self._runs: dict[int, UnitRun] = {id(u): UnitRun(u.spec.name or "<root>", rank) for u in units}
        self._pending: list[tuple[Unit, GradReduction]] = []  # issued, not yet waited
        self._finished_since_wait: list[Unit] = []  # reduced during this backward pass
        self._callback_queued = False
        self._register()

    # ---- registration -----------------------------------------------------------------------
    def _register(self) -> None:
        for unit in self.units:
            modules = unit.spec.all_modules  # one module, or a bucket of blocks
            first, last = modules[0], modules[-1]
            self._handles.append(first.register_forward_pre_hook(partial(self._pre_forward, unit), with_kwargs=True))
            self._handles.append(last.register_forward_hook(partial(self._post_forward, unit), with_kwargs=True))
            for member in modules[1:]:  # [Note: recomputation] a bucket's block may be replayed alone
                self._handles.append(member.register_forward_pre_hook(partial(self._member_pre_forward, unit)))
            for member in modules[:-1]:
                self._handles.append(member.register_forward_hook(partial(self._member_post_forward, unit)))
            for p in unit.params:
                if p.requires_grad:  # which parameters got gradients; the reduction-gated prefetch is polled here
                    # Through a weak reference: a hook a parameter holds is invisible to the garbage collector,
                    # so a strong one would keep the hooks, the engine and the model (its offload files) alive.
                    hook = partial(_weakly, weakref.WeakMethod(self._on_grad_ready), weakref.ref(unit))
                    self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- forward ----------------------------------------------------------------------------
    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: Any) -> Any:
        recompute = _in_backward()  # [Note: recomputation]
        if unit is self.root and not recompute:
            if self.in_backward:
                self.reset()  # a previous backward pass was interrupted by an exception
            self.release_held()  # no backward used it: gather it afresh in this forward
            if not self._order_known and self._forward_order:
                self._learn_order()
            self.state = TrainingState.FORWARD
            for direct in self.direct:  # [Note: direct use]
                self.plan.params.before_compute(direct)
        elif not self._order_known and not recompute and unit is not self.root and unit not in self._forward_order:
            self._forward_order.append(unit)  # [Note: prefetch] learned from the first forward
        if self._gated is not None and self._forward_gathers(unit, recompute):
            self._open_gate()  # a forward inside a backward (recomputation) gathers: the deferred prefetch goes first
        self.plan.params.before_compute(unit)
        if not recompute:
            self._prefetch_after(unit, forward=True)
        if unit.sparse_lookup:
            cast(Any, unit.spec.module).sparse = True  # [Note: sparse lookup gradients]; switched back after forward
        if not torch.is_grad_enabled():
            return None
        args, kwargs, wrapped = self._carry_end_signal(unit, args, kwargs)
        if wrapped and not recompute:
            self._runs[id(unit)].expected_signals += 1
        return (args, kwargs) if wrapped else None

    def _member_pre_forward(self, unit: Unit, module: nn.Module, args: Any) -> None:
        """A block of a bucketed unit other than its first, replayed alone inside backward: gather the unit
        (outside backward the first block's pre_forward has)."""
        if _in_backward():
            self.plan.params.before_compute(unit)

    def _member_post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        """A block of a bucketed unit other than its last, replayed inside backward: its outputs' gradients
        begin the unit's backward, as the last block's do after a forward."""
        if _in_backward() and torch.is_grad_enabled():
            self._hook_outputs(unit, output)

    def _carry_end_signal(self, unit: Unit, args: Any, kwargs: Any) -> tuple[Any, Any, bool]:
        """Pass the unit's top-level tensor inputs that require grad through `_EndOfBackward`
        ([Note: backward end]); returns the new args and kwargs and whether any was wrapped."""
        positions = [("a", i) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        positions += [("k", k) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not positions:
            return args, kwargs, False
        tensors = [args[i] if kind == "a" else kwargs[i] for kind, i in positions]
        carried = _EndOfBackward.apply(self, unit, *tensors)
        args, kwargs = list(args), dict(kwargs)
        for (kind, i), t in zip(positions, carried):
            if kind == "a":
                args[i] = t
            else:
                kwargs[i] = t
        return tuple(args), kwargs, True

    def _learn_order(self) -> None:
        """[Note: prefetch] fix the forward order and what each unit prefetches: the next `prefetch`
        units in forward order, and in reverse order during backward (skipping units whose
        backward needs no parameters, see `UnitSpec.backward_reads_params`)."""
        self._order_known = True
        order = self._forward_order
        backward = [u for u in reversed(order) if u.spec.backward_reads_params]
        for i, unit in enumerate(order):
            self._next_forward[id(unit)] = order[i + 1 : i + 1 + self.prefetch]
        for i, unit in enumerate(backward):
            self._next_backward[id(unit)] = backward[i + 1 : i + 1 + self.prefetch]
        # A backward prefetch that would hold more at once than the largest unit's parameters and
        # gradients (the floor of the peak) is issued after the unit's backward instead: with a
        # 32000-word head, not gathering the last block during the head's backward saves a block.
        # The reduction in flight and the prefetch never coexist ([Note: reduction-gated prefetch]).
        budget = max(u.param_nbytes + u.grad_nbytes for u in order)
        reverse = order[::-1]
        for unit in backward:
            i = reverse.index(unit)
            in_flight = reverse[i - 1].grad_nbytes if i > 0 else 0  # the reduction of the unit before
            ahead = sum(u.param_nbytes for u in self._next_backward[id(unit)])
            if unit.param_nbytes + unit.grad_nbytes + max(in_flight, ahead) > budget:
                self._late_prefetch.add(id(unit))
        for forward, sequence in ((True, order), (False, order[::-1])):
            for i, unit in enumerate(sequence):
                coming = sequence[i + 1 : i + 2 + self.prefetch]
                self._pool_sizes[(id(unit), forward)] = frozenset().union(*(u.buffer_nbytes for u in coming))

    def _trim_pool(self, unit: Unit, forward: bool) -> None:
        """[Note: buffer reuse] after `unit` freed its buffers, keep pooled only the sizes that the
        next units take."""
        sizes = self._pool_sizes.get((id(unit), forward))
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
            and self.plan.params.gathers
        )

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if unit.sparse_lookup:
            cast(Any, unit.spec.module).sparse = False
        if _in_backward():  # [Note: recomputation]: the unit's backward follows, keep it gathered
            if torch.is_grad_enabled():
                self._hook_outputs(unit, output)
            return None
        if self._keeps_for_backward(unit):
            self._held = unit
        else:
            self.plan.params.after_forward(unit)
        self._trim_pool(unit, forward=True)
        if unit is self.root:
            self.pool.clear()
            self.state = TrainingState.IDLE
        if not torch.is_grad_enabled():
            return None
        if unit is self.root and self._root_output_fn is not None:
            output = self._root_output_fn(output)
        self._hook_outputs(unit, output)
        return output

    def _hook_outputs(self, unit: Unit, output: Any) -> None:
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(partial(self._on_output_grad, unit))

    # ---- backward ---------------------------------------------------------------------------
    @property
    def in_backward(self) -> bool:
        return self._callback_queued

    def _on_output_grad(self, unit: Unit, grad: torch.Tensor) -> None:
        self._pre_backward(unit)

    def _pre_backward(self, unit: Unit) -> None:
        if not self._runs[id(unit)].begin_backward():
            return
        self.state = TrainingState.BACKWARD
        self._open_gate()  # a deferred prefetch goes out before anything this unit issues
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            self._callback_queued = True
        if self._held is unit:
            self._held = None  # the backward has it now; after_backward frees it
        if unit.spec.backward_reads_params:
            self.plan.params.before_compute(unit)
        if id(unit) not in self._late_prefetch:
            if self.gate_on_reductions and self._pending and self._prefetches(unit, forward=False):
                self._gated = unit  # [Note: reduction-gated prefetch]
            else:
                self._prefetch_after(unit, forward=False)
        unit.attach_grads()

    def _prefetch_after(self, unit: Unit, forward: bool) -> None:
        """[Note: prefetch] issue the gathers of the units that follow `unit` (see `_learn_order`),
        so they overlap its compute. At most the root, the running unit and `prefetch` more are
        whole at a time."""
        for nxt in self._prefetches(unit, forward):
            nxt.prefetch()

    def _forward_gathers(self, unit: Unit, recompute: bool) -> bool:
        """Whether `unit`'s forward issues a gather (its own, or, outside backward, a prefetch); the
        same on every rank."""
        own = self.plan.params.gathers and unit.needs_gather
        return own or (not recompute and any(u.needs_gather for u in self._prefetches(unit, forward=True)))

    def _prefetches(self, unit: Unit, forward: bool) -> list[Unit]:
        """The units `_prefetch_after(unit, forward)` gathers."""
        if not self.prefetch or not self.plan.params.gathers or not self._order_known:
            return []
        return (self._next_forward if forward else self._next_backward).get(id(unit), [])

    def _open_gate(self) -> None:
        """[Note: reduction-gated prefetch]
        During a unit's backward its parameters and gradients are whole, and so are either the
        previous unit's gradients (their reduction in flight) or the next unit's parameters (the
        prefetch), not both: the prefetch is issued once the reduction is done (polled at each of
        the running unit's gradients, a query that never blocks), or at the latest before the next
        collective any hook issues (a unit's pre-forward, pre-backward or post-backward), so every
        rank issues its collectives in the same order. Three units' buffers instead of four, and
        the gather still overlaps the rest of the backward.
        This holds where completion is observed by the host (gloo). Where collectives are ordered on
        a device stream (NCCL: `gate_on_reductions` False), polling from the host would almost never
        see the reduction done (the host runs ahead of the device), so the gather would wait for the
        next hook and be exposed; there the prefetch is issued at the unit's pre-backward, queued on
        the communication stream behind the reduce-scatter, and neither the host nor the compute
        stream waits. Gathered units stay bounded by `prefetch`; one more gradient buffer (the
        reduction's input) can be alive."""
        unit, self._gated = self._gated, None
        if unit is None:
            return
        while self._pending:
            self._finish(*self._pending.pop(0))
        self._prefetch_after(unit, forward=False)

    def _on_grad_ready(self, unit: Unit, param: torch.Tensor) -> None:
        run = self._runs[id(unit)]
        if run.phase is Phase.REDUCING:
            raise RuntimeError(
                f"[rank {run.rank}] hf_zero: a gradient of unit '{run.name}' arrived after the gradient of the unit's "
                "inputs, i.e. after its reduction ([Note: backward end]): one of its parameters is used outside the "
                "unit's forward. Wrap the module that uses it in the same unit (ZeroConfig.wrap)."
            )
        self._pre_backward(unit)  # a no-op, unless a gradient reached the unit without passing its outputs
        unit.mark_used(param)
        if self._gated is not None and all(reduction.pending.done() for _, reduction in self._pending):
            self._open_gate()

    def _on_end_signal(self, unit: Unit) -> None:
        """[Note: backward end] the gradient of the unit's inputs is complete."""
        self._pre_backward(unit)  # a no-op, unless no output of the unit got a gradient before
        if self._runs[id(unit)].signal():
            self._post_backward(unit)

    def _post_backward(self, unit: Unit) -> None:
        if not self._runs[id(unit)].end_backward():
            return
        self._open_gate()  # before this unit's reduction is issued
        unit.collect_grads()
        if self.requires_grad_sync and unit.has_trainable:
            free = not self.plan.grads.keeps_unsharded
            self._pending.append((unit, unit.reduce_grads(async_op=True, buffer_is_free=free)))
            self.plan.grads.after_issue(unit)  # stages 2-3: the reduction holds it until its wait
            # [Note: bounded reductions] finish older reductions as new ones are issued: each holds its
            # unit's unsharded gradients, so letting them pile up until the end of the backward pass
            # would keep every unit's full gradients alive at once (what stages 2-3 exist to avoid).
            while len(self._pending) > MAX_PENDING_REDUCTIONS:
                self._finish(*self._pending.pop(0))
        self.plan.params.after_backward(unit)
        self._trim_pool(unit, forward=False)
        if id(unit) in self._late_prefetch:
            self._prefetch_after(unit, forward=False)

    def _finalize(self) -> None:
        for unit in reversed(self.units):
            if self._runs[id(unit)].phase is Phase.IN_BACKWARD:
                self._post_backward(unit)
        self.wait_reductions()
        self._clear()
        self.pool.clear()

    def _finish(self, unit: Unit, reduction: GradReduction) -> None:
        unit.finish_reduction(reduction, self.grad_divisor())
        self.plan.grads.after_reduction(unit, reduction)
        self._finished_since_wait.append(unit)

    def wait_reductions(self) -> None:
        """Wait for every issued reduction and add its mean into the gradient shards."""
        while self._pending:
            self._finish(*self._pending.pop(0))
        if not self._finished_since_wait:
            return
        first = self._finished_since_wait[0]
        if first.host is not None and first.device.type != "cpu":
            torch.accelerator.synchronize(first.device)  # the host may now read the shards copied asynchronously
        self._finished_since_wait.clear()
        self.on_reduced()

    def _clear(self) -> None:
        for run in self._runs.values():
            run.reset()
        self._callback_queued = False
        self.state = TrainingState.IDLE

    def use_directly(self, unit: Unit) -> None:
        """[Note: direct use]
        Some code reads a unit's parameters without calling its module: TRL's fused loss computes
        log-probabilities chunk by chunk from `lm_head.weight` and the backbone's hidden states, so the
        head's forward hooks never run. Such a unit is gathered at the root's pre_forward (its
        parameters are then the real ones) and stays gathered through the forward; its backward
        begins at its first parameter gradient (pre_backward keeps the gradient autograd made) and
        ends in the final callback, after which it is freed as usual. The cost is that unit's
        parameters during the whole forward."""
        if unit not in self.direct:
            self.direct.append(unit)

    def release_held(self) -> None:
        """Free the unit a forward kept gathered for its backward, when no backward will use it."""
        held = self._held
        if held is not None:
            self._held = None
            held.reshard()

    def reset(self) -> None:
        """Forget an interrupted forward or backward pass: wait for issued work, free gathered units, detach grads."""
        for _, reduction in self._pending:
            reduction.pending.wait()
        self._pending.clear()
        self._finished_since_wait.clear()
        self._gated = None
        for unit in self.units:
            unit.detach_grads()
            self.plan.params.release([unit])
        self._held = None
        if not self._order_known:  # a first forward that did not finish: learn the order from the next one
            self._forward_order.clear()
        self._clear()
        self.pool.clear()


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) forward output: tensors, tuples, lists, dicts and ModelOutputs."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _weakly(method: weakref.WeakMethod[Callable[..., Any]], unit: weakref.ref[Unit], *args: Any) -> None:
    """Call `method(unit, *args)` (both weak references) if they still live."""
    bound, target = method(), unit()
    if bound is not None and target is not None:
        bound(target, *args)
