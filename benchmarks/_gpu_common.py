"""What the GPU check's phase scripts share: the process group, sizes, the case runner and its record.

A phase script runs under `torch.distributed.run` (so a world of one still has a real process group:
NCCL on CUDA, gloo on the CPU) and writes `<out>/<phase>.json`: one record per case, with its result,
its figures and, when it failed, the error's tail. A failing case does not stop the next one.
`benchmarks/gpu_check.py` reads these records into its report.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Sizes:
    """The LLaMA of the correctness phases and its data (`full` on the GPU; `tiny` for the CI rehearsal)."""

    hidden: int
    layers: int
    vocab: int
    seq: int
    micro: int  # sequences per rank per micro-batch
    accum: int  # micro-batches per step
    steps: int


SIZES = {
    "full": Sizes(hidden=128, layers=4, vocab=512, seq=64, micro=2, accum=2, steps=4),
    "tiny": Sizes(hidden=32, layers=2, vocab=128, seq=16, micro=2, accum=2, steps=4),
}


@dataclass
class Case:
    """One checked thing: `ok` with its figures, or the error that stopped it."""

    name: str
    ok: bool = False
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    error: str = ""


class Cases:
    """Runs cases one after another, each in its own try, and writes the phase's record after every case
    (a phase killed at its timeout still leaves what it finished)."""

    def __init__(self, phase: str, out: Path) -> None:
        self.phase = phase
        self.path = out / f"{phase}.json"
        self.cases: list[Case] = []
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def run(self, name: str, check: Callable[[], dict[str, Any]]) -> None:
        case = Case(name)
        started = time.perf_counter()
        try:
            case.figures = check() or {}
            case.ok = True
        except Exception as e:  # noqa: BLE001 - recorded; the next case runs
            case.error = "".join(traceback.format_exception(e))[-3000:]
        if dist.is_initialized():  # a case failed on any rank fails on all (and every rank is past it)
            flag = torch.tensor([0 if case.ok else 1], device=_flag_device())
            dist.all_reduce(flag)
            if case.ok and flag.item():
                case.ok, case.error = False, "failed on another rank"
        case.seconds = round(time.perf_counter() - started, 2)
        self.cases.append(case)
        if self.rank == 0:
            print(f"[{self.phase}] {name}: {'ok' if case.ok else 'FAILED'} in {case.seconds:.1f} s {case.figures}",
                  flush=True)
        if not case.ok:
            print(f"[{self.phase}] rank {self.rank}: {case.error}", flush=True)
        if self.rank == 0:
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps({"phase": self.phase, "cases": [asdict(c) for c in self.cases]}, indent=1))
            tmp.replace(self.path)

    @property
    def failed(self) -> bool:
        return any(not c.ok for c in self.cases)


def _flag_device() -> torch.device:
    backend = str(dist.get_backend()).lower()
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")


def init_group(device_kind: str, backend: str | None = None) -> torch.device:
    """Join the launcher's process group; returns this rank's compute device. NCCL on CUDA unless `backend`
    says otherwise (two processes sharing one GPU communicate over gloo: NCCL needs a GPU per rank)."""
    if device_kind == "cuda":
        torch.cuda.set_device(0 if backend == "gloo" else int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend or ("nccl" if device_kind == "cuda" else "gloo"))
    return device


def llama(sizes: Sizes, seed: int = 0) -> torch.nn.Module:
    """A LLaMA of `sizes` in fp32 on the host, initialized by `seed`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=sizes.vocab, hidden_size=sizes.hidden, intermediate_size=sizes.hidden * 2,
        num_hidden_layers=sizes.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=sizes.seq, tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config)


def corpus(sizes: Sizes, world: int, seed: int = 1234) -> torch.Tensor:
    """Token rows `[steps, accum, world * micro, seq]` with learnable structure (a noisy repeating pattern). Every
    step sees the same global batch (its micro-batches and ranks' slices differ), so the loss falls within a few
    steps by far more than the bf16 tolerance: a run that does not train cannot match."""
    g = torch.Generator().manual_seed(seed)
    n = sizes.accum * world * sizes.micro
    start = torch.randint(0, sizes.vocab, (n, 1), generator=g)
    stride = torch.randint(1, 7, (n, 1), generator=g)
    rows = (start + stride * torch.arange(sizes.seq)) % sizes.vocab
    noise = torch.rand(rows.shape, generator=g) < 0.1
    rows[noise] = torch.randint(0, sizes.vocab, (int(noise.sum()),), generator=g)
    return rows.view(1, sizes.accum, world * sizes.micro, sizes.seq).expand(sizes.steps, -1, -1, -1)


def adamw(model: torch.nn.Module, lr: float = 3e-3) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=lr)


def rel_diff(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    """max |a - b| / max(|b|, tiny), in float64."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def norm_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64 (the test suite's relative error of a weight tensor)."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def weights_diff(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest per-tensor relative error (`norm_diff`) of a full state dict against a reference one."""
    missing = set(reference) ^ set(state)
    if missing:
        raise AssertionError(f"state dict keys differ: {sorted(missing)[:5]}")
    return max(norm_diff(state[k], reference[k]) for k in reference if reference[k].is_floating_point())


def require(ok: bool, what: str) -> None:
    """A check of the GPU check (not an input check): raise with what was expected."""
    if not ok:
        raise AssertionError(what)


def write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)


def phase_arguments(doc: str, sizes: Iterable[str], phases: Iterable[str] = (),
                    flags: Iterable[str] = ()) -> tuple[argparse.Namespace, Path]:
    """The command line every phase script takes (`[phase] --device --size --out`, and the script's own on/off
    `flags`), and its out folder, made."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if phases:
        ap.add_argument("phase", choices=sorted(phases))
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--size", choices=sorted(sizes), default="full")
    ap.add_argument("--out", required=True)
    for flag in flags:
        ap.add_argument(f"--{flag}", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return args, out


def liger_kernels(model: torch.nn.Module) -> str:
    """Liger's kernels on the model instance, as the Trainer's `--use_liger_kernel` applies them (from `.whl/`; needs
    triton and a GPU); which ran. Raises ImportError without the wheel."""
    import liger_kernel
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model)
    return f"liger_kernel {getattr(liger_kernel, '__version__', '?')}"
