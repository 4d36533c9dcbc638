"""Rank functions for tests/test_call_order.py: DDP code that makes a collective call on rank 0 only ([Note: call
order]), on the peer scenarios' model (tests/_peer_harness.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import hf_zero
from tests._peer_harness import Block, Idle, Loop, _build, _optimizer


def _on_rank_0(what: str, loop: Loop, path: str) -> None:
    model = loop.model
    if what == "state_dict":
        torch.save(model.state_dict(), path)
    elif what == "full_state_dict":
        hf_zero.full_state_dict(model)
    elif what == "gathered_parameters":
        with hf_zero.gathered_parameters(model.head.parameters()):
            float(model.head.weight.norm())
    elif what == "save_checkpoint":
        hf_zero.save_checkpoint(path, model, loop.opt)
    elif what == "eval_forward":
        with torch.no_grad():
            model(loop.batch(99)[0])
    else:
        raise ValueError(what)


def _sharded_loop(stage: int) -> Loop:
    """The peer scenarios' model and optimizer, sharded at `stage`, in the loop object they run in."""
    model = _build({})
    config = hf_zero.ZeroConfig(stage=stage, wrap=[Block.__name__], bucket_size_mb=0)
    model, opt = hf_zero.initialize(model, _optimizer(model, {}), config)
    return Loop(model, opt, Idle(), dist.get_rank(), stage, sharded=True)


def _three_steps(loop: Loop, skips: Callable[[int], bool], after: Callable[[int], None]) -> dict[str, Any]:
    """Three steps of `loop`; where `skips(step)` this rank zeroes its gradients and skips the backward and step (as
    for a loss it finds non-finite); `after(step)` ends each step. Returns the error (every rank's, "Type:
    message") or the losses."""
    try:
        for step in range(3):
            loss = loop.loss(step)
            loop.note("loss", loss)
            if skips(step):
                loop.opt.zero_grad()
                continue
            loop.backward(loss)
            loop.opt.step()
            loop.opt.zero_grad()
            after(step)
    except Exception as e:  # noqa: BLE001 - the refusal goes back to the test
        return {"error": f"{type(e).__name__}: {e}", "losses": loop.record.get("loss")}
    return {"error": None, "losses": loop.record["loss"]}


def one_rank_calls(stage: int, what: str, path: str) -> dict[str, Any]:
    """Two steps on every rank, `what` on rank 0 alone after the first, as DDP code does it. Returns the error
    (every rank's, "Type: message") or the losses."""
    loop = _sharded_loop(stage)

    def after(step: int) -> None:
        if step == 0 and loop.rank == 0 and what != "nothing":
            _on_rank_0(what, loop, path)

    return _three_steps(loop, skips=lambda step: False, after=after)


def backward_skipped_on_one_rank(stage: int) -> dict[str, Any]:
    """Three steps; in the second, rank 1 skips its backward and step as DDP code does for a loss it finds
    non-finite (`if not torch.isfinite(loss): optimizer.zero_grad(); continue`). Returns the error or the losses."""
    loop = _sharded_loop(stage)
    return _three_steps(loop, skips=lambda step: step == 1 and loop.rank == 1, after=lambda step: None)


def headers_read_where_deferred(backward_on_rank_1: bool) -> dict[str, Any]:
    """`CallOrder` over a group whose collectives are ordered on a device stream (NCCL's path, the gloo group
    marked so): a forward's header, then a backward's (`keep_unread`), are not read when issued; `read_headers` reads
    both, oldest first. `backward_on_rank_1` False: rank 1 begins a forward where rank 0 begins the backward.
    Returns how many headers were read after each call, and the error `read_headers` raised."""
    from hf_zero.engine.checks.call_order import Call, CallOrder
    from hf_zero.engine.collectives import CommGroup, ops

    class StreamOrdered(CommGroup):
        @property
        def stream_ordered(self) -> bool:
            return True

    world = CommGroup.world()
    group = StreamOrdered(pg=world.pg, rank=world.rank, size=world.size, backend=world.backend)
    reads = []
    original = ops.GatheredInts.values

    def counted(self: Any) -> list[list[int]]:
        reads.append(1)
        return original(self)

    ops.GatheredInts.values = counted  # type: ignore[method-assign]
    try:
        order = CallOrder(group)
        order.begin(Call.FORWARD, read_now=False)
        after_forward = len(reads)
        second = Call.BACKWARD if backward_on_rank_1 or dist.get_rank() == 0 else Call.FORWARD
        order.begin(second, read_now=False, keep_unread=True)
        after_backward = len(reads)
        error = None
        try:
            order.read_headers()
        except ValueError as e:
            error = str(e)
        return {"after_forward": after_forward, "after_backward": after_backward, "after_read": len(reads),
                "error": error}
    finally:
        ops.GatheredInts.values = original  # type: ignore[method-assign]
