"""The two implementations of the bulk collectives (the backend's own, and the ones composed of
broadcasts / an all-reduce, which `collectives="auto"` picks on gloo) give the same results.

All-gathers are exact. Reduce-scatters match the float64 sum of every rank's chunk within the
rounding of the dtype's own additions (fp32 1e-6, bf16 2e-2 relative), and the two implementations
match each other within the same bound; with a scratch buffer to receive into, the composed
reduce-scatter (an all-to-all, then a local sum) gives what the all-reduce gives. Several exchanges are in flight at once and waited in
reverse order, as the engine's prefetch and overlapped reductions do.
"""

from __future__ import annotations

import pytest
import torch

from tests._collective_cases import bulk_collectives


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-6), ("bfloat16", 2e-2)])
def test_composed_equals_native(pools, world, dtype, tol):
    for rank, got in enumerate(pools(world).values(bulk_collectives, dtype, 1031)):
        assert got["auto_is_composed"]  # the pools run gloo
        for name in ("native", "composed"):
            res = got[name]
            for g, want in zip(res["gathered"], got["expected_gathered"]):
                torch.testing.assert_close(g, want, rtol=0, atol=0)
            torch.testing.assert_close(res["in_place"], got["expected_gathered"][0], rtol=0, atol=0)
            for r, want in zip(res["reduced"] + res["reduced_scratch"], got["expected_reduced"] * 2):
                torch.testing.assert_close(r, want, rtol=tol, atol=tol * want.abs().max().item(), msg=f"{name} rank {rank}")
        for a, b in zip(got["native"]["reduced"], got["composed"]["reduced"]):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())
        if world == 2:  # one addition per element, the same on every path: the same bits
            for a, b in zip(got["composed"]["reduced"], got["composed"]["reduced_scratch"]):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_group_of_one_and_bad_choice():
    from hf_zero.engine.collectives import CommGroup

    single = CommGroup.single()
    assert not single.using("composed").composed  # nothing to exchange
    with pytest.raises(ValueError, match="bulk collectives must be 'auto', 'native' or 'composed'"):
        single.using("tree")


def test_torchs_fake_group_plays_the_accelerators_backend(monkeypatch):
    """benchmarks/rank_of_n.py: one process playing rank r of N through torch's fake group runs the device
    backend's code path (stream-ordered, on the GPU) where the process has an accelerator, gloo's on the host."""
    from hf_zero.engine.collectives.group import CommGroup

    fake = CommGroup(pg=None, rank=1, size=8, backend="fake")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert (fake.comm_kind, fake.stream_ordered) == ("cpu", False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    assert (fake.comm_kind, fake.stream_ordered) == ("cuda", True)
    nccl, gloo = CommGroup(pg=None, rank=1, size=8, backend="nccl"), CommGroup(pg=None, rank=1, size=8, backend="gloo")
    assert (nccl.comm_kind, nccl.stream_ordered, gloo.comm_kind, gloo.stream_ordered) == ("cuda", True, "cpu", False)
