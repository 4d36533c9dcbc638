"""A pool of worker processes that run test functions on every rank, on CPU + gloo or CUDA + NCCL.

Spawning a process group costs seconds (torch and transformers imports), so each world size gets
one pool for the whole session. `DistPool.run(fn, *args)` runs `fn(*args)` on every rank and
returns each rank's `RankResult`. A task that does not finish within its timeout, or that fails
on some ranks but not others (a collective may be left half-done), marks the pool broken and
the next request for that world size starts a fresh one.

Where the ranks run is chosen by `choose_placement` from what the machine has and from
`HF_ZERO_TEST_DEVICE` (`auto`, the default: CUDA + NCCL when every rank can have a GPU of its own,
else CPU + gloo; `cpu`; `cuda`: skip where there are not enough GPUs). Only tests marked
`device_agnostic` (their inputs follow `device()`) take the GPU; the others always run on CPU.
Each rank uses the GPU of its `LOCAL_RANK`.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import queue
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as mp

ENV_VAR = "HF_ZERO_TEST_DEVICE"
STACKS_SIGNAL = signal.SIGUSR1  # a worker prints every thread's stack on it (`DistPool.run` past its timeout)


@dataclass(frozen=True)
class Placement:
    """Where a pool's ranks compute and how they communicate."""

    device: str  # "cpu" or "cuda"
    backend: str  # "gloo" or "nccl"


class PlacementUnavailable(Exception):
    """The requested placement cannot hold this many ranks here (the test is skipped, with this message)."""


def choose_placement(world_size: int, requested: str, cuda_devices: int) -> Placement:
    """The placement for `world_size` ranks: `requested` is `auto`, `cpu` or `cuda` (see the module docstring).

    NCCL needs one GPU per rank, so CUDA is taken only when `cuda_devices >= world_size`.
    """
    requested = (requested or "auto").strip().lower()
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"{ENV_VAR}={requested!r}: use 'auto', 'cpu' or 'cuda'.")
    enough = cuda_devices >= world_size
    if requested == "cuda" and not enough:
        raise PlacementUnavailable(f"{world_size} ranks need {world_size} GPUs (NCCL: one GPU per rank); "
                                   f"{cuda_devices} visible")
    if requested == "cpu" or not enough:
        return Placement("cpu", "gloo")
    return Placement("cuda", "nccl")


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


_DEVICE = None  # set in each worker: the torch.device this rank computes on


def device():  # noqa: ANN201
    """This rank's device (`cuda:LOCAL_RANK` in a CUDA pool; CPU in a gloo pool and in the test process)."""
    import torch

    return _DEVICE if _DEVICE is not None else torch.device("cpu")


def backend_and_device() -> tuple[str, str, str]:
    """(process-group backend, this rank's device, LOCAL_RANK): what a pool really runs on."""
    import torch.distributed as dist

    return str(dist.get_backend()).lower(), str(device()), os.environ["LOCAL_RANK"]


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_type is None


class RemoteError(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any, timeout_s: float,
            placement: Placement) -> None:
    global _DEVICE
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # What torchrun / accelerate launch set: Accelerate's PartialState reads them to see a multi-CPU run
    # (without ACCELERATE_USE_CPU each rank would silently believe it runs alone).
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    if placement.device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # a task past its timeout: every thread's stack, on stderr
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    extra: dict[str, Any] = {}
    if placement.device == "cuda":
        _DEVICE = torch.device("cuda", rank)  # LOCAL_RANK: one node
        torch.cuda.set_device(_DEVICE)
        extra["device_id"] = _DEVICE
    else:
        _DEVICE = torch.device("cpu")
    dist.init_process_group(
        placement.backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **extra,
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put(RankResult(rank, value=fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the test
            results.put(RankResult(rank, error_type=type(e).__name__, error=str(e), traceback=traceback.format_exc()))
    dist.destroy_process_group()


# What the workers import anyway, imported once by the fork server they are forked from (a module that fails to
# import there is left to the worker): imported by each worker instead, hf_zero and a LLaMA cost a pool of 2 8.8 s
# and a pool of 4 17 s on 2 cores.
PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama",
           "transformers.models.falcon.modeling_falcon", "transformers.trainer", "hf_zero", "tests._dist",
           "tests._training"]


def _context() -> Any:
    """The fork server's context, its preload set before it starts (the first pool of the session starts it)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class DistPool:
    def __init__(self, world_size: int, placement: Placement = Placement("cpu", "gloo"),
                 collective_timeout_s: float = 60.0) -> None:
        ctx = _context()
        self.world_size = world_size
        self.placement = placement
        self.broken = False
        port = _free_port()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, port, self._tasks[rank], self._results, collective_timeout_s, placement),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any) -> list[RankResult]:
        """Run `fn(*args, **kwargs)` on every rank; results sorted by rank."""
        for q in self._tasks:
            q.put((fn, args, kwargs))
        results: list[RankResult] = []
        try:
            for _ in range(self.world_size):
                results.append(self._results.get(timeout=timeout))
        except queue.Empty:
            self.broken = True
            self._dump_stacks()
            raise TimeoutError(f"{fn.__name__} did not finish on every rank within {timeout}s (a hang?); the "
                               "ranks' stacks are on stderr") from None
        results.sort(key=lambda r: r.rank)
        if len({r.ok for r in results}) > 1:
            self.broken = True
        return results

    def _dump_stacks(self) -> None:
        """Every live worker prints each thread's stack to stderr (where it waits, for a hang's diagnosis)."""
        for rank, p in enumerate(self._procs):
            if p.is_alive() and p.pid is not None:
                print(f"--- rank {rank} (pid {p.pid}): stacks at the timeout ---", file=sys.stderr, flush=True)
                os.kill(p.pid, STACKS_SIGNAL)
                time.sleep(1.0)  # its output before the next rank's

    def values(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run on every rank and return the values; any rank's exception fails the test with its traceback."""
        results = self.run(fn, *args, **kwargs)
        failed = [r for r in results if not r.ok]
        if failed:
            self.broken = True
            raise RemoteError("\n".join(f"--- rank {r.rank} ---\n{r.traceback}" for r in failed))
        return [r.value for r in results]

    def close(self) -> None:
        """Ask every worker to leave; those still there after a few seconds (a rank stuck in a collective its
        peer left, or in `destroy_process_group`) are killed: nothing of theirs is needed any more."""
        self.ask_to_leave()
        self.reap(time.monotonic() + 3.0)

    def ask_to_leave(self) -> None:
        for q in self._tasks:
            q.put(None)

    def reap(self, deadline: float) -> None:
        """Wait for the workers until `deadline`, then kill those still there."""
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class Pools:
    """One live pool per (world size, placement), replaced when broken."""

    def __init__(self) -> None:
        self._pools: dict[tuple[int, Placement], DistPool] = {}

    def __call__(self, world_size: int, placement: Placement = Placement("cpu", "gloo")) -> DistPool:
        key = (world_size, placement)
        pool = self._pools.get(key)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = self._pools[key] = DistPool(world_size, placement)
        return pool

    def close(self) -> None:
        """Every pool's workers asked to leave at once, then waited for under one deadline."""
        for pool in self._pools.values():
            pool.ask_to_leave()
        deadline = time.monotonic() + 3.0
        for pool in self._pools.values():
            pool.reap(deadline)
        self._pools.clear()
