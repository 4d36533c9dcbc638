"""`OptimizerSteps`: the optimizers attached to a sharded model and how a round of their steps runs.

[Note: several optimizers]
A model may be stepped by several optimizers over disjoint parameters (Muon on the matrices, AdamW on
the rest), each attached with its own path (flat shards, [Note: optimizer shards]; whole parameters,
[Note: whole-parameter step]). Whether a round of steps happens (gradients reduced, no fp16 overflow)
and which parameters got a gradient anywhere are decided once, by the first `step()` after new
gradients, and reused by the others until `zero_grad` or the next reduction: the loss scale moves once
per round. Each step publishes the units its optimizer holds parameters of. The gradients are dropped
once every optimizer has called `zero_grad()` (so `opt1.step(); opt1.zero_grad(); opt2.step()` steps
opt2 on its gradients); a backward after only some of them did is refused at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..collectives import CommGroup, comm_device, max_scalar_
from ..flat import FlatPart
from ..hooks import UnitHooks
from ..pool import release_free_host_memory
from ..resting import ShardedGrad
from .master import FlatStep
from .pieces import Piece
from .scaler import LossScaler
from .whole import WholeStep


class Sharded(Protocol):
    """What a round of optimizer steps reads of the engine it serves (`ZeroEngine` is one)."""

    parts: list[FlatPart]
    pieces: list[Piece]
    hooks: UnitHooks
    scaler: LossScaler | None
    flat_step: FlatStep
    world: CommGroup

    @property
    def has_grads(self) -> bool: ...

    def zero_grad(
        self, *, abandon_pass: bool = False, set_to_none: bool = True, keep: frozenset[int] = frozenset()
    ) -> None: ...

    def release_gathered(self) -> None: ...

    def refresh_masters(self) -> None: ...


@dataclass(frozen=True)
class Attached:
    """An optimizer attached to the engine: its whole-parameter path if it takes that one ([Note: whole-parameter
    step]), and the units whose parameters it steps."""

    optimizer: torch.optim.Optimizer
    whole: WholeStep | None
    parts: tuple[FlatPart, ...]
    groups: tuple[tuple[torch.Tensor, ...], ...] = ()  # each param group's model parameters, on every rank


class OptimizerSteps:
    """The optimizers attached to one engine, the verdict of the current round of steps, and who asked to drop
    the gradients ([Note: several optimizers])."""

    def __init__(self, engine: Sharded) -> None:
        self.engine = engine
        self.attached: list[Attached] = []
        self._verdict: dict[int, list[bool]] | None = None  # this round: the used parameters; {}: skip the round
        self._zero_requests: set[int] = set()  # optimizers that called zero_grad this round
        self._kept: dict[int, list[bool]] = {}  # [Note: zero gradients kept]: per part, parameters whose grad is 0
        self._partial_zero = False  # new gradients arrived while only some of them had
        self._grad_stand_ins: dict[int, tuple[torch.Tensor, ShardedGrad]] = {}  # [Note: optimizer tensors at rest]
        self._unheld_ids: frozenset[int] | None = None  # [Note: gradients no optimizer holds]; None: to be made

    def on_reduced(self) -> None:
        """New gradients reached the shards: the next step decides anew."""
        self._verdict = None
        self._partial_zero = self._partial_zero or bool(self._zero_requests)

    def on_zero_grad(self) -> None:
        """The gradients were dropped."""
        self._verdict = None
        self._zero_requests, self._partial_zero = set(), False

    def zero_grad_of(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        """`optimizer.zero_grad()`: with one attached optimizer, drop the gradients; with several, once each of
        them has asked since the last drop (the others still step on them).

        [Note: gradients no optimizer holds]
        torch's `optimizer.zero_grad()` clears the gradients of the parameters its groups hold, and only those: a
        parameter that requires grad and is in no optimizer (left out of the groups, or added later with
        `add_param_group`) keeps adding up its gradients from step to step. DDP code sees them: in
        `clip_grad_norm_(model.parameters(), ...)`, whose norm counts them, and in the first step after the
        parameter joins a group, which applies all of them. So the gradients of parameters no attached optimizer
        holds stay ("kept": their ranges of the shard, and any gradients not reduced yet), the others' are zeros
        (`used` cleared: no gradient, as after torch's `set_to_none`); the slab they share is not released then.
        `model.zero_grad()` (the Trainer's) drops them all, as torch's does."""
        self._zero_requests.add(id(optimizer))
        if {id(a.optimizer) for a in self.attached} <= self._zero_requests:
            self.engine.zero_grad(set_to_none=set_to_none, keep=self._unheld())

    def keep_zeros(self, set_to_none: bool) -> None:
        """[Note: zero gradients kept]
        `zero_grad(set_to_none=False)` leaves every parameter that has a gradient with a zero one, and torch's
        optimizers step a zero gradient (AdamW's moments and weight decay still move the weight); only `None`
        is skipped. The engine drops its gradient shards either way; this remembers which parameters had a
        gradient at a step since the last `set_to_none=True`, and the next step gives them zeros where no rank's
        backward reached them."""
        if set_to_none:
            self._kept = {}

    def _unheld(self) -> frozenset[int]:
        """Ids of the model's parameters no attached optimizer holds (made after `attach`, `extend`, `release`)."""
        if self._unheld_ids is None:
            held = {id(p) for entry in self.attached for group in entry.groups for p in group}
            self._unheld_ids = frozenset(id(p) for part in self.engine.parts for p in part.params if id(p) not in held)
        return self._unheld_ids

    def attach(self, entry: Attached) -> None:
        """Add an optimizer to the ones that step this model ([Note: several optimizers])."""
        self.attached.append(entry)
        self._unheld_ids = None

    def extend(self, optimizer: torch.optim.Optimizer, params: tuple[torch.Tensor, ...], parts: list[FlatPart]) -> None:
        """An attached optimizer took a new param group of `params` ([Note: param group added later] in optim.py):
        their units are among those its steps publish."""
        self._unheld_ids = None
        for i, entry in enumerate(self.attached):
            if entry.optimizer is optimizer:
                held = {id(p) for p in (*entry.parts, *parts)}
                self.attached[i] = replace(
                    entry,
                    parts=tuple(p for p in self.engine.parts if id(p) in held),
                    groups=(*entry.groups, params),
                )

    def attached_to(self, optimizer: torch.optim.Optimizer) -> Attached | None:
        """The entry of an attached optimizer, or None (never attached, or released)."""
        return next((a for a in self.attached if a.optimizer is optimizer), None)

    def model_params_of(self, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """[Note: torch clipping] `tensors` taken from attached optimizers' `param_groups` (pieces of this rank's
        shards, or the whole parameters it owns): the model parameters of the groups they make up, the same on
        every rank; None when none of them is an optimizer's. A group is taken whole or not at all (a group with
        nothing on this rank counts as taken when every other group is)."""
        given = {id(t) for t in tensors}
        chosen: list[torch.Tensor] = []
        for entry in self.attached:
            held = [{id(t) for t in group["params"]} for group in entry.optimizer.param_groups]
            hit = [bool(ids & given) for ids in held]
            if not any(hit):
                continue
            every = all(h or not ids for h, ids in zip(hit, held))
            for ids, h, params in zip(held, hit, entry.groups):
                if h and not ids <= given:
                    raise ValueError(
                        "hf_zero: gradient clipping got some of the tensors of an optimizer param group: they are "
                        "pieces of this rank's shard, and a part of a group is not the same part on every rank. "
                        "Pass whole groups (`[p for g in optimizer.param_groups for p in g['params']]`) or the "
                        "model's parameters (`model.parameters()`)."
                    )
                if h or (every and not ids):
                    chosen.extend(params)
            given -= set().union(*held)
        if not chosen and len(given) == len(tensors):
            return None
        if given:
            raise ValueError(
                "hf_zero: gradient clipping got tensors of an optimizer's param groups together with other tensors; "
                "pass the optimizer's groups or the model's parameters, not both."
            )
        return chosen

    def release(self) -> None:
        """Forget the attached optimizers (their state freed; they refuse to step): newer ones are being attached."""
        for entry in self.attached:
            entry.optimizer.state.clear()
        self.attached = []
        self._unheld_ids = None

    def rest_grads(self) -> None:
        """[Note: optimizer tensors at rest]
        What the attached optimizers step are pieces of this rank's shards (or the whole parameters it owns, [Note:
        whole-parameter step]), and their `.grad` is bound to the gradient shards for the step only. Code written
        for DDP reads `.grad` through `optimizer.param_groups` too (a norm logged, or clipping by hand over the
        groups' tensors, guarded by `if p.grad is not None`): left `None` it would skip every one silently, and a
        bound view would give this rank's part as if it were the whole. So after each backward and each step
        every such tensor's `.grad` is a `ShardedGrad` stand-in that refuses any read by name ([Note: resting
        gradients]), removed (None) when the model's stand-ins are, and replaced by the real views at the step."""
        for t, stand_in in self._stand_ins():
            t.grad = stand_in

    def wake_grads(self) -> None:
        """[Note: optimizer tensors at rest] remove the stand-ins (a forward with grad, a backward, zero_grad)."""
        for t, _ in self._stand_ins():
            if isinstance(t.grad, ShardedGrad):
                t.grad = None

    def _stand_ins(self) -> list[tuple[torch.Tensor, ShardedGrad]]:
        """Each tensor of the attached optimizers' groups and its stand-in (made again when the tensors changed, or one
        changed its dtype: a part that started training under mixed precision, [Note: requires_grad after initialize]
        in unfreeze.py)."""
        tensors = [
            (g, i, t)
            for entry in self.attached
            for g, group in enumerate(entry.optimizer.param_groups)
            for i, t in enumerate(group["params"])
        ]
        known = self._grad_stand_ins
        if len(known) != len(tensors) or any(
            id(t) not in known or known[id(t)][1].dtype != t.dtype for *_, t in tensors
        ):
            name = "optimizer.param_groups[{}]['params'][{}]"
            self._grad_stand_ins = {id(t): (t, ShardedGrad(t, name.format(g, i))) for g, i, t in tensors}
        return list(self._grad_stand_ins.values())

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step `optimizer` on this rank's shards and publish the new parameters; False if skipped. Its tensors'
        `.grad` rest as stand-ins afterwards ([Note: optimizer tensors at rest])."""
        self.wake_grads()  # what steps sees only the gradients the step binds
        try:
            return self._step(optimizer)
        finally:
            if self.engine.has_grads:
                self.rest_grads()

    def _step(self, optimizer: torch.optim.Optimizer) -> bool:
        engine = self.engine
        engine.refresh_masters()
        entry = self.attached_to(optimizer)
        if entry is None:
            raise RuntimeError(f"[rank {engine.world.rank}] hf_zero: step() of an optimizer this model does not hold")
        if self._partial_zero:
            raise ValueError(
                "A backward ran after only some of this model's optimizers called zero_grad(): their gradients are "
                "shared flat buffers, dropped once every optimizer has called zero_grad() (or model.zero_grad()). Call "
                "zero_grad() on every optimizer before the next backward."
            )
        if engine.hooks.current.unsynced:
            raise ValueError(_NEVER_SYNCED)
        used = self._round()
        if not used:
            return False
        for piece in engine.pieces:  # [Note: gradient shard lifetime] units without a reduction are skipped
            piece.part.store.bind_grads(piece, used[id(piece.part)][piece.slot_index])
        if entry.whole is not None:  # [Note: whole-parameter step]; the stores read and write the masters by range
            entry.whole.step(optimizer, used)
        else:  # [Note: master stores]: the optimizer's own step, or window by window over the offload files
            engine.flat_step.step(optimizer, used)
        published = [part.store.publish(async_op=True) for part in entry.parts]
        for pending in published:
            pending.wait()
        if any(part.placement.offloaded for part in engine.parts):
            release_free_host_memory()  # [Note: host heap]: after an offloaded step only
        engine.release_gathered()  # no copy gathered before the step is used after it
        return True

    def _round(self) -> dict[int, list[bool]]:
        """This round's verdict, decided by its first step (or unscale): per part, which parameters got a gradient
        anywhere ([Note: unused parameters]); empty when the round is skipped (no gradient, an fp16 overflow)."""
        engine = self.engine
        if self._verdict is None:
            ok = (engine.has_grads or bool(self._kept)) and (
                engine.scaler is None or engine.scaler.check_and_update(engine.parts, engine.world)
            )
            self._verdict = self._used_anywhere() if ok else {}
            for key, flags in self._verdict.items():  # [Note: zero gradients kept]
                kept = self._kept.get(key, [False] * len(flags))
                self._kept[key] = flags[:] = [a or b for a, b in zip(flags, kept)]
        return self._verdict

    def unscale(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        """[Note: grad scaler] in amp.py: `optimizer`'s gradient shards multiplied by `inv_scale`, and `found_inf`
        set where any rank's hold an inf or NaN (the same on every rank); the scaler's record of it. An optimizer
        on the whole-parameter path ([Note: whole-parameter step]) has its parameters' gradient shards unscaled
        here, before its step gathers them whole on their owners."""
        engine = self.engine
        entry = self.attached_to(optimizer)
        if engine.scaler is not None:
            raise ValueError(
                "hf_zero: torch.amp.GradScaler together with ZeroConfig(mixed_precision='fp16'), which scales the "
                "loss itself: the gradients would be scaled twice. Use one: drop the GradScaler (the engine's scaling "
                "checks every shard on every rank), or set mixed_precision='no' and compute under "
                "torch.autocast(dtype=torch.float16) as with DDP."
            )
        engine.refresh_masters()  # the reductions landed in the shards
        used = self._round()
        whole = entry is not None and entry.whole is not None
        if whole and entry is not None:  # the model parameters it steps, whole on their owners
            held = {id(p) for group in entry.groups for p in group}
        else:  # the pieces of this rank's shards in its param groups
            held = {id(t) for group in optimizer.param_groups for t in group["params"]}
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for piece in engine.pieces:
            if not used or not used[id(piece.part)][piece.slot_index] or piece.part.grads.is_zero:
                continue  # no gradient anywhere (None under DDP), or the unit got no reduction (zeros)
            if whole:
                if id(piece.param) in held:
                    by_device.setdefault(piece.grad.device, []).append(piece.grad)
                continue
            for t, (a, b) in zip(piece.optim_params, piece.bounds):
                if id(t) in held:
                    grad = piece.grad[a:b]
                    by_device.setdefault(grad.device, []).append(grad)
        flag = torch.zeros((), dtype=torch.float32, device=comm_device(engine.world))
        for device, grads in by_device.items():
            local = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, local, inv_scale.to(device))
            flag += local.to(flag.device)
        if engine.world.size > 1:
            max_scalar_(flag, engine.world)
        found_inf.copy_((found_inf + flag.to(found_inf.device)).clamp_(max=1.0))
        return {found_inf.device: found_inf}

    def publish_masters(self) -> None:
        """Publish every unit's master shard into its parameters after the optimizer moved the masters outside
        `step` (schedule-free's `train()` / `eval()`), and drop every copy gathered before."""
        engine = self.engine
        engine.hooks.wait_reductions()  # not refresh_masters: the masters moved, so they no longer match the published
        for pending in [part.store.publish(async_op=True) for part in engine.parts]:
            pending.wait()
        engine.release_gathered()

    def _used_anywhere(self) -> dict[int, list[bool]]:
        """[Note: unused parameters]
        A parameter that no rank's backward reached since `zero_grad` (an expert no token was routed
        to, a block LayerDrop skipped, a pooler the loss does not use) has no gradient in unsharded
        training, and the optimizer skips it: no weight decay, no moment update. Its unit's reduced
        shard holds zeros for it instead, so the ranks agree, with one small all-reduce per optimizer
        step, on which parameters got a gradient anywhere, and the others keep `.grad = None`."""
        engine = self.engine
        flags = torch.tensor(
            [int(u) for part in engine.parts for u in part.grads.used],
            dtype=torch.int32,
            device=comm_device(engine.world),
        )
        if engine.world.size > 1:
            max_scalar_(flags, engine.world)
        out, offset = {}, 0
        for part in engine.parts:
            out[id(part)] = [bool(f) for f in flags[offset : offset + len(part.params)].tolist()]
            offset += len(part.params)
        return out


# [Note: accumulation] in engine.py: where no_sync defers the reduction (stages 0-1, or `no_sync_keeps_grads`), a
# step after backward passes all run under no_sync found no reduced gradient and was skipped without a word (under
# DDP each replica would step on its own gradients and drift apart). Refused on every rank (each ran the same
# backward passes), before the step reads anything.
_NEVER_SYNCED = (
    "hf_zero: optimizer.step() after backward passes that all ran under model.no_sync(): their gradients were "
    "accumulated on each rank and never averaged across ranks (at this stage no_sync defers the reduction to the "
    "first backward outside it), so there is nothing to step with. Run the last micro-batch's backward outside "
    "no_sync(), as DDP's gradient accumulation does (`accelerator.accumulate` and the Trainer do), then step."
)
