"""`Unit`: the owner of one unit: its flat parts, its states and the only verbs that move them.

[Note: frozen parameters]
A unit whose parameters are partly frozen (LoRA: every projection's base weight frozen, its
adapter trainable) keeps them in two flat parts, each a `FlatPart` sharded evenly over the ranks:

- the trainable part: as any unit (master shard in the master dtype, gradient shard, reductions,
  optimizer state);
- the frozen part: its shard in the compute dtype is its only copy (no fp32 master, even under
  mixed precision), with no gradient buffer, no gradient shard and no reduction. At stage 3 it
  costs `Ψ_frozen × bytes(compute dtype) / N` at rest; at stages 0-2 it is whole on every rank.

The hooks see one `Unit` per unit: its parts are gathered, freed and prefetched together
(one all-gather each) and only the trainable parts' gradients are attached and reduced. A unit
whose parameters are all trainable, or all frozen, in one dtype has one part.

[Note: parameters kept in their own dtype]
transformers loads a model in bf16 but keeps some parameters in float32 (`_keep_in_fp32_modules` /
`_keep_in_fp32_modules_strict`: the router gates of DeepSeek-V3, GLM-4-MoE and their kin), and
computes with them in float32. The engine keeps each such parameter in a part of its own dtype:
that part gathers, computes, reduces its gradients and keeps its master in that dtype (float32
under mixed precision too), while the model's main dtype (`main_dtype`: the one most elements are
in) follows the config. A 4-bit base's packed codes are kept so too, whatever dtype stores them
([Note: quantized base] in quantized.py): never cast, never requantized by int8 gathers; and, under mixed
precision, BatchNorm's weights and biases (`kept_in_float32` in placement.py). So a
unit may hold up to one part per (trainable or frozen, dtype); the trainable ones are reduced one
after the other, each in its own dtype, as DDP reduces each parameter in its own. What the model
saves keeps each parameter's dtype. Offload files (`offload_dir`) hold one master dtype: a kept
trainable part whose master is in another is refused there (`place_key` in step/disk.py places the others).

A `Unit` holds its `ShardState` and `TrainingState`, its end-of-backward counts, its prefetch targets,
whether it is pinned (`gathered_parameters`) or held for its backward, and the stage's residencies; its
verbs check the states they may be called in ([Note: unit lifecycle] in lifecycle.py has the table).
The parts (`FlatPart`, flat.py) keep tensors and do the raw moves the verbs order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .collectives import Pending
from .flat import FlatPart
from .grads import UnitReduction
from .lifecycle import ShardState, TrainingState, illegal_call
from .placement import Placement
from .residency import GradResidency, ParamResidency
from .wrap import UnitSpec

_SHARD = ShardState
_TRAIN = TrainingState


@dataclass(frozen=True)
class Prefetch:
    """What a unit gathers ahead as it runs ([Note: prefetch] in hooks.py), fixed once the forward order is
    known: the units to prefetch as its forward and its backward begin, whether the backward prefetch waits
    for its post_backward (`late`), and the buffer sizes the pool keeps after its forward and its backward."""

    forward: tuple[Unit, ...] = ()
    backward: tuple[Unit, ...] = ()
    late: bool = False
    pooled_after_forward: frozenset[int] | None = None
    pooled_after_backward: frozenset[int] | None = None


@dataclass
class _Signals:
    """End-of-backward signals of the current pass ([Note: backward end] in hooks.py)."""

    expected: int = 0  # forwards run outside backward whose grad-requiring inputs carry the signal
    received: int = 0


class Unit:
    """One unit's parts and states, and the guarded verbs that move them ([Note: unit lifecycle])."""

    def __init__(self, parts: list[FlatPart], params: ParamResidency, grads: GradResidency) -> None:
        if not parts:
            raise ValueError("hf_zero: a unit needs at least one part")
        self.parts = tuple(parts)
        self.trainable_parts = tuple(p for p in parts if p.has_trainable)
        self.params = tuple(p for part in parts for p in part.params)
        self.name = parts[0].spec.name or "<root>"
        self.rank = parts[0].shard_group.global_rank
        self.residency = params
        self.grad_residency = grads
        self.persistent = parts[0].persistent  # stages 0-2: whole at every moment
        self._shard_state = _SHARD.UNSHARDED if self.persistent else _SHARD.SHARDED
        self._training_state = _TRAIN.IDLE
        self.prefetch_targets = Prefetch()
        self.pins = 0  # open `gathered_parameters` contexts holding the unit whole
        self._held = False  # the last unit of a forward, kept gathered for its backward
        self._gathers: list[Pending] = []  # issued, not yet waited, gathers of the parts
        self._signals = _Signals()
        self._planned = False

    # ---- checks -------------------------------------------------------------------------------------
    def _illegal(self, verb: str, why: str) -> RuntimeError:
        state = f"{self.shard_state.value}/{self.training_state.value}"
        return illegal_call(self.rank, verb, f"unit '{self.name}'", state, why)

    def _require(self, verb: str, *allowed: TrainingState) -> None:
        if self.training_state not in allowed:
            raise self._illegal(verb, f"legal only in {'/'.join(s.value for s in allowed)}")

    # ---- what the hooks read (the states are read-only outside this class) --------------------------
    @property
    def shard_state(self) -> ShardState:
        return self._shard_state

    @property
    def training_state(self) -> TrainingState:
        return self._training_state

    @property
    def held(self) -> bool:
        """Whether the forward kept the unit gathered for its backward (`hold`)."""
        return self._held

    @property
    def spec(self) -> UnitSpec:
        return self.parts[0].spec  # the parts share their modules and name

    @property
    def is_unsharded(self) -> bool:
        """Whether the parameters are whole and registered in the modules: the state says; the storage's byte
        count is never consulted."""
        return self.shard_state is _SHARD.UNSHARDED

    @property
    def needs_gather(self) -> bool:
        """Whether making the parameters whole would issue a gather (none is done or in flight)."""
        return self.shard_state is _SHARD.SHARDED

    @property
    def sparse_lookup(self) -> bool:
        return len(self.parts) == 1 and self.parts[0].sparse_lookup

    @property
    def has_trainable(self) -> bool:
        return bool(self.trainable_parts)

    def start_training(self, part: FlatPart) -> None:
        """[Note: requires_grad after initialize] `part`, frozen at `initialize`, whose parameters were unfrozen
        since: it takes gradients from now on, reduced after the unit's other trainable parts. Between passes only."""
        self._require("start_training", _TRAIN.IDLE)
        if part not in self.parts or part in self.trainable_parts:
            raise self._illegal("start_training", "only a part of this unit frozen at initialize starts training")
        self.trainable_parts = tuple(p for p in self.parts if p in self.trainable_parts or p is part)

    @property
    def placement(self) -> Placement:
        return (self.trainable_parts or self.parts)[0].placement

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def param_nbytes(self) -> int:
        return sum(p.param_nbytes for p in self.parts)

    @property
    def grad_nbytes(self) -> int:
        return sum(p.grad_nbytes for p in self.parts)

    @property
    def buffer_nbytes(self) -> frozenset[int]:
        return frozenset().union(*(p.buffer_nbytes for p in self.parts))

    def plan_prefetch(self, targets: Prefetch) -> None:
        """Fix the unit's prefetch targets, once (the forward order is learned once)."""
        if self._planned:
            raise self._illegal("plan_prefetch", "the prefetch targets are fixed once")
        self.prefetch_targets, self._planned = targets, True

    # ---- parameters ---------------------------------------------------------------------------------
    def prefetch(self) -> None:
        """SHARDED -> GATHERING: issue the parts' gathers (they overlap the running unit's compute). Nothing to do
        for a unit whose forward or backward runs now (a pass off the plan: a unit reused, two forwards before a
        backward): it is gathered, or gathers when it needs to."""
        if self.shard_state is _SHARD.SHARDED and self.training_state is _TRAIN.IDLE:
            self._gathers = [p.gather() for p in self.parts]
            self._shard_state = _SHARD.GATHERING

    def unshard(self) -> None:
        """SHARDED / GATHERING -> UNSHARDED: make the parameters whole (wait for a prefetch, or gather now) and
        register them in the modules."""
        self._require("unshard", _TRAIN.IDLE, _TRAIN.FORWARD, _TRAIN.IN_BACKWARD)
        if self.shard_state is _SHARD.UNSHARDED:
            return
        if self.shard_state is _SHARD.SHARDED:
            self._gathers = [p.gather() for p in self.parts]
        self._wait_gathers()
        for p in self.parts:
            p.bind(real=True)
        self._shard_state = _SHARD.UNSHARDED

    def reshard(self) -> None:
        """GATHERING / UNSHARDED -> SHARDED: free the parameters (the modules then hold stand-ins); nothing while
        a `gathered_parameters` context pins the unit. Stages 0-2 refuse (the only whole copy), and so does a
        unit whose forward or backward is running."""
        if self.persistent:
            raise self._illegal("reshard", "stages 0-2 keep the parameters whole; nothing may free them")
        self._require("reshard", _TRAIN.IDLE, _TRAIN.REDUCING)
        if self.shard_state is _SHARD.SHARDED or self.pins:
            return
        self._wait_gathers()  # never free memory a collective is still writing
        for p in self.parts:
            p.free()
        self._shard_state = _SHARD.SHARDED

    def give_back(self) -> None:
        """The model leaves the engine (`unshard_model`, after the caller gave every parameter its whole value as a
        tensor of its own): register the real parameters in the modules for good. UNSHARDED from then on; the
        unit is not used again."""
        self._require("give_back", _TRAIN.IDLE)
        self._wait_gathers()
        for p in self.parts:
            p.bind(real=True)
        self._shard_state = _SHARD.UNSHARDED

    def _wait_gathers(self) -> None:
        gathers, self._gathers = self._gathers, []
        for pending in gathers:
            pending.wait()

    def settle(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) for gathers in flight, leaving the states as they are: legal in every state
        ([Note: clean exit] in teardown.py). True when they all finished."""
        return all([pending.settle(timeout_s) for pending in self._gathers])

    def before_compute(self) -> None:
        """Make the parameters whole if the stage gathers them (stage 3)."""
        self.residency.before_compute(self)

    def after_forward(self) -> None:
        """Free the parameters after the forward if the stage gathers them per use."""
        self.residency.after_forward(self)

    def after_backward(self) -> None:
        """Free the parameters after the backward if the stage gathers them per use."""
        self.residency.after_backward(self)

    def release(self) -> None:
        """Free the parameters if the stage gathers them and they are gathered."""
        self.residency.release(self)

    def param_versions(self) -> tuple[int, ...]:
        """[Note: changed in forward] the parameters' version counters (every in-place change bumps its tensor's)."""
        return tuple(p._version for p in self.params)

    def changed_since(self, versions: tuple[int, ...]) -> list[str]:
        """The names of the parameters changed in place since `versions` were taken ([Note: changed in forward] in
        checks/changed_in_forward.py)."""
        names = [n for part in self.parts for n in part.spec.param_names]
        return [n for n, p, v in zip(names, self.params, versions) if p._version != v]

    def pin(self) -> None:
        """Gather and keep whole until `unpin` (`gathered_parameters`): `reshard` does nothing meanwhile."""
        self.unshard()
        self.pins += 1

    def unpin(self) -> None:
        if self.pins <= 0:
            raise self._illegal("unpin", "the unit is not pinned")
        self.pins -= 1

    def hold(self) -> None:
        """Keep the unit gathered from the end of its forward to its backward (it is the backward's first)."""
        if not self.is_unsharded:
            raise self._illegal("hold", "only a gathered unit can be kept for its backward")
        self._held = True

    def unhold(self) -> None:
        """No backward will use the unit `hold` kept: the caller frees it."""
        self._held = False

    # ---- the pass -----------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """IDLE -> FORWARD, at the unit's pre-forward (a recomputation inside backward moves nothing)."""
        self._require("begin_forward", _TRAIN.IDLE)
        self._training_state = _TRAIN.FORWARD

    def expect_signal(self) -> None:
        """This forward's inputs carry the end signal ([Note: backward end]): the backward waits for it too."""
        self._require("expect_signal", _TRAIN.FORWARD)
        self._signals.expected += 1

    def end_forward(self) -> None:
        """FORWARD -> IDLE, at the unit's post-forward."""
        self._require("end_forward", _TRAIN.FORWARD)
        self._training_state = _TRAIN.IDLE

    def begin_backward(self) -> bool:
        """IDLE -> IN_BACKWARD; False (nothing to do) when the unit's backward already began."""
        if self.training_state is _TRAIN.IN_BACKWARD:
            return False
        self._require("begin_backward", _TRAIN.IDLE)
        self._training_state = _TRAIN.IN_BACKWARD
        self._held = False  # the backward has it now; after_backward frees it
        return True

    def signal(self) -> bool:
        """Count one end signal; True when the unit's backward is through: every forward that carried the
        signal has delivered it (at least one, for a forward that only ran inside backward)."""
        self._require("signal", _TRAIN.IN_BACKWARD, _TRAIN.REDUCING)
        self._signals.received += 1
        return self._signals.received >= max(self._signals.expected, 1)

    def end_backward(self) -> bool:
        """IN_BACKWARD -> REDUCING; False when it already ended."""
        if self.training_state is _TRAIN.REDUCING:
            return False
        self._require("end_backward", _TRAIN.IN_BACKWARD)
        self._training_state = _TRAIN.REDUCING
        return True

    def end_pass(self) -> None:
        """The end of a backward pass: back to IDLE, the pass's signal counts forgotten."""
        self._require("end_pass", _TRAIN.IDLE, _TRAIN.REDUCING)
        self._training_state = _TRAIN.IDLE
        self._signals = _Signals()

    def abandon(self) -> None:
        """Forget a pass an exception stopped, from any state: back to IDLE, `.grad` views detached, the
        parameters freed if the stage gathers them."""
        self._training_state = _TRAIN.IDLE
        self._signals = _Signals()
        self._held = False
        for p in self.parts:
            p.grads.detach()
        self.release()

    # ---- gradients: the trainable parts -------------------------------------------------------------
    @property
    def unsharded_grads(self) -> list[torch.Tensor]:
        """The unsharded gradient buffers the trainable parts hold now."""
        return [g for g in (p.grads.unsharded for p in self.trainable_parts) if g is not None]

    def clear_grad_buffer(self) -> None:
        """Stages 0-1, after a reduction: zero the kept buffers for the next accumulation."""
        self._require("clear_grad_buffer", _TRAIN.REDUCING)
        for part in self.trainable_parts:
            part.grads.clear_buffer()

    def let_go_of_grads(self) -> None:
        """Stages 2-3, once a reduction is issued: it holds the unsharded gradients until its wait."""
        self._require("let_go_of_grads", _TRAIN.REDUCING)
        for part in self.trainable_parts:
            part.grads.let_go()

    def attach_grads(self) -> None:
        self._require("attach_grads", _TRAIN.IN_BACKWARD)
        for part in self.trainable_parts:
            part.grads.attach()

    def mark_used(self, param: torch.Tensor) -> None:
        self._require("mark_used", _TRAIN.IN_BACKWARD)
        for part in self.trainable_parts:
            if part.grads.holds(param):
                part.grads.mark_used(param)
                return

    def collect_grads(self) -> None:
        """Take the gradients out of the parameters' `.grad` (after the unit's backward)."""
        self._require("collect_grads", _TRAIN.REDUCING)
        for part in self.trainable_parts:
            part.grads.collect()

    def reduce_grads(self, async_op: bool = True) -> UnitReduction:
        """Issue the reductions of the unit's gradients, one per trainable part; the gradient residency then lets
        go of the buffers."""
        self._require("reduce_grads", _TRAIN.REDUCING)
        free = not self.grad_residency.keeps_unsharded
        reduction = tuple(p.grads.reduce(async_op=async_op, buffer_is_free=free) for p in self.trainable_parts)
        self.grad_residency.after_issue(self)  # stages 2-3: the reduction holds it until its wait
        return reduction

    def finish_reduction(self, reduction: UnitReduction, divisor: float) -> None:
        """Wait for the reductions, add their means into the gradient shards, and let the residency settle."""
        self._require("finish_reduction", _TRAIN.REDUCING)
        for part, one in zip(self.trainable_parts, reduction, strict=True):
            part.grads.finish(one, divisor)
        self.grad_residency.after_reduction(self, reduction)

    def release_reduced(self, reduction: UnitReduction) -> None:
        self._require("release_reduced", _TRAIN.REDUCING)
        for part, one in zip(self.trainable_parts, reduction, strict=True):
            part.grads.release_reduced(one)


def split_parts(spec: UnitSpec, main: torch.dtype, keep: frozenset[int] = frozenset()) -> list[UnitSpec]:
    """`spec` as its parts: the trainable parameters, then the frozen ones ([Note: frozen parameters]), each in the
    model's `main` dtype first, then each other dtype ([Note: parameters kept in their own dtype]); a unit whose
    parameters are all trainable (or all frozen) in one dtype is one part. `keep`: ids of parameters kept in their
    dtype even where it is `main` (BatchNorm's under mixed precision: `kept_in_float32` in placement.py)."""
    groups: dict[tuple[bool, torch.dtype | None], list[int]] = {}
    for i, p in enumerate(spec.params):
        kept = p.dtype != main or hasattr(p, "quant_state") or id(p) in keep  # 4-bit codes: never cast
        groups.setdefault((not p.requires_grad, p.dtype if kept else None), []).append(i)
    order = sorted(groups, key=lambda key: (key[0], key[1] is not None, str(key[1])))
    if order in ([], [(False, None)]):  # (a unit of no parameters of its own: one empty part)
        return [spec]
    return [_subset(spec, groups[key], frozen=key[0], dtype=key[1]) for key in order]


def _subset(spec: UnitSpec, indices: list[int], frozen: bool, dtype: torch.dtype | None) -> UnitSpec:
    return replace(
        spec,
        params=tuple(spec.params[i] for i in indices),
        param_names=tuple(spec.param_names[i] for i in indices),
        holders=tuple(spec.holders[i] for i in indices) if spec.holders else (),
        frozen=frozen,
        dtype=dtype,
    )
