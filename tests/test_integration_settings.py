"""One source of truth for the settings: every ZeroConfig field through the Trainer arguments and the Accelerate
plugin, and the mixin keeping its host config's defaults."""

from __future__ import annotations

import pytest

import hf_zero

# A value other than the default for every ZeroConfig field (as the command line would spell it).
_NON_DEFAULT = {
    "stage": ("1", 1), "reduce_dtype": ("bf16", "bf16"), "wrap": ("LlamaDecoderLayer,LlamaMLP", ("LlamaDecoderLayer", "LlamaMLP")),
    "sync_module_states": (None, False), "broadcast_buffers": (None, False), "offload_optimizer": (None, True),
    "prefetch": ("2", 2), "bucket_size_mb": ("7.5", 7.5), "shard_group_size": ("1", 1), "collectives": ("native", "native"),
    "group_timeout_s": ("30", 30.0), "no_sync_keeps_grads": (None, True), "initial_loss_scale": ("1024", 1024.0),
    "loss_scale_window": ("10", 10), "quantization_block": ("64", 64), "sequence_parallel": ("2", 2),
    "tiled_mlp": (None, True),
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


def test_accelerates_parallelism_config_asks_for_sequence_parallelism(tmp_path):
    """[Note: sequence parallelism] `ParallelismConfig(sp_size=N)` or `cp_size=N`, given to the Trainer's arguments
    or to `ZeroAccelerator`, is hf_zero's `sequence_parallel=N`; what hf_zero does not do (tensor parallelism,
    replicas outside its hybrid sharding) or a size that contradicts --zero_sequence_parallel is
    refused, naming the setting to use (Accelerate itself refuses sp and cp together)."""
    from accelerate import ParallelismConfig

    from hf_zero.integrations.zero_fields import sequence_size

    args = hf_zero.ZeroTrainingArguments(output_dir=str(tmp_path), use_cpu=True, zero_stage=3,
                                         parallelism_config=ParallelismConfig(sp_size=2))
    assert args.to_zero_config().sequence_parallel == 2
    assert sequence_size(ParallelismConfig(cp_size=4), 1) == 4
    assert sequence_size(ParallelismConfig(sp_size=2), 2) == 2 and sequence_size(ParallelismConfig(), 2) == 2
    assert sequence_size(None, 2) == 2
    for config, requested, message in [
        (ParallelismConfig(tp_size=2), 1, "does not split layers by tensor parallelism"),
        (ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), 1, "--zero_hybrid_shard"),
        (ParallelismConfig(sp_size=4), 2, "asks for sequence parallelism 4 and zero_sequence_parallel is 2"),
    ]:
        with pytest.raises(ValueError, match=message):
            sequence_size(config, requested)
