"""The launcher's environment, read in one place (`launch_env`), and the device a rank computes on.

`accelerate launch` and `torchrun` describe the job through environment variables; this module is
the only part of hf_zero that reads them. The engine asks it for the local rank, the
integrations for the precision and node size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

_TRUE = ("1", "true", "yes")


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher (`accelerate launch`, `torchrun`) says through the environment."""

    mixed_precision: str | None  # ACCELERATE_MIXED_PRECISION
    use_deepspeed: bool  # ACCELERATE_USE_DEEPSPEED
    use_fsdp: bool  # ACCELERATE_USE_FSDP
    local_world_size: int | None  # LOCAL_WORLD_SIZE: ranks per node
    local_rank: int | None = None  # LOCAL_RANK: this rank's index on its node
    world_size: int | None = None  # WORLD_SIZE: processes in the job, as the launcher started them
    use_cpu: bool = False  # ACCELERATE_USE_CPU


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.strip().isdigit() else None


def launch_env() -> LaunchEnv:
    """The launcher's settings, read from the environment (the only place hf_zero reads it).

    Example:

    ```python
    >>> launch_env().local_world_size   # under torchrun --nproc_per_node 8
    8
    ```
    """
    env = os.environ
    local = _int(env.get("LOCAL_WORLD_SIZE"))
    return LaunchEnv(
        mixed_precision=env.get("ACCELERATE_MIXED_PRECISION") or None,
        use_deepspeed=env.get("ACCELERATE_USE_DEEPSPEED", "").lower() in _TRUE,
        use_fsdp=env.get("ACCELERATE_USE_FSDP", "").lower() in _TRUE,
        local_world_size=local if local else None,
        local_rank=_int(env.get("LOCAL_RANK")),
        world_size=_int(env.get("WORLD_SIZE")),
        use_cpu=env.get("ACCELERATE_USE_CPU", "").lower() in _TRUE,
    )


def has_accelerator() -> bool:
    """Whether this process sees a device torch computes on other than the CPU (CUDA, XPU, ...)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def accelerator_device(
    kind: str, *, bound: torch.device | None, local_rank: int | None, count: int, current: int, world_size: int
) -> torch.device:
    """The accelerator (`kind`: "cuda" or "xpu") device this rank computes on, when its model is on the host.

    In order: the device the process group is bound to (`init_process_group(device_id=...)`); the one of
    `LOCAL_RANK` (what torchrun and accelerate launch set; `count` devices visible); the current device
    when it is the only choice (one device visible, or a single-rank job). Several visible devices, several
    ranks and none of these is ambiguous: every rank would land on device 0, so it is refused.

    Example:

    ```python
    >>> accelerator_device("cuda", bound=None, local_rank=3, count=8, current=0, world_size=16)
    device(type='cuda', index=3)
    ```
    """
    if bound is not None and bound.type == kind and bound.index is not None:
        return bound
    if local_rank is not None and count > 0:
        if local_rank >= count:
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {count} {kind.upper()} device(s) are visible; launch at most "
                f"{count} processes per node (--nproc_per_node / num_processes), or make more devices visible."
            )
        return torch.device(kind, local_rank)
    if current != 0 or count <= 1 or world_size <= 1:
        return torch.device(kind, current)
    raise ValueError(
        f"{count} {kind.upper()} devices are visible and nothing says which one this rank uses (no LOCAL_RANK, "
        f"no device bound to the process group, the current device is 0 on every rank). Launch with torchrun or "
        f"accelerate launch, or call torch.{kind}.set_device(local_rank) before hf_zero.initialize."
    )


def cpu_launch_warning(world_size: int) -> str:
    """What a launch of `world_size` processes on a machine without GPUs is told (once per node) before training:
    a launch config for GPUs (`accelerate launch --config_file ...8gpu.yaml`, `torchrun --nproc_per_node 8`) starts
    CPU processes there, which would otherwise go unnoticed until the first step's speed."""
    return (
        f"hf_zero: {world_size} processes were launched, and this machine has no GPU that torch can use (torch "
        f"{torch.__version__}, CUDA available: {torch.cuda.is_available()}): they train on the CPU. If the launch "
        "config meant GPUs, check the machine (nvidia-smi) and that torch is a CUDA build; for CPU training on "
        "purpose, pass --use_cpu or use accelerate_configs/cpu_2proc.yaml to silence this."
    )
