"""The checks every forward with grad makes before it runs: parameters that left the state `initialize` gave them.

Both raise on every rank alike (every rank holds the same parameters), at the first forward after the change.
"""

from __future__ import annotations

from .flat import FlatPart


def refuse_unfrozen(frozen_parts: list[FlatPart]) -> None:
    """[Note: requires_grad after initialize]
    Which parameters can train is fixed at `initialize`: a parameter frozen then lives in a frozen part (its
    only copy in the compute dtype, no master, no gradient buffer, no optimizer state: [Note: frozen
    parameters] in unit.py). Freezing a trainable one later is followed (its gradient is `None` while it
    is frozen, as in torch); unfreezing a frozen one is refused at the next forward, on every rank (the
    same parameters on each), before it could silently not train."""
    for part in frozen_parts:
        for name, p in zip(part.spec.param_names, part.params):
            if p.requires_grad:
                raise ValueError(
                    f"hf_zero: parameter '{name}' was frozen (requires_grad=False) when hf_zero.initialize ran and "
                    "now requires grad: hf_zero gives gradient, master and optimizer state only to the parameters "
                    "trainable at initialize, so it would never train. For progressive unfreezing, leave it "
                    "trainable at initialize (build the optimizer over it too) and freeze it with "
                    "requires_grad_(False) right after: hf_zero follows freezing and unfreezing from then on."
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
