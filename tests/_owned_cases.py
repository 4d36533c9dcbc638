"""Worker functions for tests/test_owned_save.py (run on every rank of a pool)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist

import hf_zero
from hf_zero.checkpoint import owned
from hf_zero.engine.module import get_engine
from tests._model_cases import MICRO_BS, batches
from tests._training import make_model, make_optimizer


def _train(kind: str, config: hf_zero.ZeroConfig, steps: int = 2) -> tuple[torch.nn.Module, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(kind)
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-2), config)
    data = batches(world)
    for i in range(steps):
        mine = data[i, rank * MICRO_BS:(rank + 1) * MICRO_BS]
        model(input_ids=mine, labels=mine).loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    return model, opt


def parallel_save(kind: str, stage: int, directory: str, settings: dict[str, Any], dtype: str | None,
                  max_shard_size: str = "5GB") -> dict[str, Any]:
    """Train two steps, then `save_pretrained(parallel=True)`; returns the full state at that step (masters)."""
    settings = dict(settings)
    if "offload_dir" in settings:
        settings["offload_dir"] = os.path.join(settings["offload_dir"], f"rank{dist.get_rank()}")
    model, _ = _train(kind, hf_zero.ZeroConfig(stage=stage, **settings))
    state = hf_zero.full_state_dict(model)  # gathered before the save: the save must not change a thing
    model.save_pretrained(directory, dtype=dtype, max_shard_size=max_shard_size, parallel=True)
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    after = hf_zero.full_state_dict(model)
    out: dict[str, Any] = {"files": files}
    if dist.get_rank() == 0:
        out["state"] = state
        out["unchanged"] = all(torch.equal(after[k], v) for k, v in state.items())
    return out


def parallel_save_memory(directory: str, window: int) -> dict[str, Any]:
    """Stage 3 on this pool: the peak allocated above the model states while `save_pretrained(parallel=True)`
    runs (torch.profiler's running "Total Allocated" of the CPU allocator, as tests/_train_memory.py), the
    largest tensor this rank owns, and the same peak for the rank-0 gathered save (a bound that can fail)."""
    owned.PIECE_NUMEL = window  # a small window, so that the bound is tight against this small model
    model, _ = _train("llama", hf_zero.ZeroConfig(stage=3))
    engine = get_engine(model)
    plan = owned.OwnerPlan.deal(owned.folder_tensors(engine, torch.float32), torch.float32, engine.world.size, 5 * 10**9)
    largest = max(plan.tensors[i].numel * 4 for i in plan.owned[dist.get_rank()])
    peaks = {}
    for parallel in (True, False):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            model.save_pretrained(os.path.join(directory, str(parallel)), parallel=parallel)
        trace = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
        peaks[parallel] = max((e["args"].get("Total Allocated", 0) for e in events if e.get("name") == "[memory]"), default=0)
    return {"parallel": peaks[True], "gathered": peaks[False], "largest": largest, "buffer": window * 4,
            "states": hf_zero.model_state_memory(model).total()}


def failing_parallel_save(directory: str, bad_rank: int) -> dict[str, Any]:
    """One rank cannot write its file (a folder stands where its temporary file would go): every rank raises
    and no weight file is left behind."""
    model, _ = _train("llama", hf_zero.ZeroConfig(stage=3))
    plan_names = owned.OwnerPlan.deal(owned.folder_tensors(get_engine(model), torch.float32), torch.float32,
                                      dist.get_world_size(), 5 * 10**9).file_names()
    if dist.get_rank() == bad_rank:
        os.makedirs(os.path.join(directory, f".{plan_names[bad_rank][0]}.partial"), exist_ok=True)
    dist.barrier()
    try:
        model.save_pretrained(directory, parallel=True)
    except (OSError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"
    else:
        error = None
    # the ranks still work together afterwards
    state = hf_zero.full_state_dict(model)
    return {"error": error, "left": sorted(os.listdir(directory)), "works": bool(state) or dist.get_rank() != 0}
