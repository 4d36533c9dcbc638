"""`ShardedOptimizer`: the user's optimizer, stepping only this rank's shards of the master weights.

[Note: optimizer shards]
The user builds any elementwise `torch.optim.Optimizer` (AdamW, Adam, SGD, ...) over
`model.parameters()`, with its own param groups and per-group hyperparameters. `initialize`
keeps that optimizer object and replaces each group's `params` by the pieces of those
parameters that fall into this rank's shard: 1D views of the units' `sharded_master` (in
chunks of bounded size, [Note: optimizer chunks] in pieces.py), whose `.grad` are the matching
views of the gradient shards (`FlatGrads.shard`). So the optimizer updates the master shards in
place, with every group's hyperparameters intact, and its state is created for the shards only.
That is exact for elementwise optimizers only; every other optimizer steps on whole parameters,
each on the rank that owns it ([Note: whole-parameter step] in whole.py).

[Note: param group added later]
Gradual unfreezing written for torch adds the unfrozen layers to the optimizer as it goes:
`optimizer.add_param_group({"params": block.parameters(), "lr": ...})` (Lightning's `BaseFinetuning`, ULMFiT
recipes). After `initialize` the group's parameters are mapped as `initialize` maps the groups it was given: on the
flat path each parameter's pieces of this rank's shard (their tensors exist for every part, trainable or frozen at
`initialize`, and keep their identity when a frozen part starts training: [Note: requires_grad after initialize] in
unfreeze.py), on the whole-parameter path the parameters are dealt to the ranks after the ones dealt before, each
rank's stand-ins for those it owns. The group dict itself joins the inner optimizer, its `params` replaced by those
tensors, and torch's `add_param_group` fills in the defaults; the state dict's piece map, the checkpoint's group
names and the parameters the optimizer publishes follow. A checkpoint saved after the group was added resumes into an
optimizer that has it too (the same script adds it before the load), as torch's `load_state_dict` needs the groups
it saved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..checks.call_order import Call
from ..engine import ZeroEngine
from .fused import fuse_where_it_applies
from .optim_configs import carry_configs
from .optim_state import OptimizerState, PieceMap, described, to_load
from .pieces import Piece, hand_over
from .stepping import Attached
from .whole import COUPLED, WholeStep, is_elementwise


def shard_optimizer(optimizer: torch.optim.Optimizer, engine: ZeroEngine) -> ShardedOptimizer:
    """Rewrite `optimizer`'s groups onto this rank's shards (elementwise optimizers, [Note: optimizer shards]) or
    onto the whole parameters this rank owns (every other, [Note: whole-parameter step]), and wrap it."""
    by_param = {id(piece.param): piece for piece in engine.pieces}
    where = {id(p): (part, i) for part in engine.parts for i, p in enumerate(part.params)}
    params = [engine.compute_param(p) for group in optimizer.param_groups for p in group["params"]]
    whole = None
    if not is_elementwise(optimizer):
        whole = WholeStep(
            [where[id(p)] for p in params],
            engine.plan.shard_group,
            {(id(piece.part), piece.slot_index): piece for piece in engine.pieces},
        )
    initial = [dict(optimizer.state.get(p, {})) for group in optimizer.param_groups for p in group["params"]]
    optimizer.state.clear()
    group_names: list[list[str]] = []
    moved: list[tuple[int, int, torch.Tensor, list[torch.Tensor]]] = []
    targets: list[tuple[tuple[int, tuple[int, int] | None], ...]] = []  # [Note: optimizer state dicts]
    index = stepped = 0
    for g, group in enumerate(optimizer.param_groups):
        pieces: list[torch.Tensor] = []
        names: list[str] = []
        for j, original in enumerate(group["params"]):
            param = params[index]  # built over meta parameters or stand-ins: the engine's own
            held: list[torch.Tensor] = []
            spans: list[tuple[int, int] | None] = []
            if whole is not None:
                stand_in = whole.stand_in(index)
                held = [stand_in] if stand_in is not None else []
                spans = [None] * len(held)
                for t in held if initial[index] else []:  # [Note: state set at construction]
                    optimizer.state[t] = {k: _carried(v, t.device) for k, v in initial[index].items()}
            elif (
                piece := by_param.get(id(param))
            ) is not None:  # in chunks ([Note: optimizer chunks]); `.grad` bound by each step
                held, spans = _chunks(piece)
                if initial[index]:  # [Note: state set at construction]
                    _carry_into_chunks(optimizer, piece, initial[index])
            targets.append(tuple((stepped + len(pieces) + k, span) for k, span in enumerate(spans)))
            pieces.extend(held)
            names.append(engine.name_of(param))
            moved.append((g, j, original, held))
            index += 1
        group["params"] = pieces
        stepped += len(pieces)  # torch numbers the tensors of every group in turn
        group_names.append(names)
    carry_configs(optimizer, moved, engine.compute_param)  # [Note: per-parameter optimizer configs]
    if whole is None:
        fuse_where_it_applies(optimizer, engine.frozen.asleep(engine.pieces))
    parts = {id(part): part for part, _ in (where[id(p)] for p in params)}
    sizes = tuple(map(len, group_names))
    groups = tuple(tuple(params[sum(sizes[:g]) : sum(sizes[: g + 1])]) for g in range(len(sizes)))
    engine.steps.attach(Attached(optimizer, whole, tuple(u for u in engine.parts if id(u) in parts), groups))
    piece_map = PieceMap(tuple(targets), tuple(int(p.numel()) for p in params), sizes)
    return ShardedOptimizer(optimizer, engine, group_names, piece_map)


def check_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module, offload_dir: str | None, engine: ZeroEngine | None = None
) -> None:
    """Raise a clear error for an optimizer that `initialize` (or, with the model's `engine`,
    `attach_optimizer`) cannot shard."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"hf_zero.initialize expects a torch.optim.Optimizer built over model.parameters(); got "
            f"{type(optimizer).__name__}."
        )
    if isinstance(optimizer, ShardedOptimizer):
        raise ValueError(
            "hf_zero: this optimizer is already sharded by hf_zero.initialize; pass the original optimizer once."
        )
    if any(_has_stepped(s) for s in optimizer.state.values()):
        raise ValueError(
            "hf_zero: the optimizer already holds state (it has taken a step). Call hf_zero.initialize before "
            "training, or load the state afterwards with hf_zero.load_checkpoint."
        )
    for param, state in optimizer.state.items():  # [Note: state set at construction]
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.ndim == 0:
                continue
            elementwise = is_elementwise(optimizer)
            if (offload_dir is not None and not elementwise) or (elementwise and value.numel() != param.numel()):
                raise ValueError(
                    f"hf_zero: {type(optimizer).__name__} set its state {key!r} (shape {tuple(value.shape)}) at "
                    "construction, "
                    + (
                        "which ZeroConfig.offload_dir cannot place in its files for an optimizer stepped on whole "
                        "parameters: drop offload_dir."
                        if offload_dir is not None
                        else "which cannot be cut into flat shards: it is not the parameter's size."
                    )
                )
    name = type(optimizer).__name__
    if name in COUPLED:
        raise ValueError(
            f"hf_zero cannot shard {name}: {COUPLED[name]}, so no rank can step its part alone "
            "([Note: whole-parameter step]). Use an optimizer whose step treats each parameter on its own."
        )
    model_params = {id(p) for p in model.parameters()}
    if engine is not None:  # the engine's own parameters too: the modules may hold their stand-ins now
        model_params |= {id(p) for part in engine.parts for p in part.params}
    for i, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in model_params:
                raise ValueError(
                    f"hf_zero: param group {i} of the optimizer holds a tensor of shape {tuple(param.shape)} that is "
                    "not a parameter of the model. Build the optimizer over model.parameters(). A module trained "
                    "beside the model (a projection head, a discriminator, DDP code's `list(model.parameters()) "
                    "+ list(head.parameters())`): make it a submodule of the model before hf_zero.initialize, so "
                    "that it is sharded and its gradients averaged over the ranks, or give it an optimizer of its "
                    "own and wrap it alone in DistributedDataParallel."
                )


def _chunks(piece: Piece | None) -> tuple[list[torch.Tensor], list[tuple[int, int] | None]]:
    """What the optimizer steps for a parameter on the flat path: its piece's chunks ([Note: optimizer chunks]), and
    the elements `[a, b)` of the flattened parameter each holds ([Note: optimizer state dicts]); none where this
    rank's shard holds none of it."""
    if piece is None:
        return [], []
    return list(piece.optim_params), [(piece.start + a, piece.start + b) for a, b in piece.bounds]


def _group_params(param_group: dict[str, Any], engine: ZeroEngine, attached: Sequence[Attached]) -> list[torch.Tensor]:
    """The engine's own parameters of a param group added after `initialize`, in order, as torch reads its `params`
    (a tensor, or an ordered collection of tensors or of (name, tensor) pairs); refused where torch refuses (not a
    dict, a set, a parameter in two groups) and where a tensor is not one of the model's parameters."""
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
    given = param_group["params"]
    if isinstance(given, set):
        raise TypeError(
            "optimizer parameters need to be organized in ordered collections, but the ordering of tensors in sets "
            "will change between runs. Please use a list instead."
        )
    given = [given] if isinstance(given, torch.Tensor) else list(given)
    if given and all(isinstance(p, tuple) for p in given):  # named parameters: torch keeps the names
        param_group["param_names"] = [name for name, _ in given]
        given = [p for _, p in given]
    params = []
    for p in given:
        if not isinstance(p, torch.Tensor) or not engine.owns(p):
            raise ValueError(
                "hf_zero: optimizer.add_param_group got "
                + (f"a tensor of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else type(p).__name__)
                + " that is not a parameter of the sharded model. Add the model's own parameters "
                "(`model.blocks[0].parameters()`)."
            )
        params.append(engine.compute_param(p))
    taken = {id(p) for entry in attached for group in entry.groups for p in group}
    seen: set[int] = set()
    for p in params:
        if id(p) in taken or id(p) in seen:
            raise ValueError(
                f"some parameters appear in more than one parameter group ('{engine.name_of(p)}' is in one already; "
                "hf_zero: each parameter may be in one group of one optimizer)"
            )
        seen.add(id(p))
    return params


def _has_stepped(state: dict[str, Any]) -> bool:
    """Whether a parameter's optimizer state records a step taken (a `step` count above 0)."""
    step = state.get("step", 0)
    return bool(step.item() > 0) if isinstance(step, torch.Tensor) else bool(step and step > 0)


def _carried(
    value: Any, device: torch.device, span: tuple[int, int] | None = None, dtype: torch.dtype | None = None
) -> Any:
    """[Note: state set at construction]
    Some optimizers set per-parameter state in their constructor: APOLLO a projection seed, torch's Adagrad
    its accumulator (`sum`, the parameter's size) and a zero step. That state moves with the parameter to
    what steps it: whole to its owner's stand-in, or (`span`: the elements `[a, b)` of the flattened
    parameter a flat chunk holds) cut to the chunk, in the chunk's `dtype` where it is floating point (the master's,
    fp32 under mixed precision, as the state the optimizer makes at its first step); numbers as they are, 0-d
    tensors copied. An optimizer that has already stepped is refused instead (`check_optimizer`)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.ndim == 0 or span is None:
        return value.clone() if value.ndim == 0 and value.device.type == "cpu" else value.to(device, copy=True)
    cut = value.reshape(-1)[span[0] : span[1]]
    return cut.to(device, dtype if dtype is not None and cut.is_floating_point() else cut.dtype, copy=True)


def _carry_into_chunks(optimizer: torch.optim.Optimizer, piece: Piece, initial: dict[str, Any]) -> None:
    """[Note: state set at construction] a parameter's construction-time state, cut to the piece, handed over as a
    loaded state is (`hand_over`: into the chunks' entries, or its elementwise entries into the offload files where
    the piece's master lives there, [Note: disk offload])."""
    span, dtype = (piece.start, piece.end), piece.master.dtype
    whole = {k: _carried(v, piece.master.device, span, dtype) for k, v in initial.items()}
    hand_over(optimizer, piece, whole, {k for k, v in initial.items() if isinstance(v, torch.Tensor) and v.ndim > 0})


def optimizer_list(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
) -> list[torch.optim.Optimizer]:
    """The optimizers `initialize` was given: none, one, or a list or tuple of several ([Note: several optimizers])."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if not optimizer:
        raise ValueError("hf_zero.initialize got an empty list of optimizers; pass None, one optimizer, or several.")
    return list(optimizer)


def check_optimizers(
    optimizers: list[torch.optim.Optimizer], model: nn.Module, offload_dir: str | None, engine: ZeroEngine | None = None
) -> None:
    """`check_optimizer` for each, and for several: no parameter in two of them, no offload_dir."""
    for optimizer in optimizers:
        check_optimizer(optimizer, model, offload_dir, engine)
    if len(optimizers) < 2:
        return
    if offload_dir is not None:
        raise ValueError(
            "hf_zero: ZeroConfig.offload_dir steps one optimizer; build one optimizer, or drop offload_dir."
        )
    owner: dict[int, int] = {}
    for i, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for param in group["params"]:
                real = engine.compute_param(param) if engine is not None else param
                if owner.setdefault(id(real), i) != i:
                    raise ValueError(
                        f"hf_zero: a parameter of shape {tuple(param.shape)} is in optimizers {owner[id(real)]} and "
                        f"{i}: each parameter may be stepped by one optimizer only. Split the parameters between them."
                    )


def shard_optimizers(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None, engine: ZeroEngine
) -> ShardedOptimizer | list[ShardedOptimizer] | tuple[ShardedOptimizer, ...] | None:
    """`shard_optimizer` for each optimizer given, returned in the shape given (None, one, list or tuple)."""
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        return shard_optimizer(optimizer, engine)
    sharded = [shard_optimizer(o, engine) for o in optimizer]
    return tuple(sharded) if isinstance(optimizer, tuple) else sharded


class ShardedOptimizer(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` whose step updates this rank's shards, then refreshes the parameters.

    `param_groups` are the user's own groups (same dicts, so LR schedulers and the Trainer's
    weight-decay groups act on them directly); each group's `params` holds this rank's shard
    pieces. Returned by `hf_zero.initialize`.

    Example:

    ```python
    >>> model, optimizer = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    >>> scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    >>> model(**batch).loss.backward()
    >>> norm = optimizer.clip_grad_norm_(1.0)
    >>> optimizer.step(); scheduler.step(); optimizer.zero_grad()
    ```
    """

    _is_accelerate_prepared = True  # Accelerate must not wrap it again

    def __init__(
        self, optimizer: torch.optim.Optimizer, engine: ZeroEngine, group_names: list[list[str]], pieces: PieceMap
    ) -> None:
        self.optimizer = optimizer
        self._engine = engine
        self.group_param_names = group_names  # the parameter names of each group, on every rank
        self._pieces = pieces  # [Note: optimizer state dicts]
        self._initializing = True
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._initializing = False
        self.param_groups = optimizer.param_groups  # one list, shared with the inner optimizer
        self.state = OptimizerState(optimizer, engine)  # type: ignore[assignment]  # [Note: optimizer state by parameter]
        self.step_was_skipped = False

    @property
    def steps_whole_parameters(self) -> bool:
        """Whether the optimizer steps on whole parameters, each on its owner ([Note: whole-parameter step]),
        rather than on flat shards."""
        return self.whole_step is not None

    @property
    def whole_step(self) -> WholeStep | None:
        """The optimizer's whole-parameter path on this rank ([Note: whole-parameter step]), or None (flat shards,
        or released)."""
        entry = self._engine.steps.attached_to(self.optimizer)
        return entry.whole if entry is not None else None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's `add_param_group`, at `initialize` and after it ([Note: param group added later]): the group's
        parameters are stepped from the next `step()` on, with its hyperparameters (the optimizer's defaults for
        those it leaves out). Call it on every rank, as every rank runs the same script.

        Example:

        ```python
        >>> model.blocks[0].requires_grad_(True)  # frozen so far: gradual unfreezing
        >>> optimizer.add_param_group({"params": model.blocks[0].parameters(), "lr": 1e-5})
        ```
        """
        if self._initializing:
            return super().add_param_group(param_group)
        self._check_attached("add_param_group")
        engine = self._engine
        params = _group_params(param_group, engine, self._engine.steps.attached)
        before = sum(len(g["params"]) for g in self.param_groups)  # torch numbers the tensors of every group in turn
        whole = self.whole_step
        if whole is not None:
            where = {id(p): (part, i) for part in engine.parts for i, p in enumerate(part.params)}
            first = len(whole.slots)
            whole.extend([where[id(p)] for p in params])
            held = [whole.stand_in(first + k) for k in range(len(params))]
            spans: list[list[tuple[int, int] | None]] = [[None] if t is not None else [] for t in held]
            tensors = [t for t in held if t is not None]
        else:
            by_param = {id(piece.param): piece for piece in engine.pieces}
            chunks = [_chunks(by_param.get(id(p))) for p in params]
            spans = [list(chunk_spans) for _, chunk_spans in chunks]
            tensors = [t for chunk_tensors, _ in chunks for t in chunk_tensors]
        targets, at = [], before
        for held_spans in spans:
            targets.append(tuple((at + k, span) for k, span in enumerate(held_spans)))
            at += len(held_spans)
        param_group["params"] = tensors  # the group itself joins the optimizer, as in torch
        self.optimizer.add_param_group(param_group)
        self.group_param_names.append([engine.name_of(p) for p in params])
        self._pieces = self._pieces.with_group(tuple(targets), tuple(int(p.numel()) for p in params))
        ids = {id(p) for p in params}
        engine.steps.extend(self.optimizer, tuple(params), [u for u in engine.parts if ids & {id(p) for p in u.params}])
        self.choose_kernel()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]  # torch's overloads of step(); ours returns the closure's loss
        """Update this rank's shards and gather the new parameters. Skipped (returns early) when no
        gradient was reduced since `zero_grad`, or when an fp16 overflow was found."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_attached("step")
        self.step_was_skipped = not self._engine.steps.step(self.optimizer)
        return loss

    def unscale_grads_(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        """[Note: grad scaler] in amp.py: what `torch.amp.GradScaler` does to an optimizer's gradients (multiply by
        `inv_scale`, record an inf or NaN in `found_inf`), on this rank's gradient shards, the flag agreed by every
        rank. Called by the scaler; returns its record."""
        self._check_attached("unscale_ (torch.amp.GradScaler)")
        return self._engine.steps.unscale(self.optimizer, inv_scale, found_inf)

    def train(self) -> None:
        """The optimizer's own `train()`, where it has one (schedule-free optimizers: the weights move back from
        their average to the point gradients are taken at), reaching the master shards and the parameters.
        The Trainer calls it before every training step; a call that changes no mode costs nothing.

        Example:

        ```python
        >>> optimizer.train()  # schedulefree.AdamWScheduleFree, before training steps
        ```
        """
        self._switch_mode("train")

    def eval(self) -> None:
        """The optimizer's own `eval()`, where it has one (schedule-free optimizers: the weights move to their
        average, the ones to evaluate and save), reaching the master shards and the parameters.

        Example:

        ```python
        >>> optimizer.eval()  # schedulefree.AdamWScheduleFree, before evaluation
        ```
        """
        self._switch_mode("eval")

    def _switch_mode(self, what: str) -> None:
        switch = getattr(self.optimizer, what, None)
        if not callable(switch):
            return
        self._check_attached(what)
        engine = self._engine
        what_moves = f"{type(self.optimizer).__name__}.{what}() (it moves the weights it holds)"
        engine.flat_step.refuse_state_access(what_moves, "drop ZeroConfig.offload_dir.")  # [Note: master stores]
        if self.whole_step is not None:
            raise ValueError(
                f"{what_moves} is supported on flat shards only: this optimizer steps on whole parameters ([Note: "
                "whole-parameter step]); declare it with hf_zero.register_elementwise if its math is elementwise."
            )
        engine.hooks.wait_reductions()
        modes = [group.get("train_mode") for group in self.param_groups]
        switch()
        if None in modes or modes != [group.get("train_mode") for group in self.param_groups]:
            engine.steps.publish_masters()  # the masters moved: into the parameters, and no stale gathered copy

    def _check_attached(self, what: str) -> None:
        if self._engine.steps.attached_to(self.optimizer) is None:
            raise RuntimeError(
                f"[rank {self._engine.world.rank}] hf_zero: optimizer.{what}() on an optimizer that was released "
                "when another one was attached to the same model (a second ZeroTrainer, hf_zero.initialize or "
                "hf_zero.attach_optimizer); use the optimizer that call returned."
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the sharded (and any held unsharded) gradients of the model (with several optimizers: once each of
        them has called it, [Note: several optimizers])."""
        self._check_attached("zero_grad")
        self._engine.steps.zero_grad_of(self.optimizer, set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over every rank's shards; returns that norm (equal to the unsharded one).

        Example:

        ```python
        >>> total_norm = optimizer.clip_grad_norm_(1.0)
        ```
        """
        return self._engine.clip_grad_norm_(max_norm, norm_type)

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the optimizer state, in torch's format over what this rank steps, with an
        `"hf_zero"` entry naming the rank ([Note: optimizer state dicts]): `load_state_dict` takes it back on that
        rank only. Save it on every rank (or use `hf_zero.save_checkpoint`, which any number of ranks resumes).

        Example:

        ```python
        >>> torch.save(optimizer.state_dict(), f"optimizer-rank{rank}.pt")  # on every rank
        ```
        """
        self._refuse_on_disk("state_dict")
        return described(self.optimizer.state_dict(), self.param_groups, self._engine.plan.shard_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's own `state_dict()`, or a plain (unsharded) optimizer's state dict over the same
        parameters and groups, cut to this rank's pieces ([Note: optimizer state dicts]). A collective: every rank
        calls it; one that cannot take its state dict raises on every rank."""
        self._refuse_on_disk("load_state_dict")
        engine = self._engine
        engine.calls.begin(Call.LOAD_OPTIMIZER_STATE, read_now=True)  # [Note: call order]
        inner = to_load(state_dict, self.param_groups, self._pieces, engine.plan.shard_group, engine.world)
        self.optimizer.load_state_dict(inner)
        self.choose_kernel()
        # torch's load_state_dict replaces the inner optimizer's `param_groups` and `state` objects: follow them, so
        # a later change of a group's learning rate (by hand or by a scheduler holding this optimizer) reaches them.
        self.param_groups = self.optimizer.param_groups  # (the state view follows the inner optimizer's own)

    def choose_kernel(self) -> None:
        """[Note: fused step] again, once a load has put the saved groups' `fused` and `foreach` back (a checkpoint
        written before the choice, or by a loop, would otherwise step the loop from then on)."""
        if self.whole_step is None:
            fuse_where_it_applies(self.optimizer, self._engine.frozen.asleep(self._engine.pieces))

    def _refuse_on_disk(self, what: str) -> None:
        self._engine.flat_step.refuse_state_access(  # [Note: master stores]
            f"optimizer.{what}()",
            "use hf_zero.save_checkpoint / hf_zero.load_checkpoint, which stream the state from and to the files.",
        )


def sharded_list(optimizer: Any, caller: str) -> list[ShardedOptimizer]:
    """The sharded optimizers given to `caller` (a checkpoint function): none, one, or a list or tuple of them."""
    optimizers = [] if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not all(isinstance(o, ShardedOptimizer) for o in optimizers):
        raise TypeError(f"{caller} expects the optimizer returned by hf_zero.initialize (or a list or tuple of them).")
    return optimizers
