"""Asynchronous save cases ([Note: asynchronous save]): functions run on every rank of a pool."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import hf_zero
from tests._training import make_model, make_optimizer


def _checksums(directory: str) -> dict[str, str]:
    """sha256 of every file under `directory`, by relative path."""
    out = {}
    for path in sorted(Path(directory).rglob("*")):
        if path.is_file():
            out[str(path.relative_to(directory))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _train(model: Any, opt: Any, steps: int) -> None:
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(steps):
        model(input_ids=batch, labels=batch).loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()


@contextlib.contextmanager
def recording_snapshots() -> Iterator[list[dict[str, Any]]]:
    """Record each asynchronous save's snapshot on this rank: of the sharded state (budget asked, bytes copied,
    bytes streamed) and of model weights written in the background (`{"weights": directory}`)."""
    import importlib

    import hf_zero.checkpoint.save as save_module

    consolidate_module = importlib.import_module("hf_zero.checkpoint.consolidate")  # the package's name is a function

    original, original_owned = save_module.snapshot, consolidate_module.snapshot_owned
    seen: list[dict[str, Any]] = []

    def spy(jobs, budget_bytes, pin):  # noqa: ANN001, ANN202
        taken = original(jobs, budget_bytes, pin)
        seen.append({"budget": budget_bytes, "host_bytes": taken.host_bytes, "live_bytes": taken.live_bytes})
        return taken

    def spy_owned(engine, directory, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append({"weights": str(directory)})
        return original_owned(engine, directory, *args, **kwargs)

    save_module.snapshot, consolidate_module.snapshot_owned = spy, spy_owned
    try:
        yield seen
    finally:
        save_module.snapshot, consolidate_module.snapshot_owned = original, original_owned


def trainer_run_recording_snapshots(job: Any) -> dict[str, Any]:
    """`tests._trainer_cases.run(job)` with this rank's snapshots in the result (`snapshots`)."""
    from tests import _trainer_cases

    with recording_snapshots() as seen:
        out = _trainer_cases.run(job)
    return {**out, "snapshots": seen}


def _slow_writes(delay_s: float) -> Any:
    """Make each file write of hf_zero.checkpoint.save take `delay_s` longer (so training overlaps it); returns
    the undo."""
    import hf_zero.checkpoint.save as save_module

    original = save_module.write_streamed

    def slow(path, entries, metadata=None):  # noqa: ANN001, ANN202
        time.sleep(delay_s)
        return original(path, entries, metadata)

    save_module.write_streamed = slow
    return lambda: setattr(save_module, "write_streamed", original)


def async_equals_sync(tmp: str, stage: int, budget: int | None) -> dict[str, Any]:
    """Train 2 steps; save synchronously, then asynchronously (its writes slowed) and train 2 more steps while it
    writes; a second asynchronous save right after waits for the first. Returns both checkpoints' checksums,
    whether the first handle was still writing when training went on, and the second save's checksums."""
    model = make_model("llama")
    config = hf_zero.ZeroConfig(stage=stage, mixed_precision="bf16" if stage == 2 else "no")
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), config)
    _train(model, opt, 2)
    hf_zero.save_checkpoint(f"{tmp}/sync", model, opt, metadata={"step": 2})
    undo = _slow_writes(0.5)
    try:
        handle = hf_zero.save_checkpoint(
            f"{tmp}/async", model, opt, metadata={"step": 2}, async_save=True, snapshot_budget_bytes=budget
        )
        writing = not handle.done()
        _train(model, opt, 2)  # changes every master and optimizer moment the checkpoint holds
        second = hf_zero.save_checkpoint(f"{tmp}/async4", model, opt, metadata={"step": 4}, async_save=True)
        first_done_before_second = handle.done()
    finally:
        undo()
    path = second.wait()
    assert handle.wait() == Path(f"{tmp}/async")
    hf_zero.save_checkpoint(f"{tmp}/sync4", model, opt, metadata={"step": 4})
    dist.barrier()
    return {
        "sync": _checksums(f"{tmp}/sync"),
        "async": _checksums(f"{tmp}/async"),
        "sync4": _checksums(f"{tmp}/sync4"),
        "async4": _checksums(str(path)),
        "writing_when_returned": writing,
        "first_done_before_second": first_done_before_second,
        "leftovers": sorted(n for n in os.listdir(tmp) if n.startswith(".")),
    }


def async_save_with_fault(tmp: str, failing_rank: int, errno_code: int) -> dict[str, Any]:
    """A good checkpoint at `tmp/ckpt`; an asynchronous save over it whose background write fails on
    `failing_rank`: what `wait` raises on each rank, and whether the previous checkpoint is intact."""
    import hf_zero.checkpoint.save as save_module

    model = make_model("llama")
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=3))
    _train(model, opt, 1)
    hf_zero.save_checkpoint(f"{tmp}/ckpt", model, opt, metadata={"attempt": "first"})
    before = _checksums(f"{tmp}/ckpt")
    _train(model, opt, 1)
    original = save_module.write_streamed

    def failing(path, entries, metadata=None):  # noqa: ANN001, ANN202
        time.sleep(0.2)  # in the background, after the call returned
        if dist.get_rank() == failing_rank:
            raise OSError(errno_code, os.strerror(errno_code), str(path))
        return original(path, entries, metadata)

    save_module.write_streamed = failing
    try:
        handle = hf_zero.save_checkpoint(f"{tmp}/ckpt", model, opt, metadata={"attempt": "second"}, async_save=True)
        returned = True
        error_type = error = None
        try:
            handle.wait()
        except Exception as e:  # noqa: BLE001 - the test inspects it
            error_type, error = type(e).__name__, str(e)
    finally:
        save_module.write_streamed = original
    dist.barrier()
    return {
        "returned": returned,
        "error_type": error_type,
        "error": error,
        "intact": _checksums(f"{tmp}/ckpt") == before,
        "leftovers": sorted(os.listdir(tmp)),
    }


def saves_of_two_engines(tmp: str) -> dict[str, Any]:
    """Model A saves asynchronously (its writes slowed); model B, made on the same ranks meanwhile (its save group
    the same, [Note: groups made once]), saves at once. B's save must start after A's is committed, or their
    agreements on the shared group pair with each other's. Returns whether A was still writing when B was made,
    whether it was done when B's save returned, and both checkpoints reloaded into fresh models against the weights
    each model had."""
    model_a = make_model("llama", seed=1)
    model_a, opt_a = hf_zero.initialize(model_a, make_optimizer(model_a, 1e-3), hf_zero.ZeroConfig(stage=3))
    _train(model_a, opt_a, 1)
    import hf_zero.checkpoint.save as save_module

    original = save_module.write_streamed

    def slow_a(path, entries, metadata=None):  # noqa: ANN001, ANN202 - A's files only
        if Path(path).parent.name.lstrip(".").startswith("a"):
            time.sleep(1.0)
        return original(path, entries, metadata)

    save_module.write_streamed = slow_a

    def undo() -> None:
        save_module.write_streamed = original

    try:
        handle = hf_zero.save_checkpoint(f"{tmp}/a", model_a, opt_a, async_save=True)
        writing = not handle.done()
        model_b = make_model("llama", seed=2)
        model_b, opt_b = hf_zero.initialize(model_b, make_optimizer(model_b, 1e-3), hf_zero.ZeroConfig(stage=2))
        hf_zero.save_checkpoint(f"{tmp}/b", model_b, opt_b)
        a_done = handle.done()
    finally:
        undo()
    handle.wait()
    same = {}
    for name, model in (("a", model_a), ("b", model_b)):
        fresh = make_model("llama", seed=3)
        fresh, _ = hf_zero.initialize(fresh, None, hf_zero.ZeroConfig(stage=1))
        hf_zero.load_checkpoint(f"{tmp}/{name}", fresh)
        want, got = hf_zero.full_state_dict(model, rank0_only=False), hf_zero.full_state_dict(fresh, rank0_only=False)
        same[name] = all(torch.equal(want[k], got[k]) for k in want)
    return {"writing": writing, "a_done": a_done, "same": same}
