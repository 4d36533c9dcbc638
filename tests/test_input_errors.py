"""Mistakes in what a user passes: clear errors naming the fix, raised on every rank, never a hang."""

from __future__ import annotations

import pytest
import torch

import hf_zero
from tests import _engine_cases as engine_cases
from tests._training import make_model, make_optimizer


# ---- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"stage": 5}, "ZeroConfig.stage must be 0, 1, 2 or 3"),
        ({"stage": True}, "ZeroConfig.stage must be 0, 1, 2 or 3"),
        ({"stage": "3"}, "ZeroConfig.stage must be 0, 1, 2 or 3"),
        ({"mixed_precision": "fp8"}, "ZeroConfig.mixed_precision must be 'no', 'bf16' or 'fp16'; got 'fp8'"),
        ({"reduce_dtype": "int8"}, "ZeroConfig.reduce_dtype must be None, 'fp32', 'bf16' or 'fp16'"),
        ({"wrap": "LlamaDecoderLayer"}, "Write wrap=['LlamaDecoderLayer'] to name one class"),
        ({"wrap": []}, "ZeroConfig.wrap must be 'auto' or a non-empty list of module class names"),
        ({"sync_module_states": "yes"}, "ZeroConfig.sync_module_states must be a bool"),
        ({"initial_loss_scale": 0}, "ZeroConfig.initial_loss_scale must be > 0"),
        ({"loss_scale_window": 0}, "ZeroConfig.loss_scale_window must be an int >= 1"),
        ({"offload_optimizer": "yes"}, "ZeroConfig.offload_optimizer must be a bool"),
        ({"offload_params": True, "offload_optimizer": True, "stage": 2}, "ZeroConfig.offload_params needs stage=3"),
        ({"offload_params": True}, "ZeroConfig.offload_params needs stage=3 and offload_optimizer=True"),
        ({"shard_group_size": -2}, "ZeroConfig.shard_group_size must be None or a positive int"),
        ({"group_timeout_s": 0}, "ZeroConfig.group_timeout_s must be None or > 0 seconds"),
        ({"prefetch": -1}, "ZeroConfig.prefetch must be an int >= 0"),
        ({"bucket_size_mb": -1}, "ZeroConfig.bucket_size_mb must be a number >= 0"),
        ({"bucket_size_mb": "25"}, "ZeroConfig.bucket_size_mb must be a number >= 0"),
        ({"collectives": "ring"}, "ZeroConfig.collectives must be 'auto', 'native' or 'composed'; got 'ring'"),
    ],
)
def test_bad_config_raises_clear_error(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[").replace("(", r"\(")):
        hf_zero.ZeroConfig(**kwargs)


def test_zero_plugin_validates_with_the_config_messages():
    with pytest.raises(ValueError, match="ZeroConfig.stage must be 0, 1, 2 or 3"):
        hf_zero.ZeroPlugin(zero_stage=7)
    with pytest.raises(ValueError, match="ZeroConfig.offload_params needs stage=3"):
        hf_zero.ZeroPlugin(zero_stage=1, zero_offload_params=True)
    with pytest.raises(ValueError, match="ZeroConfig.collectives must be"):
        hf_zero.ZeroPlugin(zero_collectives="tree")
    plugin = hf_zero.ZeroPlugin(zero_bucket_size_mb=25, zero_collectives="native")
    assert (plugin.to_zero_config("no").bucket_size_mb, plugin.to_zero_config("no").collectives) == (25, "native")
    with pytest.raises(TypeError, match="zero_plugin must be a ZeroPlugin"):
        hf_zero.ZeroAccelerator(zero_plugin={"zero_stage": 3})


def test_cli_size_arguments_are_checked():
    from hf_zero.checkpoint.writer import parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    for bad in ("lots", "-5GB", "0", "5XB"):
        with pytest.raises(ValueError, match="max_shard_size must"):
            parse_size(bad)


def test_config_is_frozen():
    config = hf_zero.ZeroConfig(stage=2)
    with pytest.raises(Exception, match="cannot assign"):
        config.stage = 3  # type: ignore[misc]


def test_bad_config_raises_on_every_rank(pools):
    errors = pools(2).values(engine_cases.config_error, {"stage": 5})
    assert all(e.startswith("ValueError: ZeroConfig.stage must be 0, 1, 2 or 3") for e in errors), errors


def test_unknown_wrap_class_lists_candidates_on_every_rank(pools):
    results = pools(2).run(engine_cases.initialize_with_wrap, [["NoSuchLayer"], ["NoSuchLayer"]])
    for r in results:
        assert r.error_type == "ValueError", r.traceback
        assert "ZeroConfig.wrap names ['NoSuchLayer']" in r.error
        assert "LlamaDecoderLayer" in r.error  # the candidates it does have


def test_error_on_one_rank_raises_on_all_without_hanging(pools):
    """Rank 1 alone passes a bad wrap: rank 1 raises its ValueError, rank 0 a ValueError naming rank 1
    and carrying its cause, both within seconds, and the process group stays usable (the case ends
    with a barrier)."""
    results = pools(2).run(engine_cases.initialize_with_wrap, ["auto", ["NoSuchLayer"]], timeout=60)
    assert results[1].error_type == "ValueError" and "NoSuchLayer" in results[1].error
    assert results[0].error_type == "ValueError" and "failed on rank(s) [1]" in results[0].error
    assert "ZeroConfig.wrap names ['NoSuchLayer']" in results[0].error


@pytest.mark.parametrize(("change", "stage", "first"), [
    ("resize", 3, "entry 0 is 'model.embed_tokens.weight [256, 64] torch.float32 grad' here and "
                  "'model.embed_tokens.weight [264, 64] torch.float32 grad' there"),
    ("freeze", 1, "entry 1 is 'model.layers.0.self_attn.q_proj.weight [64, 64] torch.float32 grad' here and "
                  "'model.layers.0.self_attn.q_proj.weight [64, 64] torch.float32' there"),
    ("config", 3, "rank 0 has 23 parameters and buffers, rank 1 14; entry 10 is "
                  "'model.layers.1.self_attn.q_proj.weight [64, 64] torch.float32 grad' here and 'model.norm.weight"),
])
def test_a_model_that_differs_between_ranks_is_refused_on_every_rank(pools, change, stage, first):
    """[Note: the same model on every rank] Rank 1 alone resized the embeddings (a main process that added tokens),
    froze a layer, or built one layer fewer: the ranks would exchange pieces of other sizes (before, a crash in
    gloo's transport or a hang). Every rank raises a ValueError at initialize, within seconds, naming the first
    entry that differs and both ranks' counts, as DDP refuses such models; the process group stays usable."""
    results = pools(2).run(engine_cases.initialize_a_model_changed_on_rank_1, change, stage, timeout=60)
    for r in results:
        assert r.error_type == "ValueError", r.traceback
        assert "the model differs between ranks" in r.error and "Every rank must build the same model" in r.error
    assert first in results[0].error, results[0].error
    assert results[1].error.startswith("[rank 1]") and "rank 0" in results[1].error


@pytest.mark.parametrize(("rank_1", "here", "there"), [
    ({"stage": 2}, "stage=3 here", "stage=2 on rank 1"),
    ({"stage": 3, "mixed_precision": "bf16"}, "mixed_precision='no' here", "mixed_precision='bf16' on rank 1"),
    ({"stage": 3, "prefetch": 2}, "prefetch=1 here", "prefetch=2 on rank 1"),
])
def test_a_config_that_differs_between_ranks_is_refused_on_every_rank(pools, rank_1, here, there):
    """[Note: the same model on every rank] Another stage, precision or prefetch depth on one rank (a node launched
    with another accelerate config file) issues other collectives: before, a hang. Every rank raises a ValueError at
    initialize naming the setting, its value on each side and the rank."""
    results = pools(2).run(engine_cases.train_with_a_config_per_rank, [{"stage": 3}, rank_1], timeout=60)
    for r in results:
        assert r.error_type == "ValueError" and "the ZeroConfig differs between ranks" in r.error, r.traceback
    assert here in results[0].error and there in results[0].error, results[0].error


def test_offload_dirs_may_differ_between_ranks(pools, tmp_path):
    """A node-local offload directory may have another path on each rank (only whether there is one must agree):
    the same losses as one directory shared by both."""
    per_rank = [{"stage": 3, "offload_optimizer": True, "offload_dir": str(tmp_path / f"rank{r}")} for r in range(2)]
    shared = [{"stage": 3, "offload_optimizer": True, "offload_dir": str(tmp_path / "shared")}] * 2
    assert pools(2).values(engine_cases.train_with_a_config_per_rank, per_rank) == pools(2).values(
        engine_cases.train_with_a_config_per_rank, shared)
    none = [{"stage": 3, "offload_optimizer": True}, per_rank[1]]
    results = pools(2).run(engine_cases.train_with_a_config_per_rank, none, timeout=60)
    assert all(r.error_type == "ValueError" and "the ZeroConfig differs between ranks" in r.error for r in results)
    assert "offload_dir set: False here, offload_dir set: True on rank 1" in results[0].error


@pytest.mark.parametrize("broken", ["missing", "no_weights", "no_config"])
def test_from_pretrained_with_the_directory_broken_on_one_rank_raises_on_every_rank(pools, tmp_path, broken):
    """[Note: agreed load] A multi-node job whose model directory is missing or incomplete on one node (a local
    path, copied to the first node only): the ranks there raise their error, and the others the same type naming the
    rank, within seconds; before, they waited in the next collective until the process group's timeout."""
    import shutil

    from tests._training import make_model as build

    good, bad = tmp_path / "good", tmp_path / "bad"
    build("llama").save_pretrained(good)
    if broken != "missing":
        shutil.copytree(good, bad)
        (bad / ("model.safetensors" if broken == "no_weights" else "config.json")).unlink()
    results = pools(2).run(engine_cases.from_pretrained_with_a_directory_per_rank, [str(good), str(bad)], timeout=60)
    kind = "ValueError" if broken == "no_config" else "FileNotFoundError"
    assert results[1].error_type == results[0].error_type == kind, (results[0].traceback, results[1].traceback)
    assert "hf_zero.from_pretrained failed on rank(s) [1]" in results[0].error
    assert str(bad) in results[0].error and str(bad) in results[1].error


@pytest.mark.parametrize("stage", [1, 3])
def test_from_pretrained_with_a_read_failing_on_one_rank_raises_on_every_rank(pools, tmp_path, stage):
    """[Note: read errors] An I/O error on rank 1's third read of the weights, amid the engine's construction (at
    stage 1 each unit's shards are then all-gathered): rank 1 raises its OSError and rank 0 an OSError naming rank 1,
    within seconds, once the engine is built; before, rank 0 waited for rank 1 in the next collective."""
    from tests._training import make_model as build

    build("llama").save_pretrained(tmp_path / "model")
    results = pools(2).run(engine_cases.from_pretrained_with_a_read_failing_on_rank_1, str(tmp_path / "model"), stage,
                           timeout=60)
    assert results[1].error_type == "OSError" and "Input/output error (injected)" in results[1].error
    assert results[0].error_type == "OSError", results[0].traceback
    assert "failed on rank(s) [1]" in results[0].error and "Input/output error (injected)" in results[0].error


def test_a_quantized_checkpoint_is_refused_on_every_rank_not_read_as_weights(pools, tmp_path):
    """An FP8 checkpoint (DeepSeek-V3's and Qwen3-FP8's kind: `quantization_config` in config.json, each matrix in
    float8 beside its `weight_scale_inv`): transformers dequantizes it on load; hf_zero read the fp8 codes as the
    weights (q_proj's largest value 448 where the model's is 0.08), silently. Now refused on every rank, naming the
    way (transformers' from_pretrained, then initialize), by `from_pretrained` and by `initialize(weights_from=)`."""
    import json

    from safetensors.torch import load_file, save_file

    from tests._training import make_model as build

    model_dir = tmp_path / "fp8"
    build("llama").save_pretrained(model_dir)
    stored = {}
    for name, value in load_file(model_dir / "model.safetensors").items():
        if name.endswith("proj.weight"):
            scale = value.abs().max() / 448.0
            stored[name] = (value / scale).to(torch.float8_e4m3fn)
            stored[name.removesuffix("weight") + "weight_scale_inv"] = scale.reshape(1, 1)
        else:
            stored[name] = value
    save_file(stored, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (model_dir / "config.json").write_text(json.dumps(config))
    results = pools(2).run(engine_cases.from_pretrained_with_a_directory_per_rank, [str(model_dir)] * 2, timeout=60)
    for r in results:
        assert r.error_type == "ValueError" and "holds quantized weights" in r.error, r.traceback
        assert "quant_method 'fp8'" in r.error and "transformers' from_pretrained" in r.error
    with pytest.raises(ValueError, match="holds quantized weights"):
        hf_zero.initialize(build("llama"), None, hf_zero.ZeroConfig(stage=3), weights_from=model_dir)


def test_hf_zeros_groups_wait_as_long_as_the_default_group_unless_told():
    """By default the groups hf_zero creates (hybrid sharding's, background saves') take the default process group's
    timeout, which the launcher set (the Trainer's --ddp_timeout): before, 600 s whatever it was, so a job that
    raised --ddp_timeout for a long pause on one rank still failed after 10 minutes on a hybrid group. The pool's
    default group waits 60 s; `group_timeout_s` still sets them."""
    from tests._dist import DistPool

    pool = DistPool(2)
    try:
        assert pool.values(engine_cases.group_timeouts, {}) == [[60.0] * 4] * 2
        told = pool.values(engine_cases.group_timeouts, {"group_timeout_s": 123.0})
        assert [t[:3] for t in told] == [[60.0, 123.0, 123.0]] * 2  # (the save group is made once per process)
    finally:
        pool.close()


def test_from_pretrained_of_different_weights_on_each_rank_is_refused_on_every_rank(pools, tmp_path):
    """[Note: the same model on every rank] A node whose copy at the model path holds another checkpoint of the
    same architecture (same shapes, other values): each rank filled its shards from its own copy, a model mixed from
    both, silently (DDP broadcasts rank 0's weights). Now every rank raises a ValueError naming both directories; a
    byte-identical copy at another path loads."""
    import shutil

    from tests._training import make_model as build

    build("llama", seed=0).save_pretrained(tmp_path / "a")
    build("llama", seed=1).save_pretrained(tmp_path / "b")
    shutil.copytree(tmp_path / "a", tmp_path / "a_copy")
    same = pools(2).run(engine_cases.from_pretrained_with_a_directory_per_rank, [str(tmp_path / "a"),
                                                                                 str(tmp_path / "a_copy")])
    assert all(r.ok for r in same), [r.traceback for r in same]
    results = pools(2).run(engine_cases.from_pretrained_with_a_directory_per_rank, [str(tmp_path / "a"),
                                                                                    str(tmp_path / "b")], timeout=60)
    for r in results:
        assert r.error_type == "ValueError" and "hold different weight files" in r.error, r.traceback
    assert f"({tmp_path / 'a'} here, {tmp_path / 'b'} on rank 1)" in results[0].error, results[0].error


def test_argument_type_errors():
    model = make_model("llama")
    with pytest.raises(TypeError, match="expects an nn.Module as model"):
        hf_zero.initialize("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expects a ZeroConfig as config"):
        hf_zero.initialize(model, None, {"stage": 3})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expects a torch.optim.Optimizer"):
        hf_zero.initialize(model, [1, 2])  # type: ignore[arg-type]
    foreign = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="is not a parameter of the model") as caught:
        hf_zero.initialize(model, foreign)
    assert "make it a submodule of the model before hf_zero.initialize" in str(caught.value)


def test_save_pretrained_arguments_it_cannot_honour_are_refused(tmp_path):
    """A sharded model's `save_pretrained` writes safetensors named model*.safetensors: a `variant` (it wrote
    model.safetensors over the directory's main weights, silently), `safe_serialization=False` and `push_to_hub`
    are refused, and nothing is written."""
    model, _ = hf_zero.initialize(make_model("llama"), None, hf_zero.ZeroConfig(stage=3))
    with pytest.raises(ValueError, match="variant='fp16' is not supported"):
        model.save_pretrained(tmp_path / "a", variant="fp16")
    with pytest.raises(ValueError, match="writes safetensors locally"):
        model.save_pretrained(tmp_path / "b", safe_serialization=False)
    with pytest.raises(ValueError, match="writes safetensors locally"):
        model.save_pretrained(tmp_path / "c", push_to_hub=True)
    assert not any(tmp_path.iterdir())


def test_optimizer_that_already_stepped_is_refused():
    model = make_model("llama")
    opt = make_optimizer(model, 1e-3)
    batch = torch.randint(0, 256, (1, 8))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    with pytest.raises(ValueError, match="already holds state"):
        hf_zero.initialize(model, opt)


def test_an_integer_parameter_is_kept_byte_for_byte():
    """A parameter in an integer dtype (packed codes; it can take no gradient) shards in a part of its own dtype
    ([Note: parameters kept in their own dtype]): never cast, gathered whole at stage 3 for its unit's forward,
    and back as it went in."""
    model = make_model("llama")
    codes = torch.arange(7, dtype=torch.int32) * 1000003
    model.model.layers[1].mlp.register_parameter("codes", torch.nn.Parameter(codes.clone(), requires_grad=False))
    seen = []
    model.model.layers[1].mlp.register_forward_pre_hook(lambda m, a: seen.append(m.codes.detach().clone()))
    model, _ = hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=3, mixed_precision="bf16"))
    batch = torch.randint(0, 256, (1, 8))
    model(input_ids=batch, labels=batch).loss.backward()
    assert len(seen) == 1 and seen[0].dtype == torch.int32 and torch.equal(seen[0], codes)
    assert torch.equal(hf_zero.full_state_dict(model)["model.layers.1.mlp.codes"], codes)


def test_meta_model_is_refused():
    with torch.device("meta"):
        model = make_model("llama")
    with pytest.raises(ValueError, match="meta device"):
        hf_zero.initialize(model)


def test_pickling_or_copying_a_sharded_model_is_refused_naming_what_to_save():
    """`torch.save(model)`, `copy.copy` and `copy.deepcopy` of a sharded model raise a TypeError that says what to do
    (unrefused: a pickling error about the process group, or an empty parameter at stage 3); the model still trains
    and its state dict still saves."""
    import copy
    import io

    model, optimizer = hf_zero.initialize(make_model("llama"), None, hf_zero.ZeroConfig(stage=3))
    with pytest.raises(TypeError, match=r"pickling a sharded model .* model.save_pretrained\(dir\)"):
        torch.save(model, io.BytesIO())
    with pytest.raises(TypeError, match="pickling a sharded model"):
        copy.copy(model)
    with pytest.raises(TypeError, match=r"copy.deepcopy of a sharded model .* before hf_zero.initialize"):
        copy.deepcopy(model)
    batch = torch.randint(0, 256, (1, 8))
    model(input_ids=batch, labels=batch).loss.backward()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    assert buffer.tell() > 0


@pytest.mark.parametrize("stage", [1, 2])
def test_replacing_a_parameters_data_is_refused_at_the_next_forward_on_every_rank(pools, stage):
    """[Note: replaced data] `param.data = tensor` after initialize (weight surgery written for a plain module) left the
    module computing with the new tensor while the steps updated the flat buffer: weights 0.93 relative off DDP's
    after one more step, silently. Now the next forward refuses it on every rank, naming the in-place way."""
    for error in pools(2).values(engine_cases.replaced_param_data, stage):
        assert "parameter 'head.weight' had its `.data` replaced" in error and "param.copy_(tensor)" in error, error


def test_a_change_in_forward_refused_after_a_step_still_names_the_parameter(pools):
    """[Note: changed in forward] a forward with grad that changed a weight in place, an optimizer step, then the
    backward: refused on every rank at the backward, naming the parameter (the step forgot what the forward had
    changed, so the refusal named "(on another rank)" on the rank that changed it too)."""
    for error in pools(2).values(engine_cases.changed_in_forward_then_step):
        assert "the forward changed parameters ['inp.weight'] in place" in error, error


@pytest.mark.parametrize(
    ("kind", "where"),
    [("ddp", "the model is a DistributedDataParallel"), ("data_parallel", "the model is a DataParallel"),
     ("inner", "the model at 'blocks.1' is a DistributedDataParallel")],
)
def test_a_model_inside_ddp_is_refused_at_initialize_on_every_rank(pools, kind, where):
    """[Note: DDP around a sharded model] `model = DDP(model)` kept above `hf_zero.initialize`: DDP's reducer would
    average the gradients a second time (it failed at the second step with DDP's message about unused
    parameters). Refused by `initialize` on every rank, naming the wrapper, where it is, and `wrapper.module`."""
    for error in pools(2).values(engine_cases.parallel_wrapper_before_initialize, kind):
        assert where in error and "wrapper.module" in error, error


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_replacing_a_parameters_data_inside_gathered_parameters_is_refused_on_every_rank(pools, stage):
    """[Note: replaced data] `param.data = tensor` on the modifier rank inside `gathered_parameters` was dropped at
    stage 3 without a word (the write-back reads the gathered buffer). Now every rank raises on leaving the block,
    the weights as they were and the parameter pointing at the engine's buffer again: the next step trains as if
    the block had not run."""
    for r in pools(2).values(engine_cases.replaced_data_in_gathered_parameters, stage):
        assert "parameter 'head.weight' had its `.data` replaced" in r["error"], r
        assert "param.copy_(tensor)" in r["error"]
        assert r["unchanged"], r
        assert r["losses"][0] == r["losses"][1], r


@pytest.mark.parametrize(("stage", "keeps_grads"), [(0, False), (1, False), (2, True), (3, True)])
def test_grad_read_between_no_sync_micro_batches_is_refused_by_name(pools, stage, keeps_grads):
    """[Note: resting gradients] where no_sync defers the reduction (stages 0-1, `no_sync_keeps_grads`), `.grad` after
    the backward was None: DDP code's `if p.grad is not None` guard logged 0. It is the stand-in now, refusing by
    name, and the accumulation trains exactly as without the read."""
    for r in pools(2).values(engine_cases.grad_under_no_sync, stage, keeps_grads):
        assert "'head.weight'.grad of a model sharded by hf_zero" in r["seen"] and "under no_sync" in r["seen"], r
        assert r["losses"][0] == r["losses"][1], r


def test_ddps_attribute_is_refused_to_ddp_only():
    """[Note: DDP around a sharded model] the attribute DDP's constructor reads is refused there only: for any
    other reader (`inspect.getmembers`, `hasattr`) it is absent, or what was set (TRL's DPO script sets it)."""
    import inspect

    from tests._peer_harness import Net

    model, _ = hf_zero.initialize(Net(), None, hf_zero.ZeroConfig(stage=1, wrap=["Block"]))
    assert not hasattr(model, "_ddp_params_and_buffers_to_ignore")
    assert len(inspect.getmembers(model)) > 0
    model._ddp_params_and_buffers_to_ignore = ["memory"]
    assert model._ddp_params_and_buffers_to_ignore == ["memory"]
