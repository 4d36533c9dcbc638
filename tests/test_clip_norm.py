"""The global gradient norm `clip_grad_norm_` returns and clips by, against the exact (float64) norm.

A ZeRO unit's gradients are one flat shard of millions of elements, and its norm must not depend on that
length: `torch.linalg.vector_norm` of one fp32 CPU tensor drifts with it (7.7e-5 relative at 4M elements;
the same drift is in `torch.nn.utils.clip_grad_norm_` for a single tensor that large).
"""

from __future__ import annotations

import copy

import pytest
import torch

import hf_zero


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Tanh(), torch.nn.Linear(2048, 4))


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_clip_norm_of_a_4m_element_unit_is_exact(stage, norm_type):
    reference = _net()
    sharded = copy.deepcopy(reference)
    x = torch.randn(64, 2048, generator=torch.Generator().manual_seed(1))
    reference(x).square().mean().backward()
    grads = [p.grad.double() for p in reference.parameters()]
    expected = torch.stack([g.norm(norm_type) for g in grads]).norm(norm_type)
    max_norm = float(expected) / 2  # clipped to half: the moves below stay far above the weights' rounding
    ref_grads = [(g * max_norm / (float(expected) + 1e-6)).float() for g in grads]  # torch's clip rule

    model, optimizer = hf_zero.initialize(sharded, torch.optim.SGD(sharded.parameters(), lr=1.0),
                                          hf_zero.ZeroConfig(stage=stage))
    assert len(model.zero_engine.parts) == 1  # one flat shard of 4.2M elements
    model(x).square().mean().backward()
    got = optimizer.clip_grad_norm_(max_norm, norm_type)
    assert abs(float(got) - float(expected)) / float(expected) <= 1e-6, (float(got), float(expected))
    optimizer.step()  # SGD with lr 1: the weights moved by exactly the clipped gradients
    with hf_zero.gathered_parameters(model):
        for p, p0, g in zip(model.parameters(), _net().parameters(), ref_grads):
            moved = p0.detach() - p.detach()
            assert ((moved - g).norm() / g.norm()).item() <= 1e-5
