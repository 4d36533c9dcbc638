"""Parameters transformers keeps in float32 in a bf16 load (MoE router gates) compute, reduce, step and save in
float32 under hf_zero, as under DDP ([Note: parameters kept in their own dtype] in hf_zero/engine/unit.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import hf_zero
from tests import _kept_dtype_cases as kc
from tests import _trainer_cases as tc
from tests._training import rel_err

BF16_NOISE = 5e-3  # relative, after 3 steps of AdamW on bf16 weights (the reductions round differently)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("kept")
    return {kind: kc.save_base(kind, str(root / kind)) for kind in kc.KINDS}


# GLM-4-MoE at stages 1-2 in the slow tier (the suite's time): its gates take the same path as DeepSeek-V3's
@pytest.mark.parametrize("kind, stage", [("deepseek_v3", 1), ("deepseek_v3", 2), ("deepseek_v3", 3), ("glm4_moe", 3),
                                         pytest.param("glm4_moe", 1, marks=pytest.mark.slow),
                                         pytest.param("glm4_moe", 2, marks=pytest.mark.slow)])
def test_a_bf16_load_with_float32_gates_trains_as_ddp(pools, bases, kind, stage):
    """DeepSeek-V3 / GLM-4-MoE loaded with dtype=bfloat16 (router gates float32, as transformers keeps them): 3 steps
    of 2 micro-batches (no_sync, the gradients summed before the reduction as DDP does), clipped, under hf_zero at each stage and under DDP on the same ranks: losses and
    norms at bf16 noise, the gates float32 throughout and within fp32 noise of DDP's, every weight in its own dtype;
    every folder written (save_pretrained, by rank 0 or by every rank; a checkpoint consolidated, also with
    dtype='bf16') keeps the gates in float32 and the rest in bf16, as transformers' save_pretrained does, and loads
    back to the trained weights bit for bit."""
    got = pools(2).values(kc.against_ddp, bases[kind], stage)[0]
    ref, mine = got["reference"], got["got"]
    np.testing.assert_allclose(mine["losses"], ref["losses"], rtol=BF16_NOISE, atol=0)
    np.testing.assert_allclose(mine["norms"], ref["norms"], rtol=BF16_NOISE, atol=0)
    gates = [n for n, v in got["ref_state"].items() if n.endswith("mlp.gate.weight")]
    assert gates and all(got["ref_state"][n].dtype == torch.float32 for n in gates)
    for name, value in got["ref_state"].items():
        assert got["state"][name].dtype == value.dtype, name
        assert rel_err(got["state"][name].float().numpy(), value.float().numpy()) <= BF16_NOISE, name
    for name in gates:  # the gate's own arithmetic is float32 on both sides
        assert rel_err(got["state"][name].numpy(), got["ref_state"][name].numpy()) <= 1e-4, name
    for suffix in ("", "-parallel", "-consolidated", "-consolidated-bf16"):
        saved = Path(got["saved"] + suffix)
        written = {}
        for file in saved.glob("*.safetensors"):
            with safe_open(file, framework="pt") as f:
                written.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - safe_open has no __iter__
        assert {written[n].dtype for n in gates} == {torch.float32}, suffix
        assert {t.dtype for n, t in written.items() if n not in gates and "e_score" not in n} == {torch.bfloat16}
        assert json.loads((saved / "config.json").read_text())["dtype"] == "bfloat16", suffix
        reloaded = kc.load_bf16(str(saved)).state_dict()
        for name, value in got["state"].items():
            assert torch.equal(reloaded[name], value), (suffix, name)


# two of the six in the suite (its time); the others in the slow tier
@pytest.mark.parametrize("kind, stage", [("deepseek_v3", 3), ("glm4_moe", 2),
                                         *(pytest.param(k, s, marks=pytest.mark.slow)
                                           for k, s in [("deepseek_v3", 1), ("deepseek_v3", 2), ("glm4_moe", 1),
                                                        ("glm4_moe", 3)])])
def test_the_trainer_on_a_bf16_load_with_float32_gates_equals_the_stock_trainer(pools, bases, tmp_path, kind, stage):
    """ZeroTrainer on the bf16 load (gates float32) against the stock Trainer under DDP on the same 2 processes
    (4 steps of 2 micro-batches, clipping, weight decay): losses, norms, eval loss and weights at bf16 noise, each
    weight in the dtype the stock run keeps it in."""
    common = dict(kind="kept_fp32", world=2, base_dir=bases[kind])
    job = tc.Job(stage=stage, out_dir=str(tmp_path / "zero"), zero_args=(("zero_no_sync_keeps_grads", True),),
                 **common)
    got = pools(2).values(tc.run, job)[0]
    ddp = pools(2).values(tc.run, tc.Job(stage=0, out_dir=str(tmp_path / "ddp"), **common), False)[0]
    for key in ("losses", "norms"):
        np.testing.assert_allclose(got[key], ddp[key], rtol=BF16_NOISE, atol=0, err_msg=key)
    np.testing.assert_allclose(got["eval_loss"], ddp["eval_loss"], rtol=BF16_NOISE)
    for name, value in ddp["state"].items():
        assert got["state"][name].dtype == value.dtype, name
        tol = 1e-4 if name.endswith("mlp.gate.weight") else BF16_NOISE  # float32 arithmetic on both sides
        assert rel_err(got["state"][name].float().numpy(), value.float().numpy()) <= tol, name


@pytest.mark.parametrize("stage", [2, 3])
def test_a_ddp_loop_with_zeroed_grads_and_eval_forwards_trains_as_ddp(pools, bases, stage):
    """The bf16 load with float32 gates in a DDP user's loop: `torch.nn.utils.clip_grad_norm_(model.parameters())`,
    `zero_grad(set_to_none=False)` and an evaluation forward after each step, against the same loop under DDP:
    losses (training and evaluation) and norms at bf16 noise, the gates within 1e-4."""
    got = pools(2).values(kc.against_ddp, bases["deepseek_v3"], stage, 3, 2, True)[0]
    ref, mine = got["reference"], got["got"]
    assert len(mine["losses"]) == 9  # 6 micro-batches, 3 evaluations
    np.testing.assert_allclose(mine["losses"], ref["losses"], rtol=BF16_NOISE, atol=0)
    np.testing.assert_allclose(mine["norms"], ref["norms"], rtol=BF16_NOISE, atol=0)
    for name, value in got["ref_state"].items():
        tol = 1e-4 if name.endswith("mlp.gate.weight") else BF16_NOISE
        assert rel_err(got["state"][name].float().numpy(), value.float().numpy()) <= tol, name


def test_mixed_precision_keeps_the_gates_in_float32(pools, bases):
    """The bf16 load under mixed_precision='bf16' at stage 3: the gate is gathered and computes in float32 (its
    forward sees a float32 weight), its master and gradient shards are float32, the rest computes in bf16 from
    float32 masters; training runs and the saved gate is float32."""
    got = pools(2).values(kc.mixed_precision_run, bases["deepseek_v3"])[0]
    assert got["gate_dtypes_seen"] == ["torch.float32"] * 2
    assert got["masters"] == {"gate": "torch.float32", "rest": "torch.float32"}
    assert got["compute"] == {"gate": "torch.float32", "rest": "torch.bfloat16"}
    assert got["losses"][-1] < got["losses"][0]
    assert got["saved_gate_dtype"] == "torch.float32"


def test_kept_parameters_on_disk_offload_are_refused_naming_the_way(bases, tmp_path):
    """The disk's files keep one master layout: a model with float32 gates among bf16 is refused at `initialize`
    naming the parameters and what works instead."""
    model = kc.load_bf16(bases["deepseek_v3"])
    config = hf_zero.ZeroConfig(stage=3, offload_optimizer=True, offload_dir=str(tmp_path / "off"))
    with pytest.raises(ValueError, match="kept in their own dtype") as caught:
        hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), config)
    assert "model.layers.1.mlp.gate.weight" in str(caught.value)
    assert "offload_optimizer without offload_dir" in str(caught.value)


@pytest.mark.parametrize("stage", [1, 3])
def test_float32_gates_under_mixed_precision_train_the_same_from_disk(pools, bases, tmp_path, stage):
    """DeepSeek-V3's bf16 load (router gates float32) under bf16 mixed precision with `offload_dir`: every master is
    float32, so the gates' part has a place of its own in the files (`place_key`) beside the rest; three clipped steps
    of two micro-batches equal the same run in memory (losses, norms, every weight, the gate float32), and its
    checkpoint loads into an in-memory model with those weights."""
    r = pools(2).values(kc.gates_on_disk_under_mixed_precision, bases["deepseek_v3"], stage, str(tmp_path))[0]
    memory, disk = r["runs"]["memory"], r["runs"]["disk"]
    np.testing.assert_allclose(disk["losses"], memory["losses"], rtol=1e-6, atol=0)
    np.testing.assert_allclose(disk["norms"], memory["norms"], rtol=1e-6, atol=0)
    assert r["dtypes"]["model.layers.1.mlp.gate.weight"] == "torch.float32", r["dtypes"]
    for name, value in r["states"]["memory"].items():
        for other in ("disk", "loaded"):
            assert rel_err(r["states"][other][name].float().numpy(), value.float().numpy()) <= 1e-6, (other, name)


@pytest.mark.parametrize("stage, offload", [(1, ""), (1, "optimizer"), (3, ""), (3, "optimizer"), (1, "disk"),
                                           (3, "disk")])
def test_batchnorm_keeps_float32_weights_under_mixed_precision(pools, tmp_path, stage, offload):
    """`kept_in_float32` (placement.py): under bf16 mixed precision BatchNorm's weights stay float32 beside its
    float32 running statistics (torch's batch norm refused the cast ones: "expected scalar type BFloat16 but found
    Float" at the first forward); its input is bf16. The losses equal hf_zero's stage 0 under the same settings
    exactly and track the fp32 model within 2e-2 over a falling trajectory; with the optimizer offloaded on a host,
    the check for edits between steps compares the float32 part in float32 (it crashed on the mixed dtypes); with
    `offload_dir` the float32 part has a place of its own in the files (`place_key`: its masters are float32 as
    the others', so it was refused for nothing)."""
    from tests import _kept_dtype_cases as cases

    where = str(tmp_path) if offload == "disk" else offload
    for r in pools(2).values(cases.batchnorm_under_mixed_precision, stage, where):
        assert r["seen"] == "torch.float32 torch.bfloat16", r["seen"]
        assert r["sharded"] == r["stage0"], (r["sharded"], r["stage0"])
        assert r["fp32"][-1] < 0.9 * r["fp32"][0], r["fp32"]
        for got, want in zip(r["sharded"], r["fp32"]):
            assert abs(got - want) <= 2e-2 * abs(want), (r["sharded"], r["fp32"])
