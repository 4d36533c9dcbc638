"""The differential fuzzer (tests/_fuzz.py) on a fixed slice of seeds: every program at stages 1-3 equals torch's
DDP on the same 2 or 3 ranks (or is refused by name); `make fuzz` runs as many as asked (benchmarks/fuzz.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests import _fuzz as fuzz
from tests._fuzz_models import FLOWS, FlowNet, MoEBlock

SLICE = range(1000, 1010)  # fixed seeds: 10 programs, 30 runs beside DDP


@pytest.mark.parametrize("seed", SLICE)
def test_fuzzed_program_equals_ddp_or_is_refused(pools, seed):
    finding = fuzz.check(pools, fuzz.draw(seed), shrink_found=False)
    assert not finding.silent, (finding.outcomes, finding.program)


def test_the_grammar_draws_every_operation_and_setting():
    """The slice and the long runs reach what the grammar names: each kind of operation, clipping API and
    setting appears among 200 programs."""
    programs = [fuzz.draw(seed) for seed in range(200)]
    kinds = {op[0] for p in programs for op in p.ops}
    assert kinds == {"step", "eval", "nograd", "freeze", "lr", "resume", "snapshot", "rewind", "asave", "aload", "join"}
    clips = {op[3][0] for p in programs for op in p.ops if op[0] == "step" and op[3] is not None}
    assert clips == {"norm", "value", "optimizer", "model"}
    assert {p.offload for p in programs} == {"none", "optimizer", "params", "disk"}
    assert {p.optimizer for p in programs} == {"adamw", "sgd", "adam_amsgrad", "rmsprop", "adafactor", "muon_adamw",
                                               *fuzz.MORE_OPTIMIZERS}
    assert {p.bucket_mb for p in programs} == {0, 25}
    assert any(p.tie for p in programs) and any(p.batchnorm for p in programs) and any(p.scheduler for p in programs)
    assert any(p.frozen for p in programs) and any(p.amp for p in programs)
    assert any(len(p.frozen) == 2 for p in programs) and any(p.refrozen for p in programs)
    assert all(p.frozen for p in programs if p.refrozen)
    assert any(p.keep_grads for p in programs) and any(p.replicas for p in programs)
    assert {p.groups for p in programs} == {"one", "decay", "blocks", "named"}
    forwards = {op[5].split(":")[0] for p in programs for op in p.ops if op[0] == "step"}
    assert forwards == set(fuzz.FORWARDS)
    assert {p.flow for p in programs} == {*FLOWS, "tokens"}
    assert any(p.local_buffers for p in programs) and any(p.native for p in programs) and any(p.uneven for p in programs)
    assert {p.world for p in programs} == {2, 3} and {p.optimizers for p in programs} == {1, 2}
    mixed = [p for p in programs if p.mixed]
    assert mixed and all(op[1] == 1 for p in mixed for op in p.ops if op[0] == "step") and not any(p.amp for p in mixed)
    assert {p.dtype for p in mixed} == {"float32", "bfloat16"} and {p.dtype for p in programs if not p.mixed} == {
        "float32"}
    left_out = [p for p in programs if p.left_out >= 0]
    assert left_out and {p.left_out for p in left_out} == {0, 1, 2} and any(p.left_out < 0 for p in programs)
    assert all(p.left_out >= 0 and not p.scheduler for p in programs if any(op[0] == "join" for op in p.ops))
    assert {p.zero for p in programs} == {"optimizer", "model"}
    assert any(p.tied_head for p in programs) and all(p.flow == "tokens" for p in programs if p.tied_head)
    assert all(fuzz.Program.from_json(p.to_json()) == p for p in programs)  # clipping's tuples too


def _used(model: torch.nn.Module, *args: torch.Tensor) -> dict[str, bool]:
    out = model(*args)
    sum(o.sum() for o in (out if isinstance(out, tuple) else (out,))).backward()
    return {name: p.grad is not None and bool(p.grad.abs().sum() > 0) for name, p in model.named_parameters()}


def test_each_flow_moves_tensors_as_it_says():
    """The flows' models do what tests/_fuzz_models.py says: the second expert reached only by rows the data routes
    to it, the root's parameter read by every block, the first block's bias reaching the others' loss, block 0's
    output reaching the head past the others."""
    torch.manual_seed(0)
    x = torch.randn(4, 12)
    expert = MoEBlock()
    unrouted, routed = _used(expert, x.clamp(max=0.5)), _used(expert, x.clamp(min=0.6))
    assert not unrouted["alt.weight"] and routed["alt.weight"] and unrouted["gate.weight"]  # gate: the router loss
    x = torch.randn(4, 6)
    assert _used(FlowNet(3, False, "shared"), x)["shift"]
    relative = _used(FlowNet(3, False, "relative"), x)
    assert relative["blocks.0.rel"] and not relative["blocks.1.rel"] and not relative["blocks.2.rel"]
    torch.manual_seed(0)
    model = FlowNet(3, False, "long")
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)
    model.blocks[2].lin.weight.data.zero_()  # blocks 1-2 pass h through; the skip doubles block 0's output
    x = torch.randn(4, 6)
    torch.manual_seed(0)
    plain = FlowNet(3, False, "plain")
    h0 = model.blocks[0](model.inp(x))
    expected = model.head(model.blocks[2](model.blocks[1](h0)) + h0)
    assert torch.allclose(model(x), expected) and not torch.allclose(plain(x), expected)


def test_shrink_keeps_only_what_the_failure_needs():
    """A failure that needs a resume and BatchNorm: the shrunk program holds one step, the resume and BatchNorm."""
    program = dataclasses.replace(
        fuzz.draw(3), batchnorm=True, tie=True, scheduler=True, offload="optimizer",
        ops=(("step", 2, True, None, True), ("eval",), ("resume", 2), ("lr", 2.0), ("step", 1, False, None, False)),
    )
    seen = []

    def fails(p: fuzz.Program) -> bool:
        seen.append(p)
        return p.batchnorm and any(op[0] == "resume" for op in p.ops)

    shrunk = fuzz.shrink(program, fails)
    assert shrunk.batchnorm and not shrunk.tie and not shrunk.scheduler and shrunk.offload == "none"
    assert [op[0] for op in shrunk.ops] == ["resume", "step"] and len(seen) > 5
