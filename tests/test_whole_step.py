"""Optimizers that need whole parameters ([Note: whole-parameter step]) match single-process training.

Tolerance: the reference's own fp32 noise, measured in the same run as the distance between the
single-process reference with the whole global batch in one backward and the same reference with one
backward per micro-batch (the sharded run's order of summation); the sharded run must be within 10x
that noise of the first. The noise is an optimizer's own: about 1e-7 for Adafactor and LARS here, but
1e-2 for Muon, whose Newton-Schulz iterations run in bfloat16. With the whole-parameter path disabled
(the optimizer declared elementwise), LARS lands far outside it.
"""

from __future__ import annotations

import functools
import pytest

from tests._optimizers import checkpoint_with_adafactor, sharded_run_on_flat_shards
from tests._training import Scenario, reference_run, rel_err, sharded_run

OPTIMIZERS = {"torch_adafactor": 1e-2, "hf_adafactor": 1e-2, "lars": 1e-1, "muon_adamw": 1e-2}


@functools.lru_cache(maxsize=None)
def _references(sc: Scenario) -> tuple[dict, float]:
    """The reference and its noise (the largest relative difference over losses and weights)."""
    ref, accumulated = reference_run(sc), reference_run(sc, accumulate=True)
    return ref, _distance(accumulated, ref)


def _distance(got: dict, ref: dict) -> float:
    losses = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    return max(losses, *(rel_err(got["state"][k], ref["state"][k]) for k in ref["state"]))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_whole_parameter_optimizers_match_single_process(pools, optimizer, stage):
    sc = Scenario(model="llama", stage=stage, world=2, steps=4, optimizer=optimizer, lr=OPTIMIZERS[optimizer])
    ref, noise = _references(sc.single())
    got = pools(2).values(sharded_run, sc)[0]
    assert set(got["state"]) == set(ref["state"])
    distance = _distance(got, ref)
    assert distance <= max(10 * noise, 1e-7), (distance, noise)


def test_lars_on_flat_shards_is_wrong(pools):
    """The same LARS run with the whole-parameter path disabled: its per-tensor norms are taken over each rank's
    flat piece, and the weights land far outside the noise (the test above would fail)."""
    sc = Scenario(model="llama", stage=3, world=2, steps=4, optimizer="lars", lr=OPTIMIZERS["lars"])
    ref, noise = _references(sc.single())
    got = pools(2).values(sharded_run_on_flat_shards, sc)[0]
    assert _distance(got, ref) > 100 * max(noise, 1e-7), (_distance(got, ref), noise)


def test_checkpoints_refuse_a_whole_parameter_optimizer_clearly(pools, tmp_path):
    for r in pools(2).values(checkpoint_with_adafactor, str(tmp_path / "ckpt")):
        assert r["whole"] and len(r["errors"]) == 2, r
        assert all("do not hold the state of optimizers that step on whole parameters" in e for e in r["errors"])
