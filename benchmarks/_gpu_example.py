"""The user-path phase of the GPU check: the README's main job in miniature, run as a user runs it.

    python benchmarks/_gpu_example.py --device cuda --out DIR

Builds the demo's assets at a tiny size (real text: the Python standard library's documentation; a
tokenizer trained here; no pretraining), then `accelerate launch --config_file
accelerate_configs/single_gpu.yaml examples/train_clm.py --zero_stage 3 --bf16` with checkpoints,
`hf-zero consolidate` of the last checkpoint, and `from_pretrained` of the result on the device:
its weights equal the run's final model and it generates. Needs `datasets` (the lent machine has none:
`make gpu-wheels` carries it). On the CPU (`--device cpu`) the same commands run with `--cpu`.
Results: `<out>/example.json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _gpu_common import Cases, norm_diff, phase_arguments, require

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done.stdout


STEPS = {"full": 6, "tiny": 2}  # optimizer steps of the run; it saves at half and at the end
DOCUMENTS = {"full": 60, "tiny": 12}


def train_clm(device: str, size: str, work: Path, env: dict[str, str]) -> dict[str, Any]:
    py, steps = sys.executable, STEPS[size]
    _run([py, "examples/make_demo_assets.py", "--out", str(work / "assets"), "--max_documents", str(DOCUMENTS[size]),
          "--pretrain_steps", "0", "--vocab_size", "512", "--hidden", "64", "--layers", "2", "--seq", "128"], env)
    launch = [py, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/single_gpu.yaml"]
    cpu = ["--use_cpu"] if device == "cpu" else []
    stdout = _run([*launch, *(["--cpu"] if device == "cpu" else []), "examples/train_clm.py",
                   "--model_name_or_path", str(work / "assets" / "base"),
                   "--train_files", str(work / "assets" / "corpus" / "train.jsonl"),
                   "--validation_files", str(work / "assets" / "corpus" / "held_out.jsonl"),
                   "--output_dir", str(work / "run"), "--zero_stage", "3", "--bf16", "--block_size", "64",
                   "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2",
                   "--learning_rate", "3e-3", "--max_steps", str(steps), "--save_steps", str(steps // 2),
                   "--logging_steps", "1",
                   "--report_to", "none", "--disable_tqdm", "true", *cpu], env)
    metrics = json.loads((work / "run" / "domain_adaptation.json").read_text())
    manifest = json.loads((work / "run" / f"checkpoint-{steps}" / "hf_zero" / "hf_zero_manifest.json").read_text())
    require(manifest["stage"] == 3, f"checkpoint-{steps} was saved at stage {manifest['stage']}")
    require(metrics["perplexity_after"] < metrics["perplexity_before"], f"perplexity did not fall: {metrics}")
    return {"perplexity_before": round(metrics["perplexity_before"], 2),
            "perplexity_after": round(metrics["perplexity_after"], 2), "held_out_line": "held-out perplexity" in stdout}


def consolidate_and_load(device: str, size: str, work: Path, env: dict[str, str]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    last = work / "run" / f"checkpoint-{STEPS[size]}" / "hf_zero"
    _run([sys.executable, "-m", "hf_zero.cli", "consolidate", str(last), str(work / "model")], env)
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32).to(device)
    final = AutoModelForCausalLM.from_pretrained(work / "run" / "final", dtype=torch.float32)
    ours, theirs = model.state_dict(), final.state_dict()
    worst = max(norm_diff(ours[k], theirs[k]) for k in theirs)
    require(worst <= 1e-2, f"the consolidated last checkpoint differs from the final model by {worst:.2e}")
    tokenizer = AutoTokenizer.from_pretrained(work / "run" / "final")
    prompt = tokenizer("json.dumps(obj)", return_tensors="pt").to(device)
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    require(generated.shape[1] > prompt["input_ids"].shape[1], "nothing was generated")
    return {"consolidated_vs_final": worst, "device": str(next(model.parameters()).device),
            "generated_tokens": int(generated.shape[1] - prompt["input_ids"].shape[1])}


def main() -> int:
    args, out = phase_arguments(__doc__, STEPS)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"):
        env.pop(var, None)
    cases = Cases("example", out)
    with tempfile.TemporaryDirectory(prefix="hf_zero_gpu_example_") as tmp:
        work = Path(tmp)
        cases.run("accelerate launch examples/train_clm.py --zero_stage 3 --bf16", lambda: train_clm(
            args.device, args.size, work, env))
        cases.run("hf-zero consolidate, from_pretrained, generate", lambda: consolidate_and_load(
            args.device, args.size, work, env))
    return 1 if cases.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
