"""The profile phase of the GPU check: where a step of each engine goes, on the speed phase's model.

    python -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/_gpu_profile.py --device cuda --out DIR

For each engine of the speed phase (same model, batch and settings; `_gpu_speed.py`), after warm-up, the
step's parts are timed with the device synchronized around each (forward, backward, clipping, the
optimizer step, `zero_grad`), so each part's seconds include the host work and the kernels it queued;
then hf_zero's step is run under `torch.profiler` and the operators taking the most host and device time
are written out (`<out>/profile_ops.txt`). Figures: `<out>/profile.json`.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch
from _gpu_common import Cases, init_group, phase_arguments
from _gpu_speed import ENGINES, SPEED_SIZES, SpeedSizes, _clip, _sync, build

PARTS = ("forward", "backward", "clip", "step", "zero_grad")


def _step(model: torch.nn.Module, optimizer: Any, autocast: Any, batch: torch.Tensor, device: torch.device,
          spent: dict[str, float] | None) -> None:
    """One training step; with `spent`, each part timed between device synchronizations."""
    marks = [time.perf_counter()]

    def mark() -> None:
        if spent is not None:
            _sync(device)
            marks.append(time.perf_counter())

    with autocast():
        loss = model(input_ids=batch, labels=batch).loss
    mark()
    loss.backward()
    mark()
    _clip(model, optimizer)
    mark()
    optimizer.step()
    mark()
    optimizer.zero_grad()
    mark()
    if spent is not None:
        for part, a, b in zip(PARTS, marks, marks[1:]):
            spent[part] = spent.get(part, 0.0) + b - a


def parts(name: str, sizes: SpeedSizes, device: torch.device, out: Path, steps: int) -> dict[str, Any]:
    """The per-part milliseconds of one engine's step (mean over `steps`); hf_zero's operators profiled."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model, optimizer, autocast = ENGINES[name](build(sizes, device), device)
    batch = torch.randint(0, sizes.vocab, (sizes.batch, sizes.seq), generator=torch.Generator().manual_seed(1))
    batch = batch.to(device)
    for _ in range(sizes.warmup):
        _step(model, optimizer, autocast, batch, device, None)
    _sync(device)
    spent: dict[str, float] = {}
    for _ in range(steps):
        _step(model, optimizer, autocast, batch, device, spent)
    figures: dict[str, Any] = {f"{k}_ms": round(1e3 * v / steps, 1) for k, v in spent.items()}
    figures["total_ms"] = round(sum(1e3 * v / steps for v in spent.values()), 1)
    if name.startswith("hf_zero"):
        figures["profiled"] = _profile(model, optimizer, autocast, batch, device, out)
    del model, optimizer
    gc.collect()
    return figures


def _profile(model: torch.nn.Module, optimizer: Any, autocast: Any, batch: torch.Tensor, device: torch.device,
             out: Path) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            _step(model, optimizer, autocast, batch, device, None)
        _sync(device)
    table = prof.key_averages()
    device_key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    text = ("# hf_zero ZeRO-3, 2 steps: by device time\n" + table.table(sort_by=device_key, row_limit=35)
            + "\n# by host time\n" + table.table(sort_by="self_cpu_time_total", row_limit=35))
    path = out / "profile_ops.txt"
    path.write_text(text)
    return str(path.name)


def main() -> int:
    args, out = phase_arguments(__doc__, SPEED_SIZES)
    device = init_group(args.device)
    sizes = SPEED_SIZES[args.size]
    cases = Cases("profile", out)
    for name in ENGINES:
        cases.run(name, lambda n=name: parts(n, sizes, device, out, steps=min(sizes.steps, 4)))
    return 1 if cases.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
