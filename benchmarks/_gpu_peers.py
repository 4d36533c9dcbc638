"""The GPU check's `peers` phase: the test suite's peer scenarios (tests/_peer_cases.py) on the GPU.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/_gpu_peers.py --device cuda --out DIR

Each scenario is a training loop written as DDP users write it (clipping with torch's own functions, frozen
and unfrozen parameters, units skipped on one rank, input gradients, gradient penalties, `model.to(...)`, ...),
run on each rank twice from the same weights and data: under plain data parallelism by hand and under hf_zero at
stages 1-3. The two ranks share the one GPU (gloo between them, CUDA compute): the scenario models, their batches
and the engine's buffers live on the GPU, where the test suite has them on the host. As in
tests/test_peer_scenarios.py, each is exact (losses, returned norms and every weight within 1e-5 relative) or,
for the scenarios listed in `REFUSED`, refused on every rank with the message that names the pattern.
Results: `<out>/peers.json`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _gpu_common import Cases, init_group, phase_arguments, require

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests` is a package of the working tree

from tests import _peer_cases as peer  # noqa: E402 - after the path above
from tests import _peer_harness  # noqa: E402

TOL = 1e-5


def scenario_case(name: str, stage: int) -> dict[str, Any]:
    """One scenario at one stage on this rank: exact against plain data parallelism, or refused as expected."""
    result = peer.run_scenario(name, stage)
    expected = peer.REFUSED.get(name, {}).get(stage)
    if expected is not None:
        error = result["error"] or ""
        require(expected in error and error.startswith(("ValueError", "TypeError", "RestingParameterError")),
                f"expected a refusal naming {expected!r}, got {error or 'no error'}")
        return {"refused": error.split(":")[0]}
    require(result["error"] is None, f"hf_zero failed: {result['error']}")
    steps = peer.worst_difference(result["reference"], result["record"])
    weights = max(result["weights"].values())
    require(not result["missing"], f"weights missing from the sharded state: {result['missing']}")
    require(steps <= TOL and weights <= TOL,
            f"differs from plain data parallelism: records {steps:.2e}, weights {weights:.2e} (allowed {TOL:.0e})")
    return {"records_rel": float(f"{steps:.2e}"), "weights_rel": float(f"{weights:.2e}")}


def main() -> int:
    args, out = phase_arguments(__doc__, ["full", "tiny"])
    device = init_group(args.device, backend="gloo")
    _peer_harness.DEVICE = device
    cases = Cases("peers", out)
    names = sorted(peer.SCENARIOS)
    if args.size == "tiny":  # the CI rehearsal: a few, to check the phase itself
        names = ["baseline", "cast_to_bf16_for_evaluation", "torch_clip_grad_norm"]
    for stage in (1, 2, 3):
        for name in names:
            cases.run(f"ZeRO-{stage} {name}", lambda n=name, s=stage: scenario_case(n, s))
    dist.barrier()
    return 1 if cases.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
