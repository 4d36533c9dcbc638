"""Mixed precision and the stage-3 lifecycle (what is whole when)."""

from __future__ import annotations

import pytest

from tests import _lifecycle_cases as lifecycle_cases
from tests._parity import assert_tracks_fp32, reference, run_and_compare
from tests._training import Scenario, sharded_run


@pytest.mark.device_agnostic
@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_tracks_fp32_at_stages_1_and_2(pools, stage):
    """bf16 compute, fp32 master/optimizer/reduction: losses within 2e-2 relative of fp32 (bf16 has
    8 mantissa bits) over a trajectory that falls by more than 8%."""
    sc = Scenario(model="falcon", stage=stage, world=2, mixed_precision="bf16", lr=1e-2, repeat_batch=True)
    assert_tracks_fp32(pools(2).values(sharded_run, sc)[0], reference(sc.single()), tol=2e-2)


@pytest.mark.device_agnostic
def test_bf16_gradient_reduction(pools):
    """reduce_dtype='bf16' in fp32 training: the reduction is the only rounding, so losses stay
    within 1e-3 relative of fp32."""
    sc = Scenario(model="llama", stage=3, world=2, config_overrides=(("reduce_dtype", "bf16"),), lr=1e-2,
                  repeat_batch=True)
    assert_tracks_fp32(pools(2).values(sharded_run, sc)[0], reference(sc.single()), tol=1e-3)


@pytest.mark.device_agnostic
def test_fp16_with_dynamic_loss_scale_tracks_fp32(pools):
    """fp16 compute with the default loss scale: losses within 2e-2 relative of fp32 (fp16 keeps 11
    mantissa bits but a narrow range; the scale keeps small gradients representable)."""
    sc = Scenario(model="llama", stage=3, world=2, mixed_precision="fp16", lr=1e-2, repeat_batch=True)
    assert_tracks_fp32(pools(2).values(sharded_run, sc)[0], reference(sc.single()), tol=2e-2)


def test_fp16_overflow_skips_step_and_halves_scale(pools):
    for r in pools(2).values(lifecycle_cases.fp16_overflow_is_skipped):
        assert r["skipped"] and r["unchanged"]
        assert r["scale"] == 2.0**39


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_stage3_keeps_only_running_and_prefetched_units_whole(pools, checkpointing, prefetch):
    """While a block runs forward, the whole units are the root (the final norm), that block and,
    with prefetch, the next unit in forward order (its gather already issued: block 1, then the
    head): [root+block0+block1, root+block1+head]; without prefetch [root+block0, root+block1].
    The embedding is freed before the blocks run. After the forward only the head is whole (the
    last unit of the forward is the first of the backward: kept, not gathered twice); the backward
    gathers the root and the blocks (in reverse order) but neither the head (kept) nor the input
    embedding (a lookup's backward needs no weights). After the backward no unit is whole, and no
    unsharded gradient buffer is left."""
    for r in pools(2).values(lifecycle_cases.gathered_units_during_training, 3, checkpointing, prefetch):
        assert r["counts"] == ([3, 3] if prefetch else [2, 2]), r
        assert r["after_forward"] == ["lm_head"], r
        assert r["gathered_in_backward"] == ["", "model.layers.1", "model.layers.0"], r
        assert r["after_backward"] == 0
        assert r["unsharded_grads_after_backward"] == 0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_stage3_backward_holds_three_blocks_and_still_prefetches(pools, checkpointing):
    """[Note: reduction-gated prefetch] with 5 equal blocks and a head over twice their size, at every
    gradient of a block at most three block-sized buffers are alive: the running block's parameters
    and gradients, and either the previous block's reduction in flight or the next block's
    prefetched parameters, never both (four before the gate). The prefetch still happens: the
    backward gathers every block asynchronously (block 4 after the head's backward) and none on demand,
    with activation checkpointing too (the recomputation gathers nothing more)."""
    for r in pools(2).values(lifecycle_cases.block_buffers_in_backward, 5, checkpointing):
        assert r["max_alive"] == 3, r
        assert r["prefetched"] == [f"model.layers.{i}" for i in (4, 3, 2, 1, 0)], r
        assert r["on_demand"] == [], r


@pytest.mark.parametrize("checkpointing", [False, True])
def test_stage3_gated_backward_prefetch_matches(pools, checkpointing):
    """[Note: reduction-gated prefetch] engaged: 4 blocks of 2 K parameters, one unit each, under a 4 K
    head (the prefetch of each block waits for the previous block's reduction): same losses and
    weights as the single-process reference over 5 steps with accumulation and clipping."""
    run_and_compare(pools, Scenario(model="llama_deep", stage=3, world=2, checkpointing=checkpointing,
                                    config_overrides=(("bucket_size_mb", 0),)))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_stream_ordered_backward_prefetch_bounds_gathered_units_and_matches(pools, checkpointing):
    """The policy the engine takes on NCCL ([Note: reduction-gated prefetch]: no host polling, the prefetch
    issued at pre-backward behind the reduction), forced here on gloo: every block is still prefetched in
    reverse order and none gathered on demand; at most one more gradient buffer is alive than with the gate
    (four block-sized buffers), and training gives the reference's losses and weights."""
    for r in pools(2).values(lifecycle_cases.block_buffers_in_backward, 5, checkpointing, True):
        assert r["max_alive"] == 4, r
        assert r["prefetched"] == [f"model.layers.{i}" for i in (4, 3, 2, 1, 0)], r
        assert r["on_demand"] == [], r
    run_and_compare(pools, Scenario(model="llama_deep", stage=3, world=2, checkpointing=checkpointing,
                                    stream_ordered=True, config_overrides=(("bucket_size_mb", 0),)))


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_checkpointing_matches(pools, stage):
    """Activation checkpointing (non-reentrant, as transformers enables it) recomputes inside the
    unit's backward, after the unit was gathered: same losses and weights as the reference."""
    run_and_compare(pools, Scenario(model="llama", stage=stage, world=2, checkpointing=True))


@pytest.mark.parametrize("world", [2, 3])
def test_stage3_large_head_adds_only_its_own_buffers(pools, world):
    """With a head much larger than a block (vocab 2048 x 32 = 64 K parameters vs 10 K per block):
    - no block-sized buffer waits in the pool while the head runs its forward (the pool keeps only
      the sizes the next units take);
    - the last block is not gathered ahead while the head's backward runs (its prefetch would hold
      more than the head's parameters and gradients, the floor of the peak), whereas with a small
      head (vocab 64) it is gathered ahead as usual;
    - the head's reduction reads autograd's own gradient tensor when its flat layout has no padding
      (2 ranks: 65536 elements split evenly), and an attached flat buffer otherwise (3 ranks)."""
    large = pools(world).values(lifecycle_cases.large_head_backward, 2048)
    small = pools(world).values(lifecycle_cases.large_head_backward, 64)
    for r in large:
        assert r["pooled_at_head"] == 0, r
        assert r["block_whole_in_head_backward"] is False, r
        assert r["adopts"] is (world == 2) and r["adopted"] is (world == 2), r
    for r in small:
        assert r["block_whole_in_head_backward"] is True, r


def test_frozen_unit_is_resharded_as_soon_as_its_backward_is_through(pools):
    """[Note: backward end] a fully frozen block ends its backward on its inputs' gradient, like any other:
    by the time the embedding (the next unit in backward) gets its gradient, the block is sharded again."""
    for r in pools(2).values(lifecycle_cases.frozen_block_state_at_embedding_grad):
        assert r["frozen"] and r["block0_at_embedding_grad"] == ["sharded", "sharded"], r


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_floating_inputs_are_cast_to_the_compute_dtype(pools, stage, precision):
    """[Note: input dtype] a model fed fp32 features (in a dict too) under mixed precision: they reach its forward in
    the compute dtype, as FSDP2's default casts them (before: "mat1 and mat2 must have the same dtype" at the first
    matrix product); token ids stay integers and float `labels` stay fp32. bf16 losses track the fp32 model's within
    2e-2 relative over a trajectory that falls; fp16's first steps are skipped while the loss scale settles, so
    its loss is held to falling."""
    from tests import _engine_cases as engine_cases

    dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
    for r in pools(2).values(engine_cases.float_inputs_under_mixed_precision, stage, precision):
        assert r["seen"] == [dtype, dtype, "torch.int64", "torch.float32"], r["seen"]
        assert r["reference"][-1] < 0.8 * r["reference"][0], r["reference"]
        if precision == "fp16":
            assert r["losses"][-1] < r["losses"][0], r["losses"]
            continue
        for got, want in zip(r["losses"], r["reference"]):
            assert abs(got - want) <= 2e-2 * abs(want), (r["losses"], r["reference"])


def test_a_backbone_called_directly_gathers_each_bucket_once(pools):
    """[Note: bucket blocks skipped or repeated]: `model.model(...)` called outside the model's forward, its layers
    joined three by three: each bucket begins one forward per call (it stays open between its blocks until the backbone
    returns), and the weights after two steps equal one plain model's (fp32, 1e-5 relative)."""
    for r in pools(2).values(lifecycle_cases.backbone_called_directly, 0.3):
        assert len(r["begun"]) == 3 and set(r["begun"].values()) == {1}, r["begun"]
        assert r["worst"] <= 1e-5, r["worst"]
