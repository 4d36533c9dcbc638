"""[Note: fused step] in hf_zero/engine/step/optim.py: Adam and AdamW left to torch step fused once sharded, and
train as the loop over whole parameters does (fp32, 1e-5 relative); a choice the user made is kept.

The parity tests (test_parity.py) run the same way at stages 0-3 on 2 and 3 ranks: their optimizer
(`tests._training.make_optimizer`) leaves the implementation to torch, their reference steps with the loop."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_zero
from tests._training import VOCAB, make_model, make_optimizer, rel_err


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(n)]


@pytest.mark.parametrize("stage", [1, 3])
def test_adamw_left_to_torch_steps_fused_and_trains_as_the_loop(stage):
    reference = make_model("llama")
    model = copy.deepcopy(reference)
    ref_opt = make_optimizer(reference, lr=1e-3)
    config = hf_zero.ZeroConfig(stage=stage)
    sharded_model, optimizer = hf_zero.initialize(model, make_optimizer(model, lr=1e-3), config)
    assert all(group["fused"] is True for group in optimizer.param_groups)
    assert ref_opt.param_groups[0]["fused"] is None  # the reference keeps torch's loop
    for ids in _batches(4):
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        loss = sharded_model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = optimizer.clip_grad_norm_(0.5)
        optimizer.step()
        optimizer.zero_grad()
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
        assert abs(norm.item() - ref_norm.item()) <= 1e-5 * ref_norm.item()
    got = hf_zero.full_state_dict(sharded_model)
    for name, value in reference.state_dict().items():
        assert rel_err(got[name].numpy(), value.numpy()) <= 1e-5, name


@pytest.mark.parametrize("choice", [{"fused": False}, {"foreach": False}, {"foreach": True}])
def test_an_implementation_the_user_chose_is_kept(choice):
    model = make_model("llama")
    built = torch.optim.AdamW(model.parameters(), lr=1e-3, **choice)
    _, optimizer = hf_zero.initialize(model, built, hf_zero.ZeroConfig(stage=3))
    for key, value in {"fused": None, "foreach": None, **choice}.items():
        assert all(group[key] is value for group in optimizer.param_groups), (key, value)


def test_a_subclass_keeps_its_own_step():
    class Mine(torch.optim.AdamW):
        pass

    model = make_model("llama")
    _, optimizer = hf_zero.initialize(model, Mine(model.parameters(), lr=1e-3), hf_zero.ZeroConfig(stage=3))
    assert all(group["fused"] is None for group in optimizer.param_groups)


@pytest.mark.parametrize("how", ["checkpoint", "state_dict"])
def test_a_load_of_a_state_saved_by_the_loop_steps_fused(tmp_path, how):
    """A checkpoint written before the choice (its groups say `fused: None`) does not turn the loop back on."""
    model = make_model("llama")
    model, optimizer = hf_zero.initialize(model, make_optimizer(model, lr=1e-3), hf_zero.ZeroConfig(stage=3))
    ids = _batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    for group in optimizer.param_groups:
        group["fused"] = None  # as a run of an earlier hf_zero saved it
    if how == "checkpoint":
        hf_zero.save_checkpoint(tmp_path / "ckpt", model, optimizer)
        hf_zero.load_checkpoint(tmp_path / "ckpt", model, optimizer)
    else:
        optimizer.load_state_dict(optimizer.state_dict())
    assert all(group["fused"] is True for group in optimizer.param_groups)


def test_bf16_masters_keep_the_loop():
    """The fused kernel computes in float32 and rounds once; the loop over bf16 tensors rounds each operation, as
    DDP's optimizer does: a bf16 model (no mixed precision) keeps it."""
    model = make_model("llama").to(torch.bfloat16)
    _, optimizer = hf_zero.initialize(model, make_optimizer(model, lr=1e-3), hf_zero.ZeroConfig(stage=3))
    assert all(group["fused"] is None for group in optimizer.param_groups)
