"""Settings of the peers translated into hf_zero's: a DeepSpeed config (`ds_config.json`) or Accelerate's FSDP
plugin settings (an `accelerate config` YAML), as `--zero_*` flags, `ZeroConfig(...)` and the Trainer flags that
carry the rest; every key that has no counterpart is named with why (`hf-zero from-deepspeed`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import ZeroConfig

AUTO = "auto"  # DeepSpeed's placeholder the HF integration fills from TrainingArguments


@dataclass
class Translation:
    """What a peer's settings become: `zero` (ZeroConfig fields), `trainer` (TrainingArguments flags), and a row per
    key read: `(key, value, what it maps to, or why nothing does)`."""

    zero: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    rows: list[tuple[str, str, str]] = field(default_factory=list)

    def map_zero(self, key: str, value: Any, **fields: Any) -> None:
        self.zero.update(fields)
        self.rows.append((key, _show(value), ", ".join(f"--zero_{k} {_flag(v)}" for k, v in fields.items())))

    def map_trainer(self, key: str, value: Any, **flags: Any) -> None:
        if value == AUTO:
            self.rows.append((key, AUTO, "the Trainer's own flag (DeepSpeed's 'auto' is filled from it)"))
            return
        self.trainer.update(flags)
        self.rows.append((key, _show(value), ", ".join(f"--{k} {_flag(v)}" for k, v in flags.items())))

    @property
    def unmapped(self) -> list[tuple[str, str, str]]:
        """The rows whose key has no counterpart."""
        return [row for row in self.rows if row[2].startswith("not mapped")]

    def note(self, key: str, value: Any, why: str) -> None:
        self.rows.append((key, _show(value), why))

    def code(self) -> str:
        """`ZeroConfig(...)` with the fields that differ from the defaults."""
        self.config()  # validated by ZeroConfig's own checks
        return "ZeroConfig(" + ", ".join(f"{k}={v!r}" for k, v in self.zero.items()) + ")"

    def config(self) -> ZeroConfig:
        """The ZeroConfig (validated by its own checks); precision comes from the Trainer's --bf16 / --fp16."""
        return ZeroConfig(**self.zero)

    def flags(self) -> str:
        zero = [f"--zero_{k} {_flag(v)}" for k, v in self.zero.items() if k != "mixed_precision"]
        trainer = [f"--{k}" if v is True else f"--{k} {_flag(v)}" for k, v in self.trainer.items()]
        return " ".join(zero + trainer)


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def _flag(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


_IGNORED_DS = {
    "overlap_comm": "always on: gathers and reductions run on their own stream, overlapped with compute",
    "contiguous_gradients": "always: gradients are reduced from one flat buffer per unit",
    "reduce_scatter": "always: stages 2-3 reduce-scatter gradients",
    "allgather_partitions": "always: stages 1-2 all-gather the updated shards",
    "round_robin_gradients": "no counterpart: gradient shards are written in place by the reduce-scatter",
    "sub_group_size": "no counterpart: the optimizer steps each rank's flat shards in fixed windows",
    "stage3_max_live_parameters": "no counterpart: at most --zero_prefetch + 1 units are gathered at a time",
    "stage3_max_reuse_distance": "no counterpart: a unit is freed after its forward and gathered again for backward",
    "stage3_param_persistence_threshold": "no counterpart: every unit is sharded (small ones are grouped by "
    "--zero_bucket_size_mb instead)",
    "memory_efficient_linear": "no counterpart: linear layers run as in the model",
    "ignore_unused_parameters": "always: parameters no rank used keep no gradient, as under DDP",
    "load_from_fp32_weights": "always: checkpoints hold the fp32 masters",
    "elastic_checkpoint": "always: hf_zero checkpoints load at any world size and stage",
    "zero_hpz_partition_size": "use --zero_shard_group_size (hybrid sharding) for node-local groups",
    "zero_quantized_weights": "use --zero_quantized_weights true",
    "zero_quantized_gradients": "use --zero_quantized_gradients true",
}


def from_deepspeed(ds: dict[str, Any]) -> Translation:
    """The hf_zero settings for a DeepSpeed config (what transformers' `--deepspeed ds_config.json` takes).

    Example:

    ```python
    >>> t = from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    >>> t.flags()
    '--zero_stage 3 --zero_offload_optimizer true'
    ```
    """
    if not isinstance(ds, dict):
        raise ValueError(f"a DeepSpeed config is a JSON object; got {type(ds).__name__}.")
    t = Translation()
    for key, value in ds.items():
        if key == "zero_optimization":
            _zero_optimization(t, value)
        elif key in ("bf16", "fp16"):
            _precision(t, key, value)
        elif key == "gradient_accumulation_steps":
            t.map_trainer(key, value, gradient_accumulation_steps=value)
        elif key == "train_micro_batch_size_per_gpu":
            t.map_trainer(key, value, per_device_train_batch_size=value)
        elif key == "gradient_clipping":
            t.map_trainer(key, value, max_grad_norm=value)
        elif key == "train_batch_size":
            t.note(key, value, "derived: micro-batch x accumulation x ranks (the Trainer's flags above)")
        elif key == "optimizer":
            _optimizer(t, value)
        elif key == "scheduler":
            _scheduler(t, value)
        elif key == "communication_data_type":
            dtype = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "float32": "fp32", "bfloat16": "bf16"}.get(
                str(value).lower()
            )
            if dtype:
                t.map_zero(key, value, reduce_dtype=dtype)
            else:
                t.note(key, value, "not mapped: --zero_reduce_dtype takes fp32, bf16 or fp16")
        elif key == "activation_checkpointing":
            t.note(
                key,
                value,
                "use --gradient_checkpointing (the model's own; partitioned activations have no "
                "counterpart: with sequence parallelism each rank keeps its share of the sequence)",
            )
        elif key in (
            "steps_per_print",
            "wall_clock_breakdown",
            "flops_profiler",
            "tensorboard",
            "wandb",
            "comms_logger",
            "dump_state",
        ):
            t.note(key, value, "ignored: DeepSpeed's logging (the Trainer's --logging_steps / --report_to)")
        elif key in ("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"):
            t.note(key, value, "ignored: every torch optimizer runs on the shards, on the device or the host")
        else:
            t.note(key, value, "not mapped: no hf_zero counterpart")
    return t


def _zero_optimization(t: Translation, zero: Any) -> None:
    if not isinstance(zero, dict):
        raise ValueError("zero_optimization must be a JSON object.")
    nvme: list[str] = []
    for key, value in zero.items():
        name = f"zero_optimization.{key}"
        if key == "stage":
            t.map_zero(name, value, stage=int(value))
        elif key in ("offload_optimizer", "offload_param"):
            device = (value or {}).get("device", "none") if isinstance(value, dict) else "none"
            if device == "none":
                t.note(name, value, "nothing offloaded")
                continue
            fields: dict[str, Any] = {"offload_optimizer": True}
            if key == "offload_param":
                fields["offload_params"] = True
            if device == "nvme":
                path = value.get("nvme_path") or "/local_nvme"
                nvme.append(path)
                fields["offload_dir"] = path
            t.map_zero(name, value, **fields)
            for sub in ("pin_memory", "buffer_count", "buffer_size", "fast_init", "max_in_cpu", "ratio"):
                if sub in value:
                    t.note(
                        f"{name}.{sub}",
                        value[sub],
                        "no setting: host copies are pinned on CUDA, and offload "
                        "files are read and written in fixed windows",
                    )
        elif key == "stage3_gather_16bit_weights_on_model_save":
            t.map_trainer(name, value, zero_save_model_weights=bool(value))
        elif key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
            t.note(
                name,
                value,
                "no byte size: units are whole blocks, grouped up to --zero_bucket_size_mb MiB; "
                "--zero_prefetch counts units gathered ahead",
            )
        elif key in _IGNORED_DS:
            t.note(name, value, _IGNORED_DS[key])
        else:
            t.note(name, value, "not mapped: no hf_zero counterpart")
    if len(set(nvme)) > 1:
        raise ValueError(
            f"offload_optimizer and offload_param name different nvme_path values {sorted(set(nvme))}; "
            "hf_zero keeps both in one --zero_offload_dir."
        )


def _precision(t: Translation, key: str, value: Any) -> None:
    enabled = value.get("enabled") if isinstance(value, dict) else value
    if enabled == AUTO:
        t.note(f"{key}.enabled", AUTO, f"the Trainer's own --{key}")
    elif enabled:
        t.map_trainer(f"{key}.enabled", True, **{key: True})
        t.zero["mixed_precision"] = key
    else:
        t.note(f"{key}.enabled", False, "off")
    if key == "fp16" and isinstance(value, dict):
        if "initial_scale_power" in value:
            t.map_zero(
                "fp16.initial_scale_power",
                value["initial_scale_power"],
                initial_loss_scale=float(2 ** int(value["initial_scale_power"])),
            )
        if "loss_scale_window" in value:
            t.map_zero(
                "fp16.loss_scale_window", value["loss_scale_window"], loss_scale_window=int(value["loss_scale_window"])
            )
        if value.get("loss_scale", 0) == 0:
            if "loss_scale" in value:
                t.note("fp16.loss_scale", 0, "dynamic, as hf_zero's (halved on overflow, doubled after the window)")
        else:
            t.note("fp16.loss_scale", value["loss_scale"], "not mapped: hf_zero's fp16 loss scale is dynamic")
        for sub in ("hysteresis", "min_loss_scale"):
            if sub in value:
                t.note(f"fp16.{sub}", value[sub], "not mapped: the scale halves at the first overflow, with no floor")


def _optimizer(t: Translation, spec: Any) -> None:
    kind = str((spec or {}).get("type", "")).lower()
    params = (spec or {}).get("params", {})
    if kind in ("adamw", "adam"):
        t.map_trainer("optimizer.type", spec.get("type"), optim="adamw_torch")
        for key, flag in (("lr", "learning_rate"), ("eps", "adam_epsilon"), ("weight_decay", "weight_decay")):
            if key in params:
                t.map_trainer(f"optimizer.params.{key}", params[key], **{flag: params[key]})
        if "betas" in params:
            betas = params["betas"]
            if betas == AUTO:
                t.map_trainer("optimizer.params.betas", AUTO)
            else:
                t.map_trainer("optimizer.params.betas", betas, adam_beta1=betas[0], adam_beta2=betas[1])
    else:
        t.note(
            "optimizer.type",
            spec.get("type") if isinstance(spec, dict) else spec,
            "not mapped: pass the Trainer's --optim (any torch optimizer runs on the shards)",
        )


def _scheduler(t: Translation, spec: Any) -> None:
    kind = str((spec or {}).get("type", ""))
    params = (spec or {}).get("params", {})
    known = {"WarmupLR": "constant_with_warmup", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
    if kind in known:
        t.map_trainer("scheduler.type", kind, lr_scheduler_type=known[kind])
        if "warmup_num_steps" in params:
            t.map_trainer(
                "scheduler.params.warmup_num_steps", params["warmup_num_steps"], warmup_steps=params["warmup_num_steps"]
            )
    else:
        t.note("scheduler.type", kind, "not mapped: pass the Trainer's --lr_scheduler_type")


_FSDP_STAGES = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0, "HYBRID_SHARD": 3, "_HYBRID_SHARD_ZERO2": 2}


def from_fsdp(accelerate_config: dict[str, Any]) -> Translation:
    """The hf_zero settings for an `accelerate config` YAML with the FSDP plugin (its `fsdp_config`).

    Example:

    ```python
    >>> t = from_fsdp({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}})
    >>> t.flags()
    '--zero_stage 3'
    ```
    """
    if not isinstance(accelerate_config, dict):
        raise ValueError("an accelerate config is a YAML mapping.")
    t = Translation()
    fsdp = accelerate_config.get("fsdp_config") or {}
    for key, value in accelerate_config.items():
        if key == "mixed_precision" and value in ("bf16", "fp16"):
            t.map_trainer(key, value, **{value: True})
            t.zero["mixed_precision"] = value
        elif key == "distributed_type":
            t.note(key, value, "launch with hf_zero's accelerate_configs/ (MULTI_GPU): hf_zero is the sharding engine")
    for key, value in fsdp.items():
        name = f"fsdp_config.{key}"
        strategy = str(value).split(".")[-1].upper() if key == "fsdp_sharding_strategy" else ""
        if key == "fsdp_sharding_strategy" and strategy in _FSDP_STAGES:
            extra = {"hybrid_shard": True} if strategy.startswith(("HYBRID", "_HYBRID")) else {}
            t.map_zero(name, value, stage=_FSDP_STAGES[strategy], **extra)
        elif key == "fsdp_reshard_after_forward":  # FSDP2's switch between ZeRO-3 and ZeRO-2
            t.map_zero(name, value, stage=3 if value in (True, "true", "FULL_SHARD") else 2)
        elif key == "fsdp_offload_params":
            if value in (True, "true"):
                t.map_zero(name, value, offload_optimizer=True, offload_params=True)
            else:
                t.note(name, value, "nothing offloaded")
        elif key == "fsdp_transformer_layer_cls_to_wrap":
            classes = [c.strip() for c in str(value).split(",") if c.strip()]
            t.map_zero(name, value, wrap=tuple(classes))
        elif key == "fsdp_auto_wrap_policy":
            t.note(
                name,
                value,
                "units are transformer blocks by default (--zero_wrap auto: the model's "
                "_no_split_modules); a size-based policy has no counterpart",
            )
        elif key == "fsdp_sync_module_states":
            t.map_zero(name, value, sync_module_states=value in (True, "true"))
        elif key in ("fsdp_backward_prefetch", "fsdp_forward_prefetch"):
            t.note(name, value, "--zero_prefetch N: units gathered ahead, in forward and backward")
        elif key == "fsdp_state_dict_type":
            t.note(
                name,
                value,
                "checkpoints are always sharded and load at any world size; "
                "--zero_save_model_weights writes the whole-model weights beside them",
            )
        elif key == "fsdp_cpu_ram_efficient_loading":
            t.note(name, value, "use hf_zero.from_pretrained: each rank reads only its shards")
        elif key == "fsdp_activation_checkpointing":
            t.map_trainer(name, value, gradient_checkpointing=value in (True, "true"))
        elif key in ("fsdp_use_orig_params", "fsdp_version"):
            t.note(name, value, "no setting: a sharded model keeps its parameters' names and classes")
        else:
            t.note(name, value, "not mapped: no hf_zero counterpart")
    if t.zero.pop("hybrid_shard", False):
        t.trainer["zero_hybrid_shard"] = True
    return t


def read_config(path: str | Path, kind: str) -> Translation:
    """Read and translate `path`: `kind` is "deepspeed" (JSON) or "fsdp" (an accelerate config YAML)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such config file: {path}")
    text = path.read_text()
    if kind == "deepspeed":
        try:
            return from_deepspeed(json.loads(text))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON ({e}); pass the ds_config.json given to --deepspeed.") from e
    import yaml

    return from_fsdp(yaml.safe_load(text))
