"""Worker side of the staging test: a recording process group that sees every tensor the engine hands
to a collective, and checks that none of it is host memory the engine offloaded.

On CUDA + NCCL a collective only takes tensors on the rank's GPU; with `offload_optimizer` /
`offload_params` the master shards, gradient shards and optimizer moments live on the host, and every
collective that reads or writes them must go through a device copy ([Note: staging] in
hf_zero/engine/collectives/ops.py). On a CPU-only machine the communication device *is* the host, so the
engine copies nothing, and a host tensor does reach the collectives (the negative control below sees
it). `force_staging` makes the communication device differ from the host (`cpu:0`, to which `.to()`
copies), so the engine takes the path it takes under NCCL, and the recorder checks every call.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from hf_zero.engine import collectives
from hf_zero.engine.engine import ZeroEngine
from tests._training import Scenario, sharded_run

_FORCED_COMM = torch.device("cpu", 0)


class _Recorder:
    """Stands in for `torch.distributed` inside hf_zero's collectives module: the tensor collectives are
    recorded (with whether a tensor shares storage with the engines' host state), everything else passes
    through."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.engines: list[ZeroEngine] = []
        self.calls: dict[str, int] = {}
        self.host_calls: dict[str, int] = {}  # calls that received host (offloaded) memory
        self.most_host_storages = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def host_storages(self) -> set[int]:
        """The storages of every tensor the engines hold on the host now (offloaded shards, masters,
        gradient shards, optimizer moments)."""
        ptrs: set[int] = set()
        for engine in self.engines:
            for unit in getattr(engine, "parts", ()):  # none yet while the engine is being built
                for _, t, placement in unit.storages():
                    if placement == "host" and t.untyped_storage().nbytes() > 0:
                        ptrs.add(t.untyped_storage().data_ptr())
            if getattr(engine, "optimizer", None) is not None and engine.config.offload_optimizer:
                for state in engine.optimizer.state.values():
                    ptrs.update(v.untyped_storage().data_ptr() for v in state.values()
                                if isinstance(v, torch.Tensor) and v.untyped_storage().nbytes() > 0)
        return ptrs

    def record(self, op: str, *tensors: torch.Tensor) -> None:
        host = self.host_storages()
        self.most_host_storages = max(self.most_host_storages, len(host))
        self.calls[op] = self.calls.get(op, 0) + 1
        if any(t.untyped_storage().data_ptr() in host for t in tensors):
            self.host_calls[op] = self.host_calls.get(op, 0) + 1

    def wrap(self, op: str, fn: Callable[..., Any], tensor_args: int) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.record(op, *args[:tensor_args])
            return fn(*args, **kwargs)
        return recorded

    # the tensor collectives hf_zero's collectives module calls through `dist.`
    def broadcast(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrap("broadcast", self._real.broadcast, 1)(*args, **kwargs)

    def all_reduce(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrap("all_reduce", self._real.all_reduce, 1)(*args, **kwargs)

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrap("all_to_all", self._real.all_to_all_single, 2)(*args, **kwargs)


def recorded_offload_run(sc: Scenario, force_staging: bool) -> dict[str, Any]:
    """`sharded_run(sc)` with every collective recorded; `force_staging` puts the communication device
    off the host. Returns the run's result with the recorder's counts."""
    probe = torch.ones(1)
    if probe.to(_FORCED_COMM).data_ptr() == probe.data_ptr():
        raise RuntimeError("this torch does not copy on .to('cpu:0'): the forced staging would not stage")
    recorder = _Recorder(dist)
    ops, agree = collectives.ops, collectives.agree  # the modules that issue collectives
    saved = [(m, name, getattr(m, name)) for m in (ops, agree) for name in ("dist", "comm_device")]
    saved += [(ops, name, getattr(ops, name)) for name in ("_all_gather_single", "_reduce_scatter_single")]
    init = ZeroEngine.__init__

    def registering_init(engine: ZeroEngine, *args: Any, **kwargs: Any) -> None:
        recorder.engines.append(engine)
        init(engine, *args, **kwargs)

    ops.dist = agree.dist = recorder
    ops._all_gather_single = recorder.wrap("all_gather", ops._all_gather_single, 2)
    ops._reduce_scatter_single = recorder.wrap("reduce_scatter", ops._reduce_scatter_single, 2)
    if force_staging:
        real_comm_device = ops.comm_device
        forced = lambda group: _FORCED_COMM if group.pg is not None else real_comm_device(group)  # noqa: E731
        ops.comm_device = agree.comm_device = forced
    ZeroEngine.__init__ = registering_init
    try:
        result = sharded_run(sc)
        run_host_calls, recorder.host_calls = recorder.host_calls, {}
        # The recorder's own control: a host shard handed to a collective by hand is seen as one,
        # unless the communication device is off the host (then it is staged like the engine's).
        engine = recorder.engines[-1]
        host_shard = next(t for unit in engine.parts for _, t, where in unit.storages()
                          if where == "host" and t.untyped_storage().nbytes() > 0)  # not a freed gradient shard
        collectives.broadcast_(host_shard, engine.world)
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        ZeroEngine.__init__ = init
    result.pop("memory")
    result.update(calls=recorder.calls, host_calls=run_host_calls, control_host_calls=recorder.host_calls,
                  most_host_storages=recorder.most_host_storages)
    return result
