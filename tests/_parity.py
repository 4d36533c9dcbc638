"""Parity helpers shared by the tests: the single-process reference and the comparisons against it.

Tolerance (fp32): per-step losses within 1e-5 relative of the single-process reference on the same
global batch, every final weight tensor within 1e-5 relative (‖w − w_ref‖ / ‖w_ref‖), and the norms
`clip_grad_norm_` returns within 1e-5 relative.
"""

from __future__ import annotations

import functools

import numpy as np

from tests._training import Scenario, reference_run, rel_err, sharded_run

TOL = 1e-5


@functools.lru_cache(maxsize=None)
def reference(sc: Scenario) -> dict:
    """The single-process reference of `sc` (cached: one per scenario per session)."""
    return reference_run(sc)


def assert_matches_reference(got: dict, ref: dict, tol: float = TOL) -> None:
    """Losses, norms and every weight tensor of `got` within `tol` relative of `ref`."""
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=tol, atol=0)
    np.testing.assert_allclose(got["norms"], ref["norms"], rtol=tol, atol=0)
    assert set(got["state"]) == set(ref["state"]), set(got["state"]) ^ set(ref["state"])
    errs = {k: rel_err(got["state"][k], ref["state"][k]) for k in ref["state"]}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= tol, f"{worst}: relative error {errs[worst]:.2e} > {tol}"


def run_and_compare(pools, sc: Scenario, tol: float = TOL) -> dict:
    """`sc` sharded on its ranks against the single-process reference; every rank saw the same losses and norms."""
    results = pools(sc.world).values(sharded_run, sc)
    ref = reference(sc.single())
    assert_matches_reference(results[0], ref, tol)
    # every rank saw the same losses and norms
    for r in results[1:]:
        assert r["losses"] == results[0]["losses"] and r["norms"] == results[0]["norms"]
    return results[0]


def assert_tracks_fp32(got: dict, ref: dict, tol: float) -> None:
    """Losses within `tol` relative of the fp32 reference, on a trajectory that moves by far more than
    `tol` (so a run that did not train, or trained on stale weights, cannot pass), and this run's own
    loss fell by more than the tolerance too."""
    losses, ref_losses = np.asarray(got["losses"]), np.asarray(ref["losses"])
    assert (ref_losses[0] - ref_losses[-1]) / ref_losses[0] > 4 * tol, ref_losses
    np.testing.assert_allclose(losses, ref_losses, rtol=tol, atol=0)
    assert (losses[0] - losses[-1]) / losses[0] > 2 * tol, losses
