"""Every way users train gives the reference's numbers: torch's activation-checkpoint wrappers and
`checkpoint(layer, ...)` in user code, experts that no token of a rank reaches, LayerDrop.

Tolerance as in test_parity.py: fp32, losses, gradient norms and every weight within 1e-5
relative of single-process training, 5 steps, accumulation 2, clipping 1.0.
"""

from __future__ import annotations

import pytest

from tests._parity import run_and_compare
from tests._training import Scenario


@pytest.mark.parametrize("bucket_mb", [0, 25], ids=["unit-per-block", "bucketed"])
@pytest.mark.parametrize("ac", ["wrapper", "wrapper_reentrant"])
def test_checkpoint_wrapper_at_stage3_matches_and_gathers_each_unit_at_most_twice(pools, ac, bucket_mb):
    """torch's `apply_activation_checkpointing(..., checkpoint_wrapper, check_fn=is LlamaDecoderLayer)`,
    the FSDP recipe: the blocks' own hooks run again during recomputation."""
    sc = Scenario(model="llama", stage=3, world=2, ac=ac, config_overrides=(("bucket_size_mb", bucket_mb),))
    got = run_and_compare(pools, sc)
    assert 1 <= got["max_gathers"] <= 2, got["max_gathers"]


@pytest.mark.parametrize("bucket_mb", [0, 25], ids=["unit-per-block", "bucketed"])
@pytest.mark.parametrize("ac", ["user", "user_reentrant"])
def test_checkpoint_in_user_code_at_stage3_matches(pools, ac, bucket_mb):
    """`torch.utils.checkpoint.checkpoint(block, x)` in the model's own forward; bucketed, a block in the
    middle of a unit is replayed alone."""
    sc = Scenario(model="toy", stage=3, world=2, ac=ac, config_overrides=(("bucket_size_mb", bucket_mb),))
    got = run_and_compare(pools, sc)
    assert 1 <= got["max_gathers"] <= 2, got["max_gathers"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_experts_unused_on_one_rank_match_and_never_hang(pools, stage, world):
    run_and_compare(pools, Scenario(model="moe", stage=stage, world=world))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_layer_drop_on_odd_steps_matches(pools, stage, world):
    run_and_compare(pools, Scenario(model="layerdrop", stage=stage, world=world))
