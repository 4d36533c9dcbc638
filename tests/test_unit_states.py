"""A unit's storage state ([Note: unit lifecycle]): the enum is the truth, and the verbs refuse the states they
may not be called in, naming the rank and the unit. One process (a world of one), tiny LLaMA."""

from __future__ import annotations

import pytest

import hf_zero
from hf_zero.engine.lifecycle import ShardState
from tests._training import make_model


def _unit(stage: int):  # noqa: ANN202
    model, _ = hf_zero.initialize(make_model("llama"), None, hf_zero.ZeroConfig(stage=stage))
    return model.zero_engine.parts[0]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_persistent_unit_refuses_to_be_freed(stage):
    """Stages 0-2 keep the parameters whole: reshard raises and frees nothing."""
    unit = _unit(stage)
    with pytest.raises(RuntimeError, match=r"\[rank 0\] hf_zero: reshard on unit '[^']+' in state unsharded"):
        unit.reshard()
    assert unit.is_unsharded and unit.unsharded_param.untyped_storage().nbytes() > 0


def test_a_second_gather_into_whole_parameters_is_refused():
    """Stage 3: the raw gather is legal only from SHARDED; on a gathered unit it raises (it would write into
    parameters in use); the transitions stay legal and idempotent."""
    unit = _unit(3)
    assert unit.state is ShardState.SHARDED
    unit.ensure_unsharded()
    with pytest.raises(RuntimeError, match=r"\[rank 0\] hf_zero: gather on unit '[^']+' in state unsharded"):
        unit.gather()
    unit.ensure_unsharded()  # again: nothing to do
    unit.reshard()
    unit.reshard()  # again: nothing to do
    assert unit.state is ShardState.SHARDED


def test_reading_a_units_state_never_consults_storage_sizes():
    """`is_unsharded` reads the state: a sharded unit whose buffer is given bytes by hand still reads sharded,
    and a gathered unit whose buffer is emptied by hand still reads gathered."""
    unit = _unit(3)
    storage = unit.unsharded_param.untyped_storage()
    nbytes = unit.layout.padded_numel * unit.unsharded_param.element_size()
    storage.resize_(nbytes)
    try:
        assert not unit.is_unsharded
    finally:
        storage.resize_(0)
    unit.ensure_unsharded()
    storage.resize_(0)
    try:
        assert unit.is_unsharded
    finally:
        storage.resize_(nbytes)
        unit.reshard()
