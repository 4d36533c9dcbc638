"""Hybrid sharding: shard within groups of ranks, replicate across them (4 processes = 2 groups of 2)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests import _engine_cases as engine_cases
from tests._parity import run_and_compare
from tests._training import Scenario, rel_err, sharded_run

HYBRID = (("shard_group_size", 2),)


# stage 1 in the slow tier (its replicas are stage 3's; the groups, reductions and resume stay in the suite)
@pytest.mark.device_agnostic
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_hybrid_matches_single_process(pools, stage):
    """fp32, 5 steps, accumulation 2, clipping: losses and weights within 1e-5 of one process."""
    run_and_compare(pools, Scenario(model="falcon", stage=stage, world=4, config_overrides=HYBRID))


@pytest.mark.device_agnostic
def test_hybrid_holds_the_model_states_of_its_group(pools):
    """Each rank holds what a rank of a 2-rank world holds (16Ψ/2 at stage 3), not 16Ψ/4."""
    hybrid = pools(4).values(sharded_run, Scenario(model="llama", stage=3, world=4, steps=1, accum=1,
                                                   config_overrides=HYBRID))
    plain = pools(2).values(sharded_run, Scenario(model="llama", stage=3, world=2, steps=1, accum=2))
    assert hybrid[0]["memory"].total() == plain[0]["memory"].total()


@pytest.mark.device_agnostic
def test_hybrid_checkpoint_resumes_under_plain_stage_3(pools, tmp_path):
    """Saved by 4 ranks in 2 groups of 2, resumed on 2 ranks fully sharded (same global batch)."""
    before = Scenario(model="llama", stage=3, world=4, accum=1, steps=5, config_overrides=HYBRID)
    after = Scenario(model="llama", stage=3, world=2, accum=2, steps=5)
    straight = pools(4).values(sharded_run, before)[0]
    pools(4).values(sharded_run, replace(before, stop_step=3, save_to=str(tmp_path / "ckpt")))
    resumed = pools(2).values(sharded_run, replace(after, seed=1, start_step=3, load_from=str(tmp_path / "ckpt")))[0]
    np.testing.assert_allclose(resumed["losses"], straight["losses"][3:], rtol=1e-6)
    for name, value in straight["state"].items():
        assert rel_err(resumed["state"][name], value) <= 1e-5, name


def test_shard_group_size_must_divide_the_world(pools):
    for r in pools(2).run(engine_cases.initialize_with_config, {"stage": 3, "shard_group_size": 3}):
        assert r.error_type == "ValueError" and "must divide the world size (2)" in r.error


def test_engines_made_one_after_another_reuse_their_process_groups(pools):
    """[Note: groups made once]: the groups of hybrid sharding, sequence parallelism and background saves are made
    by the first engine and reused by the next ones (each engine made its own: 600 gloo groups, 1800 threads per
    rank, after the fuzzer's 600 programs)."""
    for counts in pools(2).values(engine_cases.groups_after_engines, 3):
        assert counts[0] == counts[1] == counts[2], counts
