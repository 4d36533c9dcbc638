"""Models transformers loads in bf16 with some parameters kept in float32 (`_keep_in_fp32_modules_strict`: the MoE
router gates of DeepSeek-V3 and GLM-4-MoE), under hf_zero and under torch's DDP on the same ranks ([Note: parameters
kept in their own dtype] in hf_zero/engine/unit.py)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist

import hf_zero
from hf_zero.checkpoint.consolidate import save_pretrained
from tests._training import VOCAB

KINDS = ("deepseek_v3", "glm4_moe")


def save_base(kind: str, directory: str) -> str:
    """A tiny `kind` model (float32, seed 0) saved to `directory`: the checkpoint the runs load in bf16."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                  n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                  tie_word_embeddings=False)
    if kind == "deepseek_v3":
        cfg = tf.DeepseekV3Config(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                  v_head_dim=8, **common)
    else:
        cfg = tf.Glm4MoeConfig(head_dim=8, **common)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # the router's weight starts at zero: give it values whose bf16 rounding shows
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.weight.normal_(0, 0.5)
                module.e_score_correction_bias.uniform_(-0.1, 0.1)
    model.save_pretrained(directory)
    return directory


def load_bf16(directory: str) -> torch.nn.Module:
    """The model as transformers loads it with `dtype=torch.bfloat16`: the gates stay float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    model.config._attn_implementation = "eager"
    model.train()
    return model


def _batches(rank: int, steps: int, accum: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(steps * accum)]


def _train(
    model: Any, opt: torch.optim.Optimizer, batches: list[torch.Tensor], accum: int, ddp: bool, idioms: bool = False
) -> dict:
    """Steps of `accum` micro-batches (the first ones without gradient sync), clipped at 1.0. With `idioms`, as DDP
    loops also write it: `zero_grad(set_to_none=False)` and an evaluation forward after each step."""
    losses, norms = [], []
    for i, x in enumerate(batches):
        last = (i + 1) % accum == 0
        sync = model.no_sync() if not last else contextlib.nullcontext()
        with sync:
            loss = model(input_ids=x, labels=x).loss / accum
            loss.backward()
        losses.append(float(loss.detach()))
        if last:
            params = model.parameters()
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
            opt.step()
            opt.zero_grad(set_to_none=not idioms)
            if idioms:
                model.eval()
                with torch.no_grad():
                    losses.append(float(model(input_ids=x, labels=x).loss))
                model.train()
    return {"losses": losses, "norms": norms}



def against_ddp(base: str, stage: int, steps: int = 3, accum: int = 2, idioms: bool = False) -> dict[str, Any]:
    """`steps` steps of AdamW on the bf16 load (gates float32) under hf_zero at `stage` and under torch's DDP on
    the same ranks and batches: each side's losses, clipped norms, parameter dtypes, final weights (rank 0), and the
    files the sharded model saves (their dtypes)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    batches = _batches(rank, steps, accum)
    ref = load_bf16(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ddp = DDP(ref)
    reference = _train(ddp, ref_opt, batches, accum, ddp=True, idioms=idioms)
    model = load_bf16(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = hf_zero.ZeroConfig(stage=stage, no_sync_keeps_grads=True)  # DDP's order: sum the micro-batches, reduce
    model, opt = hf_zero.initialize(model, opt, config)
    got = _train(model, opt, batches, accum, ddp=False, idioms=idioms)
    state = hf_zero.full_state_dict(model)
    out = os.path.join(base, f"saved-{stage}")
    model.save_pretrained(out)
    save_pretrained(model, out + "-parallel", parallel=True, progress=False)  # every rank writes what it owns
    hf_zero.save_checkpoint(out + "-ckpt", model, opt)
    dist.barrier()
    if rank == 0:
        hf_zero.consolidate(out + "-ckpt", out + "-consolidated", progress=False)
        hf_zero.consolidate(out + "-ckpt", out + "-consolidated-bf16", dtype="bf16", progress=False)
    dist.barrier()
    return {
        "reference": reference, "got": got,
        "ref_state": {k: v.detach().clone() for k, v in ref.state_dict().items()} if rank == 0 else None,
        "state": {k: v.detach().clone() for k, v in state.items()} if rank == 0 else None,
        "saved": out,
    }


def mixed_precision_run(base: str) -> dict[str, Any]:
    """The bf16 load at stage 3 under mixed_precision='bf16': what dtype the gate's forward sees, the parts'
    master and compute dtypes, 4 steps' losses, and the dtype the saved gate has."""
    model = load_bf16(base)
    seen: list[str] = []
    gate = model.model.layers[1].mlp.gate
    gate.register_forward_pre_hook(lambda module, args: seen.append(str(module.weight.dtype)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = hf_zero.initialize(model, opt, hf_zero.ZeroConfig(stage=3, mixed_precision="bf16"))
    x = _batches(dist.get_rank(), 1, 1)[0]
    losses = []
    for _ in range(2):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    engine = model.zero_engine
    kept = [p for p in engine.parts if p.spec.dtype is not None]
    rest = [p for p in engine.parts if p.spec.dtype is None]
    out = os.path.join(base, "mixed")
    model.save_pretrained(out)
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        saved = str(f.get_tensor("model.layers.1.mlp.gate.weight").dtype)
    return {
        "gate_dtypes_seen": seen, "losses": losses, "saved_gate_dtype": saved,
        "masters": {"gate": str(kept[0].master_dtype), "rest": str(rest[0].master_dtype)},
        "compute": {"gate": str(kept[0].param_dtype), "rest": str(rest[0].param_dtype)},
    }


def batchnorm_under_mixed_precision(stage: int, offload: str) -> dict[str, Any]:
    """The peer scenarios' `Net` with a BatchNorm, fp32, trained 4 steps under `mixed_precision="bf16"` at `stage`
    (`offload`: "optimizer" to host memory, or a folder for `offload_dir`, or ""), every rank on one batch; beside
    it, the same model at stage 0 under the same settings, and in fp32 in this process alone. The losses of each,
    and the dtypes BatchNorm's weight and input had in the sharded model's forwards."""
    from tests._peer_harness import Net

    x, y = torch.randn(8, 6, generator=torch.Generator().manual_seed(5)), torch.randn(8, 3)
    runs: dict[str, list[float]] = {}
    seen: list[str] = []
    offloaded: dict[str, Any] = {"offload_optimizer": bool(offload)}
    if offload not in ("", "optimizer"):
        offloaded["offload_dir"] = offload
    for name, config in (("sharded", {"stage": stage, **offloaded}), ("stage0", {"stage": 0}), ("fp32", None)):
        torch.manual_seed(0)
        model = Net(n=2, batchnorm=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if config is not None:
            model, opt = hf_zero.initialize(model, opt, hf_zero.ZeroConfig(wrap=["Block"], mixed_precision="bf16",
                                                                           **config))
        if name == "sharded":
            model.bn.register_forward_pre_hook(lambda m, args: seen.append(f"{m.weight.dtype} {args[0].dtype}"))
        runs[name] = []
        for _ in range(4):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            runs[name].append(float(loss))
    return {**runs, "seen": seen[0]}


def gates_on_disk_under_mixed_precision(base: str, stage: int, offload_dir: str) -> dict[str, Any]:
    """The bf16 load (gates float32) under `mixed_precision="bf16"` at `stage`, 3 steps of 2 micro-batches with
    clipping, the optimizer's state and masters in memory and then in `offload_dir` (every master float32: the gates'
    part has a place of its own in the files), then a checkpoint of the disk run loaded into a fresh in-memory model.
    Each run's losses and norms, and the full states (rank 0)."""
    rank = dist.get_rank()
    batches = _batches(rank, 3, 2)
    runs: dict[str, Any] = {}
    models = {}
    for where in ("memory", "disk"):
        model = load_bf16(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        extra = {"offload_optimizer": True, "offload_dir": offload_dir} if where == "disk" else {}
        config = hf_zero.ZeroConfig(stage=stage, mixed_precision="bf16", **extra)
        model, opt = hf_zero.initialize(model, opt, config)
        runs[where] = _train(model, opt, batches, 2, ddp=False)
        if where == "disk":
            hf_zero.save_checkpoint(os.path.join(offload_dir, "ckpt"), model, opt)
        models[where] = (model, opt)
    fresh = load_bf16(base)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh, fresh_opt = hf_zero.initialize(fresh, fresh_opt, hf_zero.ZeroConfig(stage=stage, mixed_precision="bf16"))
    hf_zero.load_checkpoint(os.path.join(offload_dir, "ckpt"), fresh, fresh_opt)
    models["loaded"] = (fresh, fresh_opt)
    states = {k: hf_zero.full_state_dict(m) for k, (m, _) in models.items()}
    return {
        "runs": runs,
        "states": {k: {n: v.detach().clone() for n, v in s.items()} for k, s in states.items()} if rank == 0 else None,
        "dtypes": {n: str(v.dtype) for n, v in states["disk"].items()} if rank == 0 else None,
    }
