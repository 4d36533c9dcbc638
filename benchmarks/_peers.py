"""The peers as their users run them: DeepSpeed as the Hugging Face Trainer configures it, FSDP2 as Accelerate's
FSDP2 plugin sets it up. Every benchmark builds its peers here and records the configuration beside its figures.

DeepSpeed (`deepspeed_config`), two flavours:
- `"hf"`: the ZeRO-3 configuration of the Trainer's DeepSpeed documentation (`ds_config_zero3.json`: overlap_comm,
  contiguous_gradients, sub_group_size 1e9, max live parameters / reuse distance 1e9, 16-bit weights gathered on
  save) with its `"auto"` values filled as `transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig` fills
  them from the model: `reduce_bucket_size = hidden²`, `stage3_prefetch_bucket_size = 0.9 · hidden²`,
  `stage3_param_persistence_threshold = 10 · hidden`. What a Trainer user gets.
- `"raw"`: `{"stage": 3}` alone, DeepSpeed's own defaults (5e8-element reduce bucket, 5e7 prefetch bucket, 1e5
  persistence threshold). What a user of `deepspeed.initialize` without a tuned file gets.
With offload, the documentation's blocks: `"cpu"` puts the optimizer state and the parameters in pinned host
memory; `"nvme"` (ZeRO-Infinity) puts both on NVMe at `nvme_path`, with its `aio` block. An offloading
configuration names the optimizer (`AdamW`), so DeepSpeed builds `DeepSpeedCPUAdam` as its documentation
describes; without offload the Trainer hands DeepSpeed torch's AdamW (`zero_allow_untested_optimizer`).

FSDP2 (`fsdp2_setup`): `fully_shard` on every module class of the model's `_no_split_modules` (the decoder
layers), then on the root, `reshard_after_forward=True`; with bf16 mixed precision Accelerate's
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16, output_dtype=bf16)`; with CPU offload
`CPUOffloadPolicy(pin_memory=True)`.
"""

from __future__ import annotations

from typing import Any

LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 0.1  # the AdamW every engine of a benchmark steps with


def deepspeed_config(hidden: int, *, micro: int, bf16: bool, flavor: str = "hf", offload: str | None = None,
                     nvme_path: str | None = None, clip: float = 1.0, lean: bool = False) -> dict[str, Any]:
    """The DeepSpeed ZeRO-3 configuration a user of `flavor` runs (see the module's docstring). `lean` (NVMe):
    the documented knobs a user short of host memory turns down: `sub_group_size` 1e8 (the optimizer state
    swapped in per group: 1e9 elements hold 16 GB) and `max_in_cpu` 1e8 (parameters kept in host memory)."""
    if flavor not in ("hf", "raw"):
        raise ValueError(f"flavor must be 'hf' or 'raw', not {flavor!r}")
    zero: dict[str, Any] = {"stage": 3}
    if flavor == "hf":
        zero |= {"overlap_comm": True, "contiguous_gradients": True, "sub_group_size": int(1e9),
                 "reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                 "stage3_param_persistence_threshold": 10 * hidden, "stage3_max_live_parameters": int(1e9),
                 "stage3_max_reuse_distance": int(1e9), "stage3_gather_16bit_weights_on_model_save": True}
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                              "gradient_clipping": clip, "bf16": {"enabled": bf16}, "steps_per_print": 10**9,
                              "zero_optimization": zero}
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    elif offload == "nvme":
        if nvme_path is None:
            raise ValueError("offload='nvme' needs nvme_path")
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True, "buffer_count": 4,
                                     "fast_init": False}
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True, "buffer_count": 5,
                                 "buffer_size": int(1e8), "max_in_cpu": int(1e9)}
        config["aio"] = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                         "overlap_events": True}
        if lean:
            zero["sub_group_size"] = int(1e8)
            zero["offload_param"]["max_in_cpu"] = int(1e8)
    elif offload is not None:
        raise ValueError(f"offload must be None, 'cpu' or 'nvme', not {offload!r}")
    if offload:  # DeepSpeed builds DeepSpeedCPUAdam for an offloaded AdamW
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                           "weight_decay": WEIGHT_DECAY}}
    else:  # the Trainer passes torch's AdamW and marks it allowed
        config["zero_allow_untested_optimizer"] = True
    return config


def fsdp2_setup(model: Any, *, bf16: bool, cpu_offload: bool = False, reduce_fp32: bool = False) -> dict[str, Any]:
    """Shard `model` as Accelerate's FSDP2 plugin does; returns the settings used (for the record). `reduce_fp32`:
    the policy a user gives the plugin as `mixed_precision_policy={"param_dtype": "bf16", "reduce_dtype": "fp32",
    "output_dtype": "bf16"}` instead of `mixed_precision="bf16"`'s all-bf16 one."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    reduce = torch.float32 if reduce_fp32 else torch.bfloat16
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce,
                                   output_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy())
    offload = CPUOffloadPolicy(pin_memory=True) if cpu_offload else OffloadPolicy()
    names = set(getattr(model, "_no_split_modules", None) or [])
    wrapped = [m for m in model.modules() if type(m).__name__ in names]
    for module in wrapped:
        fully_shard(module, reshard_after_forward=True, mp_policy=policy, offload_policy=offload)
    fully_shard(model, reshard_after_forward=True, mp_policy=policy, offload_policy=offload)
    return {"wrapped": sorted(names), "units": len(wrapped) + 1, "reshard_after_forward": True,
            "mp_policy": {"param_dtype": str(policy.param_dtype), "reduce_dtype": str(policy.reduce_dtype),
                          "output_dtype": str(policy.output_dtype)},
            "offload_policy": type(offload).__name__}
