"""ZeroTrainer where the stock Trainer and DDP decide something beyond the numbers of a step: BatchNorm's buffers at
evaluation ([Note: buffer broadcast] in hf_zero/engine/buffers.py), and a CPU launch without --use_cpu ([Note:
launched world] in hf_zero/integrations/training_args.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests import _trainer_cases as tc
from tests._training import rel_err
from tests.test_trainer import TOL, _assert_close_to_reference, _ref_key, _reference

pytestmark = pytest.mark.device_agnostic


_STOCK_DDP: dict[tc.Job, dict] = {}


def _stock_ddp(pools, job: tc.Job) -> dict:
    """The stock Trainer under DDP on the same 2 processes, once per job."""
    if job not in _STOCK_DDP:
        _STOCK_DDP[job] = pools(2).values(tc.run, job, False)[0]
    return _STOCK_DDP[job]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resnet_batchnorm_trains_and_evaluates_as_stock_ddp(pools, tmp_path, stage):
    """A ResNet (BatchNorm in every block) through the Trainer on 2 processes, evaluated every 2 steps and at the
    end, against the stock Trainer under DDP on the same ranks: the evaluation after a step normalises with rank 0's
    running statistics on every rank, as DDP's broadcast gives them ([Note: buffer broadcast]); losses, norms, eval
    losses, weights and running statistics within 1e-5 (each rank evaluated with its own before: 3e-4 apart)."""
    job = tc.Job(kind="resnet", stage=stage, world=2, out_dir=str(tmp_path / "out"), eval_steps=2)
    got = pools(2).values(tc.run, job)[0]
    ddp = _stock_ddp(pools, replace(job, stage=0, out_dir=str(tmp_path / "ddp")))
    assert got["world"] == ddp["world"] == 2 and len(got["eval_losses"]) == 3
    for key in ("losses", "norms", "eval_losses"):
        np.testing.assert_allclose(got[key], ddp[key], rtol=TOL, atol=0, err_msg=key)
    for name, value in ddp["state"].items():
        assert rel_err(got["state"][name].numpy(), value.numpy()) <= TOL, name


def test_a_cpu_launch_without_use_cpu_trains_as_the_launched_processes(pools, tmp_path):
    """2 processes launched on a machine without GPUs, without --use_cpu or ACCELERATE_USE_CPU (a plain torchrun):
    the stock Trainer believes it is one process (no distributed sampler: each rank trains the same batches);
    ZeroTrainingArguments trains on the CPU as the 2-process run launched, with the single-process reference's
    numbers. Where the Trainer is made to believe one process (an Accelerate state configured first), it is
    refused on every rank naming the fix."""
    job = tc.Job(kind="llama", stage=3, world=2, out_dir=str(tmp_path / "out"))
    got = pools(2).values(tc.run_launched_without_use_cpu, job)
    assert [r["world"] for r in got] == [2, 2]
    _assert_close_to_reference(got[0], _reference(_ref_key(job)))
    said = [m for m in got[0]["records"] if "processes were launched, and this machine has no GPU" in m]
    assert len(said) == 1 and "--use_cpu" in said[0], got[0]["records"]  # once a node, before training
    assert not any("no GPU" in m for m in got[1]["records"])
    for r in pools(2).values(tc.run_launched_without_use_cpu, job, True):
        assert r["error"] is not None and "The launcher started 2 processes (WORLD_SIZE=2) but the Trainer sees 1" in \
            r["error"] and "--use_cpu" in r["error"], r


@pytest.mark.parametrize("stage,bucket_mb", [(1, 0), (2, 0), (3, 0), (3, 25)])
def test_opt_layerdrop_trains_as_stock_ddp(pools, tmp_path, stage, bucket_mb):
    """OPT's own LayerDrop (`layerdrop=0.5`: each decoder layer skipped at random in training, the draw from torch's
    generator, which the Trainer seeds alike on every rank) through the Trainer on 2 processes, against the stock
    Trainer under DDP (`find_unused_parameters`, the Trainer's default): every layer a unit of its own, and the four
    joined into one bucket. SGD: the attention's key bias gets no gradient (softmax is shift-invariant), so Adam
    would move it by the sign of rounding noise, differently under any two reduction orders; left out of the
    weights compared for the same reason. Losses and weights within 1e-5; the run without LayerDrop differs (the
    layers were skipped)."""
    job = tc.Job(kind="opt_layerdrop", stage=stage, world=2, steps=6, optim="sgd", out_dir=str(tmp_path / "out"),
                 zero_args=(("zero_bucket_size_mb", bucket_mb),))
    got = pools(2).values(tc.run, job)[0]
    ddp = _stock_ddp(pools, replace(job, stage=0, zero_args=(), out_dir=str(tmp_path / "ddp")))
    assert len(got["units"]) == (2 if bucket_mb else 5), got["units"]
    np.testing.assert_allclose(got["losses"], ddp["losses"], rtol=TOL, atol=0)
    np.testing.assert_allclose(got["norms"], ddp["norms"], rtol=TOL, atol=0)
    for name, value in ddp["state"].items():
        if "k_proj.bias" not in name:
            assert rel_err(got["state"][name].numpy(), value.numpy()) <= TOL, name
    every_layer = _stock_ddp(pools, replace(job, kind="opt", stage=0, zero_args=(), out_dir=str(tmp_path / "all")))
    assert abs(every_layer["losses"][-1] - ddp["losses"][-1]) > 1e-3


@pytest.mark.parametrize("stage,checkpointing", [(1, False), (2, True), (3, False), (3, True)])
def test_dropout_trains_as_stock_ddp(pools, tmp_path, stage, checkpointing):
    """OPT with its dropout on (0.1 on activations and attention: the masks drawn from torch's generator, which the
    Trainer seeds alike on every rank) through the Trainer on 2 processes, with and without gradient checkpointing
    (the recomputed forward draws the same masks): the sharded model draws what DDP's does, so losses, norms and
    weights equal the stock Trainer's under DDP within 1e-5; without dropout the run differs."""
    job = tc.Job(kind="opt_dropout", stage=stage, world=2, steps=4, optim="sgd", out_dir=str(tmp_path / "out"),
                 checkpointing=checkpointing)
    got = pools(2).values(tc.run, job)[0]
    ddp = _stock_ddp(pools, replace(job, stage=0, out_dir=str(tmp_path / "ddp")))
    np.testing.assert_allclose(got["losses"], ddp["losses"], rtol=TOL, atol=0)
    np.testing.assert_allclose(got["norms"], ddp["norms"], rtol=TOL, atol=0)
    for name, value in ddp["state"].items():
        if "k_proj.bias" not in name:  # no gradient (softmax is shift-invariant): see the LayerDrop test
            assert rel_err(got["state"][name].numpy(), value.numpy()) <= TOL, name
    without = _stock_ddp(pools, replace(job, kind="opt", stage=0, out_dir=str(tmp_path / "no_dropout")))
    assert abs(without["losses"][0] - ddp["losses"][0]) > 1e-3
