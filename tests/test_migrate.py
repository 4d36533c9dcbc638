"""`hf-zero from-deepspeed`: DeepSpeed configs (as transformers' DeepSpeed docs write them: ZeRO-2, ZeRO-3 with CPU
offload, ZeRO-3 with NVMe offload) and Accelerate's FSDP plugin settings, translated into hf_zero's flags. The printed
flags parse into the ZeroConfig the translation names; keys without a counterpart are named with why."""

from __future__ import annotations

import json
import shlex

import pytest
from transformers import HfArgumentParser

import hf_zero
from hf_zero.migrate import from_deepspeed, from_fsdp
from tests._cli import run_cli

AUTO = "auto"
ZERO2 = {
    "fp16": {"enabled": AUTO, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": AUTO, "warmup_max_lr": AUTO,
                                                 "warmup_num_steps": AUTO}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": AUTO, "gradient_clipping": AUTO, "train_batch_size": AUTO,
    "train_micro_batch_size_per_gpu": AUTO,
}
ZERO3 = {
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 100, "total_num_steps": AUTO}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": AUTO,
                          "stage3_prefetch_bucket_size": AUTO, "stage3_param_persistence_threshold": AUTO,
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "steps_per_print": 2000,
    "train_batch_size": AUTO, "train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": False,
}
ZERO3_NVME = {**ZERO3, "zero_optimization": {
    **ZERO3["zero_optimization"],
    "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 4},
    "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5,
                      "buffer_size": 1e8, "max_in_cpu": 1e9}}}

# key -> what the table says it maps to (a piece of it)
EXPECTED = {
    "zero2": ({"stage": 2, "offload_optimizer": True, "initial_loss_scale": 65536.0, "loss_scale_window": 1000},
              {"zero_optimization.reduce_bucket_size": "no byte size", "fp16.enabled": "the Trainer's own --fp16",
               "optimizer.type": "--optim adamw_torch", "zero_optimization.overlap_comm": "always on"}),
    "zero3": ({"stage": 3, "offload_optimizer": True, "offload_params": True, "mixed_precision": "bf16"},
              {"optimizer.params.betas": "--adam_beta1 0.9, --adam_beta2 0.95", "gradient_clipping": "--max_grad_norm 1.0",
               "scheduler.type": "--lr_scheduler_type linear", "train_micro_batch_size_per_gpu":
               "--per_device_train_batch_size 2", "zero_optimization.stage3_gather_16bit_weights_on_model_save":
               "--zero_save_model_weights true", "zero_optimization.stage3_max_live_parameters": "no counterpart"}),
    "zero3_nvme": ({"stage": 3, "offload_optimizer": True, "offload_params": True, "offload_dir": "/local_nvme",
                    "mixed_precision": "bf16"},
                   {"zero_optimization.offload_param.max_in_cpu": "no setting",
                    "zero_optimization.offload_optimizer": "--zero_offload_dir /local_nvme"}),
}


@pytest.mark.parametrize("name, ds", [("zero2", ZERO2), ("zero3", ZERO3), ("zero3_nvme", ZERO3_NVME)])
def test_deepspeed_configs_of_the_transformers_docs_map_to_flags_that_parse(tmp_path, name, ds):
    fields, table = EXPECTED[name]
    t = from_deepspeed(ds)
    assert t.zero == fields
    rows = {key: target for key, _, target in t.rows}
    for key, piece in table.items():
        assert piece in rows[key], (key, rows[key])
    read = {key for key, _, _ in t.rows}
    assert {f"zero_optimization.{k}" for k in ds["zero_optimization"]} <= read  # every key of the config is named
    assert {k for k in ds if k not in ("zero_optimization", "fp16", "bf16", "optimizer", "scheduler")} <= read
    argv = ["--output_dir", str(tmp_path), "--report_to", "none", "--use_cpu", *shlex.split(t.flags())]
    if fields.get("mixed_precision") == "bf16":
        argv.remove("--bf16")  # the CPU here: precision is checked apart
    (args,) = HfArgumentParser(hf_zero.ZeroTrainingArguments).parse_args_into_dataclasses(argv)
    wanted = {k: v for k, v in fields.items() if k != "mixed_precision"}
    got = args.to_zero_config()
    assert {k: getattr(got, k) for k in wanted} == wanted
    if name == "zero3":
        assert (args.max_grad_norm, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (1.0, 2, 4)
        assert (args.adam_beta2, args.learning_rate, args.warmup_steps, args.zero_save_model_weights) == \
            (0.95, 2e-5, 100, True)

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    done = run_cli(["from-deepspeed", str(path)])
    assert done.returncode == 0, done.stderr
    assert f"Trainer flags:  {t.flags()}" in done.stdout and f"In code:        hf_zero.{t.code()}" in done.stdout
    if name == "zero2":
        assert "2 key(s) have no hf_zero counterpart: fp16.hysteresis, fp16.min_loss_scale" in done.stdout


def test_fsdp_plugin_settings_map_and_bad_input_is_refused(tmp_path):
    yaml_text = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: bf16
num_processes: 8
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_sharding_strategy: HYBRID_SHARD
  fsdp_offload_params: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_cpu_ram_efficient_loading: true
  fsdp_sync_module_states: true
  fsdp_activation_checkpointing: true
  fsdp_some_new_key: 1
"""
    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml_text)
    done = run_cli(["from-deepspeed", "--fsdp", str(path)])
    assert done.returncode == 0, done.stderr
    import yaml

    t = from_fsdp(yaml.safe_load(yaml_text))
    assert t.zero == {"mixed_precision": "bf16", "stage": 3, "offload_optimizer": True, "offload_params": True,
                      "wrap": ("LlamaDecoderLayer",), "sync_module_states": True}
    assert t.trainer == {"bf16": True, "gradient_checkpointing": True, "zero_hybrid_shard": True}
    assert "1 key(s) have no hf_zero counterpart: fsdp_config.fsdp_some_new_key" in done.stdout
    assert "use hf_zero.from_pretrained" in done.stdout

    missing = run_cli(["from-deepspeed", str(tmp_path / "none.json")])
    assert missing.returncode == 2 and "no such config file" in missing.stderr
    (tmp_path / "bad.json").write_text("{stage: 3")
    bad = run_cli(["from-deepspeed", str(tmp_path / "bad.json")])
    assert bad.returncode == 2 and "is not JSON" in bad.stderr
    (tmp_path / "two.json").write_text(json.dumps({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
        "offload_param": {"device": "nvme", "nvme_path": "/b"}}}))
    two = run_cli(["from-deepspeed", str(tmp_path / "two.json")])
    assert two.returncode == 2 and "different nvme_path values ['/a', '/b']" in two.stderr
