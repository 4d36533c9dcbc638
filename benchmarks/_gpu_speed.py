"""The speed phase of the GPU check: one LLaMA, one batch, three engines side by side in one process.

    python -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/_gpu_speed.py --device cuda --out DIR

At a world of one (NCCL on CUDA): plain PyTorch (fp32 weights and AdamW, bf16 autocast), FSDP2
`fully_shard` on every decoder layer and the root (`MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`, as its docs configure it) and hf_zero ZeRO-3 (`mixed_precision="bf16"`). All three
keep fp32 master weights and AdamW state, compute in bf16, clip at 1.0 and run `torch.optim.AdamW`'s
default implementation. Each engine builds the same model (same seed, on the device), runs warm-up
steps, then timed steps; figures per engine: tokens/s, MFU (6 x matmul parameters + attention FLOPs
per token, against the GPU's dense bf16 peak), `torch.cuda.max_memory_allocated`, and the first and
last loss (the three runs start from the same weights and data, so the first losses agree to bf16
rounding). Results: `<out>/speed.json`.

`--compiled` runs the same three as users who care about speed run them: Liger's kernels on the model (RMSNorm,
SwiGLU, RoPE and the fused linear cross-entropy, as the Trainer's `--use_liger_kernel` applies them; where the
wheel installs and a GPU runs triton) and regional `torch.compile` (each decoder layer's forward compiled with
inductor, the engines' hooks outside the compiled code: hf_zero through `compile_as_requested`, as Accelerate's
`use_regional_compilation` reaches it; `aot_eager` on the CPU rehearsal). The warm-up steps include the
compilation. Results: `<out>/compiled.json`.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from _gpu_common import Cases, init_group, liger_kernels, phase_arguments, require
from torch._dynamo.utils import counters

import hf_zero


@dataclass(frozen=True)
class SpeedSizes:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int
    seq: int
    batch: int
    warmup: int
    steps: int


SPEED_SIZES = {
    "full": SpeedSizes(hidden=2048, intermediate=5504, layers=16, heads=16, vocab=32000, seq=2048, batch=4,
                       warmup=3, steps=10),  # 0.94B parameters
    "cpu": SpeedSizes(hidden=128, intermediate=344, layers=2, heads=4, vocab=1024, seq=128, batch=2, warmup=1,
                      steps=2),  # the rehearsal's: bf16 matrix products are slow on CPUs without AVX-512 BF16
    "tiny": SpeedSizes(hidden=64, intermediate=128, layers=2, heads=4, vocab=256, seq=32, batch=2, warmup=1, steps=2),
}
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense, per GPU (SXM)


def build(sizes: SpeedSizes, device: torch.device) -> torch.nn.Module:
    """The LLaMA in fp32, initialized on `device` from one seed (the same weights for every engine)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=sizes.vocab, hidden_size=sizes.hidden, intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers, num_attention_heads=sizes.heads, num_key_value_heads=sizes.heads,
        max_position_embeddings=sizes.seq, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with device:
        return AutoModelForCausalLM.from_config(config)


def flops_per_token(model: torch.nn.Module, sizes: SpeedSizes) -> float:
    """6 x the parameters of the matrix products (all but the input embedding's lookup) + 12 x layers x hidden x
    sequence for attention's scores and values (PaLM's appendix B)."""
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "embed_tokens" not in n)
    return 6.0 * matmul + 12.0 * sizes.layers * sizes.hidden * sizes.seq


def plain(model: torch.nn.Module, device: torch.device) -> tuple[torch.nn.Module, Any, Callable[[], Any]]:
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), lambda: torch.autocast(device.type, torch.bfloat16)


def fsdp2(model: torch.nn.Module, device: torch.device) -> tuple[torch.nn.Module, Any, Callable[[], Any]]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), contextlib.nullcontext


def zero3(model: torch.nn.Module, device: torch.device) -> tuple[torch.nn.Module, Any, Callable[[], Any]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, sharded = hf_zero.initialize(model, optimizer, hf_zero.ZeroConfig(stage=3, mixed_precision="bf16"))
    return model, sharded, contextlib.nullcontext


ENGINES = {"PyTorch (autocast bf16)": plain, "FSDP2 fully_shard (bf16)": fsdp2, "hf_zero ZeRO-3 (bf16)": zero3}


def compile_backend(device: torch.device) -> str:
    return "inductor" if device.type == "cuda" else "aot_eager"  # inductor on 2 CPU cores: minutes per layer


def apply_liger(model: torch.nn.Module, device: torch.device) -> str:
    """Liger's kernels on the model instance before any engine wraps it; which ran ("none" without the wheel or a
    GPU: triton runs on GPUs only)."""
    if device.type != "cuda":
        return "none"
    try:
        return liger_kernels(model)
    except ImportError:
        return "none"


def compile_layers(name: str, model: torch.nn.Module, device: torch.device) -> int:
    """Regional compilation after the engine wrapped the model: each decoder layer's forward, its hooks eager (for
    hf_zero through the integrations' `compile_as_requested`, as Accelerate's plugin asks). Returns the layers."""
    backend = compile_backend(device)
    if name.startswith("hf_zero"):
        from accelerate.utils import TorchDynamoPlugin

        from hf_zero.features.compile import compile_as_requested

        compile_as_requested(model, TorchDynamoPlugin(backend=backend, use_regional_compilation=True), 3)
    else:
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward, backend=backend)
    return len(model.model.layers)


def _clip(model: torch.nn.Module, optimizer: Any) -> None:
    if hasattr(optimizer, "clip_grad_norm_"):  # hf_zero's sharded optimizer
        optimizer.clip_grad_norm_(1.0)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, sizes: SpeedSizes, device: torch.device, peak: float | None,
            compiled: bool = False) -> dict[str, Any]:
    """Build, warm up and time one engine (`compiled`: with Liger's kernels and regional compilation); free
    everything it held before returning its figures."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    extra: dict[str, Any] = {}
    model = build(sizes, device)
    if compiled:
        torch._dynamo.reset()
        counters.clear()
        extra["liger"] = apply_liger(model, device)
    model, optimizer, autocast = ENGINES[name](model, device)
    if compiled:
        extra["compiled_layers"] = compile_layers(name, model, device)
        extra["backend"] = compile_backend(device)
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, sizes.vocab, (sizes.batch, sizes.seq), generator=g).to(device)
    losses: list[float] = []
    started = 0.0
    for step in range(sizes.warmup + sizes.steps):
        if step == sizes.warmup:
            _sync(device)
            started = time.perf_counter()
        with autocast():
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        _clip(model, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        if step in (0, sizes.warmup + sizes.steps - 1):
            losses.append(float(loss))
    _sync(device)
    seconds = time.perf_counter() - started
    if compiled:
        extra["frames"] = counters["frames"]["ok"]  # frames dynamo compiled: one per layer's forward at least
    tokens_per_s = sizes.batch * sizes.seq * sizes.steps / seconds
    figures: dict[str, Any] = {
        "tokens_per_s": round(tokens_per_s, 1),
        "step_s": round(seconds / sizes.steps, 4),
        "first_loss": round(losses[0], 4),
        "last_loss": round(losses[-1], 4),
        **extra,
    }
    if peak is not None:
        figures["mfu"] = round(tokens_per_s * _FLOPS[0] / (peak * 1e12), 4)
    if device.type == "cuda":
        figures["max_memory_allocated_GiB"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    del model, optimizer, loss
    gc.collect()
    return figures


_FLOPS = [0.0]  # FLOPs per token of the model (the same for every engine), set once by main


def peak_tflops(device: torch.device) -> tuple[str, float | None]:
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def main() -> int:
    args, out = phase_arguments(__doc__, SPEED_SIZES, flags=("compiled",))
    device = init_group(args.device)
    sizes = SPEED_SIZES[args.size]
    gpu, peak = peak_tflops(device)
    shape = build(sizes, torch.device("meta"))
    _FLOPS[0] = flops_per_token(shape, sizes)
    params = sum(p.numel() for p in shape.parameters())
    compiled = args.compiled
    cases = Cases("compiled" if compiled else "speed", out)
    cases.run("setup", lambda: {"device": gpu, "peak_bf16_tflops": peak, "params_M": round(params / 1e6, 1),
                                "flops_per_token": _FLOPS[0], "tokens_per_step": sizes.batch * sizes.seq,
                                "sizes": sizes.__dict__})
    for name in ENGINES:
        cases.run(name, lambda n=name: measure(n, sizes, device, peak, compiled))
    first = [c.figures["first_loss"] for c in cases.cases[1:] if c.ok]
    cases.run("same first loss", lambda: _same(first))
    dist.barrier()
    return 1 if cases.failed else 0


def _same(first: list[float]) -> dict[str, Any]:
    require(len(first) == len(ENGINES), "an engine failed")
    spread = (max(first) - min(first)) / min(first)
    require(spread <= 2e-2, f"first losses {first} differ by {spread:.1e} (bf16 rounding allows 2e-2)")
    return {"spread": round(spread, 6)}


if __name__ == "__main__":
    raise SystemExit(main())
