"""Embedding gradients as rows (and the dense fallback), and optimizer chunks stepping like whole pieces."""

from __future__ import annotations

import pytest

from tests import _engine_cases as engine_cases


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_embedding_gradient_travels_as_rows(pools, stage):
    """[Note: sparse lookup gradients]: with few tokens per rank the input embedding's gradient is
    exchanged as rows (no dense embedding-sized reduction), and its shard equals the dense gradient
    of an unsharded replica that ran every rank's batch (fp32, 1e-6 of the largest entry); the
    module's `sparse` switch is back off after the forward."""
    for r in pools(2).values(engine_cases.lookup_gradient_rows, stage, 24):
        assert r["sparse_lookup"] and r["paths"] == ["rows"], r
        assert r["max_abs_err"] <= 1e-6 * r["scale"], r
        assert r["sparse_after_forward"] is False, r


@pytest.mark.parametrize("world", [2, 3])
def test_embedding_gradient_falls_back_to_dense_on_every_rank(pools, world):
    """When the rows would outweigh the dense collective (many tokens per rank), or when one rank's
    forward bypassed the module and got a dense gradient, every rank takes the dense path (no rank
    is left in a different collective) and the shard still equals the reference. 3 ranks: shard
    boundaries cut through embedding rows."""
    many = pools(world).values(engine_cases.lookup_gradient_rows, 3, 200)
    bypass = pools(world).values(engine_cases.lookup_gradient_rows, 2, 24, 1)  # stage 2: the weight is whole
    few = pools(world).values(engine_cases.lookup_gradient_rows, 3, 24)
    for r in many + bypass:
        assert r["paths"] == ["dense"], r
        assert r["max_abs_err"] <= 1e-6 * r["scale"], r
    for r in few:
        assert r["paths"] == ["rows"] and r["max_abs_err"] <= 1e-6 * r["scale"], r


@pytest.mark.parametrize("stage", [1, 3])
def test_optimizer_chunks_step_and_checkpoint_like_whole_pieces(pools, tmp_path, stage):
    """[Note: optimizer chunks]: with chunks of 1000 elements the optimizer gets more tensors than
    there are pieces, and 3 steps of AdamW with clipping give the same weights as whole pieces
    (fp32, 1e-6 of the largest weight); checkpoints move between chunkings both ways, and the
    step after the resume agrees with the run that never stopped."""
    for r in pools(2).values(engine_cases.optimizer_chunks, stage, 1000, str(tmp_path)):
        assert r["chunks"] > r["pieces"], r
        assert r["weights_err"] <= 1e-6 * r["scale"], r
        assert r["resumed_err"] <= 1e-6 * r["scale"], r


@pytest.mark.parametrize("stage", [0, 1, 3])
@pytest.mark.parametrize("distinct", [2, 40], ids=["rows", "dense"])
def test_a_tokens_rows_are_summed_in_float32_under_bf16(pools, stage, distinct):
    """A token looked up 1000 times per rank under bf16 mixed precision: its rows are summed in float32 and rounded
    once (as an accelerator's embedding backward sums), on the row exchange and on the dense path alike, and at
    stages 0-1, whose kept gradient buffer no longer takes autograd's bf16 accumulation: the gradient is 10.0 (0.01
    x 1000, the mean over ranks), where summing in bf16 stalled at 4.0, and each step the same."""
    for r in pools(2).values(engine_cases.repeated_token_in_bf16, stage, distinct):
        assert all(abs(c - 10.0) <= 1e-5 for step in r["changes"] for c in step), r  # fp32 masters near -20
        assert ("rows" in r["paths"]) == (distinct == 2), r
