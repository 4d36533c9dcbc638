"""Per-rank model-state bytes: the ZeRO formula at each stage, and gradient shards that hold memory only from a
backward to zero_grad."""

from __future__ import annotations

import pytest

from tests import _engine_cases as engine_cases
from tests._training import VOCAB, Scenario, sharded_run


# ---- per-rank model-state bytes follow the ZeRO formula ----------------------------------------
def _formula(stage: int, psi: int, n: int, lookup: int = 0) -> dict[str, float]:
    """fp32 AdamW model-state bytes per rank (params, grads, optimizer state incl. master copies).

    4 bytes per fp32 value; Adam keeps two moments (8 bytes). Stage 1 keeps the unsharded gradient
    buffer (reused across steps) and a reduced fp32 gradient shard; in fp32 the master weights are
    the parameters themselves, so no extra copy. Stage 0 (plain DP) keeps a reduced gradient copy.
    The `lookup` parameters (the input embedding) have no unsharded gradient buffer: their
    gradient travels as rows ([Note: sparse lookup gradients]).
    """
    return {
        0: {"parameters": 4 * psi, "gradients": 8 * psi - 4 * lookup, "optimizer_states": 8 * psi},
        1: {"parameters": 4 * psi, "gradients": 4 * (psi - lookup) + 4 * psi / n, "optimizer_states": 8 * psi / n},
        2: {"parameters": 4 * psi, "gradients": 4 * psi / n, "optimizer_states": 8 * psi / n},
        3: {"parameters": 4 * psi / n, "gradients": 4 * psi / n, "optimizer_states": 8 * psi / n},
    }[stage]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_follow_zero_formula(pools, stage):
    """Within 3% of the formula plus padding (each unit is padded to a multiple of the world size)
    and AdamW's per-tensor `step` counters. Stage 3's total is 16Ψ/N."""
    world = 2
    sc = Scenario(model="llama", stage=stage, world=world, steps=1, accum=1)
    results = pools(world).values(sharded_run, sc)
    psi = results[0]["numel"]
    n_units = 3  # two decoder layers and the root
    slack = n_units * world * 4 * 4 + 64 * 8  # padding in 4 buffers, plus scalar step counters
    expected = _formula(stage, psi, world, lookup=VOCAB * 64)  # the 256 x 64 input embedding
    for r in results:
        mem = r["memory"]
        for category, want in expected.items():
            got = mem.__getattribute__(category)["cpu"]
            assert abs(got - want) <= 0.03 * want + slack, (stage, category, got, want)
    if stage == 3:
        total = results[0]["memory"].total("cpu")
        assert abs(total - 16 * psi / world) <= 0.03 * 16 * psi / world + slack


def test_memory_drops_with_stage(pools):
    totals = []
    for stage in (0, 1, 2, 3):
        sc = Scenario(model="llama", stage=stage, world=2, steps=1, accum=1)
        totals.append(pools(2).values(sharded_run, sc)[0]["memory"].total())
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4, totals


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_shards_exist_only_from_backward_to_zero_grad(pools, stage):
    """[Note: gradient shard lifetime]: no gradient memory after initialize or after zero_grad (as
    with `set_to_none`); after each backward exactly this rank's fp32 shards (stage 2-3 free the
    unsharded gradients), kept through the step."""
    for r in pools(2).values(engine_cases.gradient_memory_over_steps, stage):
        assert r["initialized"] == r["zero_grad0"] == r["zero_grad1"] == 0, r
        assert r["backward0"] == r["step0"] == r["backward1"] == r["step1"] == r["shard_bytes"] > 0, r
        assert r["grads_bound_after_zero_grad"] == 0, r
