"""Full (unsharded) views of a sharded model: reading and writing whole weights between steps.

Everything here is a collective over the engine's world: every rank calls it with the same
arguments, and every check is agreed on by all ranks before the first transfer, so a mistake on
one rank raises on all of them instead of leaving the others waiting.

[Note: write-back]
A change made to gathered parameters (in the compute dtype) reaches the fp32 master shards
element by element: rank r's master element takes the new value where it differs from the
master rounded to the compute dtype (what the parameter held before the change), and keeps its
own, more precise value elsewhere. So a `gathered_parameters` context that edits one row of a
bf16 embedding leaves every other master element bit for bit as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from .checks.call_order import Call
from .collectives import broadcast_, raise_if_any_failed
from .engine import StateDictOptions, ZeroEngine
from .flat import FlatPart
from .unit import Unit


def state_dict(engine: ZeroEngine, options: StateDictOptions) -> dict[str, torch.Tensor]:
    """The full state dict under `options`: master values (the most precise copy), tied names sharing one tensor."""
    return engine.full_state_dict(rank0_only=options.rank0_only, device=options.device or engine.device)


@torch.no_grad()
def load_state_dict(engine: ZeroEngine, values: Mapping[str, torch.Tensor], strict: bool = True) -> _IncompatibleKeys:
    """Write a full state dict into every rank's shards, master weights included, as
    `nn.Module.load_state_dict` defines it (missing / unexpected keys, `strict`, shape checks)."""
    engine.calls.begin(Call.LOAD_STATE_DICT, read_now=True)  # [Note: call order]
    expected = engine.module_state(with_params=True)
    error: Exception | None = None
    missing = [k for k in expected if k not in values]
    unexpected = [k for k in values if k not in expected]
    try:
        if not isinstance(values, Mapping):
            raise TypeError(f"load_state_dict expects a dict of tensors; got {type(values).__name__}.")
        problems = [
            f"size mismatch for {k}: copying a param with shape {tuple(values[k].shape)} from checkpoint, "
            f"the shape in current model is {tuple(t.shape)}."
            for k, t in expected.items()
            if k in values and tuple(values[k].shape) != tuple(t.shape)
        ]
        if strict and unexpected:
            problems.insert(0, "Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
        if strict and missing:
            problems.insert(0, "Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
        if problems:
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(engine.model).__name__}:\n\t" + "\n\t".join(problems)
            )
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        error = e
    raise_if_any_failed(error, engine.world, "load_state_dict")

    engine.release_gathered()
    by_name = {engine.name_of(t): values[k] for k, t in expected.items() if k in values and id(t) in engine._names}
    for part in engine.parts:
        lo, _ = part.layout.shard_range(part.shard_group.rank)
        master = part.store.read()
        for index, start, end in part.layout.local_pieces(part.shard_group.rank):
            slot = part.layout.slots[index]
            value = by_name.get(slot.name)
            if value is not None:
                flat = value.detach().reshape(-1)[start - slot.offset : end - slot.offset]
                master[start - lo : end - lo].copy_(flat)
        part.store.replace(master)
    for key, t in engine.module_state(with_params=False).items():
        if key in values:
            t.copy_(values[key])
    return _IncompatibleKeys(missing, unexpected)


@contextlib.contextmanager
def gathered_parameters(
    engine: ZeroEngine, params: Iterable[torch.Tensor], modifier_rank: int | None
) -> Iterator[None]:
    """The context behind `hf_zero.gathered_parameters` (see its docstring and [Note: write-back])."""
    engine.calls.begin(Call.GATHERED_PARAMETERS, read_now=True)  # [Note: call order]
    error: Exception | None = None
    units: list[Unit] = []
    try:
        wanted = {id(engine.compute_param(p)) for p in params}
        units = [u for u in engine.units if any(id(p) in wanted for p in u.params)]
        unknown = len(wanted) - sum(1 for u in units for p in u.params if id(p) in wanted)
        if unknown:
            raise ValueError(
                f"gathered_parameters got {unknown} tensor(s) that are not parameters of this sharded model."
            )
        if modifier_rank is not None and not 0 <= modifier_rank < engine.world.size:
            raise ValueError(f"modifier_rank must be a rank in [0, {engine.world.size}) or None; got {modifier_rank}.")
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        error = e
    raise_if_any_failed(error, engine.world, "hf_zero.gathered_parameters")
    engine.hooks.wait_reductions()
    gathered_here = [u for u in units if not u.is_unsharded]  # a unit already whole (a running forward) stays so
    for unit in units:
        unit.pin()
    versions = [u.param_versions() for u in gathered_here] if modifier_rank is None else []
    try:
        with torch.no_grad():
            yield
            if modifier_rank is not None:
                parts = [part for unit in units for part in unit.parts]
                raise_if_any_failed(_undo_replaced_data(parts), engine.world, "hf_zero.gathered_parameters")
                for part in parts:
                    _write_back(engine, part, modifier_rank)
            elif versions:  # stage 3, the same units on every rank: a change would be dropped with the copy
                changed = [n for u, v in zip(gathered_here, versions) for n in u.changed_since(v)]
                raise_if_any_failed(_read_only_error(changed), engine.world, "hf_zero.gathered_parameters")
    finally:
        for unit in units:
            unit.unpin()
        for unit in gathered_here:
            if not unit.pins:
                unit.release()


def _read_only_error(changed: list[str]) -> ValueError | None:
    """The error for parameters changed in place inside `gathered_parameters(..., modifier_rank=None)` at stage 3,
    where the gathered copy is freed at the exit and the change with it; None if none was."""
    if not changed:
        return None
    return ValueError(
        f"hf_zero.gathered_parameters: {changed[:3]}{' and more' if len(changed) > 3 else ''} changed in place "
        "inside a block with modifier_rank=None, which gathers for reading: at stage 3 the change would be dropped "
        "with the gathered copy. Pass modifier_rank=r to keep rank r's values on every rank (the weights are left "
        "as they were)."
    )


def _undo_replaced_data(parts: list[FlatPart]) -> ValueError | None:
    """The error for a parameter whose `.data` the block replaced (`param.data = tensor`), which the write-back,
    reading the gathered buffer, would drop without a word ([Note: replaced data] in checks/forward.py), after pointing
    every such parameter back at its view of the buffer; None if there is none."""
    error = None
    for part in parts:
        full = part.unsharded_param
        for slot, name, p in zip(part.layout.slots, part.spec.param_names, part.params):
            view = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
            if slot.numel and p.data_ptr() != view.data_ptr():
                p.data = view
                error = error or ValueError(
                    f"hf_zero.gathered_parameters: parameter '{name}' had its `.data` replaced (`param.data = "
                    "tensor`) inside the block: the write-back reads the gathered buffer the parameter was a view "
                    "of, so the new tensor would be dropped. Change it in place instead: `param.copy_(tensor)` "
                    "(the block runs under torch.no_grad()). The weights are left as they were."
                )
    return error


def _write_back(engine: ZeroEngine, part: FlatPart, modifier_rank: int) -> None:
    """Make `modifier_rank`'s gathered values of `unit` every rank's ([Note: write-back])."""
    full = part.unsharded_param
    broadcast_(full, engine.world, modifier_rank)
    lo, hi = part.layout.shard_range(part.shard_group.rank)
    new, master = full[lo:hi], part.store.read()
    if new.data_ptr() == master.data_ptr():
        return  # the master is this rank's shard of the parameters (fp32, stages 0-2): already written
    new = new.to(master.device)  # the master may live on the host (offload, disk)
    before = master.to(part.param_dtype)
    changed = (new != before) & ~(new.isnan() & before.isnan())
    master[changed] = new[changed].to(master.dtype)
    part.store.write(master)  # [Note: master stores]: in memory, `master` is the shard itself; else the files
    if not part.persistent:
        part.store.publish(values=master).wait()  # stage 3: the gather source follows the master


@torch.no_grad()
def unshard_model(engine: ZeroEngine) -> None:
    """Give every parameter its full value as a tensor of its own (the master dtype) and register
    the real parameters in the modules again: the model is a plain module, for a change of its
    structure (`resize_token_embeddings`) before it is sharded anew. Costs a full copy per rank."""
    engine.release_gathered()
    engine.hooks.remove()
    for gathered in engine.gather_units(rank0_only=False, device=engine.device):
        for _, p, value in gathered:
            p.data = value
    for unit in engine.units:
        unit.give_back()  # [Note: unit lifecycle]: the unit's own verb registers the real parameters


def unique_params(module_or_params: nn.Module | torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters named by `gathered_parameters`' first argument, each once, in order."""
    if isinstance(module_or_params, nn.Module):
        return list(module_or_params.parameters())
    if isinstance(module_or_params, torch.Tensor):
        return [module_or_params]
    seen: dict[int, torch.Tensor] = {}
    for p in module_or_params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                "gathered_parameters takes a module, a parameter or an iterable of parameters; got a "
                f"{type(p).__name__} inside."
            )
        seen.setdefault(id(p), p)
    return list(seen.values())
