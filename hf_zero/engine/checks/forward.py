"""The checks every forward of the model makes before it runs (`ForwardChecks`, told of each root forward: [Note:
pass events] in pass_events.py): uneven inputs under torch's `Join`, and parameters that left the state `initialize`
gave them (replaced, given new `.data`). Parameters unfrozen since `initialize` start training, or are refused, in
unfreeze.py ([Note: requires_grad after initialize]).

Each raises on every rank alike (every rank holds the same parameters), at the first forward after the change, before
the forward issues any collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..buffers import BufferSync
from ..flat import FlatPart
from ..pass_events import PassListener


class ForwardChecks(PassListener):
    """The checks of each forward of `model` (not a recomputation), first among the pass's listeners: uneven inputs
    ([Note: uneven inputs]) at every forward; with grad, or wherever the forward issues collectives (`gathers`: stage
    3, or the buffers' broadcast due, [Note: buffer broadcast] in buffers.py), the model's structure ([Note:
    parameters replaced after initialize]); with grad, parameters given new `.data` ([Note: replaced data]).
    `known`: id of each engine parameter or stand-in -> its name."""

    def __init__(
        self, model: nn.Module, known: Mapping[int, str], parts: list[FlatPart], gathers: bool, buffers: BufferSync
    ) -> None:
        self.model, self.parts, self.gathers, self.buffers = model, parts, gathers, buffers
        self.structure = ModelStructure(model, known)

    def root_forward(self) -> None:
        refuse_uneven_join(self.model)
        grad = torch.is_grad_enabled()
        if grad or self.gathers or self.buffers.due:
            self.structure.refuse_changes()
        if grad:
            refuse_replaced_data(self.parts)


def refuse_uneven_join(model: nn.Module) -> None:
    """[Note: uneven inputs]
    `torch.distributed.algorithms.Join([model])`, enabled (Accelerate's `join_uneven_inputs([model],
    even_batches=False)`): under DDP a rank out of batches leaves the loop and, at the context's exit, shadows the
    other ranks' gradient all-reduces with zeros until they finish, which every DDP forward tells it about. A
    sharded model's step is a gather and a reduce-scatter per unit and an optimizer step with its own collectives,
    which a rank without a batch cannot shadow: it would wait in a collective the others never match. So the
    first forward inside an enabled `Join` is refused, on every rank (each enters the context and runs a
    forward), and the context is switched off so that the model works after it. Disabled (`even_batches=True`,
    Accelerate's default), the context changes nothing, as with DDP (`ZeroModel.join_hook`)."""
    config = getattr(model, "_join_config", None)
    if config is None or not config.enable:
        return
    model._join_config = type(config).construct_disabled_join_config()
    raise ValueError(
        "hf_zero: torch's Join with uneven inputs (`accelerator.join_uneven_inputs([model], even_batches=False)`, "
        "`Join([model])`) is DDP's: a rank that runs out of batches shadows DDP's gradient all-reduce, but a "
        "sharded model's step is a gather and a reduce-scatter per unit, which a rank without a batch cannot "
        "shadow. Give every rank the same number of batches: Accelerate's even_batches=True (its default) or "
        "DataLoader(drop_last=True)."
    )


def refuse_replaced_data(parts: list[FlatPart]) -> None:
    """[Note: replaced data]
    At stages 0-2 every parameter is a view of its part's flat buffer for the engine's lifetime. `param.data =
    tensor` (weight surgery written for a plain module) points the parameter elsewhere: the module would compute
    with the new tensor while the steps update the flat buffer and the masters, silently apart. Refused at the
    next forward with grad, on every rank (the same parameters on each), naming the in-place way."""
    for part in parts:
        if not part.persistent:
            continue  # stage 3 swaps its parameters' storage at every gather
        for name, p, ptr in zip(part.spec.param_names, part.params, part.param_data_ptrs):
            if p.data_ptr() != ptr:
                raise ValueError(
                    f"hf_zero: parameter '{name}' had its `.data` replaced (`param.data = tensor`) after "
                    "hf_zero.initialize: its values live in the engine's flat buffer and fp32 master shards, so "
                    "the module would compute with the new tensor while training updated the old one. Change it "
                    "in place instead, where the masters see it: `with hf_zero.gathered_parameters([param], "
                    "modifier_rank=0): param.copy_(tensor)` on every rank, or model.load_state_dict(...)."
                )


# (a module's parameters, how many entries, how many of them hold one, its children, its children at the snapshot)
_Entry = tuple[dict[str, Any], int, int, dict[str, Any], dict[str, Any]]


class ModelStructure:
    """[Note: parameters replaced after initialize]
    The engine shards, reduces and steps the parameters `initialize` found, through the flat parts that own
    them. A parameter or module assigned to the model afterwards (`module.weight = nn.Parameter(t)`, `model.head
    = nn.Linear(...)`, a block appended, a bias set to `None`) is none of those: it would never be reduced across
    ranks or stepped (the optimizer was built over the old one), and at stage 3 the next gather writes the
    engine's parameter back into its holder, so the change is silently dropped. DDP's documentation forbids the
    same change after wrapping (its reducer keeps the old parameters).

    So each forward with grad (at stage 3, each forward) checks that the model is as `initialize` left it, before
    anything runs: every parameter entry holds an engine parameter or its stand-in (at stage 3 the holders hold
    either), and where a module's children changed, the whole model still holds them all (a parameterless module
    swapped, a checkpoint wrapper put around a block: accepted, as by DDP). Refused on every rank alike (the same
    model on each), naming the entry. A tensor that is not an `nn.Parameter` in a holder cannot come from an
    assignment (`nn.Module.__setattr__` takes only parameters there): it is a call's own, put there for its
    length (`torch.func.functional_call(model, {name: tensor}, ...)`), and is left to it (at stage 3 the gathers
    skip that holder too, `ModuleHolders.bind`). The check walks lists made at `initialize` (0.55 ms for an
    80-layer LLaMA's 1,047 modules on one core of this CPU, where `model.modules()` alone takes 2.8 ms).
    """

    def __init__(self, model: nn.Module, known: Mapping[int, str]) -> None:
        self.model = model
        self.known = known  # id(parameter or stand-in) -> name
        self.entries = self._snapshot()
        self.registered = sum(self._refuse_unknown(params) for params, *_ in self.entries)

    def _snapshot(self) -> list[_Entry]:
        return [
            (
                m._parameters,
                len(m._parameters),
                sum(p is not None for p in m._parameters.values()),
                m._modules,
                dict(m._modules),
            )
            for m in self.model.modules()
        ]

    # bookkeeping over every module: dynamo would unroll it and guard on each dict. torch.compiler.disable, applied
    # at the first call (importing dynamo costs ~1 s of `import hf_zero`, the CLI's start)
    @torch._disable_dynamo
    def refuse_changes(self) -> None:
        """Raise `ValueError` naming the first entry changed since `initialize` (see the class docstring)."""
        known = self.known
        for params, count, held, children, children_then in self.entries:
            now = 0
            for p in params.values():  # inline: this loop runs at every forward
                if p is not None:
                    if id(p) not in known and isinstance(p, nn.Parameter):
                        self._refuse_unknown(params)
                    now += 1
            if now != held or len(params) != count:
                raise ValueError(_replaced_message(f"parameters of {self._owner(params)} were added or removed"))
            if children != children_then:
                self._take_new_children(params, children, children_then)
                return  # the whole model was checked again

    def _refuse_unknown(self, params: dict[str, nn.Parameter | None]) -> int:
        """Raise naming a parameter of `params` the engine does not know; else how many entries hold one."""
        held = 0
        for p in params.values():
            if p is None:
                continue
            if id(p) not in self.known and isinstance(p, nn.Parameter):
                raise ValueError(_replaced_message(f"the parameter at {self._where(params, p)} is new"))
            held += 1
        return held

    def _take_new_children(
        self, params: dict[str, nn.Parameter | None], children: dict[str, Any], children_then: dict[str, Any]
    ) -> None:
        """A child assigned, added or deleted: accepted, and the lists made anew, where every parameter entry of the
        model still holds an engine parameter and none is gone (a parameterless module swapped, torch's
        activation-checkpoint wrapper put around a block, as DDP allows); else refused, naming the children."""
        entries = self._snapshot()
        held = sum(self._refuse_unknown(p) for p, *_ in entries)
        if held != self.registered:
            changed = sorted(
                k for k in children.keys() | children_then.keys() if children.get(k) is not children_then.get(k)
            )
            owner = self._owner(params).strip("'")
            where = [f"{owner}.{k}" if owner != "the model" else k for k in changed]
            raise ValueError(
                _replaced_message(
                    f"the submodules {where} were replaced or deleted ({self.registered - held} parameter entries gone)"
                )
            )
        self.entries = entries

    def _owner(self, params: dict[str, nn.Parameter | None]) -> str:
        name = next((n for n, m in self.model.named_modules(remove_duplicate=False) if m._parameters is params), "?")
        return f"'{name}'" if name else "the model"

    def _where(self, params: dict[str, nn.Parameter | None], p: nn.Parameter) -> str:
        owner = self._owner(params).strip("'")
        attr = next(a for a, q in params.items() if q is p)
        return f"'{owner}.{attr}'" if owner != "the model" else f"'{attr}'"


def _replaced_message(what: str) -> str:
    return (
        f"hf_zero: {what} since hf_zero.initialize (`module.weight = nn.Parameter(...)`, `model.head = "
        "nn.Linear(...)`, a module added, deleted or replaced): hf_zero shards, reduces and steps only the parameters "
        "it was given at initialize, so a new one would never train (at stage 3 its values would be dropped at the "
        "next gather). Make changes to the model's structure before hf_zero.initialize (and build the optimizer "
        "after them); to change a weight's values, copy them in place on every rank: `with "
        "hf_zero.gathered_parameters([param], modifier_rank=0): param.copy_(tensor)`, or model.load_state_dict(...). "
        "A PEFT adapter (get_peft_model, PeftModel.from_pretrained) goes on before sharding: on a model "
        "hf_zero.from_pretrained loads, pass peft_config=LoraConfig(...) or the adapter's directory to it."
    )
