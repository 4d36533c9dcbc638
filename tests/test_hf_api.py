"""The Hugging Face API on a sharded model: eval forwards and generate, tied weights, one process, initialize
twice, a second optimizer, the public names."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import hf_zero
from tests import _engine_cases as engine_cases
from tests._training import Scenario, make_model, make_optimizer, rel_err


# ---- inference, tied weights, HF API ------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "falcon"])
def test_eval_forward_and_generate_under_stage3(pools, kind):
    results = pools(2).values(engine_cases.eval_and_generate, kind, 3)
    ref_model = make_model(kind).eval()
    prompt = torch.tensor([[5, 17, 42, 7]])
    with torch.no_grad():
        ref_logits = ref_model(input_ids=prompt).logits.numpy()
    ref_generated = ref_model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0).tolist()
    for r in results:
        np.testing.assert_allclose(r["logits"], ref_logits, rtol=1e-5, atol=1e-6)
        assert r["generated"] == ref_generated
        assert r["is_original_class"] and r["class_name"] == type(ref_model).__name__
        assert r["has_config"] == kind


def test_tied_weights_are_sharded_once_and_stay_tied(pools):
    results = pools(2).values(engine_cases.tied_weights_stay_tied)
    assert all(r["same_object"] for r in results)
    assert results[0]["equal_values"]


def test_single_process_is_a_real_path_and_schedulers_drive_it():
    """Without torch.distributed, initialize runs as one rank; an LR scheduler built on the returned
    optimizer changes the lr the inner optimizer uses, and losses match plain training."""
    from tests._training import reference_run

    sc = Scenario(model="llama", stage=3, world=1, steps=3, accum=1)
    ref = reference_run(sc)
    torch.manual_seed(0)
    model = make_model("llama")
    model, opt = hf_zero.initialize(model, make_optimizer(model, sc.lr), hf_zero.ZeroConfig(stage=3))
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # constant: keeps the math
    from tests._training import make_batches

    data = make_batches(sc)
    losses = []
    for step in range(sc.steps):
        loss = model(input_ids=data[step], labels=data[step]).loss
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-5)
    halving = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(sc.lr * 0.5)
    assert opt.param_groups is opt.optimizer.param_groups
    del halving


def test_initialize_twice_keeps_or_reshards_the_model():
    """A second `initialize` on a sharded model: with no config (or the same) the engine stays; under another
    stage the model is sharded anew, its weights unchanged."""
    model = make_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model, _ = hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=2))
    engine = model.zero_engine
    assert hf_zero.initialize(model)[0].zero_engine is engine
    assert hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=2))[0].zero_engine is engine
    model, _ = hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=3))
    assert model.zero_engine is not engine and model.zero_engine.config.stage == 3
    for name, value in hf_zero.full_state_dict(model).items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)



def _second_optimizer(new_stage: int | None) -> dict[str, Any]:
    """Two steps with one optimizer, then `initialize` again on the sharded model with a fresh AdamW (same
    settings, or another stage: re-sharded), two more steps. Rank r trains on row r of each batch."""
    import torch.distributed as dist

    model = make_model("llama")
    config = hf_zero.ZeroConfig(stage=3)
    model, first = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6), config)
    losses = [_step(model, first, s) for s in range(2)]
    again = config if new_stage is None else hf_zero.ZeroConfig(stage=new_stage)
    model, second = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=2e-3, eps=1e-6), again)
    try:
        first.step()
        released = ""
    except RuntimeError as e:
        released = str(e)
    losses += [_step(model, second, s) for s in range(2, 4)]
    state = hf_zero.full_state_dict(model)
    return {"losses": losses, "released": released, "stage": model.zero_engine.config.stage,
            "state": {k: v.float().numpy() for k, v in state.items()} if dist.get_rank() == 0 else None}


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(step))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    import torch.distributed as dist

    batch = _batch(step)
    row = batch[dist.get_rank()].reshape(1, -1) if dist.is_initialized() else batch
    loss = model(input_ids=row, labels=row).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
    return float(mean)


@pytest.mark.parametrize("new_stage", [None, 2])
def test_a_sharded_model_takes_a_second_optimizer(pools, new_stage):
    """A model outlives its optimizer (a second Trainer on a trained model): `initialize` again attaches the new
    optimizer to the engine (or re-shards under another stage), the first one refuses to step, and the weights
    equal plain PyTorch doing the same: 2 steps of one AdamW, 2 of a fresh one (fp32, 1e-5)."""
    got = pools(2).values(_second_optimizer, new_stage)
    assert all("was released when another one was attached" in r["released"] for r in got)
    assert got[0]["stage"] == (3 if new_stage is None else 2)
    model = make_model("llama")
    first = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses = [_step(model, first, s) for s in range(2)]
    second = torch.optim.AdamW(model.parameters(), lr=2e-3, eps=1e-6)
    losses += [_step(model, second, s) for s in range(2, 4)]
    np.testing.assert_allclose(got[0]["losses"], losses, rtol=1e-5, atol=0)
    for name, value in model.state_dict().items():
        assert rel_err(got[0]["state"][name], value.numpy()) <= 1e-5, name


def test_the_public_api_is_small_and_moved_names_warn_with_their_replacement():
    """The top level holds what a user calls; the types live in hf_zero.types. A name that left the top level keeps
    working for one release with a FutureWarning naming what to use instead."""
    import warnings

    import hf_zero
    import hf_zero.types
    from hf_zero.checkpoint import AsyncSave, save_pretrained, wait_for_saves
    from hf_zero.engine import ModelStateMemory, ShardedOptimizer

    assert len(hf_zero.__all__) <= 20 and all(hasattr(hf_zero, n) for n in hf_zero.__all__ if not n.startswith("Zero"))
    assert (hf_zero.types.AsyncSave, hf_zero.types.ModelStateMemory, hf_zero.types.ShardedOptimizer) == (
        AsyncSave, ModelStateMemory, ShardedOptimizer)
    moved = {"attach_optimizer": ("hf_zero.initialize(model, optimizer)", None), "wait_for_saves": ("handle.wait()",
             wait_for_saves), "AsyncSave": ("hf_zero.types.AsyncSave", AsyncSave),
             "ShardedOptimizer": ("hf_zero.types.ShardedOptimizer", ShardedOptimizer),
             "save_pretrained": ("model.save_pretrained(output_dir, dtype=..., parallel=...)", save_pretrained)}
    for name, (replacement, obj) in moved.items():
        assert name not in hf_zero.__all__
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = getattr(hf_zero, name)
        assert [w.category for w in caught] == [FutureWarning] and replacement in str(caught[0].message)
        assert obj is None or value is obj


def test_importing_hf_zero_leaves_dynamo_unimported():
    """`import hf_zero` (every CLI start) costs torch's own import and no more: the engine's functions that dynamo
    must not trace are disabled at their first call, not at import, where `torch.compiler.disable` would import
    dynamo (about a second)."""
    import subprocess
    import sys

    code = "import sys, hf_zero, hf_zero.cli; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("stage", [1, 3])
def test_initialize_logs_one_startup_line_on_rank_0(pools, stage):
    """One line on rank 0 (none on the others): stage, ranks, units, parameters, and the model-state memory per rank
    with Adam's state, which equals what the rank holds after its first step."""
    import re

    from tests import _startup_cases

    results = pools(2).values(_startup_cases.startup_and_first_step, stage)
    assert results[1]["records"] == []
    (line,) = results[0]["records"]
    assert line.startswith(f"hf_zero: ZeRO stage {stage} on 2 rank(s) (cpu, gloo), ") and "parameters" in line, line
    with_adam = float(re.search(r"([\d.]+) MiB with Adam's state", line).group(1))
    assert with_adam == pytest.approx(results[0]["after_step"] / 2**20, abs=0.05), line


def test_the_command_line_says_its_version_and_lists_each_tool_once():
    """`hf-zero --version` and `hf-zero --help`: the version the package declares, each subcommand listed with its
    help, no internal note names in what a user reads."""
    from tests._cli import run_cli

    done = run_cli(["--version"])
    assert done.returncode == 0 and done.stdout.strip() == f"hf-zero {hf_zero.__version__}"
    done = run_cli(["--help"])
    assert done.returncode == 0
    for command in ("estimate", "from-deepspeed", "consolidate", "merge-adapter", "preemptible", "leftovers", "env"):
        assert f"\n    {command} " in done.stdout, command
        assert run_cli([command, "--help"]).returncode == 0
    assert "[Note:" not in done.stdout


def test_the_startup_line_of_a_load_says_how_fast_rank_0_read_its_weights(pools, tmp_path):
    """`hf_zero.from_pretrained`: the start-up line adds the bytes rank 0 filled its shards with from the weight
    files and the time it took (a figure on the longest part of a start); `initialize` without files adds none."""
    import re

    from tests import _startup_cases

    make_model("llama_8").save_pretrained(tmp_path / "base")  # fp32 files: the shards' own bytes
    results = pools(2).values(_startup_cases.startup_of_a_load, str(tmp_path / "base"))
    assert results[1]["records"] == []
    (line,) = results[0]["records"]
    found = re.search(r"; weights read on rank 0: ([\d.]+) MiB in ([\d.]+) s \(([\d.]+) (MiB|GiB)/s\)$", line)
    assert found, line
    assert float(found.group(1)) == pytest.approx(results[0]["shards"] / 2**20, abs=0.051), line
    assert "weights read" not in pools(2).values(_startup_cases.startup_and_first_step, 3)[0]["records"][0]


def test_the_env_command_prints_what_a_bug_report_needs(monkeypatch):
    """`hf-zero env`: hf_zero's and torch's versions, the devices, each integration's version (or "not installed")
    and the launch variables this process sees."""
    from importlib.metadata import version

    from tests._cli import run_cli

    monkeypatch.setenv("WORLD_SIZE", "16")
    done = run_cli(["env"])
    assert done.returncode == 0, done.stderr
    lines = dict(line[2:].split(": ", 1) for line in done.stdout.splitlines() if line.startswith("- "))
    assert lines["hf_zero"] == hf_zero.__version__ and lines["torch"].startswith(torch.__version__)
    assert lines["transformers"] == version("transformers") and lines["WORLD_SIZE"] == "16"
    assert lines["gloo"] == "yes" and lines["GPUs"] == ("none" if not torch.cuda.is_available() else lines["GPUs"])
    assert {"accelerate", "safetensors", "peft", "trl", "bitsandbytes", "NCCL", "CPU capability"} <= lines.keys()
