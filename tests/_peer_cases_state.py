"""Peer scenarios, continued (tests/_peer_cases.py has the runner): how users build the optimizer's groups, skip a
step, load and save state with torch's own tools (`load_state_dict(strict=False)`, `torch.distributed.checkpoint`),
re-initialize or prune weights between steps and keep activations on the host; blocks skipped or run twice,
unfreezing from the top, zero gradients kept for a skipped block. Registered in the same `SCENARIOS`
when tests/_peer_cases.py imports this module."""

from __future__ import annotations

import copy
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests._peer_harness import D, D_OUT, Loop, _steps, scenario

RESTING = "is sharded across ranks by hf_zero (ZeRO stage 3) and holds no full value between forward passes"

# The scenarios below that hf_zero refuses, with a piece of the message, by stage (joined into _peer_cases.REFUSED).
REFUSED: dict[str, dict[int, str]] = {
    "tensor_outside_the_model_in_the_optimizer": {
        s: "holds a tensor of shape () that is not a parameter of the model" for s in (1, 2, 3)
    },
    "weights_reinitialized_between_steps": {3: "'head.weight' " + RESTING},
    "pruned_after_initialize": {3: "'blocks.1.lin.weight' " + RESTING},
}


def _all_but_the_input_layer(model: nn.Module) -> list[dict[str, Any]]:
    return [{"params": [p for n, p in model.named_parameters() if not n.startswith("inp.")]}]


@scenario(groups=_all_but_the_input_layer)
def parameter_left_out_of_the_optimizer(loop: Loop) -> None:
    """A trainable parameter the optimizer was never given (`AdamW(p for n, p in named_parameters() if ...)`): it
    gets gradients and stays as it was, as under DDP."""
    _steps(loop)


def _layerwise(model: nn.Module) -> list[dict[str, Any]]:
    """Discriminative learning rates: a group per block's weights (rising lr), its biases apart without weight
    decay, the input and head weights together, every other bias in a group of its own."""
    named = dict(model.named_parameters())
    groups: list[dict[str, Any]] = [
        {"params": [named["inp.weight"], named["head.weight"]], "lr": 0.02},
        {"params": [named[n] for n in ("inp.bias", "head.bias", "spare.weight", "spare.bias")], "lr": 0.005,
         "weight_decay": 0.0},
    ]
    for i in range(3):
        block = [(n, p) for n, p in named.items() if n.startswith(f"blocks.{i}.")]
        groups.append({"params": [p for n, p in block if n.endswith("weight")], "lr": 0.01 * (i + 1)})
        groups.append({"params": [p for n, p in block if n.endswith("bias")], "lr": 0.003, "weight_decay": 0.0})
    return groups


@scenario(groups=_layerwise)
def layerwise_learning_rates(loop: Loop) -> None:
    """Param groups cut across the units (a block's weights and biases in different groups, one group holding
    parameters of the root and of the head) with their own lr and weight decay."""
    _steps(loop)


def _with_a_temperature(model: nn.Module) -> list[dict[str, Any]]:
    return [{"params": [*model.parameters(), nn.Parameter(torch.tensor(1.0))]}]


@scenario(groups=_with_a_temperature)
def tensor_outside_the_model_in_the_optimizer(loop: Loop) -> None:
    """`AdamW(list(model.parameters()) + [temperature])` with a learned scale kept outside the model (DDP would
    leave its gradient unaveraged, each rank stepping its own): refused at `initialize`, naming the way out."""
    temperature = loop.opt.param_groups[0]["params"][-1]
    for step in range(3):
        loss = loop.loss(step) * temperature
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def step_skipped_on_every_rank(loop: Loop) -> None:
    """A step skipped by every rank after its backward (`if skip: optimizer.zero_grad(); continue`, decided from a
    value all ranks share), and a batch's gradients dropped before the next batch's backward."""
    for step in range(4):
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        if step == 2:
            loop.opt.zero_grad()
            loop.backward(loop.loss(step + 10))
        if step != 1:
            loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def partial_load_state_dict(loop: Loop) -> None:
    """`model.load_state_dict({"head.weight": ..., "head.bias": ...}, strict=False)` between steps (a head reset
    from a file): the missing keys reported, the loaded tensors in place, the rest unchanged."""

    def before(step: int) -> None:
        if step == 1:
            result = loop.model.load_state_dict(
                {"head.weight": torch.full((D_OUT, D), 0.05), "head.bias": torch.zeros(D_OUT)}, strict=False
            )
            loop.note("missing", float(len(result.missing_keys)))
            loop.note("unexpected", float(len(result.unexpected_keys)))

    _steps(loop, before=before)


def _shared_directory() -> str:
    made = [tempfile.mkdtemp(prefix="hf_zero-dcp-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(made, src=0)
    return made[0]


@scenario()
def distributed_checkpoint_round_trip(loop: Loop) -> None:
    """torchtitan's and FSDP2 users' checkpoint: `torch.distributed.checkpoint.save({"model":
    model.state_dict()})`, the weights overwritten, `dcp.load` into a state dict of the model, `load_state_dict`."""
    import torch.distributed.checkpoint as dcp

    _steps(loop, n=2)
    path = _shared_directory()
    try:
        dcp.save({"model": loop.model.state_dict()}, checkpoint_id=path)
        loop.model.load_state_dict({k: torch.zeros_like(v) for k, v in loop.model.state_dict().items()})
        state = {"model": loop.model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        loop.model.load_state_dict(state["model"])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
    _steps(loop, n=2)


@scenario()
def torch_state_dict_helpers(loop: Loop) -> None:
    """`get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))` and `set_model_state_dict`
    (torch.distributed.checkpoint.state_dict, FSDP2's way to full tensors) between steps."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    _steps(loop, n=2)
    full = {k: v.clone() for k, v in
            get_model_state_dict(loop.model, options=StateDictOptions(full_state_dict=True)).items()}
    loop.note("sum", float(sum(v.sum() for v in full.values())))
    loop.model.load_state_dict({k: torch.zeros_like(v) for k, v in full.items()})
    set_model_state_dict(loop.model, full, options=StateDictOptions(full_state_dict=True))
    _steps(loop, n=2)


@scenario()
def weights_reinitialized_between_steps(loop: Loop) -> None:
    """`nn.init.normal_(model.head.weight)` and `nn.init.zeros_(bias)` between steps (a head reset): exact where the
    weights are whole on every rank; at stage 3 refused, naming `gathered_parameters(..., modifier_rank=0)`."""

    def before(step: int) -> None:
        if step == 1:
            torch.manual_seed(3)
            nn.init.normal_(loop.model.head.weight, std=0.02)
            nn.init.zeros_(loop.model.blocks[0].lin.bias)

    _steps(loop, before=before)


@scenario()
def pruned_after_initialize(loop: Loop) -> None:
    """`torch.nn.utils.prune.l1_unstructured(block.lin, "weight", amount=0.3)` between steps (the weight becomes
    `weight_orig` times a mask, in a forward pre-hook): exact where the weights are whole; refused at stage 3."""
    import torch.nn.utils.prune as prune

    def before(step: int) -> None:
        if step == 1:
            prune.l1_unstructured(loop.model.blocks[1].lin, "weight", amount=0.3)

    _steps(loop, before=before)


@scenario()
def activations_saved_on_the_host(loop: Loop) -> None:
    """`with torch.autograd.graph.save_on_cpu():` around the forward (activation offload, as FSDP recipes use it)."""
    for step in range(3):
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def blocks_skipped_on_every_rank(loop: Loop) -> None:
    """LayerDrop drawn from a seed every rank shares, and a block looped: the first block skipped, then the last, then
    the middle one with the first run twice (in a bucket of blocks: [Note: bucket blocks skipped or repeated])."""
    for step, kwargs in enumerate(({}, {"skip": (0,)}, {"skip": (2,)}, {"skip": (1,), "reuse": 2})):
        loss = loop.loss(step, **kwargs)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario(freeze=("blocks.0.", "blocks.1."))
def unfreeze_from_the_top(loop: Loop) -> None:
    """Gradual unfreezing (ULMFiT's): blocks 0 and 1 frozen at set-up, block 1 made trainable after the first step,
    block 0 after the second (in one bucket, its unit starts training with block 0 still frozen)."""

    def before(step: int) -> None:
        loop.model.blocks[1].requires_grad_(step >= 1)
        loop.model.blocks[0].requires_grad_(step >= 2)

    _steps(loop, n=4, before=before)


@scenario()
def zero_grad_keeps_zeros_of_a_skipped_block(loop: Loop) -> None:
    """The same with block 1 skipped in the second and third steps: its whole unit gets no reduction there, its
    parameters' kept zero gradients still step (and the optimizer's state they move is read in the fourth)."""
    for step in range(4):
        loss = loop.loss(step, skip=(1,) if step in (1, 2) else ())
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad(set_to_none=False)


@scenario(adafactor=True)
def zero_grad_keeps_zeros_whole_parameter(loop: Loop) -> None:
    """The same with Adafactor, stepped on whole parameters ([Note: whole-parameter step]): a zero gradient still
    moves its factored second moments."""
    zero_grad_keeps_zeros_of_a_skipped_block(loop)


def _checkpoint_reloaded(loop: Loop, between_backward_and_step: bool = False) -> None:
    """Block 1 frozen for the first step (no optimizer state), a checkpoint saved, block 1 unfrozen and two steps
    taken, the checkpoint loaded back into the live model and optimizer (a rewind after a loss spike), two steps
    again. hf_zero: `save_checkpoint` / `load_checkpoint`; the reference: rank 0's model and optimizer state dicts,
    as DDP's checkpoint holds them. After the load block 1 has no optimizer state again, as torch's
    `load_state_dict` leaves a parameter the saved state lacks (it kept the moments of the two steps). The
    gradients are the model's, not the checkpoint's: zeros kept by `zero_grad(set_to_none=False)` stay (a block
    skipped in the next step is stepped on them), and so do those of a backward the load comes after
    (`between_backward_and_step`)."""
    loop.model.blocks[1].requires_grad_(False)
    _steps(loop, n=1)
    path = _shared_directory()
    try:
        if loop.sharded:
            import hf_zero

            hf_zero.save_checkpoint(path, loop.model, loop.opt)
        else:
            saved = [copy.deepcopy((loop.model.state_dict(), loop.opt.state_dict()))]
            dist.broadcast_object_list(saved, 0)
        loop.model.blocks[1].requires_grad_(True)
        for step in range(2):
            loss = loop.loss(step)
            loop.note("loss", loss)
            loop.backward(loss)
            if step == 0 or not between_backward_and_step:
                loop.opt.step()
                loop.opt.zero_grad(set_to_none=False)
        if loop.sharded:
            hf_zero.load_checkpoint(path, loop.model, loop.opt)
        else:
            loop.model.load_state_dict(saved[0][0])
            loop.opt.load_state_dict(saved[0][1])
        if between_backward_and_step:
            loop.opt.step()
            loop.opt.zero_grad()
        _steps(loop, n=2, skip=(1,))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


@scenario()
def checkpoint_loaded_into_the_live_optimizer(loop: Loop) -> None:
    _checkpoint_reloaded(loop)


@scenario(adafactor=True)
def checkpoint_loaded_into_the_live_optimizer_whole_parameter(loop: Loop) -> None:
    """The same with Adafactor, stepped on whole parameters ([Note: whole-parameter step])."""
    _checkpoint_reloaded(loop)


@scenario()
def checkpoint_loaded_between_backward_and_step(loop: Loop) -> None:
    """The same, the load between a backward and its step: the step applies that backward's gradients."""
    _checkpoint_reloaded(loop, between_backward_and_step=True)


def sharded_twice(names: tuple[str, str], stage: int, build_extra: dict[str, Any], **config: Any) -> dict[str, Any]:
    """Scenarios `names` each under hf_zero only, at `stage` with `config`, their builds with `build_extra`: each
    one's record and full state (on this rank), or its error ("Type: message"). For what has no plain data-parallel
    reference (mixed precision) but must equal another way of doing the same under hf_zero."""
    import hf_zero
    from tests import _peer_cases  # noqa: F401 - registers every scenario
    from tests._peer_harness import SCENARIOS, Block, Idle, _build, _optimizer

    out: dict[str, Any] = {}
    for name in names:
        build, fn = SCENARIOS[name]
        build = {**build, **build_extra}
        settings = {"wrap": build.get("wrap", (Block.__name__,)), "bucket_size_mb": 0, **config}
        try:
            model = _build(build)
            model, opt = hf_zero.initialize(model, _optimizer(model, build), hf_zero.ZeroConfig(stage=stage, **settings))
            loop = Loop(model, opt, Idle(), dist.get_rank(), stage, sharded=True, dtype=build.get("dtype", torch.float32))
            fn(loop)
            state = hf_zero.full_state_dict(model, rank0_only=False)
            out[name] = {"error": None, "record": loop.record, "state": {k: v.float().cpu() for k, v in state.items()}}
        except Exception as e:  # noqa: BLE001 - the refusal goes back to the test
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def resumed_with_a_block_frozen_at_initialize(stage: int, path: str, unfreeze_at: int) -> dict[str, Any]:
    """A bf16 model under bf16 mixed precision, block 0 frozen at initialize and unfrozen from step `unfreeze_at`: four
    steps straight, a checkpoint saved after step 1; then a fresh model (block 0 frozen at initialize again, as the
    same script builds it) loads it and takes steps 2-3. Each run's record and full state, or the resumed run's
    error."""
    import hf_zero
    from tests._peer_harness import Block, Idle, _build, _optimizer

    build: dict[str, Any] = {"freeze": ("blocks.0.",), "dtype": torch.bfloat16}
    config = hf_zero.ZeroConfig(stage=stage, wrap=(Block.__name__,), bucket_size_mb=0, mixed_precision="bf16")

    def run(steps: range, resume: bool) -> dict[str, Any]:
        model = _build(build)
        model, opt = hf_zero.initialize(model, _optimizer(model, build), config)
        loop = Loop(model, opt, Idle(), dist.get_rank(), stage, sharded=True, dtype=torch.bfloat16)
        if resume:
            hf_zero.load_checkpoint(path, model, opt)
        return steps_saved_once(loop, path, steps, resume, lambda step: model.blocks[0].requires_grad_(step >= unfreeze_at))

    return straight_and_resumed(run)


def steps_saved_once(
    loop: Loop, path: str, steps: range, resume: bool, before: Callable[[int], Any] = lambda step: None
) -> dict[str, Any]:
    """The plain loop over `steps` of a sharded model (`before(step)` first in each), `save_checkpoint` to `path`
    after step 1 of a run that is not `resume`d; its record and full state (float32, on the host)."""
    import hf_zero

    for step in steps:
        before(step)
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()
        if step == 1 and not resume:
            hf_zero.save_checkpoint(path, loop.model, loop.opt)
    state = hf_zero.full_state_dict(loop.model, rank0_only=False)
    return {"record": loop.record, "state": {k: v.float().cpu() for k, v in state.items()}}


def straight_and_resumed(run: Callable[[range, bool], dict[str, Any]]) -> dict[str, Any]:
    """`run` of steps 0-3 (saving after step 1), then of steps 2-3 resumed from that save: both, or the resumed run's
    error ("Type: message")."""
    straight = run(range(4), False)
    try:
        resumed = run(range(2, 4), True)
    except Exception as e:  # noqa: BLE001 - the refusal goes back to the test
        return {"straight": straight, "error": f"{type(e).__name__}: {e}"}
    return {"straight": straight, "resumed": resumed, "error": None}
