"""Peer scenarios, continued (tests/_peer_cases.py has the runner): what DDP code does to the model object itself
(wraps it in DDP, assigns new parameters or modules to it) and backward passes restricted to some parameters
(`backward(inputs=...)`, `torch.autograd.grad`). Registered in the same `SCENARIOS` when tests/_peer_cases.py
imports this module."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms.join import Join

from tests import _peer_harness
from tests._peer_harness import D_OUT, Block, D, Loop, _steps, scenario

# The scenarios below that hf_zero refuses, with a piece of the message, by stage (joined into _peer_cases.REFUSED).
REFUSED: dict[str, dict[int, str]] = {
    "ddp_around_the_sharded_model": {s: "DistributedDataParallel around a model sharded by hf_zero" for s in (1, 2, 3)},
    "parameter_assigned_between_steps": {s: "the parameter at 'head.weight' is new since hf_zero.initialize"
                                         for s in (1, 2, 3)},
    "module_assigned_between_steps": {s: "the parameter at 'head.weight' is new since"
                                      for s in (1, 2, 3)},
    "step_after_backwards_all_under_no_sync": {1: "after backward passes that all ran under model.no_sync()"},
    "data_replaced_between_steps": {1: "parameter 'head.weight' had its `.data` replaced",
                                    2: "parameter 'head.weight' had its `.data` replaced",
                                    3: "`param.data = tensor` on 'head.weight', sharded across ranks"},
    "vector_to_parameters_between_steps": {1: "parameter 'blocks.0.norm.weight' had its `.data` replaced",
                                           2: "parameter 'blocks.0.norm.weight' had its `.data` replaced",
                                           3: "`param.data = tensor` on 'inp.weight', sharded across ranks"},
    "block_deleted_between_steps": {s: "the submodules ['blocks.2'] were replaced or deleted (4 parameter entries gone)"
                                    for s in (1, 2, 3)},
    "root_module_called_on_one_rank": {3: "rank(s) [0] began a module of the model's root called outside its forward"},
    "root_module_changing_its_weight_when_called_directly": {3: "changed parameters ['inp.weight'] in place"},
    "block_submodule_called_directly": {1: "by a submodule of the unit called directly",
                                        2: "by a submodule of the unit called directly",
                                        3: "finds it so too: call it inside the unit's forward, or call the unit's"},
    "head_weight_read_by_the_forward_of_another_unit": {3: "reads it from a module of another unit without calling"},
}


@scenario()
def ddp_around_the_sharded_model(loop: Loop) -> None:
    """`model = DistributedDataParallel(model)` kept from a DDP script after `hf_zero.initialize`: DDP would reduce
    the gradients a second time; refused in DDP's constructor by name ([Note: DDP around a sharded model]). Before,
    at stages 1-2 the second step failed with DDP's message about unused parameters, at stage 3 on reading a
    sharded parameter."""
    if loop.sharded:
        loop.model = nn.parallel.DistributedDataParallel(loop.model)
    _steps(loop)


def _assign_between_steps(loop: Loop, change: str) -> None:
    def before(step: int) -> None:
        if step == 1:
            torch.manual_seed(5)
            if change == "parameter":
                loop.model.head.weight = nn.Parameter(torch.randn(D_OUT, D, device=_peer_harness.DEVICE))
            else:
                loop.model.head = nn.Linear(D, D_OUT, device=_peer_harness.DEVICE)

    _steps(loop, before=before)


@scenario()
def parameter_assigned_between_steps(loop: Loop) -> None:
    """`module.weight = nn.Parameter(t)` after `initialize` (weight surgery written for a plain module): not a
    parameter the engine shards, reduces or steps; refused at the next forward ([Note: parameters replaced after
    initialize]). Before, at stage 3 the next gather put the engine's parameter back: the new values were silently
    dropped (losses 90% apart)."""
    _assign_between_steps(loop, "parameter")


@scenario()
def module_assigned_between_steps(loop: Loop) -> None:
    """`model.head = nn.Linear(...)` after `initialize` (a new head): refused at the next forward, naming it."""
    _assign_between_steps(loop, "module")


def _backward_to(loop: Loop, pick: str) -> None:
    for step in range(3):
        loss = loop.loss(step)
        loop.note("loss", loss)
        head = list(loop.model.head.parameters())
        if pick == "head":
            loss.backward(inputs=head)
        else:
            torch.autograd.backward(loss, inputs=[*loop.model.blocks[1].parameters(), head[0]])
        loop.dp.after_backward()
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def backward_to_the_heads_parameters(loop: Loop) -> None:
    """`loss.backward(inputs=list(model.head.parameters()))`: gradients for the head only. At stage 3 the modules
    hold stand-ins after the forward, which autograd never saw: the backward computed nothing and the step moved
    nothing, silently; now the stand-ins become the parameters the graph holds ([Note: backward to resting
    parameters])."""
    _backward_to(loop, "head")


@scenario()
def backward_to_a_units_parameters(loop: Loop) -> None:
    """`torch.autograd.backward(loss, inputs=[...])` with one block's parameters and the head's weight."""
    _backward_to(loop, "block")


@scenario()
def autograd_grad_to_parameters(loop: Loop) -> None:
    """`torch.autograd.grad(loss, model.head.parameters(), allow_unused=True)`: this rank's gradients, returned
    (not averaged, as under DDP), then the usual steps. Before, at stage 3 `None` for each (an error without
    `allow_unused`)."""
    loss = loop.loss(0)
    grads = torch.autograd.grad(loss, list(loop.model.head.parameters()), allow_unused=True)
    for g in grads:
        loop.note("grad_norm", g.norm())
    _steps(loop)


@scenario()
def parameterless_module_added_between_steps(loop: Loop) -> None:
    """A module without parameters assigned after `initialize` (an activation swapped, a probe attached): no
    parameter changes, so it trains on, as under DDP."""

    def before(step: int) -> None:
        if step == 1:
            loop.model.probe = nn.Identity()

    _steps(loop, before=before)


@scenario()
def checkpoint_wrapper_after_initialize(loop: Loop) -> None:
    """torch's `apply_activation_checkpointing` around each block after `initialize` (the FSDP recipe's line): the
    blocks move inside wrappers holding the same parameters; each block's forward runs again in the backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    apply_activation_checkpointing(loop.model, check_fn=lambda m: isinstance(m, Block))
    _steps(loop)


@scenario()
def block_deleted_between_steps(loop: Loop) -> None:
    """`del model.blocks[2]` after `initialize` (layers pruned): refused, naming the submodules and how many
    parameter entries went."""

    def before(step: int) -> None:
        if step == 1:
            del loop.model.blocks[2]

    _steps(loop, before=before)


class SpectralNormBlock(Block):
    """A block whose linear layer has torch's hook-based spectral norm: a forward pre-hook computes `weight` from
    `weight_orig` and updates the `weight_u` / `weight_v` buffers in place at each training forward."""

    def __init__(self) -> None:
        super().__init__()
        nn.utils.spectral_norm(self.lin)


@scenario(block=SpectralNormBlock)
def spectral_norm_hook_inside_a_block(loop: Loop) -> None:
    """`nn.utils.spectral_norm` (the hook form, applied before `initialize`): the pre-hook reads the gathered
    `weight_orig`, the power iteration's buffers are broadcast from rank 0 as DDP's are."""
    _steps(loop)


class PreHookedBlock(Block):
    """A block with a forward pre-hook on itself, registered before `initialize`, that reads its weights (a
    library's patch, a user's input transform)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_forward_pre_hook(lambda module, args: (args[0] + 0.01 * module.lin.weight.sum(),))


@scenario(block=PreHookedBlock)
def block_pre_hook_reading_its_weights(loop: Loop) -> None:
    """[Note: hook order] the engine's pre-forward hook runs first, so the block's own pre-hook reads the gathered
    weights (stage 3), and its use of them is inside the unit's backward (stages 1-2)."""
    _steps(loop)


@scenario()
def block_forward_hook_reading_its_weights(loop: Loop) -> None:
    """[Note: hook order] a forward hook registered on a block after `initialize`, reading the block's weights: the
    engine's post-forward hook stays last, so the weights are still whole when the user's runs (stage 3)."""
    loop.model.blocks[1].register_forward_hook(lambda module, args, out: out + 0.01 * module.lin.weight.sum())
    _steps(loop)


@scenario(wrap=("Block", "Linear"))
def head_weight_read_by_the_forward_of_another_unit(loop: Loop) -> None:
    """The model's forward computes `F.linear(h, self.head.weight, ...)` where the head is a unit of its own (its
    module matched by `wrap`) and is never called: exact at stages 1-2; at stage 3 the head's parameters rest, and
    the stand-in's message names the pattern and the ways out (a forward from Liger is found by `initialize`)."""
    _steps(loop, head_by_weight=True)


@scenario()
def join_around_the_loop(loop: Loop) -> None:
    """torch's `Join([model])`, which Accelerate's `join_uneven_inputs` builds on multi-GPU runs: disabled
    (`even_batches=True`, Accelerate's default) it changes nothing, as with DDP; enabled, the first forward inside
    it is refused on every rank ([Note: uneven inputs]: no rank can shadow a sharded step), and the model trains
    after the context as before."""
    if not loop.sharded:  # the reference: the same steps, no context (DDP's disabled Join does nothing either)
        _steps(loop, 2)
        loop.note("refused", 1.0)
        _steps(loop, 1)
        return
    with Join([loop.model], enable=False):
        _steps(loop, 2)
    try:
        with Join([loop.model]):
            loop.loss(5)
        refused = False
    except ValueError as e:
        refused = "torch's Join with uneven inputs" in str(e)
    loop.note("refused", float(refused))
    _steps(loop, 1)


@scenario()
def functional_call_with_substituted_weights(loop: Loop) -> None:
    """`torch.func.functional_call(model, {name: tensor}, (x,))` with the head's and one block's weight substituted
    (a perturbed or fast weight, as SAM-like or meta-learning code does): the forward computes with the given
    tensors, which get the gradients; the model's own parameters in those slots get none. The tensors sit in the
    modules' parameter slots for the call only: not an assignment ([Note: parameters replaced after initialize]),
    and at stage 3 the gathers leave them in place."""
    from torch.func import functional_call

    for step in range(3):
        x, y = loop.batch(step)
        loop.dp.before_forward()
        device = _peer_harness.DEVICE  # the GPU check's peers phase runs these on the GPU
        weights = {
            "head.weight": torch.full((D_OUT, D), 0.01, device=device, requires_grad=True),
            "blocks.1.lin.weight": torch.full((D, D), 0.02, device=device, requires_grad=True),
        }
        loss = nn.functional.mse_loss(functional_call(loop.model, weights, (x,)), y)
        loop.note("loss", loss)
        loop.backward(loss)
        for name, w in weights.items():
            assert w.grad is not None, name
            loop.note(name, w.grad.norm())
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def step_after_backwards_all_under_no_sync(loop: Loop) -> None:
    """Every backward under `no_sync()`, then the step (the synchronising micro-batch forgotten); the reference
    averages as DDP's synchronised backward does. Stages 2-3 reduce every micro-batch, so they train as if the
    last were synchronised; stage 1 defers the reduction: before, its step found no gradient and did nothing,
    silently (under DDP each replica steps on its own gradients and drifts apart); now refused."""
    for step in range(3):
        loss = loop.loss(step)
        loop.note("loss", loss)
        if loop.sharded:
            with loop.model.no_sync():
                loss.backward()
        else:
            loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


def _data_replaced(loop: Loop, how: str) -> None:
    def before(step: int) -> None:
        if step == 1 and how == "data":
            loop.model.head.weight.data = torch.full((D_OUT, D), 0.01, device=_peer_harness.DEVICE)
        elif step == 1:
            count = sum(p.numel() for p in loop.model.parameters())
            nn.utils.vector_to_parameters(
                torch.full((count,), 0.01, device=_peer_harness.DEVICE), loop.model.parameters()
            )

    _steps(loop, before=before)


@scenario()
def data_replaced_between_steps(loop: Loop) -> None:
    """`param.data = tensor` between steps: refused at stages 1-2 at the next forward ([Note: replaced data]); at
    stage 3 the module holds a stand-in, whose data it replaced, and the next gather put the engine's values back:
    silently dropped before (losses 46% apart), now refused at the assignment ([Note: backward to resting
    parameters], whose hook torch offers the `.data` setter)."""
    _data_replaced(loop, "data")


@scenario()
def vector_to_parameters_between_steps(loop: Loop) -> None:
    """`nn.utils.vector_to_parameters(vec, model.parameters())` (a weight snapshot restored from one vector): it
    assigns each parameter's `.data`, refused as above."""
    _data_replaced(loop, "vector")


# ---- the root's modules called outside the model's forward ([Note: direct calls]) ----------------------------------
def _steps_around(loop: Loop, loss_of: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Three steps whose loss `loss_of(step, x, y)` builds around the model's forward (the reference's buffers
    synchronised first, as DDP's forward does)."""
    for step in range(3):
        x, y = loop.batch(step)
        loop.dp.before_forward()
        loss = loss_of(step, x, y)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


def _auxiliary(loop: Loop, module: nn.Module, step: int) -> torch.Tensor:
    """A second loss from `module` called alone on other inputs."""
    other, _ = loop.batch(step + 50)
    return module(other.repeat(1, 2)).pow(2).mean()


@scenario(wrap=("Block",))
def inputs_embeds_from_the_models_own_input_layer(loop: Loop) -> None:
    """`model(inputs_embeds=model.get_input_embeddings()(ids) * scale)` (soft prompts, image features merged into
    the embeddings), where the input layer is the root's: its gradient follows the end of the root's forward."""
    _steps_around(loop, lambda step, x, y: nn.functional.mse_loss(loop.model(x, embeds=loop.model.inp(x) * 1.5), y))


@scenario(wrap=("Block",))
def root_head_called_after_the_forward(loop: Loop) -> None:
    """A second loss from the root's head called on other inputs after the model's forward (an auxiliary head)."""

    def loss_of(step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = loop.model(x)
        return nn.functional.mse_loss(out, y) + 0.1 * _auxiliary(loop, loop.model.head, step)

    _steps_around(loop, loss_of)


@scenario()
def block_submodule_called_directly(loop: Loop) -> None:
    """A block's `Linear` called alone for an auxiliary loss, before the model's forward: its unit's parameters are
    gathered and reduced with the unit's forward and backward, so the call is refused by name (no hook sits on a
    block's submodules). At stages 1-2 the loss computed before the forward has its backward run after the unit's,
    past its reduction: refused; computed after the forward, autograd runs it first and it is exact."""
    _steps_around(
        loop,
        lambda step, x, y: 0.1 * _auxiliary(loop, loop.model.blocks[1].lin, step)
        + nn.functional.mse_loss(loop.model(x), y),
    )


@scenario(wrap=("Block",))
def root_module_changing_its_weight_when_called_directly(loop: Loop) -> None:
    """The root's input layer called alone scales its weight in place (what `nn.Embedding(max_norm=...)` does to the
    rows it looks up): kept at stages 1-2 as under DDP; at stage 3 the change would leave with the gathered copy,
    so the call is refused by name."""
    direct = [False]

    def scale(module: nn.Module, args: object) -> None:
        if direct[0]:
            with torch.no_grad():
                module.weight.mul_(0.9)

    loop.model.inp.register_forward_pre_hook(scale)

    def loss_of(step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        direct[0] = True
        embeds = loop.model.inp(x)
        direct[0] = False
        return nn.functional.mse_loss(loop.model(x, embeds=embeds), y)

    _steps_around(loop, loss_of)


@scenario(wrap=("Block",))
def root_module_called_on_one_rank(loop: Loop) -> None:
    """Rank 0 alone looks at the embeddings between steps, without grad: local under DDP and at stages 1-2; at
    stage 3 a gather the other rank does not make, refused on both ranks by its header ([Note: call order])."""

    def before(step: int) -> None:
        if loop.rank == 0 and step == 1:
            with torch.no_grad():
                loop.note("embeddings", loop.model.inp(loop.batch(step)[0]).norm())

    _steps(loop, before=before)
