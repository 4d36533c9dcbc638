"""`optimizer.state_dict()` / `optimizer.load_state_dict(...)` of a sharded optimizer as DDP code uses them
([Note: optimizer state dicts]): each rank's own part resumes exactly, a plain optimizer's state (a DDP run's) is cut
to each rank's pieces, and one rank's part loaded on every rank is refused on every rank instead of resuming the
others with rank 0's moments. 2 gloo ranks, fp32, against plain data parallelism (1e-5 relative)."""

from __future__ import annotations

import pytest
import torch

from tests import _optim_state_cases as cases

TOL = 1e-5


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_ranks_optimizer_state_loaded_on_every_rank_is_refused_on_every_rank(pools, tmp_path, stage):
    results = pools(2).values(cases.saved_by_one_rank, stage, str(tmp_path / "optimizer.pt"))
    for rank, r in enumerate(results):
        assert r["error"] is not None, rank
        assert r["error"].startswith("ValueError"), r["error"]
        assert "shard rank 0's part (of 2)" in r["error"] and "save it on every rank" in r["error"].lower(), r["error"]
        assert r["unchanged"], rank


@pytest.mark.parametrize("stage", [1, 3])
def test_each_ranks_own_optimizer_state_resumes_exactly(pools, tmp_path, stage):
    for r in pools(2).values(cases.own_files_resume, stage, str(tmp_path / "optimizer")):
        went_on, resumed = r["losses"]
        assert resumed == pytest.approx(went_on, rel=TOL), r
        assert r["weights"] <= TOL, r


@pytest.mark.parametrize("stage, build", [(1, {}), (2, {"sgd": True}), (3, {}), (3, {"adafactor": True})],
                         ids=["stage1-adamw", "stage2-sgd", "stage3-adamw", "stage3-adafactor-whole"])
def test_a_plain_optimizers_state_resumes_under_hf_zero_as_under_ddp(pools, stage, build):
    for r in pools(2).values(cases.from_plain_optimizer, stage, build):
        plain, sharded = r["losses"]
        assert sharded == pytest.approx(plain, rel=TOL), r
        assert r["weights"] <= TOL, r


def test_a_ranks_own_state_into_other_param_groups_is_refused(pools, tmp_path):
    for r in pools(2).values(cases.other_pieces, 3, str(tmp_path / "optimizer")):
        assert r["error"] is not None and r["error"].startswith("ValueError"), r
        assert "over other pieces" in r["error"], r["error"]
        assert r["unchanged"], r


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("optimizer", ["nadam", "nadam_whole"])
def test_a_checkpoint_gives_the_state_back_in_the_dtype_torchs_load_gives(pools, tmp_path, stage, optimizer):
    """A float64 model: torch's NAdam keeps `mu_product` in float32 (its scalar dtype); DDP code resuming through
    `load_state_dict` gets each floating-point entry back in its parameter's dtype. `load_checkpoint` gives them back
    so too (it kept the saved float32: 2e-9 apart in float64, the differential fuzzer's seed 151143), on the flat
    path and on the whole-parameter one (a subclass of NAdam, which hf_zero does not know to be elementwise): the
    resumed weights within 1e-12 of plain data parallelism's."""
    build = {"dtype": torch.float64, optimizer: True}
    for r in pools(2).values(cases.checkpoint_resumed_as_torch_loads, stage, str(tmp_path / "ckpt"), build):
        assert all(d.endswith("torch.float64") for d in r["dtypes"]), r["dtypes"]
        assert r["weights"] <= 1e-12, r["weights"]
