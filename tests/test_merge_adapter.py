"""`hf-zero merge-adapter`: a LoRA adapter merged into its base, offline ([Note: merged export] in
hf_zero/checkpoint/merge.py), against PEFT's own `merge_and_unload`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._cli import run_cli
from tests._training import make_model

peft = pytest.importorskip("peft")


def _adapter(base: Path, out: Path, **lora: object) -> torch.nn.Module:
    """A LoRA adapter with random (non-zero) factors on the saved `base`, written by PEFT to `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False,
                        **lora)
    model = get_peft_model(model, config)
    model.save_pretrained(out)
    return model


def _peft_merged(base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    return {k: v.detach().clone() for k, v in model.merge_and_unload().state_dict().items()}


def save_lora_checkpoint(base: str, ckpt: str) -> None:
    """2 AdamW steps of LoRA on `base` under hf_zero at stage 3, then save_checkpoint to `ckpt` (on every rank)."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import hf_zero

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = hf_zero.initialize(model, opt, hf_zero.ZeroConfig(stage=3))
    x = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    hf_zero.save_checkpoint(ckpt, model, opt)


@pytest.fixture
def base(tmp_path) -> Path:
    make_model("llama").save_pretrained(tmp_path / "base")
    return tmp_path / "base"


@pytest.mark.parametrize("lora", [{}, {"use_rslora": True, "rank_pattern": {"up_proj": 2}},
                                  {"modules_to_save": ["lm_head"]}], ids=["lora", "rslora_patterns", "saved_head"])
def test_merge_adapter_equals_peft_merge_and_unload(base, tmp_path, lora):
    """The merged folder loads with from_pretrained and equals PEFT's merge_and_unload of the same adapter on the same
    base (every tensor within 1e-6), and computes the adapted model's logits; the base folder is untouched."""
    from transformers import AutoModelForCausalLM

    before = (base / "model.safetensors").read_bytes()
    adapted = _adapter(base, tmp_path / "adapter", **lora)
    out = tmp_path / "merged"
    assert run_cli(["merge-adapter", str(tmp_path / "adapter"), str(base), str(out)]).returncode == 0
    want = _peft_merged(base, tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(out)
    got = merged.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)
    x = torch.randint(0, 200, (1, 12))
    torch.testing.assert_close(merged(x).logits, adapted(x).logits, rtol=1e-5, atol=1e-5)
    assert (base / "model.safetensors").read_bytes() == before
    assert "hf_zero_output.json" in {p.name for p in out.iterdir()}


def test_merge_adapter_of_an_hf_zero_checkpoint_and_into_bf16(pools, base, tmp_path):
    """A checkpoint of a LoRA model trained under hf_zero (save_checkpoint) merges as its adapter would, here into
    bf16 (the config says bfloat16, every weight bf16, within bf16 rounding of PEFT's fp32 merge)."""
    ckpt = tmp_path / "ckpt"
    pools(2).values(save_lora_checkpoint, str(base), str(ckpt))
    out = tmp_path / "merged"
    assert run_cli(["merge-adapter", str(ckpt), str(base), str(out), "--dtype", "bf16"]).returncode == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    adapter = tmp_path / "adapter"
    assert run_cli(["consolidate", str(ckpt), str(adapter)]).returncode == 0
    want = _peft_merged(base, adapter)
    from safetensors.torch import load_file

    got = load_file(out / "model.safetensors")
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    changed = [n for n in want if "q_proj" in n]
    assert changed
    for name, value in want.items():
        torch.testing.assert_close(got[name].float(), value, rtol=1e-2, atol=1e-3, msg=name)


def test_merge_adapter_refusals_name_the_way(base, tmp_path):
    """DoRA, an output folder holding the base model itself, and a base without the adapter's modules are refused,
    writing nothing."""
    _adapter(base, tmp_path / "dora", use_dora=True)
    r = run_cli(["merge-adapter", str(tmp_path / "dora"), str(base), str(tmp_path / "out")])
    assert r.returncode == 2 and "DoRA" in r.stderr and not (tmp_path / "out").exists()
    _adapter(base, tmp_path / "adapter")
    r = run_cli(["merge-adapter", str(tmp_path / "adapter"), str(base), str(base)])
    assert r.returncode == 2 and "is a model directory" in r.stderr and "overwrite" in r.stderr
    other = tmp_path / "other"
    make_model("falcon").save_pretrained(other)
    r = run_cli(["merge-adapter", str(tmp_path / "adapter"), str(other), str(tmp_path / "out2")])
    assert r.returncode == 2 and "which the base's files do not hold" in r.stderr
    assert not any((tmp_path / "out2").glob("*.safetensors"))
