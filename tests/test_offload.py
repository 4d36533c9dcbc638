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


STAGED = {
    "stage1": (1, "no", OFFLOADS["optimizer"]),
    "stage2": (2, "no", OFFLOADS["optimizer"]),
    "stage3-params": (3, "no", OFFLOADS["optimizer+params"]),
    "stage3-params-int8": (3, "no", OFFLOADS["optimizer+params"] + (("quantized_weights", True), ("quantized_gradients", True))),
    "stage3-fp16": (3, "fp16", OFFLOADS["optimizer"]),
    "stage3-hybrid": (3, "no", OFFLOADS["optimizer+params"] + (("shard_group_size", 2),)),
}


@pytest.mark.parametrize("case", sorted(STAGED))
def test_no_host_tensor_reaches_a_collective_with_offload(pools, tmp_path, case):
    """A recording process group sees every tensor the engine hands to a collective during training with
    clipping, a checkpoint save and `full_state_dict`. With the communication device off the host (as
    under NCCL), none of them is offloaded host memory, and the numbers are those of the same run without
    staging; without it (the communication device is the host) the recorder does see host memory, so the
    check can fail."""
    from tests._staging import recorded_offload_run

    stage, mixed, overrides = STAGED[case]
    world = 4 if "hybrid" in case else 2
    sc = Scenario(model="falcon", stage=stage, world=world, steps=3, mixed_precision=mixed, config_overrides=overrides)
    staged = pools(world).values(recorded_offload_run, Scenario(**{**sc.__dict__, "save_to": str(tmp_path / "staged")}), True)
    direct = pools(world).values(recorded_offload_run, Scenario(**{**sc.__dict__, "save_to": str(tmp_path / "direct")}), False)
    for rank in range(world):
        assert staged[rank]["most_host_storages"] > 0  # there was host state to protect
        assert staged[rank]["host_calls"] == {}, f"rank {rank}: host memory reached {staged[rank]['host_calls']}"
        assert sum(staged[rank]["calls"].values()) == sum(direct[rank]["calls"].values())
        assert staged[rank]["control_host_calls"] == {}
        assert direct[rank]["control_host_calls"] == {"broadcast": 1}  # the recorder does see host memory
    np.testing.assert_allclose(staged[0]["losses"], direct[0]["losses"], rtol=1e-6, atol=0)
    np.testing.assert_allclose(staged[0]["norms"], direct[0]["norms"], rtol=1e-6, atol=0)
    for name, value in direct[0]["state"].items():
        assert rel_err(staged[0]["state"][name], value) <= 1e-6, name


@pytest.mark.parametrize("offload, trims", [(False, 0), (True, 3)])
def test_heap_is_trimmed_after_offloaded_steps_only(monkeypatch, offload, trims):
    """[Note: host heap]: an offloaded step returns its freed heap to the system; a CPU-only step in memory keeps it
    (what it frees, the next forward allocates again)."""
    import torch

    import hf_zero
    from hf_zero.engine.step import stepping

    calls = []
    monkeypatch.setattr(stepping, "release_free_host_memory", lambda: calls.append(1))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model, optimizer = hf_zero.initialize(net, torch.optim.AdamW(net.parameters(), lr=1e-2),
                                          hf_zero.ZeroConfig(stage=3, offload_optimizer=offload))
    for _ in range(3):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert len(calls) == trims
