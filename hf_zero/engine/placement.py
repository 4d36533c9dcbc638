"""Where a part's tensors live: the compute device, and the host for what ZeRO-Offload moves there.

[Note: placement]
Each flat part is told its `Placement` once, at construction, and asks it instead of testing devices:

| tensor                                   | no offload | `offload_optimizer` | + `offload_params` |
|------------------------------------------|------------|---------------------|--------------------|
| unsharded parameters and gradients       | device     | device              | device             |
| master shard, gradient shard, optimizer  | device     | host                | host               |
| stage-3 gather source (compute dtype)    | device     | device              | host               |

Host buffers are pinned when the compute device is an accelerator (their copies are asynchronous), and
a pinned gradient shard keeps its memory across steps (pinning again each step is slow). Frozen parts are
never offloaded: they have no master, gradient or optimizer state to move. The compute device itself is
chosen once per engine (`compute_device`).

[Note: compute device]
The engine computes where the training loop puts its batches. The Trainer and the Accelerate plugin say
where (`args.device`, `Accelerator.device`) and that wins: a single process launched on a GPU machine
without `torch.distributed` (`accelerate launch` with `distributed_type: NO`) computes on the GPU its
batches go to, and `use_cpu` keeps it on the host. Called directly, `initialize` takes the parameters'
device, or, for a model on the host, the rank's accelerator when the backend communicates on one (NCCL)
or when the process runs alone and has one, as DDP users place a model on their GPU before wrapping it;
gloo between several ranks computes on the host. A model sharded for one device and handed to a loop that
puts its batches on another is refused by name (`check_compute_device`), not met at the first embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..launch import accelerator_device, launch_env
from .collectives import CommGroup, bound_device, broadcast_, comm_device


@dataclass(frozen=True)
class Placement:
    """Where one part's tensors live ([Note: placement]).

    Example:

    ```python
    >>> p = Placement(torch.device("cuda", 0), host=torch.device("cpu"))
    >>> p.master_device, p.gather_source_device
    (device(type='cpu'), device(type='cuda', index=0))
    ```
    """

    device: torch.device  # the compute device: whole parameters, unsharded gradients, collectives' buffers
    host: torch.device | None = None  # where offloaded state lives (ZeRO-Offload), or None
    offload_params: bool = False  # stage 3: the gather source lives on the host too

    @property
    def offloaded(self) -> bool:
        return self.host is not None

    @property
    def master_device(self) -> torch.device:
        """Where the master shard, its gradient shard and the optimizer state live."""
        return self.host or self.device

    @property
    def gather_source_device(self) -> torch.device:
        """Where the stage-3 compute-dtype shard that gathers read from lives."""
        return self.host if self.offload_params and self.host is not None else self.device

    @property
    def host_pinned(self) -> bool:
        """Whether host buffers are pinned: the compute device is an accelerator."""
        return self.device.type != "cpu"

    def alloc(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1D buffer on `device`, pinned when it is host memory beside an accelerator."""
        return torch.empty(numel, dtype=dtype, device=device, pin_memory=device.type == "cpu" and self.host_pinned)

    @property
    def keeps_grad_shard_memory(self) -> bool:
        """Whether the gradient shard keeps its memory across `zero_grad`: a pinned host shard does."""
        return self.offloaded and self.host_pinned

    def label(self, tensor: torch.Tensor, offloaded: bool) -> str:
        """Where accounting files `tensor`: `"host"` for offloaded state (even on a CPU-only machine), else its
        device."""
        return "host" if offloaded else str(tensor.device)


def compute_device(
    model: nn.Module, world: CommGroup, has_source: bool = False, requested: torch.device | None = None
) -> torch.device:
    """The device the sharded model computes on, decided once ([Note: compute device]).

    `requested` (the device the caller puts batches on: the Trainer's `args.device`, the Accelerator's
    `device`) wins; the model's parameters must then be on the host or on it. Without it: the parameters'
    one device, or for a model on the host the rank's accelerator when the backend communicates on one, or
    when the process runs alone (no `torch.distributed`) and has one; else the host. An accelerator chosen
    is made current. Raises `ValueError` for meta parameters without a source, for parameters on several
    devices and for parameters on a device other than `requested`."""
    devices = {p.device for p in model.parameters()}
    if has_source:
        devices.discard(torch.device("meta"))  # values come from the source, not from these tensors
    if any(d.type == "meta" for d in devices):
        raise ValueError(
            "hf_zero.initialize got a model with parameters on the meta device. Materialize the weights "
            "first (e.g. load them with from_pretrained) before initialize."
        )
    if len(devices) > 1:
        raise ValueError(
            f"hf_zero.initialize needs the model's parameters on one device; found {sorted(map(str, devices))}. "
            "Load the model without a multi-device device_map."
        )
    device = next(iter(devices)) if devices else torch.device("cpu")
    if requested is not None:
        return _requested_device(device, requested)
    if device.type != "cpu":
        return device
    comm = comm_device(world)
    if comm.type != "cpu":
        return _rank_accelerator(comm.type, world)
    kind = _process_accelerator() if world.pg is None and world.size == 1 else None
    return _rank_accelerator(kind, world) if kind is not None else comm


def _process_accelerator() -> str | None:
    """The kind of accelerator this process has ("cuda", "xpu"), if any."""
    if not torch.accelerator.is_available():
        return None
    kind = torch.accelerator.current_accelerator()
    return kind.type if kind is not None and kind.type in ("cuda", "xpu") else None


def _requested_device(device: torch.device, requested: torch.device) -> torch.device:
    """`requested`, with its index filled in (made current); `ValueError` when the model sits on another
    accelerator than the one asked for."""
    requested = _plain(requested)
    accelerator = getattr(torch, requested.type) if requested.type in ("cuda", "xpu") else None
    if accelerator is not None and requested.index is None:
        requested = torch.device(requested.type, accelerator.current_device())
    if device.type != "cpu" and device != requested:
        raise ValueError(
            f"The model's parameters are on {device}, but the training loop computes on {requested} (the device "
            f"its batches are put on). Load the model on the host (the engine moves it unit by unit) or on "
            f"{requested}."
        )
    if accelerator is not None:
        accelerator.set_device(requested)
    return requested


def check_compute_device(current: torch.device, requested: torch.device | None) -> None:
    """`ValueError` when a model already sharded to compute on `current` is used by a loop that puts its batches
    on `requested` (a model sharded by `hf_zero.from_pretrained` on the host, handed to a Trainer on a GPU)."""
    if requested is None:
        return
    requested = _plain(requested)
    same = current.type == requested.type and (requested.index is None or current.index == requested.index)
    if not same:
        raise ValueError(
            f"The model was sharded to compute on {current}, but the training loop puts its batches on {requested}. "
            f"Shard it for {requested}: pass device={str(requested)!r} to hf_zero.from_pretrained / hf_zero.initialize "
            "(or let the Trainer or Accelerator shard it)."
        )


def _plain(device: torch.device) -> torch.device:
    """`device`, with the host as `cpu` whatever index it came with (multi-process Accelerate says `cpu:0`;
    host tensors say `cpu`, and the two do not compare equal)."""
    device = torch.device(device)
    return torch.device("cpu") if device.type == "cpu" else device


def _rank_accelerator(kind: str, world: CommGroup) -> torch.device:
    """The GPU of this rank (see `accelerator_device`), made the current device so that every later
    collective and allocation uses it."""
    module = getattr(torch, kind)
    chosen = accelerator_device(
        kind,
        bound=bound_device(world),
        local_rank=launch_env().local_rank,
        count=module.device_count(),
        current=module.current_device(),
        world_size=world.size,
    )
    module.set_device(chosen)
    return chosen


def kept_in_float32(model: nn.Module, compute: torch.dtype) -> frozenset[int]:
    """Ids of the parameters mixed precision leaves in their own (float32) dtype: BatchNorm's weights and biases.
    Its running statistics are buffers, which stay float32, and torch's batch norm takes a bf16 or fp16 input only
    with float32 weights beside them ("expected scalar type BFloat16 but found Float" with cast ones); FSDP's
    mixed precision keeps them so by default too. They compute, reduce and keep their masters in float32 ([Note:
    parameters kept in their own dtype] in unit.py)."""
    return frozenset(
        id(p)
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        for p in m.parameters(recurse=False)
        if p.dtype.is_floating_point and p.dtype != compute
    )


def main_dtype(model: nn.Module) -> torch.dtype:
    """The floating-point dtype most of the model's parameter elements are in: what the model computes and saves
    in. Parameters in another dtype (float32 router gates in a bf16 model, a 4-bit base's packed codes stored as
    uint8, which no gradient can reach) keep theirs ([Note: parameters kept in their own dtype] in unit.py)."""
    numel: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.dtype.is_floating_point:
            numel[p.dtype] = numel.get(p.dtype, 0) + p.numel()
    return max(numel, key=lambda d: (numel[d], d.itemsize)) if numel else torch.float32


def validate_model(
    model: nn.Module, world: CommGroup, has_source: bool = False, requested: torch.device | None = None
) -> torch.device:
    """The device the model will compute on (`compute_device`, decided here once); `ValueError` for a model the
    engine cannot shard (meta weights with no source, mixed devices)."""
    return compute_device(model, world, has_source, requested)


def move_buffers(model: nn.Module, device: torch.device, sync_from: CommGroup | None) -> None:
    """Buffers are small and replicated: move them to the compute device and agree on rank 0's."""
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is None:
                continue
            if buf.device != device:
                buf = buf.to(device)
                module._buffers[name] = buf
            if sync_from is not None:
                broadcast_(buf, sync_from)
