"""Where the test ranks run: CPU + gloo here, CUDA + NCCL with one GPU per rank (tests/_dist.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._dist import (
    ENV_VAR,
    Placement,
    PlacementUnavailable,
    backend_and_device,
    choose_placement,
    cuda_device_count,
)

CPU, CUDA = Placement("cpu", "gloo"), Placement("cuda", "nccl")


@pytest.mark.parametrize("requested, gpus, world, expected", [
    ("auto", 0, 2, CPU),    # no GPU: gloo on CPU
    ("auto", 2, 2, CUDA),   # a GPU per rank: NCCL
    ("auto", 8, 3, CUDA),
    ("auto", 1, 2, CPU),    # NCCL cannot put two ranks on one GPU: stay on CPU rather than fail
    ("cpu", 8, 2, CPU),     # asked for CPU on a GPU machine
    ("cuda", 4, 2, CUDA),
    (" CUDA ", 4, 4, CUDA),
    ("", 0, 1, CPU),        # unset means auto
])
def test_choose_placement(requested, gpus, world, expected):
    assert choose_placement(world, requested, gpus) == expected


def test_cuda_requested_without_enough_gpus_says_why():
    with pytest.raises(PlacementUnavailable, match=r"3 ranks need 3 GPUs .*1 visible"):
        choose_placement(3, "cuda", 1)


def test_unknown_request_is_refused():
    with pytest.raises(ValueError, match=f"{ENV_VAR}='tpu'"):
        choose_placement(2, "tpu", 0)


@pytest.mark.device_agnostic
def test_pool_runs_where_the_placement_says(pools):
    """The pool's ranks really use the chosen backend, and rank r computes on the device of LOCAL_RANK r."""
    expected = choose_placement(2, os.environ.get(ENV_VAR, "auto"), cuda_device_count())
    got = pools(2).values(backend_and_device)
    if expected.device == "cuda":
        assert got == [("nccl", "cuda:0", "0"), ("nccl", "cuda:1", "1")]
    else:
        assert got == [("gloo", "cpu", "0"), ("gloo", "cpu", "1")]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine may have a GPU: the no-GPU path "
                    "is checked where nvidia-smi is absent")
def test_gpu_check_without_a_gpu_says_so_and_exits_0():
    """`make gpu-check` on a machine without a GPU installs nothing, prints why (pointing to the rehearsal) and
    succeeds."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(["make", "-s", "gpu-check", f"PYTHON={sys.executable}"], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "has a torch that sees a CUDA GPU" in done.stdout and "--rehearse" in done.stdout
    assert not (root / ".venv-cuda").exists() and not (root / "outputs" / "gpu_check" / "report.json").exists()


# ---- the engine's own device choice (hf_zero.launch.accelerator_device) --------------------------------------

def test_engine_takes_the_gpu_of_local_rank():
    from hf_zero.launch import accelerator_device

    assert accelerator_device("cuda", bound=None, local_rank=3, count=8, current=0, world_size=16) == torch.device("cuda", 3)


def test_engine_prefers_the_device_bound_to_the_process_group():
    from hf_zero.launch import accelerator_device

    bound = torch.device("cuda", 5)
    assert accelerator_device("cuda", bound=bound, local_rank=3, count=8, current=0, world_size=16) == bound


def test_engine_keeps_the_current_device_when_it_is_the_only_choice():
    from hf_zero.launch import accelerator_device

    assert accelerator_device("cuda", bound=None, local_rank=None, count=1, current=0, world_size=4) == torch.device("cuda", 0)
    assert accelerator_device("cuda", bound=None, local_rank=None, count=8, current=6, world_size=4) == torch.device("cuda", 6)
    assert accelerator_device("cuda", bound=None, local_rank=None, count=8, current=0, world_size=1) == torch.device("cuda", 0)


def test_engine_refuses_to_put_every_rank_on_gpu_0():
    from hf_zero.launch import accelerator_device

    with pytest.raises(ValueError, match=r"8 CUDA devices are visible and nothing says which one.*set_device"):
        accelerator_device("cuda", bound=None, local_rank=None, count=8, current=0, world_size=4)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=4 but only 4 CUDA device\(s\)"):
        accelerator_device("cuda", bound=None, local_rank=4, count=4, current=0, world_size=8)


def test_launch_env_reads_local_rank(monkeypatch):
    from hf_zero.launch import launch_env

    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert (launch_env().local_rank, launch_env().local_world_size) == (2, 4)
    monkeypatch.delenv("LOCAL_RANK")
    assert launch_env().local_rank is None


# ---- where the engine computes ([Note: compute device] in hf_zero/engine/placement.py) ----------------------

def test_the_training_loops_device_wins_and_a_model_elsewhere_is_refused():
    from hf_zero.engine.placement import _requested_device, check_compute_device

    assert _requested_device(torch.device("cpu"), torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"parameters are on cuda:1, but the training loop computes on cpu"):
        _requested_device(torch.device("cuda", 1), torch.device("cpu"))
    check_compute_device(torch.device("cuda", 0), torch.device("cuda"))  # no index: the current one
    check_compute_device(torch.device("cpu"), None)
    with pytest.raises(ValueError, match=r"sharded to compute on cpu, but the training loop puts its batches on "
                                         r"cuda:0\. Shard it for cuda:0: pass device='cuda:0'"):
        check_compute_device(torch.device("cpu"), torch.device("cuda", 0))


def test_initialize_refuses_a_device_that_is_not_one():
    import hf_zero

    with pytest.raises(ValueError, match=r"device='gpu' is not a device"):
        hf_zero.initialize(torch.nn.Linear(2, 2), None, hf_zero.ZeroConfig(stage=3), device="gpu")
    with pytest.raises(TypeError, match=r"device as a torch.device or a string; got int"):
        hf_zero.initialize(torch.nn.Linear(2, 2), None, hf_zero.ZeroConfig(stage=3), device=0)  # type: ignore[arg-type]


# the slow tier (15 s on 2 cores: a process that fakes a GPU): the GPU check runs the real one on a lent GPU
@pytest.mark.slow
def test_alone_on_a_gpu_machine_each_entry_point_computes_where_its_batches_go(tmp_path):
    """A single process without torch.distributed (`accelerate launch` with `distributed_type: NO`) on a machine
    with a GPU: `initialize` alone takes the GPU (as a model on the host does under NCCL); the Trainer (sharding
    for an evaluation before training, as examples/train_clm.py does) and the Accelerator compute on the device
    their batches go to. The GPU is faked (tests/_device_choice.py); the GPU check runs the real one."""
    import json

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(root / "tests" / "_device_choice.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("DEVICES "))
    seen = json.loads(line[len("DEVICES "):])
    assert seen["initialize"] == ["cuda"]
    assert seen["trainer"]["picked"] == [] and seen["trainer"]["engine"] == seen["trainer"]["args"] == "cpu"
    assert seen["trainer"]["eval_after"] < seen["trainer"]["eval_before"]  # it trained
    assert seen["accelerator"]["picked"] == [] and seen["accelerator"]["engine"] == "cpu"


def test_the_host_is_one_device_whatever_index_the_loop_gives_it():
    """Accelerate's multi-process CPU runs put batches on `cpu:0`; host tensors say `cpu` (and the two differ)."""
    from hf_zero.engine.placement import _requested_device, check_compute_device

    assert _requested_device(torch.device("cpu"), torch.device("cpu", 0)) == torch.device("cpu")
    assert str(_requested_device(torch.device("cpu"), torch.device("cpu", 0))) == "cpu"
    check_compute_device(torch.device("cpu"), torch.device("cpu", 0))
