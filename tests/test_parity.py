"""Every stage computes what unsharded training computes.

Tolerance (fp32, tests/_parity.py): per-step losses within 1e-5 relative of the single-process reference on the
same global batch, and every final weight tensor within 1e-5 relative (‖w − w_ref‖ / ‖w_ref‖),
over 5 optimizer steps with gradient accumulation 2, global-norm clipping at 1.0 and AdamW with
two weight-decay groups. The gradient norms returned by `clip_grad_norm_` match the reference's
within 1e-5 relative as well.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests._parity import assert_tracks_fp32, reference, run_and_compare
from tests._training import Scenario, sharded_run

# Every rank function here follows tests._dist.device(): on a machine with a GPU per rank the pools run on
# CUDA + NCCL (make gpu-check), elsewhere on CPU + gloo.
pytestmark = pytest.mark.device_agnostic


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("model", ["llama", "falcon"])
def test_stage_matches_single_process(pools, model, stage, world):
    run_and_compare(pools, Scenario(model=model, stage=stage, world=world))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_sync_accumulation_matches(pools, stage):
    """`with model.no_sync():` on the first micro-batch gives the same update as syncing every one."""
    run_and_compare(pools, Scenario(model="llama", stage=stage, world=2, use_no_sync=True))


@pytest.mark.parametrize("stage", [1, 3])
def test_frozen_parameters(pools, stage):
    """Frozen parameters stay put, and the rest still matches (they share flat units with trainable ones)."""
    sc = Scenario(model="llama", stage=stage, world=3, frozen=("layers.0.mlp.gate_proj", "embed_tokens"))
    got = run_and_compare(pools, sc)
    from tests._training import make_model

    initial = make_model("llama").state_dict()
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.embed_tokens.weight"):
        np.testing.assert_array_equal(got["state"][name], initial[name].numpy())


@pytest.mark.parametrize("world", [2, 3])
def test_odd_sizes_and_unit_smaller_than_world(pools, world):
    """A non-HF model (auto-wrap falls back to the repeated ModuleList blocks) whose parameter counts
    are odd, plus a named 2-element unit that is smaller than the world size."""
    sc = Scenario(model="toy", stage=3, world=world, wrap=("ToyBlock", "ToyGain"))
    run_and_compare(pools, sc)
    run_and_compare(pools, Scenario(model="toy", stage=2, world=world))


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_mixed_precision_tracks_fp32(pools, world):
    """bf16 compute with fp32 master weights and fp32 reduction at stage 3: losses within 2e-2 relative of
    fp32 (bf16 keeps 8 bits of mantissa, about 3 significant digits) over a trajectory that falls by more. At a
    world of one each use casts the masters ([Note: a shard group of one])."""
    sc = Scenario(model="llama", stage=3, world=world, mixed_precision="bf16", lr=1e-2, repeat_batch=True)
    assert_tracks_fp32(pools(world).values(sharded_run, sc)[0], reference(sc.single()), tol=2e-2)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_native_collectives_match(pools, stage, world):
    """The backend's own all-gather/reduce-scatter (what NCCL runs) give the same training as the
    composed collectives `collectives="auto"` picks on gloo."""
    run_and_compare(pools, Scenario(model="llama", stage=stage, world=world, config_overrides=(("collectives", "native"),)))


@pytest.mark.parametrize("stage, world, checkpointing", [(3, 2, False), (3, 3, True), (2, 2, False), (1, 3, False)])
def test_bucketed_units_match(pools, stage, world, checkpointing):
    """`bucket_size_mb` large enough to join both blocks of the tiny LLaMA into one unit (one
    all-gather and one reduce-scatter for the two), with and without activation checkpointing."""
    sc = Scenario(model="llama", stage=stage, world=world, checkpointing=checkpointing,
                  config_overrides=(("bucket_size_mb", 0.2),))
    run_and_compare(pools, sc)
