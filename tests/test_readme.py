"""The README's quickstart, run as written: its Python snippets (the Trainer's and Accelerate's) as `train.py`
under `torchrun` with 2 processes on this CPU machine (no --use_cpu: hf_zero takes the launch as the 2-process
run it is), in a folder holding what the snippets name (`./llama-base`: a tiny LLaMA with its tokenizer;
`corpus.jsonl`); what they save loads with `from_pretrained`. The README's shell commands that need no GPU
(`hf-zero estimate`, `hf-zero consolidate`, `hf-zero from-deepspeed`) are checked by tests/test_estimate.py,
tests/test_consolidate.py and tests/test_migrate.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from tests._training import make_model, make_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    here = tmp_path_factory.mktemp("readme")
    make_model("llama").save_pretrained(here / "llama-base")
    make_tokenizer(str(here / "llama-base"))
    lines = ["the quick brown fox jumps over the lazy dog " * (1 + i % 5) for i in range(64)]
    (here / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return here


def _launch(folder: Path, script: str) -> subprocess.CompletedProcess:
    (folder / "train.py").write_text(script)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py"]
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("which", ["trainer", "accelerate"])
def test_readme_quickstart_runs_as_written(folder, which):
    snippets = _snippets()
    assert len(snippets) == 2, "the README's Python snippets: the Trainer's, then Accelerate's"
    script = snippets[0] if which == "trainer" else snippets[1]
    done = _launch(folder, script)
    assert done.returncode == 0, done.stderr[-4000:]
    saved = folder / ("out/final" if which == "trainer" else "final")
    model = AutoModelForCausalLM.from_pretrained(saved)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in make_model("llama").parameters())
    assert "hf_zero: ZeRO stage 3 on 2 rank(s) (cpu, gloo)" in done.stderr  # the start-up line, once
    assert done.stderr.count("hf_zero: ZeRO stage 3 on") == 1
    if which == "trainer":
        assert (folder / "out" / "checkpoint-8" / "hf_zero").is_dir() and (saved / "tokenizer.json").is_file()
    else:
        assert (folder / "ckpt" / "hf_zero").is_dir()
