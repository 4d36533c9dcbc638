"""The GPU check's `qlora` phase: QLoRA on a sharded 4-bit base with bitsandbytes' CUDA kernels.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/_gpu_qlora.py --device cuda --out DIR

The test suite's QLoRA cases (tests/_qlora_cases.py) with the models, their batches and the engine on the GPU, two
ranks sharing it (gloo between them, CUDA compute): transformers' 4-bit load (NF4, double quantization, compute in
fp32) + PEFT's LoRA under hf_zero at stages 1-3 against the same QLoRA in one process on both ranks' batches
(losses, clipped gradient norms and adapters), the packed codes unchanged by training; and
`hf_zero.from_pretrained(..., quantization_config=..., peft_config=...)` quantizing on the GPU as it reads: codes and
scales equal transformers' 4-bit load onto the GPU byte for byte, and 3 steps equal the user's build. Needs the
bitsandbytes and peft wheels from `.whl/` (benchmarks/gpu_wheels.txt). The tolerance is 1e-4: the reference
multiplies both ranks' rows at once, each rank its own, and cuBLAS may round such shapes differently (the figures
are reported). Results: `<out>/qlora.json`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _gpu_common import Cases, init_group, phase_arguments, require

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests` is a package of the working tree

from tests import _qlora_cases as qlora  # noqa: E402 - after the path above
from tests._training import make_model  # noqa: E402

TOL = 1e-4


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _adapters_rel(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    require(mine.keys() == theirs.keys() and len(mine) >= 4, f"adapters {sorted(mine)} vs {sorted(theirs)}")
    return max(float((mine[k].float().cpu() - v.float().cpu()).norm() / v.float().cpu().norm().clamp_min(1e-12))
               for k, v in theirs.items())


def against_one_process(base: str, stage: int, storage: str) -> dict[str, Any]:
    r = qlora.qlora_against_one_process(base, stage, "nf4", True, storage)
    require(r["codes_kept"], "the packed codes changed in training")
    figures = {key: _rel(r["record"][key], r["reference"][key]) for key in ("loss", "norm")}
    figures["adapters"] = _adapters_rel(r["adapters"], r["ref_adapters"])
    require(max(figures.values()) <= TOL, f"differs from one process: {figures} (allowed {TOL:.0e})")
    return {k: float(f"{v:.2e}") for k, v in figures.items()}


def loaded_both_ways(base: str, stage: int, storage: str) -> dict[str, Any]:
    r = qlora.qlora_loaded_both_ways(base, stage, storage)
    require(r["codes_equal"] and r["scales_equal"],
            f"codes equal: {r['codes_equal']}, scales equal: {r['scales_equal']} (to transformers' load on the GPU)")
    figures = {key: _rel(r["got"][key], r["want"][key]) for key in ("loss", "norm")}
    figures["adapters"] = _adapters_rel(r["adapters"][1], r["adapters"][0])
    require(max(figures.values()) <= TOL, f"differs from the user's build: {figures} (allowed {TOL:.0e})")
    return {k: float(f"{v:.2e}") for k, v in figures.items()}


def main() -> int:
    args, out = phase_arguments(__doc__, ["full", "tiny"])
    device = init_group(args.device, backend="gloo")
    qlora.DEVICE = device
    cases = Cases("qlora", out)
    where = [str(Path(tempfile.mkdtemp(prefix="hf_zero_gpu_qlora_")) / "llama") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(where)  # one directory, rank 0's
    base = where[0]
    if dist.get_rank() == 0:
        make_model("llama").save_pretrained(base)
    dist.barrier()
    stages = (3,) if args.size == "tiny" else (1, 2, 3)
    for stage in stages:
        for storage in ("uint8", "float32"):
            cases.run(f"ZeRO-{stage} QLoRA (NF4, {storage} storage) vs one process, {dist.get_world_size()} ranks",
                      lambda s=stage, st=storage: against_one_process(base, s, st))
    cases.run("hf_zero.from_pretrained quantizing on the device vs transformers' load + initialize (ZeRO-3)",
              lambda: loaded_both_ways(base, 3, "uint8"))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(Path(base).parent, ignore_errors=True)
    return 1 if cases.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
