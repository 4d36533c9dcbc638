"""The GPU check's `io` phase: `hf_zero.from_pretrained` onto the GPU, and a checkpoint's save and load, against
the lent machine's own disk, measured beside each other in one run.

    python -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/_gpu_io.py --device cuda --out DIR

A LLaMA with TinyLlama's shapes (`full`: 8 layers, 0.48B; `tiny`: 1 layer with a small vocabulary, for the CPU
rehearsal) is saved with `save_pretrained` in bf16. Each read is timed with the file's pages dropped from the
page cache first (`POSIX_FADV_DONTNEED` after an fsync, which needs no root; `drop_caches` as well where
allowed), and beside it the same bytes are read plainly (`O_DIRECT`, 64 MiB requests) just before and just
after: the disk's speed for those bytes at that moment. Cases:

1. `from_pretrained`: hf_zero's (ZeRO-3, bf16 mixed precision, fp32 masters on the GPU) against transformers'
   own `from_pretrained(...).to(device)` as its users load a model, weights compared (equal: the bf16 file
   cast to fp32 masters and back is exact).
2. `save_checkpoint` and `load_checkpoint` of that model with AdamW after one step: the save against writing
   the same bytes plainly, the load against reading its files plainly.

Results: `<out>/io.json`. On the host (the CPU rehearsal) transformers' tensors stay mapped from the file
until first used, so its time there is not a load's; `.to(cuda)` reads them all. On the CPU VM
(docs/performance.md) the masters' fresh host memory shares two cores with the reads; on the GPU the masters
live in device memory, and the host only stages the reads. Where the filesystem refuses O_DIRECT the plain
probes read and write through the page cache (evicted first, fsynced after), as `probes_direct` records.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _capacity_model import SHAPE
from _gpu_common import Cases, init_group, phase_arguments, require, weights_diff
from io_vs_disk import _read_ranges, _write_probe, drop_caches

import hf_zero

LAYERS = {"full": 8, "tiny": 1}
DIRECT = {"read": True, "write": True}  # whether the plain probes went around the page cache


def evict(directory: Path) -> bool:
    """Drop `directory`'s files from the page cache (written back first); True where `drop_caches` also ran."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return drop_caches()


def plain_read(directory: Path, pattern: str = "*.safetensors") -> float:
    """GB/s of reading `directory`'s safetensors files with O_DIRECT (buffered where the filesystem refuses
    O_DIRECT: `DIRECT["read"]` says which), after evicting them."""
    files = sorted(directory.glob(pattern))
    evict(directory)
    start = time.perf_counter()
    try:
        moved = _read_ranges([(f, 0, f.stat().st_size) for f in files])
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        DIRECT["read"] = False
        start = time.perf_counter()
        moved = sum(len(chunk) for f in files for chunk in _chunks(f))
    return moved / 1e9 / (time.perf_counter() - start)


def _chunks(path: Path) -> Any:
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(64 << 20):
            yield chunk


def timed(fn: Any, device: torch.device) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return value, time.perf_counter() - start


def model_config(size: str) -> Any:
    from transformers import LlamaConfig

    shape = dict(SHAPE) if size == "full" else {**SHAPE, "vocab_size": 1024, "hidden_size": 256,
                                                 "intermediate_size": 512, "num_attention_heads": 4}
    return LlamaConfig(num_hidden_layers=LAYERS[size], **shape)


def from_pretrained_case(work: Path, size: str, device: torch.device) -> tuple[dict[str, Any], Any, Any]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(model_config(size)).to(torch.bfloat16).save_pretrained(work / "hf")
    nbytes = sum(f.stat().st_size for f in (work / "hf").glob("*.safetensors"))
    before = plain_read(work / "hf")
    dropped = evict(work / "hf")
    config = hf_zero.ZeroConfig(stage=3, mixed_precision="bf16")
    (model, optimizer), ours = timed(lambda: hf_zero.from_pretrained(
        AutoModelForCausalLM, work / "hf", config, device=device,
        optimizer_fn=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-5)), device)
    after = plain_read(work / "hf")
    evict(work / "hf")
    theirs_model, theirs = timed(lambda: AutoModelForCausalLM.from_pretrained(work / "hf").to(device), device)
    state = {k: v.float() for k, v in hf_zero.full_state_dict(model).items()}
    reference = {k: v.float() for k, v in theirs_model.state_dict().items()}
    diff = weights_diff(state, reference)
    require(diff == 0.0, f"hf_zero.from_pretrained differs from transformers' by {diff:.2e}")
    del theirs_model
    beside = (before + after) / 2
    figures = {"file_GB": round(nbytes / 1e9, 3), "plain_read_GBps": [round(before, 2), round(after, 2)],
               "hf_zero_s": round(ours, 2), "hf_zero_GBps": round(nbytes / 1e9 / ours, 2),
               "fraction_of_plain": round(nbytes / 1e9 / ours / beside, 2),
               "transformers_s": round(theirs, 2), "weights_rel": diff, "drop_caches": dropped,
               "masters_on": str(next(iter(model.parameters())).device)}
    return figures, model, optimizer


def checkpoint_case(work: Path, model: Any, optimizer: Any, device: torch.device) -> dict[str, Any]:
    ids = torch.randint(0, model.config.vocab_size, (1, 16), device=device)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    nbytes = 12 * sum(p.numel() for p in hf_zero.full_state_dict(model).values())  # fp32 masters + 2 moments
    write = nbytes / 1e9 / _timed_write(work / "probe", nbytes)
    ckpt = work / "ckpt"
    _, save_s = timed(lambda: hf_zero.save_checkpoint(ckpt, model, optimizer), device)
    saved = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    before = plain_read(ckpt)
    evict(ckpt)
    _, load_s = timed(lambda: hf_zero.load_checkpoint(ckpt, model, optimizer), device)
    after = plain_read(ckpt)
    read = (before + after) / 2
    return {"checkpoint_GB": round(saved / 1e9, 2), "plain_write_GBps": round(write, 2),
            "save_s": round(save_s, 2), "save_fraction": round(saved / 1e9 / save_s / write, 2),
            "plain_read_GBps": [round(before, 2), round(after, 2)], "load_s": round(load_s, 2),
            "load_fraction": round(saved / 1e9 / load_s / read, 2), "probes_direct": dict(DIRECT)}


def _timed_write(path: Path, nbytes: int) -> float:
    """Seconds to write `nbytes` with O_DIRECT and fsync (buffered and fsynced where O_DIRECT is refused)."""
    start = time.perf_counter()
    try:
        _write_probe(path, nbytes)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        DIRECT["write"] = False
        block = os.urandom(1 << 20) * 64
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for _ in range(-(-nbytes // len(block))):
                f.write(block)
            os.fsync(f.fileno())
        path.unlink()
    return time.perf_counter() - start


def main() -> int:
    args, out = phase_arguments(__doc__, LAYERS)
    device = init_group(args.device)
    cases = Cases("io", out)
    work = Path(tempfile.mkdtemp(prefix="hf_zero_gpu_io_", dir=os.environ.get("TMPDIR", "/var/tmp")))
    loaded: dict[str, Any] = {}

    def first() -> dict[str, Any]:
        figures, loaded["model"], loaded["optimizer"] = from_pretrained_case(work, args.size, device)
        return figures

    try:
        cases.run("from_pretrained onto the device, against the disk and transformers'", first)
        if "model" in loaded:
            cases.run("save_checkpoint and load_checkpoint against the disk",
                      lambda: checkpoint_case(work, loaded["model"], loaded["optimizer"], device))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    dist.barrier()
    return 1 if cases.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
