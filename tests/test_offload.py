"""CPU offload: the same numbers as without it, with the state accounted to the host.

Tolerance: losses and weights within 1e-6 relative of the same run without offload (fp32); on a
CPU-only machine the arithmetic is identical, the test allows 1e-6 for a GPU's host/device mix.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests._training import Scenario, rel_err, sharded_run

OFFLOADS = {
    "optimizer": (("offload_optimizer", True),),
    "optimizer+params": (("offload_optimizer", True), ("offload_params", True)),
}


@pytest.mark.device_agnostic  # on CUDA: host shards and masters staged for NCCL ([Note: staging])
@pytest.mark.parametrize(
    "stage, offload",
    [(1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "optimizer+params")],
)
@pytest.mark.parametrize("mixed", ["no", "bf16"])
def test_offload_matches_no_offload_and_lives_on_the_host(pools, stage, offload, mixed):
    base = Scenario(model="falcon", stage=stage, world=2, mixed_precision=mixed)
    plain = pools(2).values(sharded_run, base)[0]
    off = pools(2).values(sharded_run, Scenario(**{**base.__dict__, "config_overrides": OFFLOADS[offload]}))[0]
    np.testing.assert_allclose(off["losses"], plain["losses"], rtol=1e-6, atol=0)
    for name, value in plain["state"].items():
        assert rel_err(off["state"][name], value) <= 1e-6, name

    mem, plain_mem = off["memory"], plain["memory"]
    # Master weights and optimizer moments are on the host, the gradient shards too; nothing of the
    # optimizer state is left on the device.
    assert mem.optimizer_states.get("host", 0) > 0 and "cpu" not in mem.optimizer_states
    assert mem.gradients.get("host", 0) > 0
    assert mem.total("host") + mem.total("cpu") >= plain_mem.total("cpu")  # nothing lost from the books
    if offload == "optimizer+params":
        assert mem.parameters.get("host", 0) > 0  # the parameter shards live on the host
        assert mem.parameters.get("cpu", 0) == 0  # and nothing stays gathered on the device between steps
    else:
        assert mem.parameters.get("cpu", 0) > 0 and "host" not in mem.parameters
    # The device holds less model state than without offload.
    assert mem.total("cpu") < plain_mem.total("cpu")
