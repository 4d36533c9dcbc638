"""Parts frozen at `initialize` that start training later: which may, and how each takes a trainable part's storage.

[Note: requires_grad after initialize]
A parameter frozen at `initialize` lives in a frozen part: its only copy in the compute dtype, on the device, no
master, no gradient buffer, no optimizer state ([Note: frozen parameters] in unit.py). Freezing a trainable one later
is followed (its gradient is `None` while it is frozen, as in torch). Unfreezing one (gradual unfreezing: a model
frozen but for its head, its blocks unfrozen from the top as training goes; LoRA's base weights trained after a
warm-up of the adapters) is found at the next forward with grad: its frozen part starts training from there, beside
its unit's other trainable parts if it has any, exactly as under DDP (its gradients reduced, the optimizer stepping it
if its param groups hold it, or one added for it since, as torch's does: [Note: param group added later] in
step/optim.py).

The part first takes what a part trainable at `initialize` would have had (`FlatPart.start_training`): under mixed
precision an fp32 master made from its compute copy, with `offload_optimizer` that master (and so its gradient shard
and optimizer state) on the host, and at stage 3 the gather source a trainable part gathers from. The optimizer's
tensors for its pieces keep their identity (the param groups and any state hold them) and are pointed at the new
master (`repoint`); state the optimizer made at construction (Adagrad's sum) follows in the master's dtype.

That is exact only where the compute copy holds what training starts from. Under mixed precision a part whose
parameters were in a wider dtype at `initialize` (an fp32 model trained in bf16), or loaded since from a checkpoint
that holds them so (fp32 masters saved after the part started training: `load_checkpoint` tells `loaded`), kept only
their rounding; DDP would train from the fp32 weights. There, and with `offload_dir` (the offload files are laid out
at `initialize` for the parameters trainable then), the unfreezing is refused on every rank (the same parameters on
each), naming the way: leave the parameter trainable at `initialize` and freeze it right after, which hf_zero follows
from then on. (A part frozen in a model built in bf16 from fp32 files, `from_pretrained(..., dtype=torch.bfloat16)`,
starts from their bf16 rounding, the weights of the model asked for; a part trainable at `initialize` there reads its
fp32 master from the files.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..dtypes import dtype_from_name
from .flat import FlatPart
from .part_settings import PartSettings
from .step.fused import fuse_where_it_applies
from .step.pieces import Piece
from .step.stepping import Attached
from .unit import Unit


class FrozenParts:
    """The parts frozen at `initialize` that have not started training, and what each was frozen from.

    Args:
        parts: the frozen parts, as the engine built them.
        rounded: id of each part whose compute copy rounded its parameters -> the dtype they had before.
        trainable_settings: the settings a part gets when it starts training (the engine's, for a trainable part).
        on_disk: the masters live in offload files (`offload_dir`).
    """

    def __init__(
        self,
        parts: list[FlatPart],
        rounded: dict[int, torch.dtype],
        trainable_settings: Callable[[FlatPart], PartSettings],
        on_disk: bool,
    ) -> None:
        self.parts = parts
        self._rounded = rounded
        self._trainable_settings = trainable_settings
        self._on_disk = on_disk

    def start_unfrozen(
        self, units: list[Unit], pieces: list[Piece], attached: list[Attached]
    ) -> list[tuple[FlatPart, Unit]]:
        """Start training each part unfrozen since the last call (its storage made a trainable part's, its pieces
        and the attached optimizers' tensors repointed, its unit told), or refuse; returns the parts started, each
        with its unit."""
        woken = []
        for part in unfrozen(self.parts):
            names = [name for name, p in zip(part.spec.param_names, part.held_params) if p.requires_grad]
            why = self._why_it_stays(part)
            if why is not None:
                raise ValueError(
                    f"hf_zero: parameter '{names[0]}' was frozen (requires_grad=False) when hf_zero.initialize ran "
                    f"and now requires grad, and it cannot start training here: {why}. For progressive unfreezing in "
                    "this setting, leave it trainable at initialize (build the optimizer over it too) and freeze it "
                    "with requires_grad_(False) right after: hf_zero follows freezing and unfreezing from then on."
                )
            woken.append((part, next(u for u in units if part in u.parts)))
        for part, unit in woken:
            for real, held in zip(part.params, part.held_params):  # stage 3: as the next gather would
                real.requires_grad_(held.requires_grad)  # ([Note: resting parameters])
            moved = part.start_training(self._trainable_settings(part))
            if moved:
                repoint(part, [piece for piece in pieces if piece.part is part], attached)
            unit.start_training(part)
            self.parts.remove(part)
            for entry in attached if moved else ():  # [Note: fused step]: chosen again, its tensors in fp32 now
                if entry.whole is None:
                    fuse_where_it_applies(entry.optimizer, self.asleep(pieces))
        return woken

    def loaded(self, dtypes: Mapping[str, str]) -> None:
        """A checkpoint's masters were loaded (`dtypes`: each parameter's saved dtype, by name): a part still frozen
        whose compute copy now rounds what the checkpoint holds (fp32 masters, saved after it started training under
        mixed precision) cannot start training from it."""
        for part in self.parts:
            for name in part.spec.param_names:
                saved = dtype_from_name(dtypes[name]) if name in dtypes else part.param_dtype
                if saved != part.param_dtype:
                    self._rounded[id(part)] = saved

    def asleep(self, pieces: list[Piece]) -> frozenset[int]:
        """Ids of the optimizer tensors of `pieces` whose part has not started training ([Note: fused step])."""
        return frozenset(id(t) for piece in pieces if piece.part in self.parts for t in piece.optim_params)

    def _why_it_stays(self, part: FlatPart) -> str | None:
        """Why `part` cannot start training exactly, or None."""
        if self._on_disk:
            return (
                "with offload_dir its master weights and optimizer state would have to join the offload files, "
                "laid out at initialize for the parameters trainable then"
            )
        wider = self._rounded.get(id(part))
        if wider is not None:
            return (
                f"under mixed precision a frozen part keeps only its {part.param_dtype} copy, and this parameter was "
                f"{wider} at initialize (or in the checkpoint loaded since): training would start from its "
                f"{part.param_dtype} rounding, not from the {wider} weights"
            )
        return None


def unfrozen(parts: list[FlatPart]) -> list[FlatPart]:
    """The parts of `parts` some of whose parameters (as the modules hold them) require grad now."""
    return [part for part in parts if any(p.requires_grad for p in part.held_params)]


def repoint(part: FlatPart, pieces: list[Piece], attached: list[Attached]) -> None:
    """Point the tensors the optimizers hold for `part` (its pieces' `master` and `optim_params`, or the whole
    parameters a rank owns: [Note: whole-parameter step]) at its new master, in its dtype ([Note: master stores] in
    step/master.py), and move the state they have (made at construction) to the master's dtype and device. The
    tensors keep their identity: the optimizers' groups and state hold them."""
    held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the optimizer's tensor, what it is to be)
    for piece in pieces:
        master, chunks = part.store.piece_tensors(piece.local[0], piece.local[1], piece.bounds)
        piece.master.data = master
        held += zip(piece.optim_params, chunks)
    for entry in attached:
        if entry.whole is not None:
            held += entry.whole.follow_master(part)
    for tensor, new in held:
        tensor.data = new
        for entry in attached:
            state = entry.optimizer.state
            if state.get(tensor):
                state[tensor] = {key: _follow(value, tensor) for key, value in state[tensor].items()}


def _follow(value: Any, chunk: torch.Tensor) -> Any:
    """An optimizer state entry of `chunk`: elementwise ones (its shape) in its dtype and device, the rest as is."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == chunk.shape:
        return value.to(chunk.device, chunk.dtype)
    return value
