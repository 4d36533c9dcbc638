"""ZeroTrainer against the stock Trainer.

Tolerance (fp32): the logged training losses, the logged gradient norms and the eval loss within
1e-5 relative of the stock Trainer in one process on the same global batch (gradient accumulation
on, `max_grad_norm=1.0`, AdamW with the Trainer's weight-decay groups, linear lr schedule), and
the final weights within 1e-5 relative (‖w − w_ref‖ / ‖w_ref‖).
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests import _async_save_cases as async_save_cases
from tests import _trainer_cases as tc
from tests._training import OTHER_ARCHITECTURES, make_tokenizer, rel_err

# Every rank function here follows tests._dist.device(): on a machine with a GPU per rank the pools run on
# CUDA + NCCL (make gpu-check), elsewhere on CPU + gloo.
pytestmark = pytest.mark.device_agnostic

TOL = 1e-5


@functools.lru_cache(maxsize=None)
def _reference(job: tc.Job) -> dict:
    return tc.reference(job)


def _ref_key(job: tc.Job) -> tc.Job:
    return replace(job, stage=0, world=1, out_dir="/tmp/hf_zero-ref", save_steps=None, stop_after=None,
                   resume_from=None, seed=0, checkpointing=False, save_model_to=None, tokenizer_dir=None,
                   evaluate_first=False)


def _assert_close_to_reference(got: dict, ref: dict) -> None:
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=TOL, atol=0)
    np.testing.assert_allclose(got["norms"], ref["norms"], rtol=TOL, atol=0)
    np.testing.assert_allclose(got["eval_loss"], ref["eval_loss"], rtol=TOL, atol=0)
    for name, value in ref["state"].items():
        assert rel_err(got["state"][name].numpy(), value.numpy()) <= TOL, name


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", ["llama", "falcon"])
def test_zero_trainer_matches_stock_trainer(pools, tmp_path, kind, stage):
    job = tc.Job(kind=kind, stage=stage, world=2, out_dir=str(tmp_path / "out"))
    got = pools(2).values(tc.run, job)[0]
    assert got["world"] == 2 and len(got["losses"]) == job.steps
    _assert_close_to_reference(got, _reference(_ref_key(job)))


def test_evaluate_before_train_then_trains_as_the_stock_trainer(pools, tmp_path):
    """`trainer.evaluate()` first (the base model's loss, as examples do), then `train()`: the model is sharded for
    the evaluation, its optimizer attached when training starts; losses, norms and weights equal the stock
    Trainer's. (transformers 5.24's stock Trainer under DDP does not wrap a model it evaluated first: its ranks then
    train apart; the single-process reference has no ranks to part.)"""
    job = tc.Job(kind="llama", stage=3, world=2, out_dir=str(tmp_path / "out"), evaluate_first=True)
    got = pools(2).values(tc.run, job)[0]
    reference = _reference(_ref_key(job))
    _assert_close_to_reference(got, reference)
    assert got["first_eval"] is not None and abs(got["first_eval"] - got["eval_loss"]) > 1e-4


# stage 3 (every block gathered, split and reduced) in the suite for the MoE (Mixtral: fused 3-D experts, each rank's
# router choosing other experts) and a tied model; the others in the slow tier (2-3 s each)
@pytest.mark.parametrize("kind", [k if k in ("mixtral", "gpt2") else pytest.param(k, marks=pytest.mark.slow)
                                  for k in OTHER_ARCHITECTURES])
def test_other_architectures_train_as_the_stock_trainer(pools, tmp_path, kind):
    job = tc.Job(kind=kind, stage=3, world=2, out_dir=str(tmp_path / "out"))
    got = pools(2).values(tc.run, job)[0]
    assert sorted(got["state"]) == sorted(_reference(_ref_key(job))["state"])
    _assert_close_to_reference(got, _reference(_ref_key(job)))


def test_liger_kernel_forward_reading_the_head_weight_trains_as_the_stock_trainer(pools, tmp_path):
    """`--use_liger_kernel`: Liger's forward passes `lm_head.weight` to its fused loss without calling the head (a
    Liger-like forward here: Liger needs triton and a GPU). The model is sharded before the Trainer (as
    `hf_zero.from_pretrained` gives it), so the Trainer applies Liger to a sharded model: at stage 3 the head, a
    unit of its own, is kept gathered through each forward from then on ([Note: direct use])."""
    job = tc.Job(kind="llama", stage=3, world=2, out_dir=str(tmp_path / "out"), liger=True, presharded=True)
    got = pools(2).values(tc.run, job)[0]
    _assert_close_to_reference(got, _reference(_ref_key(job)))


def test_neftune_noise_trains_as_the_stock_trainer_on_the_same_ranks(pools, tmp_path):
    """`--neftune_noise_alpha`: the Trainer hooks the input embeddings (a forward hook that adds uniform noise to
    their output, from each rank's own random stream). At stage 3 (the embeddings gathered by hf_zero's hooks
    around the same module) the losses, gradient norms and weights equal the stock Trainer's on the same two ranks
    (DDP: each rank draws the same noise as here), and differ from a run without the noise."""
    job = tc.Job(kind="llama", stage=3, world=2, out_dir=str(tmp_path / "out"), neftune_alpha=5.0)
    got = pools(2).values(tc.run, job)[0]
    ddp = pools(2).values(tc.run, replace(job, out_dir=str(tmp_path / "ddp")), False)[0]
    _assert_close_to_reference(got, ddp)
    quiet = pools(2).values(tc.run, replace(job, out_dir=str(tmp_path / "quiet"), neftune_alpha=None))[0]
    assert abs(quiet["losses"][-1] - got["losses"][-1]) > 1e-4  # the noise changed the training


# the whole model in the slow tier (26-29 s on 2 cores: dynamo traces past each graph break of the hooks of a llama);
# the suite compiles the whole of a smaller model in tests/test_sharded_model.py
@pytest.mark.parametrize(("regional", "backend"), [(True, "aot_eager"),
                                                   pytest.param(False, "eager", marks=pytest.mark.slow),
                                                   pytest.param(False, "aot_eager", marks=pytest.mark.slow)])
def test_torch_compile_compiles_the_sharded_model_and_trains_as_the_stock_trainer(pools, tmp_path, regional, backend):
    """[Note: compile] `--torch_compile_backend` at stage 3 (`eager`: dynamo alone; `aot_eager`: with AOT autograd;
    neither generates code): the sharded model is compiled (dynamo compiled frames on every rank; before, the request
    was dropped and none were) and the losses, norms, eval loss and weights are those of the stock Trainer compiled
    the same way. With Accelerate's regional compilation, each block's forward is compiled and its hooks stay
    outside."""
    job = tc.Job(kind="llama", stage=3, world=2, steps=3, out_dir=str(tmp_path / "out"), compile_backend=backend,
                 regional_compile=regional)
    runs = pools(2).values(tc.run, job)
    ref = _reference(_ref_key(job))
    assert ref["compiled_frames"]["ok"] >= 1
    for got in runs:
        assert got["compiled_frames"].get("ok", 0) >= 1, got["compiled_frames"]
    _assert_close_to_reference(runs[0], ref)


def test_sequence_parallel_trains_and_evaluates_as_the_stock_trainer(pools, tmp_path):
    """`--zero_sequence_parallel 2` on 2 ranks ([Note: sequence parallelism]): each rank holds half of every
    sequence, the two ranks get the same batches, and the losses, gradient norms, eval loss and weights are the
    stock Trainer's on one process. The evaluation's metrics see each held-out sample once (7 of them: the last
    batch is short) and the tokens-seen count is the stock one, not once per rank of the group."""
    job = tc.Job(kind="llama", stage=3, world=2, out_dir=str(tmp_path / "out"), zero_args=(("zero_sequence_parallel", 2),),
                 eval_rows=7, counts=True)
    got = pools(2).values(tc.run, job)[0]
    assert len(got["losses"]) == job.steps
    ref = _reference(_ref_key(job))
    _assert_close_to_reference(got, ref)
    assert got["counts"]["samples"] == ref["counts"]["samples"] == 7
    assert got["counts"]["label_sum"] == ref["counts"]["label_sum"]
    np.testing.assert_allclose(got["counts"]["accuracy"], ref["counts"]["accuracy"], rtol=TOL)
    assert got["tokens_seen"] == ref["tokens_seen"] > 0


# stage 2 in the slow tier, as above
@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("kind, world", [("scalars", 1), ("scalars", 2), ("mlp", 1), ("mlp", 2)])
def test_models_without_blocks_train_and_resume_as_the_stock_trainer(pools, tmp_path, kind, world, stage):
    """[Note: units without blocks]: the upstream Trainer tests' model (two scalar parameters on the root, no
    submodule) and an nn.Sequential of Linear layers (one unit per layer: bucket_size_mb=0) train with the stock
    Trainer's losses and weights (fp32, 1e-6), and a run stopped at checkpoint-2 resumes to the same end."""
    base = tc.Job(kind=kind, stage=stage, world=world, global_batch=8, micro_bs=2, steps=4, save_steps=2,
                  zero_args=(("zero_bucket_size_mb", 0.0),))
    got = pools(world).values(tc.run, replace(base, out_dir=str(tmp_path / "straight")))[0]
    ref = _reference(_ref_key(base))
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-6, atol=0)
    np.testing.assert_allclose(got["eval_loss"], ref["eval_loss"], rtol=1e-6, atol=0)
    for name, value in ref["state"].items():
        assert rel_err(got["state"][name].numpy(), value.numpy()) <= 1e-6, name
    assert got["units"] == (["net.0", "net.2", "net.4", ""] if kind == "mlp" else [""])
    pools(world).values(tc.run, replace(base, out_dir=str(tmp_path / "run"), stop_after=2))
    resumed = pools(world).values(tc.run, replace(base, out_dir=str(tmp_path / "run"), seed=1,
                                                 resume_from=str(tmp_path / "run" / "checkpoint-2")))[0]
    assert resumed["losses"] == got["losses"]
    for name, value in got["state"].items():
        np.testing.assert_array_equal(resumed["state"][name].numpy(), value.numpy(), err_msg=name)


@pytest.mark.parametrize("keep", [False, True], ids=["reduce-each-micro-batch", "no_sync_keeps_grads"])
@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_accumulation_holds_only_gradient_shards_between_micro_batches(pools, tmp_path, stage, keep):
    """gradient_accumulation_steps=4: the Trainer runs three of each step's micro-batches under
    `model.no_sync()`. By default every micro-batch is reduced into the fp32 gradient shards, so between
    micro-batches the gradients held are exactly the shards (the ZeRO formula's 4Ψ/N, padding included)
    and no unit keeps unsharded gradients; `--zero_no_sync_keeps_grads` keeps every trainable unit's
    unsharded gradients instead (an embedding its gradient rows), and the accounting shows them. Losses match the stock Trainer either way."""
    job = tc.Job(kind="llama", stage=stage, world=2, global_batch=16, micro_bs=2, out_dir=str(tmp_path / "out"),
                 zero_args=(("zero_no_sync_keeps_grads", keep),), measure_window=True)
    got = pools(2).values(tc.run, job)[0]
    assert job.accum == 4 and len(got["window"]) == 3 * job.steps
    for sample in got["window"]:
        if keep:
            assert sample["unsharded_grads"] == sample["dense_trainable_units"], sample  # (the embedding keeps rows)
            assert sample["held_unsharded_bytes"] > 0 and sample["gradients"] >= sample["held_unsharded_bytes"], sample
        else:
            assert sample["unsharded_grads"] == 0 and sample["gradients"] == sample["shard_bytes"], sample
    _assert_close_to_reference(got, _reference(_ref_key(job)))


def test_gradient_checkpointing_gives_the_same_losses(pools, tmp_path):
    job = tc.Job(kind="llama", stage=3, world=2, out_dir=str(tmp_path / "out"), checkpointing=True)
    _assert_close_to_reference(pools(2).values(tc.run, job)[0], _reference(_ref_key(job)))


def test_zero_stage_parsed_from_the_command_line():
    from transformers import HfArgumentParser

    import hf_zero

    parser = HfArgumentParser(hf_zero.ZeroTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", "out", "--use_cpu", "--zero_stage", "3", "--zero_wrap", "LlamaDecoderLayer",
         "--zero_reduce_dtype", "bf16", "--zero_offload_optimizer", "--zero_offload_params",
         "--zero_bucket_size_mb", "25", "--zero_collectives", "native"]
    )
    assert args.zero_stage == 3 and isinstance(args.zero_stage, int)
    config = args.to_zero_config()
    assert (config.stage, config.wrap, config.reduce_dtype) == (3, ("LlamaDecoderLayer",), "bf16")
    assert config.offload_optimizer and config.offload_params
    assert (config.bucket_size_mb, config.collectives) == (25.0, "native")
    with pytest.raises(SystemExit):  # argparse rejects a stage outside 0-3
        parser.parse_args_into_dataclasses(["--output_dir", "out", "--zero_stage", "4"])
    json.loads(args.to_json_string())  # the arguments stay JSON-serializable (saved by the Trainer)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"deepspeed": "ds_config.json"}, "hf_zero cannot be combined with DeepSpeed"),
        ({"fsdp": "full_shard"}, "hf_zero cannot be combined with FSDP"),
        ({"zero_reduce_dtype": "int8"}, "ZeroConfig.reduce_dtype must be None, 'fp32', 'bf16' or 'fp16'"),
        ({"zero_wrap": " , "}, "--zero_wrap must be 'auto' or comma-separated module class names"),
        ({"bf16": True, "fp16": True}, "Pass at most one of --bf16 and --fp16"),
        ({"zero_stage": 2, "zero_offload_params": True}, "ZeroConfig.offload_params needs stage=3"),
        ({"zero_hybrid_shard": True, "zero_shard_group_size": 2}, "Pass --zero_hybrid_shard or --zero_shard_group_size"),
        ({"zero_shard_group_size": 0}, "ZeroConfig.shard_group_size must be None or a positive int"),
        ({"zero_stage": 0, "zero_shard_group_size": 2}, "ZeroConfig.shard_group_size needs stage 1, 2 or 3"),
        ({"optim": "galore_adamw_layerwise", "optim_target_modules": ["mlp"]},
         "--optim galore_adamw_layerwise steps each parameter from a hook on it inside backward"),
        ({"optim": "lomo"}, "--optim lomo updates each parameter inside backward"),
        ({"bf16_full_eval": True}, "--bf16_full_eval casts the whole model to bf16 for evaluation"),
    ],
)
def test_refused_combinations(kwargs, message):
    import hf_zero

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("-", r"\-")):
        hf_zero.ZeroTrainingArguments(output_dir="out", use_cpu=True, **{"zero_stage": 3, **kwargs})


def test_precision_follows_the_launcher_unless_a_flag_says_otherwise(monkeypatch):
    import hf_zero

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `accelerate launch` sets from the yaml
    args = hf_zero.ZeroTrainingArguments(output_dir="out", use_cpu=True)
    assert args.to_zero_config().mixed_precision == "bf16" and args.mixed_precision == "bf16"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ValueError, match="hf_zero supports mixed precision 'no', 'bf16' or 'fp16'"):
        hf_zero.ZeroTrainingArguments(output_dir="out", use_cpu=True)


def test_hybrid_shard_flag_takes_the_node_size_from_the_launcher(monkeypatch):
    import hf_zero

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = hf_zero.ZeroTrainingArguments(output_dir="out", use_cpu=True, zero_hybrid_shard=True)
    assert args.to_zero_config().shard_group_size == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="takes the group size from LOCAL_WORLD_SIZE"):
        hf_zero.ZeroTrainingArguments(output_dir="out", use_cpu=True, zero_hybrid_shard=True)


def test_zero_trainer_refuses_plain_training_arguments(tmp_path):
    from transformers import TrainingArguments

    import hf_zero
    from tests._training import make_model

    with pytest.raises(TypeError, match="ZeroTrainer needs ZeroTrainingArguments"):
        hf_zero.ZeroTrainer(model=make_model("llama"), args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True))


@pytest.mark.parametrize("resume_world, global_batch", [(2, 8), (1, 8), (3, 12)])
def test_interrupt_and_resume(pools, tmp_path, resume_world, global_batch):
    """Train 4 steps with a checkpoint every 2; separately stop right after checkpoint-2 and resume
    from it (a model initialized with another seed, on `resume_world` ranks): the logged losses of
    steps 3-4 equal the uninterrupted run's (bit for bit on the same world size, 1e-5 otherwise)."""
    base = tc.Job(kind="falcon", stage=3, world=2, global_batch=global_batch, save_steps=2)
    straight = pools(2).values(tc.run, replace(base, out_dir=str(tmp_path / "straight")))[0]
    interrupted = pools(2).values(tc.run, replace(base, out_dir=str(tmp_path / "run"), stop_after=2))[0]
    assert interrupted["losses"] == straight["losses"][:2]
    assert "checkpoint-2" in interrupted["checkpoints"]
    resumed_job = replace(base, world=resume_world, out_dir=str(tmp_path / "run"), seed=1,
                          resume_from=str(tmp_path / "run" / "checkpoint-2"))
    resumed = pools(resume_world).values(tc.run, resumed_job)[0]
    assert resumed["world"] == resume_world
    assert resumed["losses"][:2] == straight["losses"][:2]  # the log history restored from trainer_state.json
    if resume_world == 2:
        assert resumed["losses"][2:] == straight["losses"][2:]
    else:
        np.testing.assert_allclose(resumed["losses"][2:], straight["losses"][2:], rtol=TOL, atol=0)
    for name, value in straight["state"].items():
        assert rel_err(resumed["state"][name].numpy(), value.numpy()) <= TOL, name


def test_a_model_outlives_its_trainer(pools, tmp_path):
    """A model trained by one ZeroTrainer (to checkpoint-2), handed to a second ZeroTrainer that resumes from
    that checkpoint: the second attaches its own optimizer to the sharded model, and the run ends with the
    stock Trainer's weights for the same 4 steps (fp32, 1e-5)."""
    job = tc.Job(kind="llama", stage=3, world=2, save_steps=2, stop_after=2, out_dir=str(tmp_path / "out"))
    got = pools(2).values(tc.run_with_a_second_trainer, job)[0]
    ref = _reference(_ref_key(job))
    assert got["same_model"] and len(got["losses"]) == 4
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=TOL, atol=0)
    for name, value in ref["state"].items():
        assert rel_err(got["state"][name].numpy(), value.numpy()) <= TOL, name


def test_save_total_limit_rotates_sharded_checkpoints(pools, tmp_path):
    """`--save_total_limit 2` with a checkpoint every step: after 4 steps only checkpoint-3 and -4 are left,
    the older ones removed whole (their hf_zero/ shards included), and the last one is complete."""
    job = tc.Job(kind="llama", stage=2, world=2, out_dir=str(tmp_path / "out"), save_steps=1, save_total_limit=2)
    got = pools(2).values(tc.run, job)[0]
    assert [c for c in got["checkpoints"] if c.startswith("checkpoint-")] == ["checkpoint-3", "checkpoint-4"]
    assert not (tmp_path / "out" / "checkpoint-1").exists() and not (tmp_path / "out" / "checkpoint-2").exists()
    manifest = json.loads((tmp_path / "out" / "checkpoint-4" / "hf_zero" / "hf_zero_manifest.json").read_text())
    assert manifest["user"] == {"global_step": 4} and manifest["optimizer"]["class"] == "AdamW"
    assert (tmp_path / "out" / "checkpoint-4" / "scheduler.pt").is_file()
    assert not (tmp_path / "out" / "checkpoint-4" / "optimizer.pt").exists()


def test_save_model_writes_a_from_pretrained_directory(pools, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make_tokenizer(str(tmp_path / "tok"))
    job = tc.Job(kind="falcon", stage=3, world=2, out_dir=str(tmp_path / "out"),
                 save_model_to=str(tmp_path / "final"), tokenizer_dir=str(tmp_path / "tok"))
    got = pools(2).values(tc.run, job)[0]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    state = reloaded.state_dict()
    for name, value in got["state"].items():
        assert torch.equal(state[name], value), name
    assert AutoTokenizer.from_pretrained(tmp_path / "final").pad_token == "<pad>"
    assert (tmp_path / "final" / "training_args.bin").is_file()


def _weight_writers(folder) -> list[str]:
    from safetensors import safe_open

    writers = []
    for path in sorted(folder.glob("model*.safetensors")):
        with safe_open(str(path), "pt") as f:
            writers.append(f.metadata()["hf_zero_rank"])
    return sorted(writers)


def test_each_checkpoint_is_a_model_folder_that_from_pretrained_loads(pools, tmp_path):
    """Stage 3 on 2 ranks, a checkpoint every 2 of 4 steps: each checkpoint-N holds config.json,
    generation_config.json, the tokenizer, training_args.bin and weights written by both ranks, and
    `AutoModelForCausalLM.from_pretrained(checkpoint-N)` equals the model's state at step N exactly (taken by
    a callback at that save); the run resumes from such a checkpoint as before."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make_tokenizer(str(tmp_path / "tok"))
    job = tc.Job(kind="llama", stage=3, world=2, out_dir=str(tmp_path / "out"), save_steps=2,
                 tokenizer_dir=str(tmp_path / "tok"), snapshot_on_save=True)
    got = pools(2).values(tc.run, job)[0]
    assert sorted(got["snapshots"]) == [2, 4]
    for step, state in got["snapshots"].items():
        folder = tmp_path / "out" / f"checkpoint-{step}"
        for name in ("config.json", "generation_config.json", "training_args.bin", "tokenizer.json", "trainer_state.json"):
            assert (folder / name).is_file(), (step, name)
        assert _weight_writers(folder) == ["0", "1"]
        loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        assert set(loaded) == set(state)
        for name, value in state.items():
            assert torch.equal(loaded[name], value), (step, name)
        assert AutoTokenizer.from_pretrained(folder).pad_token == "<pad>"
    assert not torch.equal(got["snapshots"][2]["lm_head.weight"], got["snapshots"][4]["lm_head.weight"])
    resumed = pools(2).values(tc.run, replace(job, out_dir=str(tmp_path / "out"), seed=1, snapshot_on_save=False,
                                              resume_from=str(tmp_path / "out" / "checkpoint-2")))[0]
    assert resumed["losses"] == got["losses"]


def test_model_weights_off_and_best_model_loading(pools, tmp_path):
    """`--zero_save_model_weights false`: checkpoint-N holds the folder's side files and no weights. With weights
    on, `load_best_model_at_end` (the eval loss of this data rises: the best is an early step) ends with that
    checkpoint's weights, which its own model folder holds too: two paths that must agree exactly."""
    from transformers import AutoModelForCausalLM

    off = tc.Job(kind="llama", stage=3, world=2, out_dir=str(tmp_path / "off"), save_steps=2,
                 zero_args=(("zero_save_model_weights", False),))
    pools(2).values(tc.run, off)
    folder = tmp_path / "off" / "checkpoint-2"
    assert (folder / "config.json").is_file() and (folder / "training_args.bin").is_file()
    assert not list(folder.glob("model*.safetensors")) and (folder / "hf_zero").is_dir()
    best = tc.Job(kind="llama", stage=3, world=2, out_dir=str(tmp_path / "best"), save_steps=1, steps=3,
                  best_model=True)
    got = pools(2).values(tc.run, best)[0]
    assert got["best"] is not None and not got["best"].endswith("checkpoint-3")  # not the last step's weights
    loaded = AutoModelForCausalLM.from_pretrained(got["best"]).state_dict()
    for name, value in got["state"].items():
        assert torch.equal(loaded[name], value), name


# stage 2 in the slow tier: it shares stage 1's persistent parameters and stage 3's gradient shards; the suite keeps
# stage 1's out-of-memory in the forward and stage 3's at the step's end
@pytest.mark.parametrize("stage, oom", [pytest.param(1, "forward", marks=pytest.mark.slow),
                                        pytest.param(1, "step_end", marks=pytest.mark.slow),
                                        pytest.param(2, "forward", marks=pytest.mark.slow),
                                        pytest.param(2, "step_end", marks=pytest.mark.slow),
                                        pytest.param(3, "forward", marks=pytest.mark.slow), (3, "step_end")])
def test_auto_find_batch_size_halves_and_trains_as_the_stock_trainer(pools, tmp_path, stage, oom):
    """`--auto_find_batch_size` with an out-of-memory error at the first batch size, raised at the end of the first
    step (transformers' own test double) or inside a decoder layer's forward on the second micro-batch (a pass
    half done at stage 3: units gathered, gradients of the first micro-batch held). The Trainer halves the batch
    and starts again; the losses and final weights equal the stock Trainer's with the same error (fp32, 1e-5)."""
    job = tc.Job(kind="llama", stage=stage, world=2, out_dir=str(tmp_path / "out"), oom=oom)
    got = pools(2).values(tc.run, job)[0]
    ref = _reference(_ref_key(job))
    assert got["train_batch_size"] == ref["train_batch_size"] == job.micro_bs // 2
    _assert_close_to_reference(got, ref)
    attempts, order, units = got["attempts"]
    assert len(attempts) == 2
    if stage == 3:  # the retry starts with nothing gathered, and learns its prefetch order from a whole forward
        assert attempts[1]["gathered"] == 0 and order == units - 1, got["attempts"]
    if stage >= 2:
        assert attempts[1]["unsharded_grads"] == 0, got["attempts"]


# the slow tier (14 s on 2 cores): the batch size found and halving at stage 3 stay in the suite through the test above
@pytest.mark.slow
def test_auto_find_batch_size_resumes_with_the_batch_size_found(pools, tmp_path):
    """transformers' `test_auto_batch_size_with_resume_from_checkpoint` at stage 3 on 2 ranks: a new Trainer on the
    same (sharded) model starts at the configured batch size and takes the one found from the checkpoint; steps,
    logged losses and final weights as the stock Trainer's in this process (which, too, ends at step 3 of 2)."""
    job = tc.Job(kind="llama", stage=3, world=2, out_dir=str(tmp_path / "out"), steps=2, save_steps=1, oom="step_end")
    got = pools(2).values(tc.auto_batch_then_resume, job)[0]
    ref = tc.auto_batch_then_resume(replace(job, world=1, out_dir=str(tmp_path / "stock")), zero=False)
    assert (got["first"], got["before"], got["after"]) == (1, 2, 1)
    assert {k: got[k] for k in ("first", "before", "after", "steps")} == {k: ref[k] for k in ("first", "before", "after", "steps")}
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=TOL, atol=0)
    for name, value in ref["state"].items():
        assert rel_err(got["state"][name].numpy(), value.numpy()) <= TOL, name


OPTIM_CHOICES = {  # --optim: what it builds and the path it takes; whether its state is quantized
    "adafactor": ("transformers' Adafactor: factored second moments, whole parameters", False),
    "stable_adamw": ("optimi's StableAdamW: per-tensor update clipping and a step count in its groups", False),
    "schedule_free_adamw": ("schedulefree's AdamWScheduleFree: flat shards, train()/eval() move the weights", False),
    "adamw_torch_8bit": ("torchao's AdamW8bit: blockwise quantized state, whole parameters", True),
    "adamw_8bit": ("bitsandbytes' AdamW8bit: blockwise quantized state, embeddings in 32 bits", True),
    "galore_adamw": ("GaLore: low-rank projections of the matrices, whole parameters", False),
    "apollo_adamw": ("APOLLO: random projections seeded per parameter at construction", False),
    "adagrad": ("torch's Adagrad: flat shards, its accumulator set at construction", False),
}


@functools.lru_cache(maxsize=None)
def _quantization_noise(job: tc.Job) -> float:
    """How far the stock Trainer moves from itself when only the summation order changes (micro-batches of 1
    instead of 2, same global batch): the flips of quantized state that fp32 rounding causes."""
    a, b = _reference(job), _reference(replace(job, micro_bs=1))
    logged = max(abs(x - y) / abs(y) for k in ("losses", "norms", "eval_losses") for x, y in zip(a[k], b[k]))
    return max(logged, *(rel_err(a["state"][n].numpy(), b["state"][n].numpy()) for n in a["state"]))


# torchao's AdamW8bit compiles its kernels on first use (40 s on a 2-core machine): the slow tier; bitsandbytes'
# AdamW8bit keeps quantized state on whole parameters in the main tier
@pytest.mark.parametrize(
    "optim", [pytest.param(o, marks=pytest.mark.slow) if o == "adamw_torch_8bit" else o for o in OPTIM_CHOICES]
)
def test_optim_choices_at_stage_3_match_the_stock_trainer(pools, tmp_path, optim):
    """Every `--optim` whose package installs on a CPU machine, at `--zero_stage 3` on 2 processes, with an
    evaluation every 2 steps (schedule-free's eval() / train()): losses, norms, eval losses and weights as the stock
    Trainer's, within 1e-5; for quantized state within 10x the stock Trainer's own noise (`_quantization_noise`)."""
    targets = ("self_attn", "mlp") if optim.startswith(("galore", "apollo")) else None
    job = tc.Job(kind="llama", stage=3, world=2, out_dir=str(tmp_path / "out"), optim=optim, optim_target_modules=targets,
                 eval_steps=2)
    got = pools(2).values(tc.run, job)[0]
    ref = _reference(_ref_key(job))
    assert len(ref["eval_losses"]) == 3  # at steps 2 and 4, and the final evaluate()
    tol = max(TOL, 10 * _quantization_noise(_ref_key(job))) if OPTIM_CHOICES[optim][1] else TOL
    for key in ("losses", "norms", "eval_losses"):
        np.testing.assert_allclose(got[key], ref[key], rtol=tol, atol=0, err_msg=key)
    for name, value in ref["state"].items():
        assert rel_err(got["state"][name].numpy(), value.numpy()) <= tol, name
    if optim in ("adafactor", "stable_adamw"):  # and the stock Trainer under DDP on the same 2 processes
        ddp = pools(2).values(tc.run, replace(job, out_dir=str(tmp_path / "ddp")), False)[0]
        assert ddp["world"] == 2
        for key in ("losses", "norms", "eval_losses"):
            np.testing.assert_allclose(got[key], ddp[key], rtol=TOL, atol=0, err_msg=key)
        for name, value in ddp["state"].items():
            assert rel_err(got["state"][name].numpy(), value.numpy()) <= TOL, name


def test_zero_trainer_with_offload_dir_saves_and_resumes_like_in_memory(pools, tmp_path):
    """`--zero_offload_optimizer --zero_offload_dir DIR` through ZeroTrainingArguments: the Trainer's losses equal
    the in-memory run's, its periodic checkpoint streams the state from the offload files, and a run resumed
    from that checkpoint (into disk offload again, from another init) logs the same losses for steps 3-4."""
    disk = (("zero_offload_optimizer", True), ("zero_offload_dir", str(tmp_path / "offload")))
    base = tc.Job(kind="llama", stage=3, world=2, save_steps=2)
    memory = pools(2).values(tc.run, replace(base, out_dir=str(tmp_path / "memory"),
                                             zero_args=(("zero_offload_optimizer", True),)))[0]
    straight = pools(2).values(tc.run, replace(base, out_dir=str(tmp_path / "disk"), zero_args=disk))[0]
    assert straight["losses"] == memory["losses"]
    interrupted = pools(2).values(tc.run, replace(base, out_dir=str(tmp_path / "run"), zero_args=disk,
                                                  stop_after=2))[0]
    assert "checkpoint-2" in interrupted["checkpoints"]
    resumed = pools(2).values(tc.run, replace(base, out_dir=str(tmp_path / "run"), zero_args=disk, seed=1,
                                              resume_from=str(tmp_path / "run" / "checkpoint-2")))[0]
    assert resumed["losses"] == straight["losses"]
    for name, value in straight["state"].items():
        assert rel_err(resumed["state"][name].numpy(), value.numpy()) <= TOL, name


def test_resume_with_nothing_to_resume_from_says_what_the_stock_trainer_says(tmp_path):
    """`train(resume_from_checkpoint=True)` on an empty output directory: the stock Trainer's message, word for word."""
    import hf_zero
    from tests._trainer_cases import PointsDataset, scalar_model

    args = hf_zero.ZeroTrainingArguments(output_dir=str(tmp_path / "empty"), zero_stage=3, use_cpu=True, report_to="none",
                                         max_steps=1)
    trainer = hf_zero.ZeroTrainer(model=scalar_model(0), args=args, train_dataset=PointsDataset(8, seed=0))
    with pytest.raises(ValueError, match=r"^No valid checkpoint found in output directory \(.*empty\)$"):
        trainer.train(resume_from_checkpoint=True)



def test_async_save_in_the_trainer_resumes_exactly(pools, tmp_path):
    """`--zero_async_save` ([Note: asynchronous save]): a run stopped right after checkpoint-2 (written in the
    background, its snapshot bounded by `--zero_snapshot_budget`; train() returns once it is committed) resumes to
    the losses and weights of an uninterrupted run bit for bit; `--save_total_limit 1` with it is refused (it would
    delete the last complete checkpoint), and so is a budget without `--zero_async_save` or one that is no size."""
    base = tc.Job(kind="falcon", stage=3, world=2, global_batch=8, save_steps=2)
    straight = pools(2).values(tc.run, replace(base, out_dir=str(tmp_path / "straight")))[0]
    background = (("zero_async_save", True), ("zero_snapshot_budget", "3KB"))
    run = tmp_path / "run"
    job = replace(base, out_dir=str(run), stop_after=2, zero_args=background)
    ranks = pools(2).values(async_save_cases.trainer_run_recording_snapshots, job)
    interrupted = ranks[0]
    for rank in ranks:  # checkpoint-2: its sharded state (the budget bounding the host copy, the rest streamed)
        taken, weights = rank["snapshots"]  # and its model weights, both snapshotted for the save thread
        assert taken["budget"] == 3000 and taken["host_bytes"] <= 3000 and taken["live_bytes"] > 3000
        assert weights == {"weights": str(run / "checkpoint-2")}
    assert "checkpoint-2" in interrupted["checkpoints"]
    assert (run / "checkpoint-2" / "hf_zero" / "hf_zero_manifest.json").is_file()
    # the checkpoint's model weights, written in the background too, are the synchronous run's byte for byte
    weights = sorted(p.name for p in (tmp_path / "straight" / "checkpoint-2").glob("model*.safetensors*"))
    assert weights and weights == sorted(p.name for p in (run / "checkpoint-2").glob("model*.safetensors*"))
    for name in weights:
        sync_bytes = (tmp_path / "straight" / "checkpoint-2" / name).read_bytes()
        assert (run / "checkpoint-2" / name).read_bytes() == sync_bytes, name
    resumed = pools(2).values(tc.run, replace(base, out_dir=str(run), seed=1, zero_args=background,
                                              resume_from=str(run / "checkpoint-2")))[0]
    assert resumed["losses"] == straight["losses"]
    for name, value in straight["state"].items():
        np.testing.assert_array_equal(resumed["state"][name].numpy(), value.numpy(), err_msg=name)
    import hf_zero

    with pytest.raises(ValueError, match="--zero_async_save with --save_total_limit 1"):
        hf_zero.ZeroTrainingArguments(output_dir=str(tmp_path), zero_async_save=True, save_total_limit=1, use_cpu=True)
    with pytest.raises(ValueError, match="zero_snapshot_budget='1GB' bounds an asynchronous save's snapshot"):
        hf_zero.ZeroTrainingArguments(output_dir=str(tmp_path), zero_snapshot_budget="1GB", use_cpu=True)
    with pytest.raises(ValueError, match="zero_snapshot_budget must look like '5GB'"):
        hf_zero.ZeroPlugin(zero_async_save=True, zero_snapshot_budget="lots")


def test_weights_read_directly_after_training_at_world_size_one_stage_3(pools, tmp_path):
    """At world size 1 (a shard group of one) stage 3 has nothing to shard: `trainer.model.a` reads as with the stock
    Trainer after training (transformers' own Trainer tests do this), with the same values."""
    zero = pools(1).values(tc.read_weights_after_training, str(tmp_path / "zero"), True)[0]
    stock = pools(1).values(tc.read_weights_after_training, str(tmp_path / "stock"), False)[0]
    assert zero["a"] == pytest.approx(stock["a"], rel=TOL) and zero["b"] == pytest.approx(stock["b"], rel=TOL)
    assert zero["a"] != pytest.approx(0.5, rel=1e-3)  # it trained
