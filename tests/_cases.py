"""Functions the engine tests run on every rank of a pool (they must be importable by name)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import hf_zero
from tests._training import make_model, make_optimizer


def config_error(kwargs: dict[str, Any]) -> str:
    """Build a ZeroConfig from `kwargs` on this rank; return the error text (no collective involved)."""
    try:
        hf_zero.ZeroConfig(**kwargs)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def initialize_with_wrap(wrap_by_rank: list[Any]) -> float:
    """initialize with a per-rank wrap setting; returns the seconds it took to fail (it must fail)."""
    model = make_model("llama")
    start = time.monotonic()
    try:
        hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=3, wrap=wrap_by_rank[dist.get_rank()]))
    except Exception:
        dist.barrier()  # the process group is still healthy: every rank got here
        raise
    return time.monotonic() - start


def eval_and_generate(kind: str, stage: int) -> dict[str, Any]:
    """Eval logits and greedy generation through the sharded model (every rank calls them)."""
    model = make_model(kind)
    model, _ = hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=stage))
    model.eval()
    prompt = torch.tensor([[5, 17, 42, 7]])
    with torch.no_grad():
        logits = model(input_ids=prompt).logits
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return {
        "logits": logits.numpy().copy(),
        "generated": generated.tolist(),
        "class_name": type(model).__name__,
        "is_original_class": isinstance(model, type(make_model(kind))),
        "has_config": model.config.model_type,
    }


def tied_weights_stay_tied() -> dict[str, Any]:
    model = make_model("falcon")
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=3))
    same_object = model.lm_head.weight is model.transformer.word_embeddings.weight
    batch = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad()
    state = hf_zero.full_state_dict(model)
    if dist.get_rank() != 0:
        return {"same_object": same_object}
    return {
        "same_object": same_object and model.lm_head.weight is model.transformer.word_embeddings.weight,
        "equal_values": bool(torch.equal(state["lm_head.weight"], state["transformer.word_embeddings.weight"])),
    }
