"""LoRA through `peft` on a sharded model: `get_peft_model` before `hf_zero.initialize`, at stages 1-3,
against single-process PEFT training (fp32, 1e-5 relative, 5 steps, accumulation 2, clipping); the
adapter saved with the PEFT model's own `save_pretrained` reloads with `PeftModel.from_pretrained`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests import _model_cases as cases
from tests._parity import run_and_compare
from tests._training import Scenario, make_model, rel_err

pytest.importorskip("peft")


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", ["llama", "falcon"])
def test_lora_matches_single_process_peft_and_saves_a_loadable_adapter(pools, tmp_path, kind, stage):
    from peft import PeftModel

    adapter_dir = tmp_path / "adapter"
    sc = Scenario(model=kind, stage=stage, world=2, lora=True, lr=1e-2, save_to=str(adapter_dir))
    got = run_and_compare(pools, sc)
    trainable = [k for k in got["state"] if "lora_" in k]
    assert trainable and got["trainable_numel"] < got["numel"] // 5  # it is LoRA: a small adapter is trained
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter_dir.iterdir()}
    assert not (adapter_dir / "model.safetensors").exists()  # the adapter, not the whole model
    reloaded = PeftModel.from_pretrained(make_model(kind), adapter_dir)
    state = reloaded.state_dict()
    for k in trainable:  # the adapter as trained, exactly
        np.testing.assert_array_equal(state[k].numpy(), got["state"][k])
    for k, v in state.items():
        if "lora_" not in k:  # the base weights stay the base's
            assert rel_err(v.numpy(), got["state"][k]) == 0.0, k
    with torch.no_grad():
        ids = torch.arange(12).reshape(1, 12)
        assert torch.isfinite(reloaded(input_ids=ids).logits).all()


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("stage", [2, 3])
def test_lora_with_transformers_activation_checkpointing_matches(pools, stage, reentrant):
    """LoRA with transformers' activation checkpointing, as the Trainer turns it on (`gradient_checkpointing_enable`,
    which also makes the frozen embeddings' output require grad: `enable_input_require_grads`, a forward hook on the
    embedding module, which the reentrant variant needs for any gradient to reach the adapter): losses, norms and
    weights as single-process training without checkpointing (fp32, 1e-5)."""
    run_and_compare(pools, Scenario(model="llama", stage=stage, world=2, lora=True, lr=1e-2, checkpointing=True,
                                    reentrant=reentrant))


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "falcon"])
def test_lora_model_states_follow_the_formula_with_frozen_weights_at_compute_dtype(pools, kind, mixed_precision):
    """[Note: frozen parameters] At stage 3, measured at the optimizer step: every frozen parameter shard once in
    the compute dtype (Ψ_frozen·b/N), the adapter's once as its fp32 master (the gather source, [Note: cast on
    gather]: 4Ψ_lora/N), gradient shards and optimizer state for the adapter only (fp32 gradients 4Ψ_lora/N,
    AdamW moments 8Ψ_lora/N)."""
    from tests._training import sharded_run

    sc = Scenario(model=kind, stage=3, world=2, lora=True, mixed_precision=mixed_precision, steps=1, accum=1)
    for r in pools(2).values(sharded_run, sc):
        parts, mem = r["parts"], r["memory"]
        compute = 2 if mixed_precision == "bf16" else 4
        frozen = [p for p in parts if not p["trainable"]]
        lora = [p for p in parts if p["trainable"]]
        assert frozen and all(p["frozen"] for p in frozen)
        assert sum(mem.parameters.values()) == compute * sum(p["shard"] for p in frozen) + 4 * sum(p["shard"] for p in lora)
        assert sum(mem.gradients.values()) == 4 * sum(p["shard"] for p in lora)
        moments = 8 * sum(p["local"] for p in lora)
        scalars = sum(mem.optimizer_states.values()) - moments
        assert 0 <= scalars <= 8 * 64, (sum(mem.optimizer_states.values()), moments)  # AdamW's step counters
        psi_frozen = sum(p["shard"] for p in frozen) * 2  # ≈ Ψ_frozen (2 ranks), padding included
        assert psi_frozen > 20 * moments / 8  # the base dominates: without the split it would cost 16x as much


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_trainer_trains_a_peft_model_like_the_stock_trainer(pools, tmp_path, stage):
    """`ZeroTrainer(model=get_peft_model(...))`: losses and the trained adapter match the stock Trainer with
    the same PEFT model; `trainer.save_model` writes the adapter, which `PeftModel.from_pretrained` loads."""
    from dataclasses import replace

    from peft import PeftModel

    from tests import _trainer_cases as tc

    job = tc.Job(kind="llama", stage=stage, world=2, out_dir=str(tmp_path / "out"), lora=True,
                 save_model_to=str(tmp_path / "final"), save_steps=4)
    got = pools(2).values(tc.run, job)[0]
    ref = tc.reference(replace(job, out_dir=str(tmp_path / "ref"), save_model_to=None))
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=0)
    for k, v in ref["state"].items():
        assert rel_err(got["state"][k].numpy(), v.numpy()) <= 1e-5, k
    reloaded = PeftModel.from_pretrained(make_model("llama"), tmp_path / "final").state_dict()
    for k in (k for k in ref["state"] if "lora_" in k):
        np.testing.assert_array_equal(reloaded[k].numpy(), got["state"][k].numpy())
    # [Note: adapter export] the last checkpoint's sharded state, consolidated offline: the adapter save_model wrote
    import hf_zero
    from safetensors.torch import load_file

    assert hf_zero.consolidate(tmp_path / "out" / "checkpoint-4" / "hf_zero", tmp_path / "exported",
                               progress=False) == ["adapter_model.safetensors"]
    exported, saved = (load_file(d / "adapter_model.safetensors") for d in (tmp_path / "exported", tmp_path / "final"))
    assert exported.keys() == saved.keys() and len(saved) > 0
    for k, v in saved.items():
        assert torch.equal(exported[k], v), k


@pytest.mark.parametrize("stage", [1, 3])
def test_merge_and_unload_on_rank_0_as_ddp_scripts_do(pools, tmp_path, stage):
    """[Note: merging an adapter] `model.merge_and_unload().save_pretrained(dir)` on rank 0 at the end of a DDP
    script: at stage 1 every weight is whole, so it merges locally and the directory loads with the merged weights;
    at stage 3 the base weights are shards: refused by name (before, the stand-in's generic error), naming how."""
    from safetensors.torch import load_file

    results = pools(2).values(cases.lora_merged_on_rank_0, stage, str(tmp_path / "merged"))
    if stage == 3:
        assert "merge_and_unload() of a PEFT model sharded at ZeRO stage 3" in results[0]["error"], results[0]
        assert "PeftModel.from_pretrained" in results[0]["error"]
        return
    assert results[0]["error"] is None, results[0]
    assert (tmp_path / "merged" / "config.json").exists()
    state = load_file(tmp_path / "merged" / "model.safetensors")
    assert not [k for k in state if "lora" in k]
    expected = results[0]["expected"]
    assert len(expected) == 8  # the four attention projections of both layers
    for name, weight in expected.items():
        torch.testing.assert_close(state[name], weight, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def quantizable(tmp_path_factory):
    """Tiny LLaMA and Falcon checkpoints for bitsandbytes to quantize on load."""
    from tests._training import make_model

    root = tmp_path_factory.mktemp("qlora")
    for kind in ("llama", "falcon"):
        make_model(kind).save_pretrained(root / kind)
    return root


@pytest.mark.parametrize("kind, stage, quant_type, double, storage", [
    ("llama", 1, "nf4", True, "float32"), ("llama", 2, "nf4", True, "float32"), ("llama", 3, "nf4", True, "float32"),
    ("llama", 3, "fp4", False, "float32"), ("falcon", 2, "nf4", False, "float32"), ("falcon", 3, "fp4", True, "float32"),
    ("llama", 3, "nf4", True, "uint8"), ("falcon", 3, "nf4", True, "uint8"),
    pytest.param("llama", 1, "nf4", True, "uint8", marks=pytest.mark.slow),  # the suite's time: the codes' part
    pytest.param("llama", 2, "fp4", False, "uint8", marks=pytest.mark.slow),  # takes the same path at every stage
])
def test_qlora_on_a_sharded_4bit_base_equals_one_process(pools, quantizable, kind, stage, quant_type, double, storage):
    """[Note: quantized base] QLoRA as PEFT users build it (transformers' 4-bit load with the codes stored as
    uint8, bitsandbytes' default, or as float32, prepare_model_for_kbit_training, LoRA) under hf_zero on 2 ranks:
    losses, clipped gradient norms and adapter weights after 3 AdamW steps within 1e-5 of the same QLoRA in one
    process on both ranks' batches, with bitsandbytes' own kernels on both sides; the codes byte for byte."""
    from tests import _qlora_cases

    for rank, r in enumerate(pools(2).values(_qlora_cases.qlora_against_one_process, str(quantizable / kind), stage,
                                             quant_type, double, storage)):
        assert r["codes_kept"], rank
        for key in ("loss", "norm"):
            np.testing.assert_allclose(r["record"][key], r["reference"][key], rtol=1e-5, err_msg=f"{rank} {key}")
        assert r["adapters"].keys() == r["ref_adapters"].keys() and len(r["adapters"]) >= 4
        for name, value in r["ref_adapters"].items():
            assert rel_err(r["adapters"][name].numpy(), value.numpy()) <= 1e-5, (rank, name)


@pytest.mark.parametrize("stage", [1, 3])
def test_an_evaluation_between_qlora_steps_leaves_the_codes_in_place(pools, quantizable, stage):
    """[Note: codes repacked on the CPU] bitsandbytes' layers set to repack their codes at an eval forward, as on a
    CPU with AVX512-BF16: an evaluation between the steps under hf_zero keeps the codes byte for byte, and the
    losses, eval loss, norms and adapters equal one-process QLoRA within 1e-5 (stages 1-2 refused the next forward:
    the parameter's data replaced; stage 3 changed the codes)."""
    from tests import _qlora_cases

    for rank, r in enumerate(pools(2).values(_qlora_cases.qlora_against_one_process, str(quantizable / "llama"),
                                             stage, "nf4", True, "uint8", evaluate=True)):
        assert r["codes_kept"], rank
        assert len(r["record"]["eval"]) == 1
        for key in ("loss", "norm", "eval"):
            np.testing.assert_allclose(r["record"][key], r["reference"][key], rtol=1e-5, err_msg=f"{rank} {key}")
        for name, value in r["ref_adapters"].items():
            assert rel_err(r["adapters"][name].numpy(), value.numpy()) <= 1e-5, (rank, name)


@pytest.mark.parametrize("stage, storage", [(3, "uint8"), (1, "float32")])
def test_qlora_from_pretrained_reads_slices_and_equals_the_users_build(pools, quantizable, stage, storage):
    """[Note: quantized load] `hf_zero.from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True,
    ...), peft_config=LoraConfig(...))` on 2 ranks, no rank holding the model whole: the packed codes and every
    weight's scales equal transformers' 4-bit load byte for byte, and 3 steps of QLoRA equal the user's build
    (transformers' load, peft, initialize): losses, clipped norms and adapters within 1e-5."""
    from tests import _qlora_cases

    for rank, r in enumerate(pools(2).values(_qlora_cases.qlora_loaded_both_ways, str(quantizable / "llama"), stage,
                                             storage)):
        assert r["codes_equal"] and r["scales_equal"], rank
        for key in ("loss", "norm"):
            np.testing.assert_allclose(r["got"][key], r["want"][key], rtol=1e-5, err_msg=f"{rank} {key}")
        mine, theirs = r["adapters"][1], r["adapters"][0]
        assert mine.keys() == theirs.keys() and len(mine) >= 4
        for name, value in theirs.items():
            assert rel_err(mine[name].numpy(), value.numpy()) <= 1e-5, (rank, name)


def test_a_checkpoint_saved_with_its_4bit_weights_loads_into_shards(pools, quantizable, tmp_path):
    """[Note: quantized load] a directory transformers saved from its 4-bit load (codes and scales as stored):
    `hf_zero.from_pretrained` at stage 3 on 2 ranks reads each rank's slice of the codes as they are and rebuilds
    every scale: codes and scales equal transformers' load of the same directory byte for byte, and so do the
    logits."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tests import _qlora_cases

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.float32)
    AutoModelForCausalLM.from_pretrained(quantizable / "llama", quantization_config=q, dtype=torch.float32,
                                         device_map={"": "cpu"}).save_pretrained(tmp_path / "4bit")
    for rank, r in enumerate(pools(2).values(_qlora_cases.qlora_from_a_saved_4bit_checkpoint, str(tmp_path / "4bit"),
                                             3)):
        assert r["codes_equal"] and r["scales_equal"], rank
        assert r["logits"] == 0.0, (rank, r["logits"])


def test_a_4bit_base_the_engine_cannot_shard_exactly_is_refused_naming_the_way(pools, quantizable):
    from tests import _qlora_cases

    for r in pools(2).values(_qlora_cases.qlora_refusals, str(quantizable / "llama")):
        assert "requires grad: its data are packed codes" in r["trainable_base"]
        assert "was repacked by bitsandbytes for its CPU kernel" in r["repacked"]
        assert "Call hf_zero.initialize before any forward" in r["repacked"]


@pytest.mark.parametrize("storage", ["uint8", pytest.param("float32", marks=pytest.mark.slow)])
def test_qlora_under_mixed_precision_and_int8_gathers_keeps_the_codes(pools, quantizable, storage):
    """Mixed precision (bf16) and int8 weight gathers at stage 3 cast and requantize the rest of the model, never
    the packed codes (their own part: [Note: quantized base]): the codes come out byte for byte, and the run tracks
    the fp32 one-process QLoRA at bf16 noise (losses within 2e-2)."""
    from tests import _qlora_cases

    for rank, r in enumerate(pools(2).values(_qlora_cases.qlora_against_one_process, str(quantizable / "llama"), 3,
                                             "nf4", True, storage, mixed_precision="bf16", quantized_weights=True)):
        assert r["codes_kept"], rank
        np.testing.assert_allclose(r["record"]["loss"], r["reference"]["loss"], rtol=2e-2, err_msg=str(rank))


def test_qlora_through_zero_trainer_equals_the_stock_trainer_under_ddp(pools, quantizable, tmp_path):
    """The Trainer path as PEFT users take it: a QLoRA model (4-bit base, LoRA) given to ZeroTrainer at stage 3 on 2
    processes, against the stock Trainer under DDP on the same processes: losses, gradient norms, eval loss and
    adapter weights within 1e-5."""
    from dataclasses import replace

    from tests import _trainer_cases as tc

    job = tc.Job(kind="qlora", stage=3, world=2, out_dir=str(tmp_path / "zero"), base_dir=str(quantizable / "llama"))
    got = pools(2).values(tc.run, job)[0]
    ddp = pools(2).values(tc.run, replace(job, out_dir=str(tmp_path / "ddp")), False)[0]
    assert got["world"] == ddp["world"] == 2
    for key in ("losses", "norms"):
        np.testing.assert_allclose(got[key], ddp[key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(got["eval_loss"], ddp["eval_loss"], rtol=1e-5)
    adapters = [name for name in ddp["state"] if "lora_" in name]
    assert len(adapters) >= 4
    for name in adapters:
        assert rel_err(got["state"][name].numpy(), ddp["state"][name].numpy()) <= 1e-5, name


@pytest.mark.parametrize("stage", [1, 3])
def test_qlora_estimate_counts_what_a_rank_holds(pools, quantizable, stage):
    """`hf-zero estimate --qlora`'s count (`as_4bit` on the meta model: the packed codes as frozen weights of the
    model's dtype, the quantization scales whole on every rank) against what each rank holds after a QLoRA step
    (hf_zero's own count of its shards, plus the scales bitsandbytes keeps): within 5%, and the scales exact."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_zero.estimate import Workload, as_4bit, estimate
    from tests import _qlora_cases

    config = AutoConfig.from_pretrained(quantizable / "llama")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    meta = get_peft_model(meta, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0))
    scales = as_4bit(meta)
    rows = estimate(meta, config, world_size=2, workload=Workload(seq_len=16), mixed_precision="no",
                    whole_state_bytes=scales)
    predicted = next(r for r in rows if r.stage == stage and r.offload == "none").model_states
    measured = pools(2).values(_qlora_cases.qlora_memory, str(quantizable / "llama"), stage)
    assert {r["scales"] for r in measured} == {scales}
    worst = max(r["measured"] + r["scales"] for r in measured)
    assert abs(predicted - worst) <= 0.05 * worst, (predicted, worst)


@pytest.mark.parametrize("stage", [1, 3])
def test_lora_base_weights_unfrozen_after_a_warm_up_under_mixed_precision(pools, stage):
    """peft's LoRA on a bf16 model under bf16 mixed precision: the base's `q_proj` weights, frozen by
    `get_peft_model` before `initialize`, unfrozen after two steps of adapters only, in a DDP-style loop (torch's
    `clip_grad_norm_` on `model.parameters()`, `zero_grad(set_to_none=False)`, eval forwards between steps): bit for
    bit the run where they were trainable at `initialize` and frozen by the same toggles (losses and every weight)."""
    woken = pools(2).values(cases.lora_base_unfrozen_after_warm_up, stage, True)[0]
    reference = pools(2).values(cases.lora_base_unfrozen_after_warm_up, stage, False)[0]
    assert woken["losses"] == reference["losses"], (woken["losses"], reference["losses"])
    for name, value in reference["state"].items():
        assert torch.equal(woken["state"][name], value), name
    assert woken["before"] and all(not torch.equal(woken["state"][k], v) for k, v in woken["before"].items())
