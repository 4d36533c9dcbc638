"""The engine's contract beyond parity: memory accounting, errors, inference, tied weights, HF API."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import hf_zero
from tests import _engine_cases as engine_cases
from tests._training import VOCAB, Scenario, make_model, make_optimizer, rel_err, sharded_run


# ---- per-rank model-state bytes follow the ZeRO formula ----------------------------------------
def _formula(stage: int, psi: int, n: int, lookup: int = 0) -> dict[str, float]:
    """fp32 AdamW model-state bytes per rank (params, grads, optimizer state incl. master copies).

    4 bytes per fp32 value; Adam keeps two moments (8 bytes). Stage 1 keeps the unsharded gradient
    buffer (reused across steps) and a reduced fp32 gradient shard; in fp32 the master weights are
    the parameters themselves, so no extra copy. Stage 0 (plain DP) keeps a reduced gradient copy.
    The `lookup` parameters (the input embedding) have no unsharded gradient buffer: their
    gradient travels as rows ([Note: sparse lookup gradients]).
    """
    return {
        0: {"parameters": 4 * psi, "gradients": 8 * psi - 4 * lookup, "optimizer_states": 8 * psi},
        1: {"parameters": 4 * psi, "gradients": 4 * (psi - lookup) + 4 * psi / n, "optimizer_states": 8 * psi / n},
        2: {"parameters": 4 * psi, "gradients": 4 * psi / n, "optimizer_states": 8 * psi / n},
        3: {"parameters": 4 * psi / n, "gradients": 4 * psi / n, "optimizer_states": 8 * psi / n},
    }[stage]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_follow_zero_formula(pools, stage):
    """Within 3% of the formula plus padding (each unit is padded to a multiple of the world size)
    and AdamW's per-tensor `step` counters. Stage 3's total is 16Ψ/N."""
    world = 2
    sc = Scenario(model="llama", stage=stage, world=world, steps=1, accum=1)
    results = pools(world).values(sharded_run, sc)
    psi = results[0]["numel"]
    n_units = 3  # two decoder layers and the root
    slack = n_units * world * 4 * 4 + 64 * 8  # padding in 4 buffers, plus scalar step counters
    expected = _formula(stage, psi, world, lookup=VOCAB * 64)  # the 256 x 64 input embedding
    for r in results:
        mem = r["memory"]
        for category, want in expected.items():
            got = mem.__getattribute__(category)["cpu"]
            assert abs(got - want) <= 0.03 * want + slack, (stage, category, got, want)
    if stage == 3:
        total = results[0]["memory"].total("cpu")
        assert abs(total - 16 * psi / world) <= 0.03 * 16 * psi / world + slack


def test_memory_drops_with_stage(pools):
    totals = []
    for stage in (0, 1, 2, 3):
        sc = Scenario(model="llama", stage=stage, world=2, steps=1, accum=1)
        totals.append(pools(2).values(sharded_run, sc)[0]["memory"].total())
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4, totals


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
        ({"group_timeout_s": 0}, "ZeroConfig.group_timeout_s must be > 0 seconds"),
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


def test_models_without_blocks_get_predictable_units(caplog):
    """[Note: units without blocks]: one unit when the model fits one bucket, else one per child with
    parameters (through single-child wrappers), joined up to the bucket; the log says which."""
    from torch import nn

    from hf_zero.engine.wrap import find_units

    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with caplog.at_level("WARNING", logger="hf_zero"):
        units = find_units(seq, "auto", bucket_numel=1000)
    assert [u.name for u in units] == [""] and len(units[0].params) == 4
    assert "Sequential has no transformer blocks" in caplog.text and "one unit, the model itself" in caplog.text
    assert "ZeroConfig(wrap=[...])" in caplog.text
    units = find_units(seq, "auto", bucket_numel=0)
    assert [u.name for u in units] == ["0", "2", ""] and units[-1].params == ()

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))

    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_zero"):
        units = find_units(Wrapped(), "auto", bucket_numel=50)  # 40 + 72 + 18 parameters
    assert [u.name for u in units] == ["net.0-1", "net.2", ""]
    assert "a unit per child of net with parameters (net.0, net.1, net.2; consecutive" in caplog.text

    class Scalars(nn.Module):  # the upstream Trainer tests' kind of model: parameters on the root only
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Parameter(torch.tensor(0.5)), nn.Parameter(torch.tensor(0.1))

    units = find_units(Scalars(), "auto", bucket_numel=0)
    assert [u.name for u in units] == [""] and units[0].param_names == ("a", "b")


def test_argument_type_errors():
    model = make_model("llama")
    with pytest.raises(TypeError, match="expects an nn.Module as model"):
        hf_zero.initialize("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expects a ZeroConfig as config"):
        hf_zero.initialize(model, None, {"stage": 3})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expects a torch.optim.Optimizer"):
        hf_zero.initialize(model, [1, 2])  # type: ignore[arg-type]
    foreign = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="is not a parameter of the model"):
        hf_zero.initialize(model, foreign)


def test_optimizer_that_already_stepped_is_refused():
    model = make_model("llama")
    opt = make_optimizer(model, 1e-3)
    batch = torch.randint(0, 256, (1, 8))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    with pytest.raises(ValueError, match="already holds state"):
        hf_zero.initialize(model, opt)


def test_meta_model_is_refused():
    with torch.device("meta"):
        model = make_model("llama")
    with pytest.raises(ValueError, match="meta device"):
        hf_zero.initialize(model)


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


def test_bucket_size_groups_consecutive_blocks():
    """Blocks join until a unit holds `bucket_numel` parameters; the untied embedding and head stay
    units of their own, and every parameter still belongs to exactly one unit."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_zero.engine.wrap import find_units

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    names = lambda specs: [s.name for s in specs]  # noqa: E731
    assert names(find_units(model, "auto")) == [
        "model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3",
        "model.layers.4", "lm_head", ""]
    grouped = find_units(model, "auto", bucket_numel=2 * block)  # a unit closes once it holds >= 2 blocks
    assert names(grouped) == ["model.embed_tokens", "model.layers.0-1", "model.layers.2-3", "model.layers.4", "lm_head", ""]
    assert [len(s.all_modules) for s in grouped] == [1, 2, 2, 1, 1, 1]
    assert grouped[1].all_modules == (model.model.layers[0], model.model.layers[1])
    owned = [n for s in grouped for n in s.param_names]
    assert sorted(owned) == sorted(n for n, _ in model.named_parameters())
    assert not grouped[0].backward_reads_params and all(s.backward_reads_params for s in grouped[1:])
    assert names(find_units(model, "auto", bucket_numel=10**9)) == ["model.embed_tokens", "model.layers.0-4", "lm_head", ""]


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_shards_exist_only_from_backward_to_zero_grad(pools, stage):
    """[Note: gradient shard lifetime]: no gradient memory after initialize or after zero_grad (as
    with `set_to_none`); after each backward exactly this rank's fp32 shards (stage 2-3 free the
    unsharded gradients), kept through the step."""
    for r in pools(2).values(engine_cases.gradient_memory_over_steps, stage):
        assert r["initialized"] == r["zero_grad0"] == r["zero_grad1"] == 0, r
        assert r["backward0"] == r["step0"] == r["backward1"] == r["step1"] == r["shard_bytes"] > 0, r
        assert r["grads_bound_after_zero_grad"] == 0, r


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_embedding_gradient_travels_as_rows(pools, stage):
    """[Note: sparse lookup gradients]: with few tokens per rank the input embedding's gradient is
    exchanged as rows (no dense embedding-sized reduction), and its shard equals the dense gradient
    of an unsharded replica that ran every rank's batch (fp32, 1e-6 of the largest entry); the
    module's `sparse` switch is back off after the forward."""
    for r in pools(2).values(engine_cases.lookup_gradient_rows, stage, 24):
        assert r["sparse_lookup"] and r["paths"] == ["rows"], r
        assert r["max_abs_err"] <= 1e-6 * r["scale"], r
        assert r["sparse_after_forward"] is False, r


@pytest.mark.parametrize("world", [2, 3])
def test_embedding_gradient_falls_back_to_dense_on_every_rank(pools, world):
    """When the rows would outweigh the dense collective (many tokens per rank), or when one rank's
    forward bypassed the module and got a dense gradient, every rank takes the dense path (no rank
    is left in a different collective) and the shard still equals the reference. 3 ranks: shard
    boundaries cut through embedding rows."""
    many = pools(world).values(engine_cases.lookup_gradient_rows, 3, 200)
    bypass = pools(world).values(engine_cases.lookup_gradient_rows, 2, 24, 1)  # stage 2: the weight is whole
    few = pools(world).values(engine_cases.lookup_gradient_rows, 3, 24)
    for r in many + bypass:
        assert r["paths"] == ["dense"], r
        assert r["max_abs_err"] <= 1e-6 * r["scale"], r
    for r in few:
        assert r["paths"] == ["rows"] and r["max_abs_err"] <= 1e-6 * r["scale"], r


@pytest.mark.parametrize("stage", [1, 3])
def test_optimizer_chunks_step_and_checkpoint_like_whole_pieces(pools, tmp_path, stage):
    """[Note: optimizer chunks]: with chunks of 1000 elements the optimizer gets more tensors than
    there are pieces, and 3 steps of AdamW with clipping give the same weights as whole pieces
    (fp32, 1e-6 of the largest weight); checkpoints move between chunkings both ways, and the
    step after the resume agrees with the run that never stopped."""
    for r in pools(2).values(engine_cases.optimizer_chunks, stage, 1000, str(tmp_path)):
        assert r["chunks"] > r["pieces"], r
        assert r["weights_err"] <= 1e-6 * r["scale"], r
        assert r["resumed_err"] <= 1e-6 * r["scale"], r


# A value other than the default for every ZeroConfig field (as the command line would spell it).
_NON_DEFAULT = {
    "stage": ("1", 1), "reduce_dtype": ("bf16", "bf16"), "wrap": ("LlamaDecoderLayer,LlamaMLP", ("LlamaDecoderLayer", "LlamaMLP")),
    "sync_module_states": (None, False), "broadcast_buffers": (None, False), "offload_optimizer": (None, True),
    "prefetch": ("2", 2), "bucket_size_mb": ("7.5", 7.5), "shard_group_size": ("1", 1), "collectives": ("native", "native"),
    "group_timeout_s": ("30", 30.0), "no_sync_keeps_grads": (None, True), "initial_loss_scale": ("1024", 1024.0),
    "loss_scale_window": ("10", 10), "quantization_block": ("64", 64),
}
_NON_DEFAULT_STAGE3 = {"offload_optimizer": (None, True), "offload_params": (None, True),  # need stage 3
                       "offload_dir": ("/nvme/offload", "/nvme/offload"),
                       "quantized_weights": (None, True), "quantized_gradients": (None, True)}


def test_every_zero_config_field_reaches_the_engine_from_both_integrations(tmp_path):
    """[Note: one source of truth] every ZeroConfig field but the host-owned precision is `--zero_<field>` and
    `ZeroPlugin(zero_<field>=...)`, with ZeroConfig's default and help, and a non-default value reaches the
    ZeroConfig through each. A field added to ZeroConfig without a value here fails this test."""
    import dataclasses

    from transformers import HfArgumentParser

    fields = {f.name: f for f in dataclasses.fields(hf_zero.ZeroConfig)}
    exposed = {name for name, f in fields.items() if not f.metadata.get("host_owned")}
    assert exposed == set(_NON_DEFAULT) | set(_NON_DEFAULT_STAGE3), exposed ^ (set(_NON_DEFAULT) | set(_NON_DEFAULT_STAGE3))
    args_fields = {f.name: f for f in dataclasses.fields(hf_zero.ZeroTrainingArguments)}
    plugin_fields = {f.name: f for f in dataclasses.fields(hf_zero.ZeroPlugin)}
    for name in exposed:
        for where in (args_fields, plugin_fields):
            f = where["zero_" + name]
            assert f.default == fields[name].default and f.metadata["help"] == fields[name].metadata["help"], name
    assert "zero_mixed_precision" not in args_fields and "zero_mixed_precision" not in plugin_fields
    for values in (_NON_DEFAULT, _NON_DEFAULT_STAGE3):
        argv = ["--output_dir", str(tmp_path), "--use_cpu"]
        for name, (cli, _) in values.items():
            flag = "--zero_" + name
            if cli is None:  # a boolean: the bare flag for True, the --no_ form against a True default
                argv.append(flag if not fields[name].default else "--no_zero_" + name)
            else:
                argv += [flag, cli]
        (args,) = HfArgumentParser(hf_zero.ZeroTrainingArguments).parse_args_into_dataclasses(argv)
        from_cli = args.to_zero_config()
        from_plugin = hf_zero.ZeroPlugin(**{"zero_" + n: v for n, (_, v) in values.items()}).to_zero_config("no")
        for name, (_, value) in values.items():
            assert value != fields[name].default, name  # the round trip proves something
            assert getattr(from_cli, name) == value and getattr(from_plugin, name) == value, name


@pytest.mark.parametrize("host", ["trl.SFTConfig", "trl.DPOConfig", "transformers.Seq2SeqTrainingArguments"])
def test_zero_arguments_mixin_keeps_the_host_configs_defaults(host):
    """`class C(hf_zero.ZeroArgumentsMixin, HostConfig)` has every --zero_* field and every field of the host
    config with the host's default (TRL turns bf16 on and sets its own learning rates)."""
    import dataclasses
    import importlib

    module, name = host.rsplit(".", 1)
    pytest.importorskip(module)
    base = getattr(importlib.import_module(module), name)
    composed = dataclasses.make_dataclass("Composed", [], bases=(hf_zero.ZeroArgumentsMixin, base))
    a, b = composed(output_dir="/tmp/hf_zero-args", use_cpu=True), base(output_dir="/tmp/hf_zero-args", use_cpu=True)
    for f in dataclasses.fields(base):
        if f.init:
            assert getattr(a, f.name) == getattr(b, f.name), f.name
    assert a.zero_stage == hf_zero.ZeroConfig().stage and a.to_zero_config().mixed_precision == ("bf16" if b.bf16 else "no")


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
    from hf_zero.checkpoint import AsyncSave, wait_for_saves
    from hf_zero.engine import ModelStateMemory, ShardedOptimizer

    assert len(hf_zero.__all__) <= 20 and all(hasattr(hf_zero, n) for n in hf_zero.__all__ if not n.startswith("Zero"))
    assert (hf_zero.types.AsyncSave, hf_zero.types.ModelStateMemory, hf_zero.types.ShardedOptimizer) == (
        AsyncSave, ModelStateMemory, ShardedOptimizer)
    moved = {"attach_optimizer": ("hf_zero.initialize(model, optimizer)", None), "wait_for_saves": ("handle.wait()",
             wait_for_saves), "AsyncSave": ("hf_zero.types.AsyncSave", AsyncSave),
             "ShardedOptimizer": ("hf_zero.types.ShardedOptimizer", ShardedOptimizer)}
    for name, (replacement, obj) in moved.items():
        assert name not in hf_zero.__all__
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = getattr(hf_zero, name)
        assert [w.category for w in caught] == [FutureWarning] and replacement in str(caught[0].message)
        assert obj is None or value is obj
