"""A unit's states ([Note: unit lifecycle]): the enum is the truth, and every verb refuses the states it may not
be called in, naming the rank and the unit, and leaves the states as they were. One process (a world of one),
tiny LLaMA."""

from __future__ import annotations

from typing import Any

import pytest

import hf_zero
from hf_zero.engine.lifecycle import GradState, PassState, ShardState, TrainingState
from hf_zero.engine.passes import Pass
from hf_zero.engine.unit import Prefetch
from tests._training import make_model

IDLE, FORWARD, IN_BACKWARD, REDUCING = (
    TrainingState.IDLE,
    TrainingState.FORWARD,
    TrainingState.IN_BACKWARD,
    TrainingState.REDUCING,
)


def _unit(stage: int) -> Any:
    """Layer 0's unit of a tiny LLaMA in a world of one. Stage 3 over a shard group of one keeps the parameters whole
    ([Note: a shard group of one]) unless they rest on the host: offload_params makes it gather and free them."""
    offload = {"offload_optimizer": True, "offload_params": True} if stage == 3 else {}
    config = hf_zero.ZeroConfig(stage=stage, bucket_size_mb=0, **offload)
    model, _ = hf_zero.initialize(make_model("llama"), None, config)
    return next(u for u in model.zero_engine.units if u.spec.name == "model.layers.0")


def _drive(unit: Any, state: TrainingState) -> None:
    """Bring an IDLE unit to `state` through its own verbs (the states are read-only from outside)."""
    if state is FORWARD:
        unit.begin_forward()
    elif state in (IN_BACKWARD, REDUCING):
        unit.begin_backward()
        if state is REDUCING:
            unit.end_backward()
    assert unit.training_state is state


@pytest.mark.parametrize("state", [FORWARD, IN_BACKWARD, REDUCING])
def test_a_prefetch_of_a_unit_in_use_does_nothing(state):
    """A pass off the plan (a unit reused, two forwards before a backward) may ask to prefetch a unit whose forward or
    backward runs: nothing is issued and no state moves."""
    unit = _unit(3)
    _drive(unit, state)
    unit.prefetch()
    assert (unit.shard_state, unit.training_state) == (ShardState.SHARDED, state)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_shard_group_of_one_keeps_stage_3_parameters_whole(stage):
    """Stage 3 in a world of one gathers nothing: the unit is whole at rest, as at stages 1-2."""
    model, _ = hf_zero.initialize(make_model("llama"), None, hf_zero.ZeroConfig(stage=stage))
    engine = model.zero_engine
    assert not engine.plan.params.uses_gather
    assert all(u.is_unsharded for u in engine.units)
    float(model.model.layers[0].mlp.up_proj.weight.detach().sum())  # readable between steps


# (verb, its arguments, a training state in which it is illegal)
ILLEGAL = [
    ("unshard", (), REDUCING),
    ("reshard", (), FORWARD),
    ("reshard", (), IN_BACKWARD),
    ("begin_forward", (), FORWARD),
    ("begin_forward", (), IN_BACKWARD),
    ("begin_forward", (), REDUCING),
    ("expect_signal", (), IDLE),
    ("end_forward", (), IDLE),
    ("end_forward", (), IN_BACKWARD),
    ("end_forward", (), REDUCING),
    ("begin_backward", (), FORWARD),
    ("begin_backward", (), REDUCING),
    ("signal", (), IDLE),
    ("signal", (), FORWARD),
    ("attach_grads", (), IDLE),
    ("attach_grads", (), REDUCING),
    ("mark_used", ("param",), IDLE),
    ("mark_used", ("param",), REDUCING),
    ("end_backward", (), IDLE),
    ("end_backward", (), FORWARD),
    ("collect_grads", (), IN_BACKWARD),
    ("reduce_grads", (), IDLE),
    ("reduce_grads", (), IN_BACKWARD),
    ("finish_reduction", (None, 1.0), IDLE),
    ("finish_reduction", (None, 1.0), IN_BACKWARD),
    ("release_reduced", (None,), FORWARD),
    ("end_pass", (), FORWARD),
    ("end_pass", (), IN_BACKWARD),
    ("give_back", (), FORWARD),
    ("give_back", (), IN_BACKWARD),
    ("give_back", (), REDUCING),
]


@pytest.mark.parametrize("verb,args,state", ILLEGAL, ids=[f"{v}-{s.value}" for v, _, s in ILLEGAL])
def test_each_verb_refuses_the_states_it_may_not_be_called_in(verb, args, state):
    unit = _unit(3)
    unit.unshard() if verb == "reshard" else None  # reshard of a gathered unit: the memory a running pass uses
    _drive(unit, state)
    shard_before = unit.shard_state
    args = tuple(unit.params[0] if a == "param" else a for a in args)
    pattern = rf"\[rank 0\] hf_zero: {verb} on unit 'model\.layers\.0' in state {shard_before.value}/{state.value}"
    with pytest.raises(RuntimeError, match=pattern):
        getattr(unit, verb)(*args)
    assert (unit.shard_state, unit.training_state) == (shard_before, state)


def test_verbs_that_need_more_than_a_training_state():
    """hold needs a gathered unit, unpin a pinned one, the prefetch targets are fixed once."""
    unit = _unit(3)
    with pytest.raises(RuntimeError, match=r"\[rank 0\] hf_zero: hold on unit 'model\.layers\.0' in state sharded"):
        unit.hold()
    with pytest.raises(RuntimeError, match=r"\[rank 0\] hf_zero: unpin on unit 'model\.layers\.0'.*not pinned"):
        unit.unpin()
    unit.plan_prefetch(Prefetch())
    with pytest.raises(RuntimeError, match=r"\[rank 0\] hf_zero: plan_prefetch on unit 'model\.layers\.0'"):
        unit.plan_prefetch(Prefetch())


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_persistent_unit_refuses_to_be_freed(stage):
    """Stages 0-2 keep the parameters whole: reshard raises and frees nothing, and so do the raw moves of its
    parts."""
    unit = _unit(stage)
    with pytest.raises(RuntimeError, match=r"\[rank 0\] hf_zero: reshard on unit '[^']+' in state unsharded/idle"):
        unit.reshard()
    part = unit.parts[0]
    for raw in (part.free, part.gather):
        with pytest.raises(RuntimeError, match=r"\[rank 0\] hf_zero: (free|gather) on a part of unit"):
            raw()
    assert unit.is_unsharded and part.unsharded_param.untyped_storage().nbytes() > 0


def test_the_transitions_are_idempotent_where_the_table_says():
    """Stage 3: unshard of a whole unit and reshard of a sharded one do nothing; a pinned unit stays whole;
    a prefetched unit is waited for, not gathered twice."""
    unit = _unit(3)
    assert unit.shard_state is ShardState.SHARDED
    unit.prefetch()
    assert unit.shard_state is ShardState.GATHERING
    unit.prefetch()  # in flight already: nothing to do
    unit.unshard()
    assert unit.shard_state is ShardState.UNSHARDED
    unit.unshard()
    unit.pin()
    unit.reshard()  # pinned: stays whole
    assert unit.is_unsharded
    unit.unpin()
    unit.reshard()
    unit.reshard()
    assert unit.shard_state is ShardState.SHARDED


def test_reading_a_units_state_never_consults_storage_sizes():
    """`is_unsharded` reads the state: a sharded unit whose buffers are given bytes by hand still reads sharded,
    and a gathered unit whose buffers are emptied by hand still reads gathered."""
    unit = _unit(3)
    storages = [p.unsharded_param.untyped_storage() for p in unit.parts]
    sizes = [p.layout.padded_numel * p.unsharded_param.element_size() for p in unit.parts]
    for storage, n in zip(storages, sizes):
        storage.resize_(n)
    try:
        assert not unit.is_unsharded and unit.needs_gather
    finally:
        for storage in storages:
            storage.resize_(0)
    unit.unshard()
    for storage in storages:
        storage.resize_(0)
    try:
        assert unit.is_unsharded and not unit.needs_gather
    finally:
        for storage, n in zip(storages, sizes):
            storage.resize_(n)
        unit.reshard()


def test_the_states_are_read_only_from_outside():
    unit = _unit(3)
    for field in ("shard_state", "training_state", "held"):
        with pytest.raises(AttributeError):
            setattr(unit, field, getattr(unit, field))
    with pytest.raises(AttributeError):
        unit.parts[0].grads.state = GradState.SUMMED
    with pytest.raises(AttributeError):
        Pass().state = PassState.BACKWARD
    for field in ("deferred", "create_graph", "gated", "ran_anywhere", "has_pending"):
        with pytest.raises(AttributeError):
            setattr(Pass(), field, getattr(Pass(), field))


def test_only_the_pass_touches_its_facts():
    """[Note: pass state]: every fact of the running pass (reductions in flight, the gate, what ran, the units
    check, deferral, the direct call) and of the accumulation across passes (no_sync, unsynced, gradients reduced
    or resting) is a private field of `Pass`, changed only by its verbs: no other module of the package reads or
    writes one on another object (`x.current._pending`), and neither the hooks nor the engine keep one of their
    own."""
    import ast
    import dataclasses
    from pathlib import Path

    import hf_zero

    private = {f.name for f in dataclasses.fields(Pass) if f.name.startswith("_")}
    assert {"_pending", "_gated", "_deferred", "_check_in_flight", "_state", "_direct_call", "_root_calls"} <= private
    assert {"_reduces", "_in_no_sync", "_unsynced", "_has_grads", "_grads_resting"} <= private
    root = Path(hf_zero.__file__).parent
    reaches = [
        f"{path.relative_to(root)}:{node.lineno} .{node.attr}"
        for path in root.rglob("*.py")
        if path.name != "passes.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in private
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")  # other classes' own fields
    ]
    assert reaches == []
    from hf_zero.engine import engine, hooks

    kept = [  # the pass's facts assigned anywhere but in Pass (`self.unsynced = ...` in the hooks, say)
        f"{module.__name__}:{node.lineno} .{target.attr}"
        for module in (engine, hooks)
        for node in ast.walk(ast.parse(Path(module.__file__).read_text()))
        if isinstance(node, ast.Assign | ast.AugAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute) and target.attr.lstrip("_") in {name.lstrip("_") for name in private}
    ]
    assert kept == []


def test_each_gradient_verb_refuses_the_states_it_may_not_be_called_in():
    """[Note: gradient states]: driven through the unit's verbs at stage 1 (the unsharded buffer kept across
    reductions), every legal move lands in the state the table names, and every illegal one raises with the
    rank and the unit, moving nothing."""
    unit = _unit(1)
    grads = unit.trainable_parts[0].grads
    assert grads.state is GradState.EMPTY and grads.is_zero
    unit.begin_backward()
    unit.attach_grads()
    assert grads.state is GradState.HELD
    unit.end_backward()
    unit.collect_grads()
    reduction = unit.reduce_grads(async_op=True)
    assert grads.state is GradState.IN_FLIGHT and grads.is_zero

    def refused(verb: str, call: Any) -> None:
        pattern = rf"\[rank 0\] hf_zero: {verb} on the gradients of unit 'model\.layers\.0' in state in_flight"
        with pytest.raises(RuntimeError, match=pattern):
            call()
        assert grads.state is GradState.IN_FLIGHT

    refused("zero", grads.zero)  # zero_grad with a reduction in flight: its sum would land in released memory
    refused("attach", grads.attach)  # accumulating into the buffer the reduction reads
    refused("collect", grads.collect)
    refused("reduce", lambda: grads.reduce(async_op=True))  # the same buffer reduced twice
    refused("clear_buffer", grads.clear_buffer)
    unit.finish_reduction(reduction, 1.0)
    assert grads.state is GradState.SUMMED and not grads.is_zero
    with pytest.raises(RuntimeError, match=r"\[rank 0\] hf_zero: finish on the gradients of unit .* in state summed"):
        grads.finish(reduction[0], 1.0)  # finished already
    grads.zero()
    assert grads.state is GradState.EMPTY and grads.is_zero


def test_the_pass_refuses_the_moves_it_may_not_make():
    """[Note: pass state]: the pass's verbs move PassState only where the table says, raising with the rank."""
    p = Pass(rank=3)
    p.end_forward()  # IDLE: nothing to do
    p.begin_forward()
    with pytest.raises(RuntimeError, match=r"\[rank 3\] hf_zero: begin_forward on the pass in state forward"):
        p.begin_forward()
    p.begin_backward()
    assert p.in_backward
    for verb in ("begin_forward", "end_forward", "begin_backward"):
        with pytest.raises(RuntimeError, match=rf"\[rank 3\] hf_zero: {verb} on the pass in state backward"):
            getattr(p, verb)()
    assert p.state is PassState.BACKWARD


def test_gradients_held_while_a_reduction_is_in_flight():
    """[Note: gradient states]: at stages 2-3 a backward may accumulate while the previous micro-step's reduction
    is in flight (its buffer let go): both facts at once, `zero` refused until it lands, the sum kept after."""
    unit = _unit(3)
    grads = unit.trainable_parts[0].grads
    unit.begin_backward()
    unit.attach_grads()
    unit.end_backward()
    unit.collect_grads()
    reduction = unit.reduce_grads(async_op=True)
    grads.attach()
    assert grads.state is GradState.HELD | GradState.IN_FLIGHT and grads.is_zero
    with pytest.raises(RuntimeError, match=r"zero on the gradients of unit .* in state held\+in_flight"):
        grads.zero()
    unit.finish_reduction(reduction, 1.0)
    assert grads.state is GradState.HELD | GradState.SUMMED and not grads.is_zero
