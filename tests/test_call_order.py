"""DDP code that makes one of hf_zero's collective calls on rank 0 only ([Note: call order]): refused at once on
every rank, naming what each rank began, where before rank 0 waited in a collective the others never joined (a
hang until the process group's timeout) or, at stage 3, paired gathers of the wrong units. A forward without grad
at stages 1-2 involves no other rank: on rank 0 alone it is as local as under DDP."""

from __future__ import annotations

import pytest

from tests import _call_order_cases as cases

CALLS = {
    "state_dict": "gathering the weights",
    "full_state_dict": "gathering the weights",
    "gathered_parameters": "hf_zero.gathered_parameters",
    "save_checkpoint": "hf_zero.save_checkpoint",
    "eval_forward": "a forward without grad",
}


@pytest.mark.parametrize("stage, what", [(1, "state_dict"), (2, "gathered_parameters"), (3, "state_dict"),
                                         (3, "full_state_dict"), (1, "save_checkpoint"), (3, "eval_forward")])
def test_a_collective_call_on_one_rank_is_refused_on_every_rank(pools, tmp_path, stage, what):
    for rank, r in enumerate(pools(2).values(cases.one_rank_calls, stage, what, str(tmp_path / "out"))):
        error = r["error"]
        assert error is not None and error.startswith("ValueError"), (rank, error)
        assert "the ranks are in different collective calls" in error, error
        assert f"rank(s) [0] began {CALLS[what]}" in error, error
        assert "rank(s) [1] began a forward with grad" in error, error
        assert len(r["losses"]) == 1, r  # refused at the first call that differs: rank 1 in step 1's forward
        assert ("different numbers of them" in error) == (what == "eval_forward"), error  # uneven evaluation named


@pytest.mark.parametrize("stage", [1, 2])
def test_a_forward_without_grad_on_one_rank_is_local_at_stages_1_and_2(pools, tmp_path, stage):
    alone = pools(2).values(cases.one_rank_calls, stage, "eval_forward", str(tmp_path / "out"))
    plain = pools(2).values(cases.one_rank_calls, stage, "nothing", str(tmp_path / "out"))
    for got, want in zip(alone, plain):
        assert got["error"] is None, got["error"]
        assert got["losses"] == want["losses"]


@pytest.mark.parametrize("stage", [1, 3])
def test_a_backward_skipped_on_one_rank_is_refused_on_every_rank(pools, stage):
    """A backward skipped on rank 1 (its loss non-finite): rank 0's reductions met rank 1's next forward, a hang
    until the process group's timeout (as under DDP). The backward's header meets the forward's: both raise at
    once, naming what each began and how to decide the skip together."""
    for rank, r in enumerate(pools(2).values(cases.backward_skipped_on_one_rank, stage, timeout=60)):
        error = r["error"]
        assert error is not None and error.startswith("ValueError"), (rank, error)
        assert "rank(s) [0] began a backward" in error and "rank(s) [1] began a forward with grad" in error, error
        assert "torch.distributed.all_reduce(skip)" in error, error
        assert len(r["losses"]) == 2, r  # rank 0 raised in step 1's backward, rank 1 in step 2's forward


@pytest.mark.parametrize("apart", [False, True])
def test_on_a_stream_ordered_backend_the_backwards_header_adds_no_read(pools, apart):
    """On NCCL the headers are read where the engine waits anyway: the backward's is issued without reading the
    forward's (no host sync at the backward's start), and the next `read_headers` reads both, raising where apart."""
    for r in pools(2).values(cases.headers_read_where_deferred, not apart):
        assert (r["after_forward"], r["after_backward"], r["after_read"]) == (0, 0, 2), r
        if apart:
            assert r["error"] is not None and "rank(s) [0] began a backward" in r["error"], r
            assert "rank(s) [1] began a forward with grad" in r["error"], r
        else:
            assert r["error"] is None, r
