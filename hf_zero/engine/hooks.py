"""Forward/backward hooks and the per-iteration backward state.

[Note: lifecycle]
For each unit (the root included), in one training iteration:

1. pre_forward (module forward-pre hook): the stage's `before_compute` (stage 3: gather).
2. post_forward (module forward hook): `after_forward` (stage 3: free), and, when grad mode is
   on, a hook on every output tensor that requires grad: the first of them to receive its
   gradient runs pre_backward.
3. pre_backward: gather again (stage 3) and point the trainable parameters' `.grad` at the
   unit's unsharded gradient buffer. The first pre_backward of a backward pass queues the
   final callback on the autograd engine.
4. post_backward: when every trainable parameter of the unit has accumulated its gradient
   (counted by post-accumulate-grad hooks), detach the `.grad` views, issue the asynchronous
   reduce-scatter (unless inside `no_sync()`), and `after_backward` (stage 3: free).
5. final callback (end of the backward pass): post_backward for every unit that started but
   did not finish (parameters unused this time, frozen units), wait for every issued
   reduction, add the means into the fp32 gradient shards, reset the iteration state.

Activation checkpointing needs no special case: recomputation runs inside the unit's backward,
after step 3 has gathered the parameters. `reset()` discards the iteration state after an
exception interrupted a backward pass; the root's pre_forward calls it when it finds one.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .flat import FlatUnit, GradReduction
from .stages import StagePlan


MAX_PENDING_REDUCTIONS = 1  # issued reduce-scatters left in flight while the next unit's backward runs


class UnitHooks:
    """Registers the hooks of every unit and owns the state of the running backward pass."""

    def __init__(self, units: list[FlatUnit], plan: StagePlan, root_output_fn: Callable[[Any], Any] | None = None):
        self.units = units  # inner units in module order, the root last
        self.root = units[-1]
        self.plan = plan
        self.requires_grad_sync = True  # False inside no_sync(): keep unsharded grads, no reduction
        self.grad_divisor: Callable[[], float] = lambda: float(plan.data_parallel_size)
        self.on_reduced: Callable[[], None] = lambda: None  # told when fresh gradients reached the shards
        self._root_output_fn = root_output_fn  # rewrites the root's outputs (the fp16 loss scale)
        self.prefetch = 0  # units gathered ahead of the running one (stage 3)
        self._forward_order: list[FlatUnit] = []  # inner units in the order the first forward ran them
        self._backward_order: list[FlatUnit] = []  # its reverse
        self._position: dict[int, int] = {}  # id(unit) -> index in _forward_order
        self._order_known = False
        self._handles: list[RemovableHandle] = []
        # Per backward pass:
        self._started: dict[int, int] = {}  # id(unit) -> trainable params expected
        self._ready: dict[int, int] = {}  # id(unit) -> trainable params whose grad accumulated
        self._done: set[int] = set()  # id(unit) whose post_backward ran
        self._pending: list[tuple[FlatUnit, GradReduction]] = []  # issued, not yet waited
        self._finished_since_wait: list[FlatUnit] = []  # reduced during this backward pass
        self._callback_queued = False
        self._register()

    # ---- registration -----------------------------------------------------------------------
    def _register(self) -> None:
        for unit in self.units:
            module = unit.spec.module
            self._handles.append(module.register_forward_pre_hook(partial(self._pre_forward, unit), with_kwargs=True))
            self._handles.append(module.register_forward_hook(partial(self._post_forward, unit), with_kwargs=True))
            for p in unit.params:
                if not p.requires_grad:
                    continue  # frozen now; if unfrozen later, the final callback still reduces its unit
                self._handles.append(p.register_post_accumulate_grad_hook(partial(self._on_grad_ready, unit)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- forward ----------------------------------------------------------------------------
    def _pre_forward(self, unit: FlatUnit, module: nn.Module, args: Any, kwargs: Any) -> None:
        if unit is self.root:
            if self.in_backward:
                self.reset()  # a previous backward pass was interrupted by an exception
            if not self._order_known and self._forward_order:
                self._order_known = True
                self._backward_order = self._forward_order[::-1]
                self._position = {id(u): i for i, u in enumerate(self._forward_order)}
        elif not self._order_known and unit not in self._forward_order:
            self._forward_order.append(unit)  # [Note: prefetch] learned from the first forward
        self.plan.params.before_compute(unit)
        self._prefetch_after(unit, forward=True)

    def _post_forward(self, unit: FlatUnit, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        self.plan.params.after_forward(unit)
        if not torch.is_grad_enabled():
            return None
        if unit is self.root and self._root_output_fn is not None:
            output = self._root_output_fn(output)
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(partial(self._on_output_grad, unit))
        return output

    # ---- backward ---------------------------------------------------------------------------
    @property
    def in_backward(self) -> bool:
        return self._callback_queued

    def _on_output_grad(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        self._pre_backward(unit)

    def _pre_backward(self, unit: FlatUnit) -> None:
        if id(unit) in self._started:
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            self._callback_queued = True
        self.plan.params.before_compute(unit)
        self._prefetch_after(unit, forward=False)
        unit.attach_grads()
        expected = len(unit.trainable)
        self._started[id(unit)] = expected
        self._ready[id(unit)] = 0

    def _prefetch_after(self, unit: FlatUnit, forward: bool) -> None:
        """[Note: prefetch] issue the gathers of the next `prefetch` units (in forward order in the
        forward pass, its reverse in the backward pass), so they overlap this unit's compute. At
        most the root, the running unit and `prefetch` more are whole at a time."""
        if not self.prefetch or self.plan.params.persistent or not self._order_known:
            return
        position = self._position.get(id(unit))
        if position is None:
            return
        if forward:
            following = self._forward_order[position + 1 : position + 1 + self.prefetch]
        else:
            start = len(self._forward_order) - position
            following = self._backward_order[start : start + self.prefetch]
        for nxt in following:
            nxt.prefetch()

    def _on_grad_ready(self, unit: FlatUnit, param: torch.Tensor) -> None:
        if id(unit) not in self._started:
            self._pre_backward(unit)  # a gradient that reached the unit without passing its outputs
        self._ready[id(unit)] += 1
        if self._ready[id(unit)] == self._started[id(unit)]:
            self._post_backward(unit)

    def _post_backward(self, unit: FlatUnit) -> None:
        if id(unit) in self._done:
            return
        self._done.add(id(unit))
        unit.detach_grads()
        if self.requires_grad_sync and self._started[id(unit)] > 0:
            self._pending.append((unit, unit.reduce_grads(async_op=True)))
            if not self.plan.keep_unsharded_grads:
                unit.unsharded_grad = None  # the reduction holds it until its wait
            # [Note: bounded reductions] finish older reductions as new ones are issued: each holds its
            # unit's unsharded gradients, so letting them pile up until the end of the backward pass
            # would keep every unit's full gradients alive at once (what stages 2-3 exist to avoid).
            while len(self._pending) > MAX_PENDING_REDUCTIONS:
                self._finish(*self._pending.pop(0))
        self.plan.params.after_backward(unit)

    def _finalize(self) -> None:
        for unit in reversed(self.units):
            if id(unit) in self._started:
                self._post_backward(unit)
        self.wait_reductions()
        self._clear()

    def _finish(self, unit: FlatUnit, reduction: GradReduction) -> None:
        unit.finish_reduction(reduction, self.grad_divisor())
        if self.plan.keep_unsharded_grads and unit.unsharded_grad is not None:
            unit.unsharded_grad.zero_()
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
        self._started.clear()
        self._ready.clear()
        self._done.clear()
        self._callback_queued = False

    def reset(self) -> None:
        """Forget an interrupted backward pass: wait for issued work, free gathered units, detach grads."""
        for _, reduction in self._pending:
            reduction.pending.wait()
        self._pending.clear()
        self._finished_since_wait.clear()
        for unit in self.units:
            unit.detach_grads()
            if not self.plan.params.persistent:
                unit.reshard()
        self._clear()


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
