"""The examples, run as users run them: `accelerate launch` with the shipped CPU config, 2 processes (one on the
suite's pool of 2 ranks, given what the launcher gives each process: tests/_example_cases.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import _example_cases as example_cases

ROOT = Path(__file__).resolve().parent.parent
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(ROOT / "accelerate_configs" / "cpu_2proc.yaml"), "--num_cpu_threads_per_process", "1"]


def _run(cmd: list[str], timeout: int = 600, baseline: bool = False) -> subprocess.CompletedProcess:
    """Run `cmd` (an `accelerate launch`) and require exit code 0. A `baseline` run (stock DDP, no hf_zero in the
    process) may instead abort *at exit* (SIGABRT, torch's own gloo teardown race, pytorch/pytorch#179291, which
    hf_zero contains only in processes that use it: [Note: clean exit]); its outputs are checked by the caller."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    torch_exit_abort = baseline and "Signal 6 (SIGABRT)" in done.stderr
    assert done.returncode == 0 or torch_exit_abort, (
        f"{' '.join(cmd)}\n--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-6000:]}"
    )
    return done


# The demo's assets, small: corpora, instructions and a base model pretrained for 2 steps, cached beside them
ASSET_ARGS = ["--max_documents", "60", "--pretrain_steps", "2", "--vocab_size", "512", "--hidden", "64", "--layers",
              "2", "--seq", "128"]


def _make_assets(out: Path) -> subprocess.CompletedProcess:
    cache = out.parent / "demo-cache"
    return _run([sys.executable, "examples/make_demo_assets.py", "--out", str(out), "--cache", str(cache), *ASSET_ARGS])


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "assets"
    made = _make_assets(out)
    assert "pretraining on the general text for 2 steps" in made.stdout and "reused" not in made.stdout
    return out


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_demo_assets_hold_out_unseen_modules_and_reuse_the_cached_base(assets):
    """The demo's corpora are real text split by module/package (no held-out group is trained on, no held-out
    entry is a near-copy of training text), and the pretrained base is cached: a second run reuses it."""
    sys.path.insert(0, str(ROOT / "examples"))
    from demo_corpus import MAX_SHARED_SHINGLES, Document, shared_shingle_fraction
    from safetensors.torch import load_file

    again = assets.parent / "again"
    assert "reused the pretrained base" in _make_assets(again).stdout
    a, b = load_file(assets / "base" / "model.safetensors"), load_file(again / "base" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    for corpus in ("corpus", "general"):
        train, held = (_records(assets / corpus / f"{part}.jsonl") for part in ("train", "held_out"))
        assert train and held
        assert not {r["source"] for r in train} & {r["source"] for r in held}
        docs = {part: [Document(r["source"], (r["text"],)) for r in rows]
                for part, rows in (("train", train), ("held", held))}
        assert shared_shingle_fraction(docs["held"], docs["train"]) <= MAX_SHARED_SHINGLES
    pairs = _records(assets / "instructions.jsonl")
    assert pairs and all(p["prompt"].startswith("What does `") and p["completion"] for p in pairs)


def test_train_clm_with_accelerate_launch_and_zero_stage_3(assets, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    done = _run(ACCELERATE + [
        "examples/train_clm.py", "--model_name_or_path", str(assets / "base"),
        "--train_files", str(assets / "corpus" / "train.jsonl"), "--validation_files", str(assets / "corpus" / "held_out.jsonl"), "--output_dir", str(out), "--zero_stage", "3",
        "--block_size", "64", "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3", "--max_steps", "8", "--save_steps", "4",
        "--logging_steps", "1", "--report_to", "none", "--use_cpu", "--disable_tqdm", "true",
        "--attn_implementation", "sdpa",
    ])
    assert "held-out perplexity" in done.stdout
    # The main job's log holds nothing a user would take for an error: no optional package's import-time notes
    # (torchao's "Failed to load", torch's pytree deprecations), no FutureWarning from hf_zero's own calls.
    noise = [line for line in (done.stdout + done.stderr).splitlines()
             if any(word in line for word in ("Failed to load", "Traceback", "FutureWarning", "is deprecated"))]
    assert not noise, noise[:5]
    metrics = json.loads((out / "domain_adaptation.json").read_text())
    assert metrics["perplexity_after"] < metrics["perplexity_before"]
    manifest = json.loads((out / "checkpoint-8" / "hf_zero" / "hf_zero_manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["stage"] == 3  # really 2 processes, really sharded
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    generated = model.generate(**tokenizer("json.dumps(obj)", return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > 2


# the slow tier (21 s on 2 cores): sequence parallelism through the Trainer is in tests/test_trainer.py, through an
# example in the SFT test below
@pytest.mark.slow
def test_train_clm_with_sequence_parallelism_on_long_blocks(assets, tmp_path):
    """[Note: sequence parallelism]: the example as a user with long documents runs it, `--zero_sequence_parallel
    2` with blocks 16x the base model's pretraining length and gradient checkpointing: it trains, evaluates before
    and after, and saves a model that from_pretrained loads."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    done = _run(ACCELERATE + [
        "examples/train_clm.py", "--model_name_or_path", str(assets / "base"),
        "--train_files", str(assets / "corpus" / "train.jsonl"), "--validation_files",
        str(assets / "corpus" / "held_out.jsonl"), "--output_dir", str(out), "--zero_stage", "3",
        "--zero_sequence_parallel", "2", "--block_size", "2048", "--gradient_checkpointing",
        "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3",
        "--max_steps", "2", "--save_steps", "2", "--logging_steps", "1", "--report_to", "none", "--use_cpu",
        "--disable_tqdm", "true",
    ])
    metrics = json.loads((out / "domain_adaptation.json").read_text())
    assert metrics["perplexity_after"] < metrics["perplexity_before"], metrics
    assert "held-out perplexity" in done.stdout
    settings = json.loads((out / "checkpoint-2" / "hf_zero" / "hf_zero_manifest.json").read_text())
    assert settings["world_size"] == 2 and settings["stage"] == 3
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    assert model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False).shape == (1, 12)


def _accelerate_run(assets: Path, out: Path, max_steps: int, *extra: str) -> None:
    _run(ACCELERATE + [
        "examples/train_accelerate.py", "--model_name_or_path", str(assets / "base"),
        "--train_files", str(assets / "corpus" / "train.jsonl"), "--output_dir", str(out), "--zero_stage", "3",
        "--block_size", "64",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3",
        "--lr_scheduler_type", "constant", "--max_train_steps", str(max_steps), "--checkpointing_steps", "2", *extra,
    ])


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


# the slow tier (39 s on 2 cores): the plugin's background save and resume stay in the suite through
# tests/test_accelerate.py::test_save_state_and_load_state_resume (async_save) and the Trainer's in test_trainer.py
@pytest.mark.slow
def test_train_accelerate_resumed_from_a_background_save(assets, tmp_path):
    """A 4-step run saves every 2 steps in the background (`--zero_async_save`, its host copy bounded), so step_2
    is written while steps 3-4 change the weights, and step_4 while the process ends (it waits for it); a second
    run resumes from step_2: steps 3-4 have the same losses, and the final models are equal."""
    from safetensors.torch import load_file

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir(), resumed.mkdir()
    background = ("--zero_async_save", "--zero_snapshot_budget", "64KB")
    _accelerate_run(assets, straight, 4, *background)
    for step in (2, 4):
        assert (straight / f"step_{step}" / "hf_zero" / "hf_zero_manifest.json").is_file()
    _accelerate_run(assets, resumed, 4, "--resume_from_checkpoint", str(straight / "step_2"), *background)
    full, parts = _log(straight), _log(resumed)
    assert [e["step"] for e in full] == [1, 2, 3, 4] and [e["step"] for e in parts] == [3, 4]
    np.testing.assert_allclose([e["loss"] for e in parts], [e["loss"] for e in full[2:]], rtol=1e-6)
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    for name in a:
        np.testing.assert_allclose(a[name].numpy(), b[name].numpy(), rtol=1e-5, atol=1e-7, err_msg=name)


# The plain run on the suite's 2-rank pool (the launcher's processes cost 41 s on 2 cores, 30 of them starting
# interpreters and importing TRL's dependencies); the sequence-parallel run under `accelerate launch` in the slow
# tier: both take the same TRL path at stage 3, and sequence parallelism stays in the suite through the Trainer's
# and tests/test_sequence_parallel.py
@pytest.mark.parametrize("variant", ["plain", "padding_free_sequence_parallel", "qlora",
                                     pytest.param("sequence_parallel", marks=pytest.mark.slow)])
def test_sft_trl_example_at_stage_3_matches_stock_sft_trainer_under_ddp(pools, assets, tmp_path, variant):
    """`examples/sft_trl.py` (TRL's SFTTrainer with hf_zero mixed in, its default fused loss) on 2 processes:
    the logged losses equal the same script's with TRL's stock SFTTrainer under DDP (1e-5 relative), and the
    saved model loads with `from_pretrained`, equal to the stock run's weights. The plain variant runs the script
    on the pool's two ranks, each given what `accelerate launch` gives a process (tests/_example_cases.py; the
    launcher itself: the other examples' tests); with `--zero_sequence_parallel 2` (both ranks read the same 4
    samples, each holds half of every sequence; TRL's fused log-probabilities come back whole), under `accelerate
    launch`, the token accuracy is the stock run's too. With `--qlora` (TRL's QLoRA: a 4-bit NF4 base, double
    quantization, codes stored as uint8, LoRA on every linear, TRL preparing the model): losses and the saved adapter
    equal the stock run's."""
    pytest.importorskip("trl")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    common = ["examples/sft_trl.py", "--model_name_or_path", str(assets / "base"), "--dataset_file",
              str(assets / "instructions.jsonl"),
              "--max_steps", "4", "--per_device_train_batch_size", "2", "--learning_rate", "1e-3", "--logging_steps", "1",
              "--max_length", "64", "--report_to", "none", "--use_cpu", "--disable_tqdm", "true", "--save_strategy", "no",
              "--adam_epsilon", "1e-6", "--bf16", "false"]  # fp32 (TRL's configs default to bf16)
    zero, stock = tmp_path / "zero", tmp_path / "stock"
    if variant in ("plain", "qlora"):  # qlora: a 4-bit NF4 base (double quantization), LoRA on every linear
        script, args = str(ROOT / common[0]), common[1:] + (["--qlora", "--lora_rank", "4"] if variant == "qlora" else [])
        for out, flags in ((stock, ["--use_stock_trainer"]), (zero, ["--zero_stage", "3"])):
            pools(2).values(example_cases.run_example, script, [*args, "--output_dir", str(out), *flags])
    elif variant == "padding_free_sequence_parallel":  # TRL's BFD packing: padding-free rows of whole samples end to
        # end, position_ids restarting at each ([Note: packed documents]), split by sequence over the 2 ranks
        script = str(ROOT / common[0])
        args = [*common[1:], "--packing", "--packing_strategy", "bfd", "--pad_to_multiple_of", "2"]
        split = ["--zero_stage", "3", "--zero_sequence_parallel", "2", "--per_device_train_batch_size", "4"]
        for out, flags in ((stock, ["--use_stock_trainer"]), (zero, split)):
            pools(2).values(example_cases.run_example, script, [*args, "--output_dir", str(out), *flags])
    else:
        _run(ACCELERATE + common + ["--output_dir", str(stock), "--use_stock_trainer"], baseline=True)
        split = ["--zero_sequence_parallel", "2", "--per_device_train_batch_size", "4", "--pad_to_multiple_of", "2"]
        _run(ACCELERATE + common + ["--output_dir", str(zero), "--zero_stage", "3"] + split)
    got, want = json.loads((zero / "losses.json").read_text()), json.loads((stock / "losses.json").read_text())
    assert len(got) == 4
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)
    if variant == "qlora":  # the adapter, as PEFT saves it, equal to the stock run's
        a, b = (load_file(run / "final" / "adapter_model.safetensors") for run in (zero, stock))
        assert a.keys() == b.keys() and len(b) >= 8 and all(a[n].dtype == b[n].dtype for n in b)
        a, b = {n: t.float() for n, t in a.items()}, {n: t.float() for n, t in b.items()}
    else:
        AutoModelForCausalLM.from_pretrained(zero / "final")
        a, b = load_file(zero / "final" / "model.safetensors"), load_file(stock / "final" / "model.safetensors")
    for name in b:
        np.testing.assert_allclose(a[name].numpy(), b[name].numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    accuracy = [json.loads((run / "accuracy.json").read_text()) for run in (stock, zero)]
    np.testing.assert_allclose(accuracy[1], accuracy[0], rtol=1e-5, atol=0)


# the slow tier (44 s each on 2 cores): TRL stays in the main tier through the SFT example
@pytest.mark.parametrize("stage, sync", [pytest.param(3, False, marks=pytest.mark.slow),
                                         pytest.param(3, True, marks=pytest.mark.slow)], ids=["dpo", "tr-dpo"])
def test_dpo_at_stage_3_matches_stock_dpo_trainer_under_ddp(assets, tmp_path, stage, sync):
    """TRL's DPOTrainer with hf_zero mixed in (reference model built by TRL and sharded at stage 3 as well,
    fused log-probabilities) against
    TRL's stock DPOTrainer under DDP, both under `accelerate launch` on 2 processes: losses within 1e-5
    relative and equal saved weights (fp32: TRL's configs default to bf16, turned off for both). With
    `sync_ref_model` (TR-DPO) the sharded reference model is mixed with the policy every step, as stock does."""
    pytest.importorskip("trl")
    from safetensors.torch import load_file

    zero, stock = tmp_path / "zero", tmp_path / "stock"
    flags = ["--sync_ref_model"] if sync else []
    _run(ACCELERATE + ["tests/_dpo_run.py", str(assets / "base"), str(zero), str(stage), *flags])
    _run(ACCELERATE + ["tests/_dpo_run.py", str(assets / "base"), str(stock), "stock", *flags], baseline=True)
    got, want = json.loads((zero / "losses.json").read_text()), json.loads((stock / "losses.json").read_text())
    assert len(got) == 3 and got[0] == pytest.approx(0.6931, abs=1e-3)  # DPO starts at log 2 (policy = reference)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert json.loads((zero / "ref.json").read_text()) == {"ref_sharded": True}  # the reference model is sharded too
    a, b = load_file(zero / "final" / "model.safetensors"), load_file(stock / "final" / "model.safetensors")
    for name in b:
        np.testing.assert_allclose(a[name].numpy(), b[name].numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


# the slow tier (37 s on 2 cores: two `accelerate launch`es importing TRL): ranks that end their generations at
# different steps are in tests/test_sharded_model.py, TRL's trainers in the main tier through the SFT example
@pytest.mark.slow
def test_grpo_at_stage_3_matches_stock_grpo_trainer_under_ddp(tmp_path):
    """TRL's GRPOTrainer (online RL) with hf_zero mixed in against TRL's stock GRPOTrainer under DDP, both under
    `accelerate launch` on 2 processes: every step generates on the sharded model (ranks ending their completions
    at different steps keep each other's gathers going), scores, and trains against a reference model (KL, beta
    0.04). The sampled lengths, rewards, KL, losses and gradient norms within 1e-5 relative, and equal saved
    weights (fp32)."""
    pytest.importorskip("trl")
    from safetensors.torch import load_file

    from tests._training import make_model, make_tokenizer

    base, zero, stock = tmp_path / "base", tmp_path / "zero", tmp_path / "stock"
    make_model("llama", seed=3).save_pretrained(base)
    make_tokenizer(str(base))
    _run(ACCELERATE + ["tests/_grpo_run.py", str(base), str(zero), "3"])
    _run(ACCELERATE + ["tests/_grpo_run.py", str(base), str(stock), "stock"], baseline=True)
    got, want = json.loads((zero / "logged.json").read_text()), json.loads((stock / "logged.json").read_text())
    assert len(got) == 2 and all(w["completions/min_length"] < w["completions/max_length"] for w in want)  # uneven
    assert want[1]["kl"] > 0
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for key in w:
            np.testing.assert_allclose(g[key], w[key], rtol=1e-5, atol=1e-7, err_msg=key)
    a, b = load_file(zero / "final" / "model.safetensors"), load_file(stock / "final" / "model.safetensors")
    for name in b:
        np.testing.assert_allclose(a[name].numpy(), b[name].numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


def _two_node_config(directory: Path, machine_rank: int, port: int) -> Path:
    """`accelerate_configs/two_nodes_8gpu.yaml` for two "nodes" on this machine: 2 CPU processes each."""
    import yaml

    config = yaml.safe_load((ROOT / "accelerate_configs" / "two_nodes_8gpu.yaml").read_text())
    config.update(num_processes=4, machine_rank=machine_rank, main_process_ip="127.0.0.1", main_process_port=port,
                  mixed_precision="no", use_cpu=True)
    path = directory / f"node{machine_rank}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _trainer_losses(checkpoint: Path) -> list[float]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


@pytest.mark.slow  # hybrid sharding's numbers: test_hybrid.py; this adds the two-node launch (make test-slow)
def test_two_nodes_on_localhost_with_hybrid_sharding_then_resume_on_one_node(assets, tmp_path):
    """Two launcher processes (`accelerate launch`, a config derived from the shipped two-node one, 2 processes
    each, rendezvous on localhost) train with `--zero_hybrid_shard` (shard within a node, replicate across) and
    save; one node (2 processes, plain stage 3, gradient accumulation for the same global batch) resumes from
    the step-2 checkpoint. Steps 3-4 match the two-node run's (1e-5), and so do the final weights."""
    import socket

    from safetensors.torch import load_file

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["examples/train_clm.py", "--model_name_or_path", str(assets / "base"),
              "--train_files", str(assets / "corpus" / "train.jsonl"), "--validation_files",
              str(assets / "corpus" / "held_out.jsonl"), "--block_size", "64", "--zero_stage", "3",
              "--learning_rate", "3e-3", "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1",
              "--adam_epsilon", "1e-6", "--report_to", "none", "--use_cpu", "--disable_tqdm", "true"]
    two_nodes = tmp_path / "two_nodes"
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    launchers = [
        subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          str(_two_node_config(tmp_path, rank, port)), "--num_cpu_threads_per_process", "1", *common,
                          "--output_dir", str(two_nodes), "--per_device_train_batch_size", "2", "--zero_hybrid_shard"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in launchers]
    for rank, (p, out) in enumerate(zip(launchers, outputs)):
        assert p.returncode == 0, f"node {rank} failed:\n{out[-6000:]}"
    manifest = json.loads((two_nodes / "checkpoint-2" / "hf_zero" / "hf_zero_manifest.json").read_text())
    assert manifest["world_size"] == 4 and manifest["stage"] == 3
    # hybrid: the model is sharded over one node's 2 ranks (the other node holds a replica), so 2 shard files
    assert sorted(f for f in manifest["files"] if f.startswith("model-")) == [
        "model-rank00000-of-00002.safetensors", "model-rank00001-of-00002.safetensors"]

    one_node = tmp_path / "one_node"
    _run(ACCELERATE + common + ["--output_dir", str(one_node), "--per_device_train_batch_size", "2",
                                "--gradient_accumulation_steps", "2",
                                "--resume_from_checkpoint", str(two_nodes / "checkpoint-2")])
    want, got = _trainer_losses(two_nodes / "checkpoint-4"), _trainer_losses(one_node / "checkpoint-4")
    assert len(want) == 4 and len(got) == 4
    np.testing.assert_allclose(got[2:], want[2:], rtol=1e-5, atol=0)
    a, b = load_file(one_node / "final" / "model.safetensors"), load_file(two_nodes / "final" / "model.safetensors")
    for name in b:
        np.testing.assert_allclose(a[name].numpy(), b[name].numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


def test_pack_documents_keeps_the_boundaries():
    """`--packing`: whole documents into exact blocks, positions restarting at each document (or piece of one cut at a
    block's end), its first token not predicted from the one before; the partial last block dropped."""
    sys.path.insert(0, str(ROOT / "examples"))
    from clm_data import pack_documents

    blocks = pack_documents([[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11]], 4)
    assert blocks["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert blocks["position_ids"] == [[0, 1, 2, 0], [0, 1, 2, 3]]
    assert blocks["labels"] == [[-100, 2, 3, -100], [-100, 6, 7, 8]]


def test_train_clm_packing_with_sequence_parallelism(pools, assets, tmp_path):
    """`examples/train_clm.py --packing --zero_sequence_parallel 2` on 2 ranks: blocks keep their documents' boundaries
    and are split by sequence ([Note: packed documents]); it trains, evaluates before and after, saves a model."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    args = ["--model_name_or_path", str(assets / "base"), "--train_files", str(assets / "corpus" / "train.jsonl"),
            "--validation_files", str(assets / "corpus" / "held_out.jsonl"), "--output_dir", str(out),
            "--zero_stage", "3", "--zero_sequence_parallel", "2", "--packing", "--block_size", "128",
            "--per_device_train_batch_size", "2", "--learning_rate", "3e-3", "--max_steps", "3", "--save_strategy",
            "no", "--logging_steps", "1", "--report_to", "none", "--use_cpu", "--disable_tqdm", "true",
            "--attn_implementation", "sdpa"]
    pools(2).values(example_cases.run_example, str(ROOT / "examples" / "train_clm.py"), args)
    metrics = json.loads((out / "domain_adaptation.json").read_text())
    assert metrics["perplexity_after"] < metrics["perplexity_before"], metrics
    AutoModelForCausalLM.from_pretrained(out / "final")
