"""The peer scenarios' harness (tests/_peer_cases.py has the scenarios): the models, plain data parallelism by
hand (the reference), the loop object a scenario gets, and the registry.

`PlainDP` is DDP's semantics by hand: the buffers are broadcast from rank 0 at the start of the first forward and of
every forward that follows a forward with grad outside `no_sync` (DDP's `require_forward_param_sync`), after every
backward the gradients averaged over the ranks, a gradient a rank lacks counting as zero and a parameter
no rank reached keeping `.grad = None` (DDP's `broadcast_buffers=True`, with `find_unused_parameters=True`). `Idle`
is hf_zero's side, where the engine does that itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

D_IN, D, D_OUT = 6, 12, 3
# Where the scenario models and their batches live: the host in the test suite; the GPU check's `peers` phase
# (benchmarks/_gpu_peers.py) sets the GPU, the two ranks sharing it over gloo.
DEVICE = torch.device("cpu")


class Block(nn.Module):
    """The unit of every scenario model (`ZeroConfig(wrap=["Block"])`)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


@dataclasses.dataclass
class Carried:
    """A block output inside a plain dataclass (no pytree registration)."""

    hidden: torch.Tensor
    scale: float = 1.0


class DataclassBlock(Block):
    def forward(self, x: Any) -> Carried:  # type: ignore[override]
        x = x.hidden if isinstance(x, Carried) else x
        return Carried(super().forward(x))


class Net(nn.Module):
    """Input projection, `n` blocks, an optional BatchNorm, a head, and a spare head (used by some scenarios)."""

    def __init__(self, n: int = 3, batchnorm: bool = False, block: type[Block] = Block) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList(block() for _ in range(n))
        self.bn = nn.BatchNorm1d(D) if batchnorm else None
        self.head = nn.Linear(D, D_OUT)
        self.spare = nn.Linear(D, D_OUT)

    def forward(
        self,
        x: torch.Tensor,
        spare: bool = False,
        reuse: int = 1,
        skip: tuple[int, ...] = (),
        embeds: torch.Tensor | None = None,
        head_by_weight: bool = False,
        recompute: bool = False,
    ) -> torch.Tensor:
        """`spare`: add the spare head; `reuse`: apply block 0 that many times; `skip`: blocks not run; `embeds`:
        used instead of `inp(x)` (HF's `inputs_embeds`); `head_by_weight`: the head's weight read, the head not
        called (a fused loss's way); `recompute`: each block called through torch's non-reentrant activation
        checkpoint, as transformers' gradient checkpointing calls a decoder layer."""
        h: Any = self.inp(x) if embeds is None else embeds
        for i, block in enumerate(self.blocks):
            for _ in range(reuse if i == 0 else 1):
                if i in skip:
                    continue
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False) if recompute else block(h)
        h = h.hidden if isinstance(h, Carried) else h
        h = self.bn(h) if self.bn is not None else h
        out = nn.functional.linear(h, self.head.weight, self.head.bias) if head_by_weight else self.head(h)
        return out + self.spare(h) if spare else out


class PlainDP:
    """The reference: DDP's semantics by hand (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.due = True  # DDP's `require_forward_param_sync`: the next forward broadcasts the buffers
        self.in_no_sync = False

    def before_forward(self) -> None:
        if self.due:
            for b in self.model.buffers():
                dist.broadcast(b, 0)
        self.due = torch.is_grad_enabled() and not self.in_no_sync  # what DDP's post-forward sets

    def after_backward(self) -> None:
        """Average the gradients over the ranks: which parameters have one anywhere in one collective, then their
        gradients in one flat all-reduce (elementwise sums: the same numbers as one collective per parameter)."""
        world = dist.get_world_size()
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            return
        has = torch.tensor([int(p.grad is not None) for p in params], device=params[0].device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX)
        got = [p for p, anywhere in zip(params, has.tolist()) if anywhere]
        for p in got:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if not got:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in got])
        dist.all_reduce(flat)
        flat.div_(world)
        offset = 0
        for p in got:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


class Idle:
    """hf_zero's side: the engine does what PlainDP does by hand."""

    def before_forward(self) -> None:
        pass

    def after_backward(self) -> None:
        pass


@dataclasses.dataclass
class Loop:
    model: nn.Module
    opt: Any
    dp: PlainDP | Idle
    rank: int
    stage: int
    sharded: bool
    record: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    twin: nn.Module | None = None  # a copy of the model made before sharding (`scenario(twin=True)`)
    dtype: torch.dtype = torch.float32  # the model's and its batches' (`scenario(dtype=...)`)

    def batch(self, step: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + self.rank)
        x, y = torch.randn(n, D_IN, generator=g), torch.randn(n, D_OUT, generator=g)
        return x.to(DEVICE, self.dtype), y.to(DEVICE, self.dtype)

    def loss(self, step: int, **kwargs: Any) -> torch.Tensor:
        x, y = self.batch(step)
        self.dp.before_forward()
        return nn.functional.mse_loss(self.model(x, **kwargs), y)

    def note(self, key: str, value: float | torch.Tensor) -> None:
        self.record.setdefault(key, []).append(float(value.detach()) if isinstance(value, torch.Tensor) else value)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.dp.after_backward()


Scenario = Callable[[Loop], None]
SCENARIOS: dict[str, tuple[dict[str, Any], Scenario]] = {}


def scenario(**build: Any) -> Callable[[Scenario], Scenario]:
    """Register a scenario; `build`: the model's constructor arguments and `freeze` (names frozen before
    initialize), `wrap`, `sgd` (plain SGD instead of AdamW with weight decay), `adafactor` (torch's Adafactor),
    `adagrad` (torch's Adagrad, its state made at construction), `nadam` (torch's NAdam), `nadam_whole` (a subclass of it),
    `trainable_only` (the optimizer over what requires grad at set-up), `left_out` (name prefixes of parameters left
    out of the optimizer),
    `twin` (a copy of the model made before initialize, in `loop.twin`), `groups` (a function of the model giving
    AdamW's param groups), `dtype` (the model and its batches in that dtype)."""

    def register(fn: Scenario) -> Scenario:
        SCENARIOS[fn.__name__] = (build, fn)
        return fn

    return register


def _steps(
    loop: Loop, n: int = 3, before: Callable[[int], None] | None = None, clip: float | None = None, **kwargs: Any
) -> None:
    """The plain loop for `n` steps; `before(step)` runs first in each (a scenario's change between steps); `clip`:
    torch's `clip_grad_norm_(model.parameters(), clip)` before each step (the norm recorded)."""
    for step in range(n):
        if before is not None:
            before(step)
        loss = loop.loss(step, **kwargs)
        loop.note("loss", loss)
        loop.backward(loss)
        if clip is not None:
            loop.note("norm", torch.nn.utils.clip_grad_norm_(loop.model.parameters(), clip))
        loop.opt.step()
        loop.opt.zero_grad()


# ---- building a scenario's model and optimizer ---------------------------------------------------------------------------------------
def _build(build: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    model = Net(
        n=build.get("n", 3), batchnorm=build.get("batchnorm", False), block=build.get("block", Block)
    )
    if build.get("tie"):
        model.blocks[2].lin.weight = model.blocks[0].lin.weight
    for name, p in model.named_parameters():
        if any(name.startswith(f) for f in build.get("freeze", ())):
            p.requires_grad_(False)
    return model.to(DEVICE, build.get("dtype", torch.float32))


def _optimizer(model: nn.Module, build: dict[str, Any]) -> torch.optim.Optimizer:
    groups = build.get("groups")
    if groups is not None:  # `groups(model)`: the optimizer's param groups, as a scenario builds them
        return torch.optim.AdamW(groups(model), lr=0.01, weight_decay=0.1)
    params = list(model.parameters())
    if build.get("trainable_only"):  # what requires grad at set-up (the rest added as groups later)
        params = [p for p in params if p.requires_grad]
    left_out = build.get("left_out", ())  # parameters left out of the optimizer, by name prefix (they still train)
    chosen = {id(p) for p in params}
    params = [p for n, p in model.named_parameters() if id(p) in chosen and not n.startswith(tuple(left_out))]
    if build.get("sgd"):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if build.get("nadam"):  # a 0-d float32 state entry (`mu_product`) beside the parameter's own
        return torch.optim.NAdam(params, lr=0.01)
    if build.get("nadam_whole"):  # the same under a class hf_zero does not know: stepped on whole parameters
        return type("UsersNAdam", (torch.optim.NAdam,), {})(params, lr=0.01)
    if build.get("adagrad"):  # state made at construction ([Note: state set at construction])
        return torch.optim.Adagrad(params, lr=0.05, initial_accumulator_value=0.1)
    if build.get("adafactor"):  # factored second moments: stepped on whole parameters ([Note: whole-parameter step])
        return torch.optim.Adafactor(params, lr=0.01)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
