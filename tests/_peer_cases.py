"""Peer scenarios: PyTorch idioms that DDP trains correctly, replayed under hf_zero on every rank of a pool.

Each scenario is a training loop written the way a user writes it for DDP (the situations PyTorch's own
FSDP2 and DDP test suites exercise: `test/distributed/_composable/fsdp/test_fully_shard_*.py`,
`test/distributed/test_c10d_common.py`, `test_c10d_gloo.py`). It runs twice on each rank, in the same
process, from the same initial weights and data:

- under **plain data parallelism** (`PlainDP`): a full replica per rank; before every forward the buffers
  are broadcast from rank 0 and after every backward the gradients averaged over the ranks, a gradient a
  rank lacks counting as zero and a parameter no rank reached keeping `.grad = None` (DDP's defaults,
  `broadcast_buffers=True`, with `find_unused_parameters=True`);
- under **hf_zero** at a stage, the same code on the sharded model and optimizer (`Idle`: no extra calls).

`run_scenario` returns what each run produced (losses, returned norms, the final weights and buffers), or
the error the hf_zero run raised; the test compares them. A scenario's `Loop` object gets `dp` (its
data-parallel hooks), `rank` and `batch(step)`. The models, `PlainDP`, `Loop` and the registry are in
tests/_peer_harness.py.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hf_zero
from tests._peer_harness import (
    SCENARIOS,
    Block,
    D,
    DataclassBlock,
    Idle,
    Loop,
    Net,
    PlainDP,
    _build,
    _optimizer,
    _steps,
    scenario,
)

# Scenarios hf_zero refuses, with a piece of the message (every other scenario must be exact), by stage; those of
# tests/_peer_cases_model.py are added from its own REFUSED when it is imported below.
REFUSED: dict[str, dict[int, str]] = {
    "cast_to_bf16_for_evaluation": {s: "a conversion to torch.bfloat16 on " for s in (1, 2, 3)},
    "deepcopy_for_an_ema": {s: "copy.deepcopy of a sharded model" for s in (1, 2, 3)},
    "grad_rows_zeroed_before_step": {s: "'head.weight'.grad of a model sharded by hf_zero" for s in (1, 2, 3)},
    "grad_norms_logged_from_p_grad": {s: ".grad of a model sharded by hf_zero" for s in (1, 2, 3)},
    "grad_norm_logged_under_no_sync": {s: "(under no_sync, its own sum, not yet averaged" for s in (1, 2, 3)},
    "optimizer_built_after_initialize": {s: "hf_zero.attach_optimizer" for s in (1, 2, 3)},
    "torch_two_step_clipping": {s: "get_total_norm + clip_grads_with_norm_" for s in (1, 2, 3)},
    "torch_clip_bound_early": {s: "optimizer.clip_grad_norm_(max_norm)" for s in (1, 2, 3)},
    "unit_skipped_on_one_rank": {3: "units ['blocks.1'] ran their forward on some ranks and not on others"},
    "last_unit_skipped_on_one_rank": {3: "units ['blocks.2'] ran their forward on some ranks and not on others"},
    # in the first forward (no prefetch plan yet) the gathers themselves are checked, naming the units met
    "accumulation_unit_skipped_on_one_rank": {3: "gather different units (['blocks.1', 'blocks.2'])"},
    "weight_changed_in_forward": {3: "the forward changed parameters ['blocks.0.lin.weight'"},
    "root_weight_changed_in_forward": {3: "the forward changed parameters ['inp.weight'] in place"},
    "clip_through_part_of_a_group": {s: "some of the tensors of an optimizer param group" for s in (1, 2, 3)},
    "optimizer_state_read_by_parameter": {s: "optimizer.state['head.weight'] (keyed by a model parameter)"
                                          for s in (1, 2, 3)},
    "grad_norm_logged_through_optimizer_groups": {s: "'optimizer.param_groups[0]['params'][0]'.grad of a model"
                                                  for s in (1, 2, 3)},
}


def worst_difference(reference: dict[str, list[float]], record: dict[str, list[float]]) -> float:
    """The largest relative difference between two runs' records (losses, norms, ...), key by key."""
    if reference.keys() != record.keys():
        raise ValueError(f"the runs recorded different things: {sorted(reference)} vs {sorted(record)}")
    worst = 0.0
    for key, values in reference.items():
        if len(values) != len(record[key]):
            raise ValueError(f"{key}: {len(values)} values in the reference, {len(record[key])} in the run")
        for a, b in zip(values, record[key]):
            if math.isnan(a) or math.isnan(b):  # max() would pass a NaN over
                if not (math.isnan(a) and math.isnan(b)):
                    return math.inf
                continue
            worst = max(worst, abs(a - b) / max(abs(a), 1e-6))
    return worst


def _set_trainable(module: nn.Module, trainable: bool) -> None:
    for p in module.parameters():
        p.requires_grad_(trainable)


# ---- the scenarios ------------------------------------------------------------------------------------
@scenario()
def baseline(loop: Loop) -> None:
    """The plain loop, with accumulation over two micro-batches (the first under no_sync with DDP's idiom) and
    the optimizer's own clipping."""
    for step in range(3):
        for micro in range(2):
            loss = loop.loss(10 * step + micro) / 2
            loop.note("loss", loss)
            if micro == 0 and loop.sharded:
                with loop.model.no_sync():
                    loss.backward()
            else:
                loop.backward(loss) if micro == 1 else loss.backward()
        if loop.sharded:
            loop.note("norm", loop.opt.clip_grad_norm_(0.05))
        else:
            loop.note("norm", torch.nn.utils.clip_grad_norm_(loop.model.parameters(), 0.05))
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def torch_clip_grad_norm(loop: Loop) -> None:
    """`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`: the unchanged line of a DDP loop."""
    _steps(loop, clip=0.05)


@scenario()
def torch_clip_grad_norm_inf(loop: Loop) -> None:
    """The max-norm variant, called through `torch.nn.utils.clip_grad.clip_grad_norm_`."""
    from torch.nn.utils.clip_grad import clip_grad_norm_

    for step in range(3):
        loss = loop.loss(step)
        loop.backward(loss)
        loop.note("norm", clip_grad_norm_(list(loop.model.parameters()), 0.01, norm_type=float("inf")))
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def torch_clip_grad_norm_subset(loop: Loop) -> None:
    """`clip_grad_norm_` over some parameters only (the head's), the others left as they are."""
    for step in range(3):
        loss = loop.loss(step)
        loop.backward(loss)
        loop.note("norm", torch.nn.utils.clip_grad_norm_(loop.model.head.parameters(), 0.01))
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def torch_two_step_clipping(loop: Loop) -> None:
    """torch's two-step API: `get_total_norm` of the `.grad`s, then `clip_grads_with_norm_`."""
    for step in range(3):
        loss = loop.loss(step)
        loop.backward(loss)
        params = list(loop.model.parameters())
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        loop.note("norm", norm)
        torch.nn.utils.clip_grads_with_norm_(params, 0.05, norm)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def torch_clip_bound_early(loop: Loop) -> None:
    """`from torch.nn.utils import clip_grad_norm_` above `import hf_zero`: torch's own function object."""
    from hf_zero.engine.step import torch_clip

    early = torch_clip._original.get("clip_grad_norm_", torch.nn.utils.clip_grad_norm_)
    for step in range(3):
        loss = loop.loss(step)
        loop.backward(loss)
        loop.note("norm", early(loop.model.parameters(), 0.05))
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def torch_clip_grad_value(loop: Loop) -> None:
    """`torch.nn.utils.clip_grad_value_(model.parameters(), clip)`."""
    for step in range(3):
        loss = loop.loss(step)
        loop.backward(loss)
        torch.nn.utils.clip_grad_value_(loop.model.parameters(), 0.002)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def zero_grad_keeps_zeros(loop: Loop) -> None:
    """`zero_grad(set_to_none=False)` with a head used only in the first step: torch keeps its zero gradient,
    so AdamW's momentum and weight decay still move it in the later steps."""
    for step in range(3):
        loss = loop.loss(step, spare=step == 0)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad(set_to_none=False)


@scenario()
def model_zero_grad(loop: Loop) -> None:
    """`model.zero_grad()` instead of the optimizer's."""
    for step in range(3):
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.model.zero_grad()


@scenario(freeze=("blocks.0.",))
def unfreeze_later(loop: Loop) -> None:
    """Progressive unfreezing: block 0 frozen at set-up, made trainable after the first step."""
    _steps(loop, before=lambda step: _set_trainable(loop.model.blocks[0], step >= 1))


@scenario(freeze=("blocks.0.lin.",))
def unfreeze_part_of_a_unit_later(loop: Loop) -> None:
    """Progressive unfreezing of a unit frozen only in part at set-up (its norm trains, its linear layer not)."""
    _steps(loop, before=lambda step: _set_trainable(loop.model.blocks[0], step >= 1))


@scenario()
def unfreeze_after_freezing(loop: Loop) -> None:
    """Progressive unfreezing as hf_zero asks for it: trainable at set-up, frozen right after, unfrozen later."""
    _set_trainable(loop.model.blocks[0], False)
    _steps(loop, before=lambda step: _set_trainable(loop.model.blocks[0], step >= 1))


@scenario()
def freeze_unit_for_a_step(loop: Loop) -> None:
    """Every parameter of block 1 frozen for the second step, then trainable again."""
    _steps(loop, before=lambda step: _set_trainable(loop.model.blocks[1], step != 1))


@scenario()
def optimizer_state_round_trip(loop: Loop) -> None:
    """`opt.load_state_dict(opt.state_dict())` mid-run, then a scheduler and a hand-set learning rate."""
    sched = torch.optim.lr_scheduler.LambdaLR(loop.opt, lambda s: 1.0 / (1 + s))
    for step in range(4):
        if step == 1:
            loop.opt.load_state_dict(loop.opt.state_dict())
        if step == 3:
            for group in loop.opt.param_groups:
                group["lr"] = 0.05
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        sched.step()
        loop.opt.zero_grad()


@scenario(batchnorm=True)
def batchnorm_buffers(loop: Loop) -> None:
    """BatchNorm's running statistics: DDP broadcasts rank 0's buffers before every forward; then an eval pass."""
    _steps(loop)
    loop.model.eval()
    with torch.no_grad():
        x, y = loop.batch(99)
        loop.dp.before_forward()
        loop.note("eval", nn.functional.mse_loss(loop.model(x), y))
    loop.model.train()


@scenario()
def unit_reused(loop: Loop) -> None:
    """One block applied twice in a forward (weight sharing in a loop)."""
    _steps(loop, reuse=2)


@scenario()
def two_forwards_one_backward(loop: Loop) -> None:
    """Two forwards, the sum of their losses backpropagated once (contrastive pairs, multi-crop)."""
    for step in range(3):
        loss = loop.loss(step) + loop.loss(step + 50)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def two_backwards_one_step(loop: Loop) -> None:
    """Two forward/backward pairs accumulated into one step without no_sync (each backward reduces)."""
    for step in range(3):
        for micro in range(2):
            loss = loop.loss(10 * step + micro)
            loop.note("loss", loss)
            loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def forward_without_backward(loop: Loop) -> None:
    """A forward with grad enabled whose graph is dropped (a metric, a skipped NaN step) between steps."""
    for step in range(3):
        probe = loop.loss(step + 70)
        loop.note("probe", probe)
        del probe
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def eval_between_steps(loop: Loop) -> None:
    """`model.eval()` and a no-grad forward between training steps, then `model.train()`."""
    for step in range(3):
        loss = loop.loss(step)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()
        loop.model.eval()
        with torch.no_grad():
            loop.note("eval", loop.loss(step + 80))
        loop.model.train()


@scenario()
def eval_forward_with_grad(loop: Loop) -> None:
    """An eval-mode forward with grad enabled, between the training forward and its backward."""
    for step in range(3):
        loss = loop.loss(step)
        loop.model.eval()
        loop.note("eval", loop.loss(step + 80).detach())
        loop.model.train()
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario(block=DataclassBlock)
def dataclass_outputs(loop: Loop) -> None:
    """Blocks that return their hidden state inside a plain dataclass."""
    _steps(loop)


@scenario()
def input_gradient(loop: Loop) -> None:
    """An input that requires grad (an adversarial perturbation): its gradient and the step."""
    for step in range(3):
        x, y = loop.batch(step)
        x.requires_grad_(True)
        loop.dp.before_forward()
        loss = nn.functional.mse_loss(loop.model(x), y)
        loop.note("loss", loss)
        loop.backward(loss)
        loop.note("input_grad", x.grad.abs().sum())
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def gradient_penalty(loop: Loop) -> None:
    """`torch.autograd.grad(..., create_graph=True)` on the input, then a backward through the penalty."""
    for step in range(3):
        x, y = loop.batch(step)
        x.requires_grad_(True)
        loop.dp.before_forward()
        out = loop.model(x)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = nn.functional.mse_loss(out, y) + 0.1 * gx.pow(2).mean()
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def gradient_penalty_built_on_another_thread(loop: Loop) -> None:
    """The gradient penalty, its first backward run on another thread: autograd numbers the nodes each thread
    creates on its own, so the graph that backward builds is numbered below the forward's, and the second
    backward meets the second-order terms in another order. This is what every gradient penalty on a GPU does (the
    first backward runs on the device's autograd thread); the GPU check found stages 1-2 refusing it there."""
    for step in range(3):
        x, y = loop.batch(step)
        x.requires_grad_(True)
        loop.dp.before_forward()
        out = loop.model(x)
        found: list[tuple[torch.Tensor, ...]] = []
        worker = threading.Thread(target=lambda: found.append(torch.autograd.grad(out.sum(), x, create_graph=True)))
        worker.start()
        worker.join()
        (gx,) = found[0]
        loss = nn.functional.mse_loss(out, y) + 0.1 * gx.pow(2).mean()
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def unit_skipped_on_one_rank(loop: Loop) -> None:
    """Rank 1 skips block 1 in the second step (LayerDrop with a per-rank draw)."""
    _skipped_on_rank_1(loop, block=1)


def _skipped_on_rank_1(loop: Loop, block: int) -> None:
    """Three steps; rank 1 skips `block` in the second."""
    for step in range(3):
        loss = loop.loss(step, skip=(block,) if step == 1 and loop.rank == 1 else ())
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def last_unit_skipped_on_one_rank(loop: Loop) -> None:
    """Rank 1 skips the last block (the first unit the backward meets) in the second step: at stage 3 the check
    that the ranks ran the same units, issued after the forward, is resolved before that unit's backward."""
    _skipped_on_rank_1(loop, block=2)


@scenario(tie=True)
def weight_shared_by_two_units(loop: Loop) -> None:
    """One parameter used by two blocks (`blocks[2].lin.weight = blocks[0].lin.weight`), as FSDP2's shared-parameter
    tests do."""
    _steps(loop)


@scenario()
def submodule_forward_backward(loop: Loop) -> None:
    """A loss on one block called directly (an auxiliary objective), besides the model's own."""
    for step in range(3):
        loss = loop.loss(step)
        x, _ = loop.batch(step + 40)
        aux = loop.model.blocks[1](x.repeat(1, 2)).pow(2).mean()
        loop.note("aux", aux)
        loop.backward(loss + 0.1 * aux)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario(wrap=("Block", "Linear"))
def nested_units(loop: Loop) -> None:
    """Two classes named: every block, and the Linears outside the blocks (a block's own Linears stay in it)."""
    _steps(loop)


@scenario()
def empty_batch_on_one_rank(loop: Loop) -> None:
    """Rank 1's second batch is empty (the tail of an uneven dataset): every unit still runs on every rank."""
    for step in range(3):
        x, y = loop.batch(step)
        if step == 1 and loop.rank == 1:
            x, y = x[:0], y[:0]
        loop.dp.before_forward()
        out = loop.model(x)
        loss = ((out - y) ** 2).sum() / 4  # a sum over the local batch: an empty batch contributes 0
        loop.note("loss", loss)
        loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


def _accumulate(loop: Loop, skips: Callable[[int, int], tuple[int, ...]]) -> None:
    """Two micro-batches per step, the first under no_sync (DDP's idiom); `skips(step, micro)`: blocks not run."""
    for step in range(3):
        for micro in range(2):
            loss = loop.loss(10 * step + micro, skip=skips(step, micro)) / 2
            loop.note("loss", loss)
            if micro == 0:
                context = loop.model.no_sync() if loop.sharded else contextlib.nullcontext()
                with context:
                    loss.backward()
            else:
                loop.backward(loss)
        loop.opt.step()
        loop.opt.zero_grad()


@scenario()
def accumulation_unit_only_in_first_micro_batch(loop: Loop) -> None:
    """Block 1 runs in the first micro-batch (under no_sync) and in no rank's second: its accumulated gradient must
    still be reduced by the synchronising one."""
    _accumulate(loop, lambda step, micro: (1,) if micro == 1 else ())


@scenario()
def accumulation_unit_skipped_on_one_rank(loop: Loop) -> None:
    """Rank 1 skips block 1 in the first micro-batch (under no_sync) of each step."""
    _accumulate(loop, lambda step, micro: (1,) if micro == 0 and loop.rank == 1 else ())


@scenario()
def unused_parameter(loop: Loop) -> None:
    """A parameter no forward uses (`spare`): DDP with find_unused_parameters leaves it untouched."""
    _steps(loop)


@scenario()
def param_grad_hook(loop: Loop) -> None:
    """A gradient hook on a parameter (`p.register_hook`), scaling the head's weight gradient."""
    loop.model.head.weight.register_hook(lambda g: g * 3.0)
    _steps(loop)


from tests import _peer_cases_loop  # noqa: E402, F401 - registers the rest of the scenarios
from tests import _peer_cases_model  # noqa: E402
from tests import _peer_cases_amp  # noqa: E402, F401 - registers the GradScaler scenarios
from tests import _peer_cases_state  # noqa: E402
from tests import _peer_cases_groups  # noqa: E402, F401 - registers the param groups added later

REFUSED.update(_peer_cases_model.REFUSED)
REFUSED.update(_peer_cases_state.REFUSED)


# ---- the runner ---------------------------------------------------------------------------------------
def run_scenario(name: str, stage: int, **config: Any) -> dict[str, Any]:
    """Run scenario `name` under PlainDP and under hf_zero at `stage` on this rank; return both records, the final
    weights and buffers of each, or the hf_zero run's error ("Type: message")."""
    build, fn = SCENARIOS[name]
    rank = dist.get_rank()
    ref = _build(build)
    ref_twin = copy.deepcopy(ref) if build.get("twin") else None
    ref_loop = Loop(ref, _optimizer(ref, build), PlainDP(ref), rank, stage, sharded=False, twin=ref_twin,
                    dtype=build.get("dtype", torch.float32))
    fn(ref_loop)
    reference = {k: v.detach().cpu().clone() for k, v in ref.state_dict().items()}

    model = _build(build)
    config = {"wrap": build.get("wrap", (build.get("block", Block).__name__,)), "bucket_size_mb": 0, **config}
    zcfg = hf_zero.ZeroConfig(stage=stage, **config)
    twin = copy.deepcopy(model) if build.get("twin") else None
    try:
        model, opt = hf_zero.initialize(model, _optimizer(model, build), zcfg)
        loop = Loop(model, opt, Idle(), rank, stage, sharded=True, twin=twin, dtype=build.get("dtype", torch.float32))
        fn(loop)
        state = hf_zero.full_state_dict(model, rank0_only=False)
    except Exception as e:  # noqa: BLE001 - the refusal goes back to the test
        return {"error": f"{type(e).__name__}: {e}", "reference": ref_loop.record}
    return {
        "error": None,
        "reference": ref_loop.record,
        "record": loop.record,
        "weights": {k: float((state[k].cpu() - v).abs().max() / (v.abs().max() + 1e-12)) for k, v in reference.items()},
        "missing": sorted(set(reference) - set(state)),
    }


# ---- a buffer whose shape changes, resumed through the model's own load_state_dict --------------------
class GrowingMemory(Net):
    """A model with a persistent buffer that grows every step (a memory bank), and a `load_state_dict` override
    that resizes it to the saved shape before loading (what the stock Trainer's resume calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("memory", torch.zeros(1, D))

    def remember(self, h: torch.Tensor) -> None:
        self.memory = torch.cat([self.memory, h.detach().mean(0, keepdim=True)])

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        if "memory" in state_dict:
            self.memory = torch.zeros_like(state_dict["memory"])
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def resume_growing_buffer(stage: int, path: str) -> dict[str, Any]:
    """Train 2 steps (the buffer grows to 3 rows), save a checkpoint, load it into a fresh sharded model: the
    buffer comes back with its saved shape and values, through the model's override."""
    model = GrowingMemory()
    model, opt = hf_zero.initialize(model, _optimizer(model, {}), hf_zero.ZeroConfig(stage=stage, wrap=("Block",)))
    loop = Loop(model, opt, Idle(), dist.get_rank(), stage, sharded=True)
    for step in range(2):
        loss = loop.loss(step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.remember(torch.full((1, D), float(step + 1)))
    hf_zero.save_checkpoint(path, model, opt)
    fresh = GrowingMemory()
    fresh, fresh_opt = hf_zero.initialize(
        fresh, _optimizer(fresh, {}), hf_zero.ZeroConfig(stage=stage, wrap=("Block",))
    )
    hf_zero.load_checkpoint(path, fresh, fresh_opt)
    return {"saved": model.memory.tolist(), "loaded": fresh.memory.tolist()}
