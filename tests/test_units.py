"""How a model is cut into units: blocks, buckets of blocks, models without blocks."""

from __future__ import annotations

import torch


def test_models_without_blocks_get_predictable_units(caplog):
    """[Note: units without blocks]: one unit when the model fits one bucket, else one per child with
    parameters (through single-child wrappers), joined up to the bucket; the log says which."""
    from torch import nn

    from hf_zero.engine.wrap import find_units

    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with caplog.at_level("WARNING", logger="hf_zero"):
        units = find_units(seq, "auto", bucket_numel=1000)
    assert [u.name for u in units] == [""] and len(units[0].params) == 4
    assert "Sequential has no transformer blocks" in caplog.text and "one unit, the model itself" in caplog.text
    assert "ZeroConfig(wrap=[...])" in caplog.text
    units = find_units(seq, "auto", bucket_numel=0)
    assert [u.name for u in units] == ["0", "2", ""] and units[-1].params == ()

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))

    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_zero"):
        units = find_units(Wrapped(), "auto", bucket_numel=50)  # 40 + 72 + 18 parameters
    assert [u.name for u in units] == ["net.0-1", "net.2", ""]
    assert "a unit per child of net with parameters (net.0, net.1, net.2; consecutive" in caplog.text

    class Scalars(nn.Module):  # the upstream Trainer tests' kind of model: parameters on the root only
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Parameter(torch.tensor(0.5)), nn.Parameter(torch.tensor(0.1))

    units = find_units(Scalars(), "auto", bucket_numel=0)
    assert [u.name for u in units] == [""] and units[0].param_names == ("a", "b")


def test_bucket_size_groups_consecutive_blocks():
    """Blocks join until a unit holds `bucket_numel` parameters; the untied embedding and head stay
    units of their own, and every parameter still belongs to exactly one unit. Blocks frozen whole join only each
    other (such a unit can be unfrozen later)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_zero.engine.wrap import find_units

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    names = lambda specs: [s.name for s in specs]  # noqa: E731
    assert names(find_units(model, "auto")) == [
        "model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3",
        "model.layers.4", "lm_head", ""]
    grouped = find_units(model, "auto", bucket_numel=2 * block)  # a unit closes once it holds >= 2 blocks
    assert names(grouped) == ["model.embed_tokens", "model.layers.0-1", "model.layers.2-3", "model.layers.4", "lm_head", ""]
    assert [len(s.all_modules) for s in grouped] == [1, 2, 2, 1, 1, 1]
    assert grouped[1].all_modules == (model.model.layers[0], model.model.layers[1])
    owned = [n for s in grouped for n in s.param_names]
    assert sorted(owned) == sorted(n for n, _ in model.named_parameters())
    assert not grouped[0].backward_reads_params and all(s.backward_reads_params for s in grouped[1:])
    assert names(find_units(model, "auto", bucket_numel=10**9)) == ["model.embed_tokens", "model.layers.0-4", "lm_head", ""]
    for p in model.model.layers[:2].parameters():  # gradual unfreezing's start: the lowest blocks frozen whole
        p.requires_grad_(False)
    model.model.layers[3].mlp.requires_grad_(False)  # a block frozen in part (LoRA's shape) joins trainable ones
    assert names(find_units(model, "auto", bucket_numel=10**9)) == [
        "model.embed_tokens", "model.layers.0-1", "model.layers.2-4", "lm_head", ""]
