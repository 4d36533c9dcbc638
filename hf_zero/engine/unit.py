"""`Unit`: the flat parts of one unit, run by the hooks as one unit.

[Note: frozen parameters]
A unit whose parameters are partly frozen (LoRA: every projection's base weight frozen, its
adapter trainable) keeps them in two flat parts, each a `FlatPart` sharded evenly over the ranks:

- the trainable part: as any unit (master shard in the master dtype, gradient shard, reductions,
  optimizer state);
- the frozen part: its shard in the compute dtype is its only copy (no fp32 master, even under
  mixed precision), with no gradient buffer, no gradient shard and no reduction. At stage 3 it
  costs `Ψ_frozen × bytes(compute dtype) / N` at rest; at stages 0-2 it is whole on every rank.

The hooks see one `Unit` per unit: its parts are gathered, freed and prefetched together
(one all-gather each) and only the trainable part's gradients are attached and reduced. A unit
whose parameters are all trainable, or all frozen, is a group of one part.
"""

from __future__ import annotations

import torch

from .flat import FlatPart, GradReduction
from .wrap import UnitSpec


class Unit:
    """The parts (`FlatPart`s, trainable first) of one unit ([Note: frozen parameters])."""

    def __init__(self, parts: list[FlatPart]) -> None:
        if not parts:
            raise RuntimeError("hf_zero: a unit group needs at least one part")
        self.parts = parts
        self.trainable_part: FlatPart | None = next((p for p in parts if p.has_trainable), None)
        self.params = tuple(p for part in parts for p in part.params)

    # ---- what the hooks read ----------------------------------------------------------------
    @property
    def spec(self) -> UnitSpec:
        return self.parts[0].spec  # the parts share their modules and name

    @property
    def sparse_lookup(self) -> bool:
        return len(self.parts) == 1 and self.parts[0].sparse_lookup

    @property
    def has_trainable(self) -> bool:
        return self.trainable_part is not None

    @property
    def host(self) -> torch.device | None:
        return self._grads().host

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def needs_gather(self) -> bool:
        return any(p.needs_gather for p in self.parts)

    @property
    def is_unsharded(self) -> bool:
        return all(p.is_unsharded for p in self.parts)

    @property
    def param_nbytes(self) -> int:
        return sum(p.param_nbytes for p in self.parts)

    @property
    def grad_nbytes(self) -> int:
        return sum(p.grad_nbytes for p in self.parts)

    @property
    def buffer_nbytes(self) -> frozenset[int]:
        return frozenset().union(*(p.buffer_nbytes for p in self.parts))

    # ---- parameters: every part -------------------------------------------------------------
    def prefetch(self) -> None:
        for p in self.parts:
            p.prefetch()

    def ensure_unsharded(self) -> None:
        for p in self.parts:
            p.ensure_unsharded()

    def reshard(self) -> None:
        for p in self.parts:
            p.reshard()

    # ---- gradients: the trainable part ------------------------------------------------------
    def _grads(self) -> FlatPart:
        return self.trainable_part or self.parts[0]

    @property
    def unsharded_grad(self) -> torch.Tensor | None:
        return self._grads().unsharded_grad

    @unsharded_grad.setter
    def unsharded_grad(self, value: torch.Tensor | None) -> None:
        self._grads().unsharded_grad = value

    def attach_grads(self) -> None:
        if self.trainable_part is not None:
            self.trainable_part.attach_grads()

    def collect_grads(self) -> None:
        if self.trainable_part is not None:
            self.trainable_part.collect_grads()

    def detach_grads(self) -> None:
        for p in self.parts:
            p.detach_grads()

    def mark_used(self, param: torch.Tensor) -> None:
        self._grads().mark_used(param)

    def reduce_grads(self, async_op: bool = True, buffer_is_free: bool = False) -> GradReduction:
        return self._grads().reduce_grads(async_op=async_op, buffer_is_free=buffer_is_free)

    def finish_reduction(self, reduction: GradReduction, divisor: float) -> None:
        self._grads().finish_reduction(reduction, divisor)

    def release_reduced(self, reduction: GradReduction) -> None:
        self._grads().release_reduced(reduction)


def split_frozen(spec: UnitSpec) -> list[UnitSpec]:
    """`spec` as its trainable part and its frozen part (each only if it has parameters); a unit with
    no trainable parameter is one frozen part."""
    groups: dict[bool, list[int]] = {True: [], False: []}
    for i, p in enumerate(spec.params):
        groups[p.requires_grad].append(i)
    if not groups[False]:
        return [spec]
    if not groups[True]:
        return [_subset(spec, groups[False], frozen=True)]
    return [_subset(spec, groups[True], frozen=False), _subset(spec, groups[False], frozen=True)]


def _subset(spec: UnitSpec, indices: list[int], frozen: bool) -> UnitSpec:
    from dataclasses import replace

    return replace(
        spec,
        params=tuple(spec.params[i] for i in indices),
        param_names=tuple(spec.param_names[i] for i in indices),
        slots=tuple(spec.slots[i] for i in indices) if spec.slots else (),
        frozen=frozen,
    )
