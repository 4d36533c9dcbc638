"""One benchmark run under torchrun: train the preset model with one engine, write a JSON record.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/_worker.py \\
        --engine hf_zero3 --preset small --steps 5 --warmup 2 --out result.json

Every engine trains the same LLaMA (same config, init seed and token batches), with fp32 AdamW,
global-norm clipping at 1.0 and the global batch split evenly over the ranks. Tokens/s is timed
over the steps after the warm-up, between barriers. Peak memory is the process's peak resident
set during training (VmHWM, reset with /proc/self/clear_refs after the model is built), minus the
resident set at that reset; model-state bytes are the parameters, gradients and optimizer state
this rank holds after the last step.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

PRESETS = {
    # issue 8's first preset: activations matter; ~31M parameters
    "small": dict(hidden=512, layers=8, heads=8, kv_heads=8, inter=1376, vocab=8192, seq=256, global_batch=8),
    # model states dominate: a 217M-parameter LLaMA, short sequences
    "large": dict(hidden=1024, layers=12, heads=16, kv_heads=16, inter=2816, vocab=32000, seq=32, global_batch=2),
}
ENGINES = ["ddp", "hf_zero1", "hf_zero2", "hf_zero3", "hf_zero3_offload", "fsdp2", "fsdp2_noreshard", "ds1", "ds2", "ds3"]


def build_model(p: dict) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["inter"],
                         num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                         num_key_value_heads=p["kv_heads"], max_position_embeddings=p["seq"], tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config)


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Local parameters, gradients and optimizer state (DTensors counted by their local shard)."""
    seen, total = set(), 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        t = getattr(t, "_local_tensor", t)
        s = t.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes():
            seen.add(s.data_ptr())
            total += s.nbytes()

    for p in model.parameters():
        add(p)
        if p.grad is not None:
            add(p.grad)
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                add(v)
    return total


def setup(engine: str, model: torch.nn.Module, micro: int):
    """Returns (model, step_fn(batch) -> loss float, state_bytes_fn)."""
    def adamw(params):  # noqa: ANN001
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=True)

    if engine.startswith("hf_zero"):
        import hf_zero

        stage = int(engine[7])
        config = hf_zero.ZeroConfig(stage=stage, offload_optimizer=engine.endswith("offload"))
        model, opt = hf_zero.initialize(model, adamw(model.parameters()), config)

        def step(batch):  # noqa: ANN001
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            return loss.detach()

        return step, lambda: hf_zero.model_state_memory(model).total()
    if engine == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = adamw(ddp.parameters())
    elif engine.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        reshard = engine == "fsdp2"
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        ddp, opt = model, adamw(model.parameters())
    elif engine.startswith("ds"):
        import deepspeed

        cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
               "zero_optimization": {"stage": int(engine[2])}, "steps_per_print": 10**9,
               "zero_allow_untested_optimizer": True}
        ds_engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), config=cfg)

        def ds_step(batch):  # noqa: ANN001
            loss = ds_engine(input_ids=batch, labels=batch).loss
            ds_engine.backward(loss)
            ds_engine.step()
            return loss.detach()

        return ds_step, lambda: -1  # DeepSpeed keeps its own flat buffers; not comparable by this count
    else:
        raise ValueError(engine)

    def torch_step(batch):  # noqa: ANN001
        loss = ddp(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    return torch_step, lambda: _state_bytes(ddp, opt)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=ENGINES, required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.engine.startswith("ds"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    p = PRESETS[args.preset]
    micro = p["global_batch"] // world
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, p["vocab"], (args.warmup + args.steps, p["global_batch"], p["seq"]), generator=g)
    model = build_model(p)
    n_params = sum(q.numel() for q in model.parameters())
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak resident set: measure training only
        f.write("5")
    base = _rss("VmRSS:")
    step, state_bytes = setup(args.engine, model, micro)
    losses = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            dist.barrier()
            start = time.perf_counter()
        batch = data[i, rank * micro : (rank + 1) * micro]
        loss = step(batch)
        mean = loss.float().reshape(1).clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    dist.barrier()
    elapsed = time.perf_counter() - start
    record = {
        "engine": args.engine, "preset": args.preset, "rank": rank, "world": world, "params": n_params,
        "tokens_per_s": args.steps * p["global_batch"] * p["seq"] / elapsed, "losses": losses,
        "peak_rss_bytes": _rss("VmHWM:") - base, "model_state_bytes": state_bytes(),
    }
    records = [None] * world
    dist.all_gather_object(records, record)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(records, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
