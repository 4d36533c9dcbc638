"""Which files `hf_zero.from_pretrained` reads and a sharded model's saves write: the same as transformers'
`from_pretrained` reads and `save_pretrained` writes, or a refusal naming the way (a stale index beside a single
file, `subfolder`, loader keywords with no meaning here, a remote-code model's code)."""

from __future__ import annotations

import importlib
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests._training import make_model


@pytest.mark.parametrize("stale_shards", [False, True])
def test_a_single_file_beside_a_stale_index_loads_as_transformers_loads_it(tmp_path, stale_shards):
    """Saved sharded, then as one file into the same directory: transformers' `save_pretrained` leaves the old
    index (and another tool may leave the old shards). `from_pretrained` reads `model.safetensors` first; so must
    hf_zero (it read the index: a missing file, or with the old shards there, the old weights, silently)."""
    import hf_zero

    old, new = make_model("llama", seed=1), make_model("llama", seed=2)
    kept = tmp_path / "kept"
    old.save_pretrained(kept, max_shard_size="20KB")
    directory = tmp_path / "model"
    old.save_pretrained(directory, max_shard_size="20KB")
    new.save_pretrained(directory)
    if stale_shards:
        for f in kept.glob("model-*.safetensors"):
            shutil.copy(f, directory / f.name)
    assert (directory / "model.safetensors.index.json").is_file()
    expected = AutoModelForCausalLM.from_pretrained(directory).state_dict()
    assert torch.equal(expected["lm_head.weight"], new.state_dict()["lm_head.weight"])
    model, _ = hf_zero.from_pretrained(AutoModelForCausalLM, directory, hf_zero.ZeroConfig(stage=3))
    for name, value in hf_zero.full_state_dict(model).items():
        assert torch.equal(value, expected[name]), name


def test_loader_keywords_read_the_files_transformers_reads_or_are_refused(tmp_path):
    """`subfolder` took the config from the subfolder and the weights from the folder above (another model's,
    silently); now both come from it, as transformers'. A dtype by name (`dtype="bfloat16"`) is taken as
    transformers takes it. `variant` and `gguf_file` would read files other than transformers' and are refused
    naming what to do."""
    import hf_zero

    make_model("llama", seed=1).save_pretrained(tmp_path)
    make_model("llama", seed=2).save_pretrained(tmp_path / "sub")
    expected = AutoModelForCausalLM.from_pretrained(tmp_path, subfolder="sub").state_dict()
    model, _ = hf_zero.from_pretrained(AutoModelForCausalLM, tmp_path, hf_zero.ZeroConfig(stage=3), subfolder="sub")
    for name, value in hf_zero.full_state_dict(model).items():
        assert torch.equal(value, expected[name]), name
    by_name, _ = hf_zero.from_pretrained(AutoModelForCausalLM, tmp_path, hf_zero.ZeroConfig(stage=3), dtype="bfloat16")
    assert {p.dtype for p in by_name.parameters()} == {torch.bfloat16}  # a dtype by name, as transformers takes it
    with pytest.raises(TypeError, match=r"variant: it reads model.safetensors"):
        hf_zero.from_pretrained(AutoModelForCausalLM, tmp_path, hf_zero.ZeroConfig(stage=3), variant="fp16")
    with pytest.raises(TypeError, match=r"not GGUF"):
        hf_zero.from_pretrained(AutoModelForCausalLM, tmp_path, hf_zero.ZeroConfig(stage=3), gguf_file="m.gguf")


_REMOTE_CONFIG = """from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
"""
_REMOTE_MODEL = """from transformers import LlamaForCausalLM

from .configuration_tiny import TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
"""


@pytest.mark.parametrize("how", ["initialize", "from_pretrained"])
def test_a_remote_code_model_saves_its_code_and_loads_back(tmp_path, monkeypatch, how):
    """A model whose code lives in its directory (`trust_remote_code`, `auto_map` in config.json): its
    `save_pretrained` and the consolidation of its checkpoint lacked `modeling_*.py`, so transformers could not
    load them; now both copy the code as transformers' `save_pretrained` does, and load with the trained
    weights."""
    import hf_zero

    package = tmp_path / "code" / "tinyremote"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "configuration_tiny.py").write_text(_REMOTE_CONFIG)
    (package / "modeling_tiny.py").write_text(_REMOTE_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    config_module = importlib.import_module("tinyremote.configuration_tiny")
    model_module = importlib.import_module("tinyremote.modeling_tiny")
    config_module.TinyRemoteConfig.register_for_auto_class()
    model_module.TinyRemoteForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    config = config_module.TinyRemoteConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model_module.TinyRemoteForCausalLM(config).save_pretrained(tmp_path / "base")
    zero = hf_zero.ZeroConfig(stage=3)
    if how == "initialize":
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", trust_remote_code=True)
        model, _ = hf_zero.initialize(model, None, zero)
    else:
        model, _ = hf_zero.from_pretrained(AutoModelForCausalLM, tmp_path / "base", zero, trust_remote_code=True)
    expected = hf_zero.full_state_dict(model)
    model.save_pretrained(tmp_path / "saved")
    hf_zero.save_checkpoint(tmp_path / "ckpt", model)
    hf_zero.consolidate(tmp_path / "ckpt", tmp_path / "consolidated", progress=False)
    for directory in ("saved", "consolidated"):
        assert {"configuration_tiny.py", "modeling_tiny.py"} <= {p.name for p in (tmp_path / directory).iterdir()}
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / directory, trust_remote_code=True)
        assert type(loaded).__name__ == "TinyRemoteForCausalLM"
        for name, value in loaded.state_dict().items():
            assert torch.equal(value, expected[name]), (directory, name)
