"""`ModelStateMemory`: the bytes of model state a rank holds, by category and device."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelStateMemory:
    """Bytes of model state this rank holds, by category and device (e.g. `{"cuda:0": 1024}`).

    `optimizer_states` includes the fp32 master weights when they are a separate copy (mixed
    precision, offload, or stage 3 sharded parameters in another dtype), as in the ZeRO paper.
    Tensors offloaded to host memory (`offload_optimizer`, `offload_params`) are counted under
    `"host"`, also on a CPU-only machine where host and device are the same memory.
    """

    parameters: dict[str, int] = field(default_factory=dict)
    gradients: dict[str, int] = field(default_factory=dict)
    optimizer_states: dict[str, int] = field(default_factory=dict)

    def total(self, device: str | None = None) -> int:
        """All bytes, or those on `device` (e.g. `"cpu"`)."""
        parts = (self.parameters, self.gradients, self.optimizer_states)
        return sum(n for part in parts for dev, n in part.items() if device is None or dev == device)
