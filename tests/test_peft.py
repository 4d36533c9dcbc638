"""LoRA through `peft` on a sharded model: `get_peft_model` before `hf_zero.initialize`, at stages 1-3,
against single-process PEFT training (fp32, 1e-5 relative, 5 steps, accumulation 2, clipping); the
adapter saved with the PEFT model's own `save_pretrained` reloads with `PeftModel.from_pretrained`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._training import Scenario, make_model, rel_err
from tests.test_parity import run_and_compare

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
