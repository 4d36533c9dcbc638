"""The start-up line `initialize` logs on rank 0 (tests/test_hf_api.py)."""

from __future__ import annotations

from typing import Any

import torch

import hf_zero
from tests._training import hf_zero_records, make_model


def startup_and_first_step(stage: int) -> dict[str, Any]:
    """Initialize (capturing the hf_zero log records), take one step; the records and the memory after it."""
    with hf_zero_records() as records:
        model = make_model("llama")
        model, opt = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), hf_zero.ZeroConfig(stage=stage))
    x = torch.randint(0, 100, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    return {"records": records, "after_step": hf_zero.model_state_memory(model).total()}


def startup_of_a_load(directory: str) -> dict[str, Any]:
    """`hf_zero.from_pretrained` of `directory` at stage 3 (capturing the log records): the records and this rank's
    parameter shards' bytes."""
    from transformers import AutoModelForCausalLM

    with hf_zero_records() as records:
        model, _ = hf_zero.from_pretrained(AutoModelForCausalLM, directory, hf_zero.ZeroConfig(stage=3))
    return {"records": records, "shards": hf_zero.model_state_memory(model).total()}
