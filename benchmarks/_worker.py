"""One benchmark run under torchrun: train the preset model with one engine, write a JSON record.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/_worker.py \
        --engine hf_zero3 --preset small --weights /tmp/init --steps 5 --warmup 2 --out result.json

Every engine trains the same LLaMA (the same saved initial weights, token batches and AdamW as a
user writes it, fp32, global-norm clipping at 1.0, the global batch split evenly over the ranks).
Each engine loads the weights the way its users do: hf_zero with `hf_zero.from_pretrained`
(each rank reads only its shards), the others with `from_pretrained` on every rank, then wrap.
Tokens/s is timed over the steps after the warm-up, between barriers.

`--device cuda` runs on the GPU of each rank's LOCAL_RANK with NCCL; memory is then CUDA memory
allocated by the caching allocator (`torch.cuda.memory_allocated` / `max_memory_allocated`) in the
same fields. On CPU (the default), memory is the process's resident set (VmRSS/VmHWM), which on
CPU is what holds the model:
- `peak_rss_bytes`: peak over loading, wrapping and training minus the baseline, the resident
  set after imports and process-group set-up (before any model exists);
- `train_peak_rss_bytes`: peak during the timed training loop minus the resident set when it starts;
- `model_state_bytes`: parameters, gradients and optimizer state this rank holds at the last
  optimizer step (hf_zero frees its gradient shards in `zero_grad`, so it is read before that).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

PRESETS = {
    # issue 8's first preset: activations matter; ~31M parameters
    "small": dict(hidden=512, layers=8, heads=8, kv_heads=8, inter=1376, vocab=8192, seq=256, global_batch=8),
    # model states dominate: a 217M-parameter LLaMA, short sequences
    "large": dict(hidden=1024, layers=12, heads=16, kv_heads=16, inter=2816, vocab=32000, seq=32, global_batch=2),
    # the small preset with the input embedding tied to the head (no sparse embedding gradient)
    "small_tied": dict(hidden=512, layers=8, heads=8, kv_heads=8, inter=1376, vocab=8192, seq=256, global_batch=8,
                       tied=True),
}
ENGINES = ["local", "ddp", "hf_zero1", "hf_zero2", "hf_zero3", "hf_zero3_q", "hf_zero3_offload", "fsdp2", "fsdp2_noreshard",
           "ds1", "ds2", "ds3", "ds3_raw"]
# fsdp2: as Accelerate's FSDP2 plugin sets it up; ds3: as the HF Trainer configures DeepSpeed ("auto" filled);
# ds3_raw: DeepSpeed's own defaults ({"stage": 3}); ds1 / ds2: {"stage": N} (see _peers.py)
PEER_CONFIG: dict = {}  # the configuration the peer of this run was built with, recorded beside its figures
# local: every rank trains its own micro-batch with no communication at all (the compute floor of a step:
#        what any engine would take if its collectives cost nothing; not the same training, losses not compared)
# hf_zero3_q: ZeRO-3 with int8 weight gathers (per-block scales) and bf16 gradient reduction
QUANTIZED = {"quantized_weights": True, "reduce_dtype": "bf16"}


def build_model(p: dict) -> torch.nn.Module:
    """The preset's LLaMA with its initial weights (seed 0); saved once, loaded by every engine."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config(p))


def hf_config(p: dict):  # noqa: ANN201
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["inter"],
                         num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                         num_key_value_heads=p["kv_heads"], max_position_embeddings=p["seq"], tie_word_embeddings=p.get("tied", False))
    config._attn_implementation = "sdpa"
    return config


DEVICE = torch.device("cpu")  # set by main(): cuda:LOCAL_RANK with --device cuda


def _rss(field: str) -> int:
    """Current (VmRSS) or peak (VmHWM) memory: host resident set on CPU, CUDA allocations on a GPU."""
    if DEVICE.type == "cuda":
        return torch.cuda.max_memory_allocated(DEVICE) if field == "VmHWM:" else torch.cuda.memory_allocated(DEVICE)
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


def setup(engine: str, weights: str, micro: int, options: dict, bf16: bool = False):
    """Returns (step_fn(batch) -> loss, state_bytes_fn). `bf16`: mixed precision as each engine's users turn it on:
    hf_zero's `mixed_precision="bf16"`, DDP under the autocast Accelerate puts around the forward, FSDP2 with
    Accelerate's `MixedPrecisionPolicy`, DeepSpeed's `"bf16": {"enabled": true}`."""
    from transformers import AutoModelForCausalLM

    def adamw(params):  # noqa: ANN001
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)  # as a user writes it (per-tensor on CPU)

    if engine.startswith("hf_zero"):
        import hf_zero

        stage = int(engine[7])
        extra = QUANTIZED if engine.endswith("_q") else {}
        precision = {"mixed_precision": "bf16"} if bf16 else {}
        config = hf_zero.ZeroConfig(stage=stage, offload_optimizer=engine.endswith("offload"),
                                    **{**precision, **extra, **options})
        model, opt = hf_zero.from_pretrained(AutoModelForCausalLM, weights, config, optimizer_fn=lambda m: adamw(m.parameters()))
        model.train()

        held = {"bytes": 0}

        def step(batch):  # noqa: ANN001
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            held["bytes"] = hf_zero.model_state_memory(model).total()  # zero_grad frees the gradient shards
            opt.zero_grad()
            return loss.detach()

        return step, lambda: held["bytes"]
    model = AutoModelForCausalLM.from_pretrained(weights).to(DEVICE)
    model.train()
    if engine == "local":
        ddp, opt = model, adamw(model.parameters())
    elif engine == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[DEVICE.index] if DEVICE.type == "cuda" else None)
        opt = adamw(ddp.parameters())
    elif engine == "fsdp2":
        from _peers import fsdp2_setup

        PEER_CONFIG.update(fsdp2_setup(model, bf16=bf16))
        ddp, opt = model, adamw(model.parameters())
    elif engine == "fsdp2_noreshard":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        ddp, opt = model, adamw(model.parameters())
    elif engine.startswith("ds"):
        import deepspeed

        from _peers import deepspeed_config

        if engine.startswith("ds3"):
            cfg = deepspeed_config(model.config.hidden_size, micro=micro, bf16=bf16,
                                   flavor="raw" if engine == "ds3_raw" else "hf")
        else:
            cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                   "zero_optimization": {"stage": int(engine[2])}, "steps_per_print": 10**9,
                   "zero_allow_untested_optimizer": True, "bf16": {"enabled": bf16}}
        PEER_CONFIG.update(cfg)
        ds_engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), config=cfg)

        def ds_step(batch):  # noqa: ANN001
            loss = ds_engine(input_ids=batch, labels=batch).loss
            ds_engine.backward(loss)
            ds_engine.step()
            return loss.detach()

        return ds_step, lambda: -1  # DeepSpeed keeps its own flat buffers; not comparable by this count
    else:
        raise ValueError(engine)

    autocast = bf16 and engine in ("local", "ddp", "fsdp2_noreshard")  # FSDP2's policy casts by itself
    if autocast:
        PEER_CONFIG.update({"autocast": "bfloat16"})

    def torch_step(batch):  # noqa: ANN001
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
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
    ap.add_argument("--weights", required=True, help="save_pretrained directory of the preset's initial model")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--options", default="{}", help="JSON of extra ZeroConfig fields (hf_zero engines)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, the GPU of LOCAL_RANK")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: each engine's mixed precision")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    global DEVICE
    cuda = args.device == "cuda"
    if cuda:
        DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(DEVICE)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import transformers  # noqa: F401  (imports belong to the baseline, for every engine alike)

    backend = "nccl" if cuda else "gloo"
    if args.engine.startswith("ds"):
        if not cuda:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend)
    else:
        if args.engine.startswith("hf_zero"):
            import hf_zero  # noqa: F401
        dist.init_process_group(backend, device_id=DEVICE if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    p = PRESETS[args.preset]
    micro = p["global_batch"] // world
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, p["vocab"], (args.warmup + args.steps, p["global_batch"], p["seq"]), generator=g)
    _reset_peak()
    base = _rss("VmRSS:")
    step, state_bytes = setup(args.engine, args.weights, micro, json.loads(args.options), args.precision == "bf16")
    setup_peak = _rss("VmHWM:")
    _reset_peak()
    train_base = _rss("VmRSS:")
    losses, step_s, cpu_s = [], [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            dist.barrier()
            start = time.perf_counter()
        began, began_cpu = time.perf_counter(), time.process_time()
        batch = data[i, rank * micro : (rank + 1) * micro].to(DEVICE)
        loss = step(batch)
        mean = loss.float().reshape(1).clone()
        dist.all_reduce(mean)  # also lines the ranks up: every step is timed from the same point on each
        losses.append(float(mean) / world)
        if i >= args.warmup:
            step_s.append(time.perf_counter() - began)
            cpu_s.append(time.process_time() - began_cpu)
    dist.barrier()
    elapsed = time.perf_counter() - start
    train_peak = _rss("VmHWM:")
    n_params = sum(math.prod(s) for s in _param_shapes(p))
    record = {
        "engine": args.engine, "preset": args.preset, "rank": rank, "world": world, "params": n_params,
        "device": args.device, "device_name": torch.cuda.get_device_name(DEVICE) if cuda else "cpu",
        "options": json.loads(args.options), "peer_config": PEER_CONFIG, "precision": args.precision,
        # A run's throughput is that of its median step: a step that another tenant of the machine slowed
        # down moves it little (the mean over all steps stays in `tokens_per_s_mean`).
        "tokens_per_s": p["global_batch"] * p["seq"] / statistics.median(step_s),
        "tokens_per_s_mean": args.steps * p["global_batch"] * p["seq"] / elapsed, "step_s": step_s, "losses": losses,
        # CPU time of the process (all its threads) per step: what the step costs, less what other tenants took
        "cpu_s": cpu_s,
        "peak_rss_bytes": max(setup_peak, train_peak) - base, "train_peak_rss_bytes": train_peak - train_base,
        "model_state_bytes": state_bytes(), "zero3_state_formula_bytes": 16 * n_params // world,
    }
    records = [None] * world
    dist.all_gather_object(records, record)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(records, f)
    dist.destroy_process_group()
    # Leave without interpreter shutdown: the figures are out, and there a gloo worker thread that is still
    # releasing the last collective's tensors can abort the process (torch 2.13, pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _reset_peak() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats(DEVICE)
        return
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM restarts from the current resident set
        f.write("5")


def _param_shapes(p: dict) -> list[tuple[int, ...]]:
    with torch.device("meta"):
        return [tuple(t.shape) for t in build_model(p).parameters()]


if __name__ == "__main__":
    main()
