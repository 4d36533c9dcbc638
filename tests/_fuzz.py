"""A differential fuzzer: training programs drawn from a grammar of what users do (tests/_fuzz_grammar.py), run
under torch's DDP and under hf_zero at stages 1-3 on the same ranks, compared number by number; under bf16 mixed
precision, against hf_zero's own stage 0 ([Note: fuzz mixed precision]).

`run_program` runs one program on every rank of a pool: under `DistributedDataParallel` (its defaults,
`find_unused_parameters=True`), then under hf_zero at each stage, from the same weights and data. The outcome of a
stage is `exact` (losses, returned norms, eval losses, every final weight and buffer within `TOL`), `refused` (a
`ValueError` / `TypeError` naming the pattern: never silent), or `diverged` / `crashed` with what differed.
`shrink` removes operations and settings while the divergence stays, for the smallest program that shows it.

[Note: fuzz noise]
Adam divides a gradient by the root of its running square: where a gradient is tiny, a difference of one rounding
in the clipping coefficient or a summation order moves that element by up to a full step, so a correct fp32 run
can land 1e-5 from DDP's on one element. A program that differs in fp32 is run again in float64 on both sides
(the engine keeps float64 through masters, norms and reductions): exact there (1e-9), the fp32 difference was
rounding and is counted as `noise`; different there too, it is a divergence, shrunk in float64.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hf_zero
from tests._fuzz_grammar import FORWARDS, MORE_OPTIMIZERS, STAGES, Program, draw, muon_and_adamw
from tests._fuzz_models import FlowNet, unit_classes
from tests._peer_harness import D_IN, D_OUT

__all__ = ["FORWARDS", "MORE_OPTIMIZERS", "STAGES", "Program", "draw", "check", "run_program", "shrink"]

TOL = {"float32": 1e-5, "float64": 1e-9, "mixed": 1e-6}  # relative; mixed: against stage 0, bitwise but for 1e-6
REFUSALS = ("ValueError", "TypeError")


def _forward_kwargs(forward: str) -> dict[str, Any]:
    if forward.startswith("skip:"):
        return {"skip": (int(forward.split(":")[1]),)}
    return {"reuse": {"reuse": 2}, "recompute": {"recompute": True}, "spare": {"spare": True}}.get(forward, {})


def _snapshot_or_rewind(run: _Run, kind: str) -> None:
    """`snapshot`: the model's `state_dict()` kept (full tensors under hf_zero); `rewind`: loaded back, if one was
    taken (a rewind to a known-good point: the optimizer's state stays)."""
    if kind == "snapshot":
        run.snapshot = {k: v.detach().clone() for k, v in run.inner.state_dict().items()}
    elif run.snapshot is not None:
        run.inner.load_state_dict(run.snapshot)


# ---- running one program on this rank ------------------------------------------------------------------------
def _model(program: Program) -> nn.Module:
    torch.manual_seed(program.seed)
    model = FlowNet(program.blocks, program.batchnorm, program.flow, program.tied_head)
    if program.tie:
        model.blocks[2].lin.weight = model.blocks[0].lin.weight
    return model.to(getattr(torch, program.dtype))


def _groups(program: Program, model: nn.Module) -> Any:
    """The optimizer's parameters as `program.groups` splits them (the `lr` of a group scales the optimizer's), the
    block `program.left_out` left out."""
    groups = _all_groups(program, model)
    if program.left_out < 0:
        return groups
    out = {id(p) for p in model.blocks[program.left_out].parameters()}
    if program.groups == "named":
        return [(n, p) for n, p in groups if id(p) not in out]
    if not isinstance(groups, list):
        return [p for p in groups if id(p) not in out]
    kept = [{**g, "params": [p for p in g["params"] if id(p) not in out]} for g in groups]
    return [g for g in kept if g["params"]]


def _all_groups(program: Program, model: nn.Module) -> Any:
    named = list(model.named_parameters())
    if program.groups == "named":
        return named
    if program.groups == "decay":  # the Trainer's split: no decay on biases and normalisation weights
        plain = [p for n, p in named if n.endswith("bias") or ".norm." in n or n.startswith("bn.")]
        return [{"params": [p for _, p in named if not any(p is q for q in plain)]},
                {"params": plain, "weight_decay": 0.0}]
    if program.groups == "blocks":  # discriminative learning rates: deeper blocks faster, the rest in one group
        groups: list[dict[str, Any]] = [{"params": [p for n, p in named if not n.startswith("blocks.")]}]
        seen: set[int] = set()  # a weight tied across blocks goes with the first
        for i, block in enumerate(model.blocks):
            mine = [p for p in block.parameters() if id(p) not in seen]
            seen.update(id(p) for p in mine)
            groups.append({"params": mine, "lr_scale": 1.0 + i})
        return groups
    return model.parameters()


def _optimizer(program: Program, model: nn.Module) -> Any:
    """The program's optimizer, or (`optimizers=2`) one over the blocks' parameters and one over the rest."""
    params = _groups(program, model)
    if program.optimizers == 1:
        opt = _make_optimizer(program, params)
    else:
        given = list(params)
        groups = given if isinstance(given[0], dict) else [{"params": given}]
        blocks = {id(p) for p in model.blocks.parameters()}
        sides = [[{**g, "params": [p for p in g["params"] if (id(p) in blocks) == inside]} for g in groups]
                 for inside in (True, False)]
        opt = Several([_make_optimizer(program, [g for g in side if g["params"]]) for side in sides])
    for group in opt.param_groups:
        group["lr"] = group["lr"] * group.pop("lr_scale", 1.0)
    return opt


class Several:
    """Optimizers (or their schedulers) over disjoint parameters, each called in turn as a loop with several writes
    it; `state_dict()` is the list of theirs."""

    def __init__(self, members: list[Any]) -> None:
        self.members = members

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for m in self.members for g in m.param_groups]

    def step(self) -> None:
        for m in self.members:
            m.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.members:
            m.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> list[Any]:
        return [m.state_dict() for m in self.members]

    def load_state_dict(self, states: list[Any]) -> None:
        for m, state in zip(self.members, states):
            m.load_state_dict(state)


def _each(opt: Any) -> Any:
    """What hf_zero's calls take: the list of several optimizers, or the one."""
    return opt.members if isinstance(opt, Several) else opt


def _each_list(opt: Any) -> list[Any]:
    return opt.members if isinstance(opt, Several) else [opt]


def _make_optimizer(program: Program, params: Any) -> torch.optim.Optimizer:
    if program.optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    if program.optimizer == "adam_amsgrad":
        return torch.optim.Adam(params, lr=0.01, amsgrad=True)
    if program.optimizer == "rmsprop":
        return torch.optim.RMSprop(params, lr=0.005, momentum=0.5)
    if program.optimizer == "adafactor":  # reads each parameter's shape: stepped whole, on the rank that owns it
        return torch.optim.Adafactor(params, lr=0.01)
    if program.optimizer == "muon_adamw":
        return muon_and_adamw(params)
    if program.optimizer in MORE_OPTIMIZERS:
        return MORE_OPTIMIZERS[program.optimizer](params)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _scheduler(program: Program, opt: Any) -> Any:
    if not program.scheduler:
        return None
    if isinstance(opt, Several):
        return Several([torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in opt.members])
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _scaler(program: Program) -> Any:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) if program.amp else None


def _batch(step: int, micro: int, rank: int, dtype: torch.dtype, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x, y = torch.randn(4, D_IN, generator=g) * (1 + rank), torch.randn(4, D_OUT, generator=g)
    return x[:rows].to(dtype), y[:rows].to(dtype)


def _config(program: Program, stage: int, scratch: str) -> hf_zero.ZeroConfig:
    """`scratch`: a folder of this run's own, where `offload="disk"` keeps its files."""
    return hf_zero.ZeroConfig(
        stage=stage, wrap=unit_classes(program.flow), bucket_size_mb=program.bucket_mb, prefetch=program.prefetch,
        offload_optimizer=program.offload != "none", offload_params=program.offload == "params" and stage == 3,
        offload_dir=f"{scratch}/offload" if program.offload == "disk" else None,
        no_sync_keeps_grads=program.keep_grads, shard_group_size=1 if program.replicas else None,
        broadcast_buffers=not program.local_buffers, collectives="native" if program.native else "auto",
        mixed_precision="bf16" if program.mixed else "no",
    )


@dataclasses.dataclass
class _Run:
    """One run's live objects: the model as the loop calls it, its optimizer and scheduler, and what it records."""

    model: nn.Module
    inner: nn.Module  # the module whose parameters are frozen and compared (DDP's `.module`)
    opt: Any
    sched: Any
    no_sync: Any
    dtype: torch.dtype
    scaler: Any = None  # a torch.amp.GradScaler, or None
    uneven: bool = False  # `Program.uneven`
    left_out: int = -1  # `Program.left_out`
    joined: bool = False  # a `join` op added it to the optimizer
    zero: str = "optimizer"  # `Program.zero`
    snapshot: dict[str, torch.Tensor] | None = None  # the weights a `snapshot` op kept
    saved: Any = None  # what an `asave` op kept: DDP's (model, optimizer) state dicts; hf_zero's pending save
    record: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def note(self, key: str, value: Any) -> None:
        self.record.setdefault(key, []).append(float(value))


def _apply(run: _Run, op: tuple[Any, ...], step: int, rank: int) -> None:
    kind = op[0]
    if kind == "step":
        _, micros, use_no_sync, clip, set_to_none = op[:5]
        forward = op[5] if len(op) > 5 else "plain"
        kwargs = _forward_kwargs(forward)
        run.model.train(forward != "evalmode")
        for micro in range(micros):
            x, y = _batch(step, micro, rank, run.dtype, 3 if run.uneven and rank == 1 and micro == 0 else 4)
            quiet = use_no_sync and micro < micros - 1
            with run.no_sync() if quiet else contextlib.nullcontext():
                loss = nn.functional.mse_loss(run.model(x, **kwargs).to(y.dtype), y) / micros
                (run.scaler.scale(loss) if run.scaler is not None else loss).backward()
            run.note("loss", loss.detach())
        params = list(run.inner.parameters())
        if run.scaler is not None and clip is not None:
            for opt in _each_list(run.opt):
                run.scaler.unscale_(opt)
        if clip is not None and clip[0] == "norm":
            norm_type = float(clip[2]) if clip[2] != "inf" else float("inf")
            run.note("norm", torch.nn.utils.clip_grad_norm_(params, clip[1], norm_type=norm_type))
        elif clip is not None and clip[0] == "value":
            torch.nn.utils.clip_grad_value_(params, clip[1])
        elif clip is not None:  # hf_zero's own APIs (the sharded optimizer's, the model's); torch's under DDP
            owner = run.opt if clip[0] == "optimizer" else run.model
            sharded = hasattr(owner, "clip_grad_norm_") and run.model is run.inner
            norm = owner.clip_grad_norm_(clip[1]) if sharded else torch.nn.utils.clip_grad_norm_(params, clip[1])
            run.note("norm", norm)
        if run.scaler is not None:
            for opt in _each_list(run.opt):
                run.scaler.step(opt)
            run.scaler.update()
            run.note("scale", run.scaler.get_scale())
        else:
            run.opt.step()
        if run.sched is not None:
            run.sched.step()
        (run.model if run.zero == "model" else run.opt).zero_grad(set_to_none=set_to_none)
        run.model.train()
    elif kind in ("snapshot", "rewind"):
        _snapshot_or_rewind(run, kind)
    elif kind == "eval":
        run.model.eval()
        with torch.no_grad():
            x, y = _batch(900 + step, 0, rank, run.dtype)
            run.note("eval", nn.functional.mse_loss(run.model(x).to(y.dtype), y))
        run.model.train()
    elif kind == "nograd":
        with torch.no_grad():
            run.model(_batch(800 + step, 0, rank, run.dtype)[0])
    elif kind == "freeze":
        for p in run.inner.blocks[op[1]].parameters():
            p.requires_grad_(not op[2])
    elif kind == "lr":
        for group in run.opt.param_groups:
            group["lr"] = group["lr"] * op[1]
    elif kind == "join":  # the block left out joins the (first) optimizer as a group of its own
        block = run.inner.blocks[run.left_out]
        named = "param_names" in _each_list(run.opt)[0].param_groups[0]  # torch: all groups named, or none
        params = list(block.named_parameters(prefix=f"blocks.{run.left_out}")) if named else list(block.parameters())
        _each_list(run.opt)[0].add_param_group({"params": params, "lr": 0.004})
        run.joined = True


def _ddp(program: Program, model: nn.Module) -> DistributedDataParallel:
    """DDP as its users build it; `local_buffers`: no buffer broadcast before the forwards (`forward_sync_buffers`:
    rank 0's still taken at construction, as a resumed job loads rank 0's checkpoint)."""
    return DistributedDataParallel(model, find_unused_parameters=True, forward_sync_buffers=not program.local_buffers)


def _run_ddp(program: Program, rank: int) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    model = _model(program)
    ddp = _ddp(program, model)  # built over every parameter: DDP's reducer
    _freeze_at_start(program, model)  # never reduces one frozen when it is built, so it is frozen after
    opt = _optimizer(program, model)
    run = _Run(ddp, model, opt, _scheduler(program, opt), ddp.no_sync, getattr(torch, program.dtype), _scaler(program),
               program.uneven, left_out=program.left_out, zero=program.zero)
    for step, op in enumerate(program.ops):
        if op[0] in ("asave", "aload"):
            _keep_or_load(run, op[0])
        elif op[0] == "resume":  # a resumed DDP job: a fresh wrapper (rank 0's buffers, its flag due) on the same state,
            model.zero_grad(set_to_none=True)  # and no `.grad` (a fresh process has none, zeros kept or not)
            frozen = [p for p in model.parameters() if not p.requires_grad]
            for p in frozen:  # DDP's reducer holds only what requires grad when it is built
                p.requires_grad_(True)
            ddp = _ddp(program, model)
            for p in frozen:
                p.requires_grad_(False)
            run.model, run.no_sync = ddp, ddp.no_sync
        else:
            _apply(run, op, step, rank)
    return run.record, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _keep_or_load(run: _Run, kind: str) -> None:
    """DDP's side of `asave` / `aload`: rank 0's model and optimizer state dicts kept (what DDP's checkpoint holds:
    the buffers as rank 0 has them), then loaded back on every rank; the scheduler and the scaler go on."""
    if kind == "asave":
        saved = [copy.deepcopy((run.inner.state_dict(), run.opt.state_dict()))]
        dist.broadcast_object_list(saved, 0)
        run.saved = saved[0]
    elif run.saved is not None:
        run.inner.load_state_dict(run.saved[0])
        run.opt.load_state_dict(copy.deepcopy(run.saved[1]))


def _freeze_at_start(program: Program, model: nn.Module) -> None:
    for i in program.frozen:
        for p in model.blocks[i].parameters():
            p.requires_grad_(False)


def _sharded(program: Program, stage: int, scratch: str, resumed: bool = False) -> _Run:
    model = _model(program)
    if not resumed:
        _freeze_at_start(program, model)
    model, opt = hf_zero.initialize(model, _each(_optimizer(program, model)), _config(program, stage, scratch))
    opt = Several(opt) if isinstance(opt, list) else opt
    return _Run(model, model, opt, _scheduler(program, opt), model.no_sync, getattr(torch, program.dtype),
                _scaler(program), program.uneven, left_out=program.left_out, zero=program.zero)


def _resume(run: _Run, program: Program, stage: int, directory: str) -> _Run:
    """Save a checkpoint, build a fresh sharded model at `stage` (`refrozen`: the blocks frozen at the start frozen
    again before `initialize`, as the same script does), load it; what was frozen at the save is frozen, the rest
    trains (a block frozen at `initialize` then starts training: [Note: requires_grad after initialize])."""
    scaler_state = run.scaler.state_dict() if run.scaler is not None else None
    hf_zero.save_checkpoint(directory, run.model, _each(run.opt), metadata={"scaler": scaler_state})
    frozen = [name for name, p in run.inner.named_parameters() if not p.requires_grad]
    sched_state = run.sched.state_dict() if run.sched is not None else None
    fresh = _sharded(dataclasses.replace(program, seed=program.seed + 1), stage, f"{directory}-resumed",
                     resumed=not program.refrozen)  # (another seed: the load must win)
    if run.joined:  # the same script adds the group again before the load
        _apply(fresh, ("join",), 0, 0)
    meta = hf_zero.load_checkpoint(directory, fresh.model, _each(fresh.opt))
    if fresh.scaler is not None:
        fresh.scaler.load_state_dict(meta["scaler"])
    fresh.record, fresh.snapshot, fresh.saved = run.record, run.snapshot, run.saved
    for name, p in fresh.inner.named_parameters():
        p.requires_grad_(name not in frozen)
    if fresh.sched is not None and sched_state is not None:
        fresh.sched.load_state_dict(sched_state)
    return fresh


def _run_sharded(program: Program, stage: int, rank: int, directory: str) -> tuple[dict, dict]:
    saves: list[Any] = []  # every asynchronous save started
    try:
        return _run_ops(_sharded(program, stage, directory), program, rank, directory, saves)
    except BaseException:
        for save in saves:  # a refused or crashed run's save in flight: written before the next run starts
            with contextlib.suppress(Exception):
                save.wait()
        raise


def _run_ops(run: _Run, program: Program, rank: int, directory: str, saves: list[Any]) -> tuple[dict, dict]:
    for step, op in enumerate(program.ops):
        if op[0] == "resume":
            run = _resume(run, program, op[1], f"{directory}/step{step}")
        elif op[0] == "asave":  # [Note: asynchronous save]: training goes on while the checkpoint is written
            run.saved = hf_zero.save_checkpoint(
                f"{directory}/async", run.model, _each(run.opt), async_save=True, snapshot_budget_bytes=op[1]
            )
            saves.append(run.saved)
        elif op[0] == "aload" and run.saved is not None:
            hf_zero.load_checkpoint(run.saved.wait(), run.model, _each(run.opt))
        elif op[0] != "aload":
            _apply(run, op, step, rank)
    if run.saved is not None:
        run.saved.wait()  # written before the run's folder goes
    state = hf_zero.full_state_dict(run.model, rank0_only=False)
    return run.record, {k: v.detach().clone() for k, v in state.items()}


def _difference(reference: tuple[dict, dict], got: tuple[dict, dict], tol: float) -> str | None:
    """What differs beyond `tol` between two runs' records and final states, or None."""
    (ref_record, ref_state), (record, state) = reference, got
    if ref_record.keys() != record.keys():
        return f"recorded {sorted(record)}, DDP {sorted(ref_record)}"
    for key, values in ref_record.items():
        if len(values) != len(record[key]):
            return f"{key}: {len(record[key])} values, DDP {len(values)}"
        for i, (a, b) in enumerate(zip(record[key], values)):
            if abs(a - b) > tol * max(abs(b), 1e-6):
                return f"{key}[{i}]: {a!r}, DDP {b!r}"
    for name, value in ref_state.items():
        if name not in state:
            return f"{name} missing"
        got_value = state[name].to(value.dtype)
        scale = float(value.abs().max()) + 1e-12
        if float((got_value - value).abs().max()) > tol * scale:
            return f"{name}: {float((got_value - value).abs().max()):.3g} from DDP's (max {scale:.3g})"
    return None


def run_program(text: str, stages: tuple[int, ...] = STAGES) -> dict[int, str]:
    """On every rank of a pool: the outcome of the program (`Program.to_json`) at each stage, as
    `exact`, `refused: <message>`, `diverged: <what>` or `crashed: <type>: <message>`."""
    program = Program.from_json(text)
    library = logging.getLogger("hf_zero")
    level = library.level
    library.setLevel(logging.WARNING)  # no start-up line per run
    try:
        return _outcomes(program, stages)
    finally:
        library.setLevel(level)


def _outcomes(program: Program, stages: tuple[int, ...]) -> dict[int, str]:
    rank = dist.get_rank()
    directory = [tempfile.mkdtemp(prefix="hf_zero-fuzz-") if rank == 0 else ""]
    dist.broadcast_object_list(directory, 0)
    outcomes: dict[int, str] = {}
    try:
        reference: Any = _mixed_reference(program, rank, directory[0]) if program.mixed else _run_ddp(program, rank)
        for stage in stages:
            try:
                got = _run_sharded(program, stage, rank, f"{directory[0]}/stage{stage}")
            except Exception as e:  # noqa: BLE001 - the outcome goes back to the driver
                kind = "refused" if type(e).__name__ in REFUSALS and "hf_zero" in str(e) else "crashed"
                outcomes[stage] = f"{kind}: {type(e).__name__}: {e}"
                continue
            if isinstance(reference, str):  # the reference was refused: so must this stage be
                outcomes[stage] = f"diverged: stage 0 {reference}, this stage ran"
                continue
            difference = _difference(reference, got, TOL["mixed" if program.mixed else program.dtype])
            outcomes[stage] = "exact" if difference is None else f"diverged: {difference}"
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory[0], ignore_errors=True)
    return outcomes


def _mixed_reference(program: Program, rank: int, directory: str) -> tuple[dict, dict] | str:
    """[Note: fuzz mixed precision]
    Under bf16 mixed precision DDP is no reference (its bf16 arithmetic is autocast's, not a bf16 copy of the
    weights), but hf_zero's stage 0 is: every weight whole on every rank, gradients all-reduced. With one micro-batch
    a step, stages 1-3 compute the same bf16 products from the same bf16 casts of the same fp32 masters and reduce
    the same gradients in fp32 (with 2 ranks, or 3, every order of the sum rounds alike), so they must equal it to
    the last bit (1e-6 allowed); offload and a shard group per rank are the stage's own, the rest the program's.
    Returns the reference's record and final state, or the refusal that stopped it."""
    try:
        plain = dataclasses.replace(program, offload="none", replicas=False)
        return _run_sharded(plain, 0, rank, f"{directory}/stage0")
    except Exception as e:  # noqa: BLE001 - a refusal is the reference's outcome
        if type(e).__name__ in REFUSALS and "hf_zero" in str(e):
            return f"refused: {type(e).__name__}: {e}"[:200]
        raise


# ---- the driver's side -------------------------------------------------------------------------------------------
def verdict(per_rank: list[dict[int, str]]) -> dict[int, str]:
    """One outcome per stage over the ranks: a refusal must be on every rank (else `diverged: refused on some`)."""
    merged: dict[int, str] = {}
    for stage in per_rank[0]:
        outcomes = [r[stage] for r in per_rank]
        bad = [o for o in outcomes if o.startswith(("diverged", "crashed"))]
        if bad:
            merged[stage] = bad[0]
        elif all(o.startswith("refused") for o in outcomes):
            merged[stage] = outcomes[0]
        elif any(o.startswith("refused") for o in outcomes):
            merged[stage] = "diverged: refused on some ranks only"
        else:
            merged[stage] = "exact"
    return merged


def is_silent(outcome: str) -> bool:
    return outcome.startswith(("diverged", "crashed"))


def shrink(program: Program, fails: Any) -> Program:
    """The smallest program found, removing operations and simplifying settings, for which `fails(program)` holds."""
    simpler = [dict(amp=False), dict(frozen=()), dict(batchnorm=False), dict(tie=False), dict(scheduler=False), dict(offload="none"),
               dict(prefetch=1), dict(optimizer="adamw"), dict(bucket_mb=0), dict(groups="one"),
               dict(keep_grads=False), dict(replicas=False), dict(flow="plain"),
               dict(local_buffers=False), dict(native=False), dict(uneven=False), dict(world=2), dict(optimizers=1),
               dict(refrozen=False)]
    changed = True
    while changed:
        changed = False
        for i in range(len(program.ops)):
            candidate = dataclasses.replace(program, ops=program.ops[:i] + program.ops[i + 1 :])
            if any(op[0] == "step" for op in candidate.ops) and fails(candidate):
                program, changed = candidate, True
                break
        for i, op in enumerate(program.ops):  # a step's forward made plain
            if op[0] == "step" and len(op) > 5 and op[5] != "plain":
                candidate = dataclasses.replace(program, ops=program.ops[:i] + (op[:5] + ("plain",),) + program.ops[i + 1 :])
                if fails(candidate):
                    program, changed = candidate, True
        for change in simpler:
            candidate = dataclasses.replace(program, **change)
            if candidate != program and fails(candidate):
                program, changed = candidate, True
    return program


def write_report(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


@dataclasses.dataclass
class Finding:
    """What one program gave: the outcome per stage (`exact`, `refused: ...`, `noise`, `diverged: ...`), and for a
    divergence the shrunk program that shows it."""

    program: Program
    outcomes: dict[int, str]
    shrunk: Program | None = None

    @property
    def silent(self) -> bool:
        return any(is_silent(o) for o in self.outcomes.values())


def outcomes_of(
    pools: Any, program: Program, stages: tuple[int, ...] = STAGES, timeout: float = 180.0
) -> dict[int, str]:
    """`run_program` on every rank of `pools(program.world)` (tests/_dist.py's pools); a hang or an error outside
    the runs is a crash."""
    try:
        results = pools(program.world).run(run_program, program.to_json(), stages, timeout=timeout)
    except TimeoutError as e:
        return {stage: f"crashed: hang: {e}" for stage in stages}
    failed = [r for r in results if not r.ok]
    if failed:
        return {stage: f"crashed: {failed[0].error_type}: {failed[0].error}" for stage in stages}
    return verdict([r.value for r in results])


def check(pools: Any, program: Program, shrink_found: bool = True) -> Finding:
    """The program's finding: fp32 outcomes, fp32 differences re-run in float64 ([Note: fuzz noise]), a
    divergence that stays shrunk (in float64)."""
    outcomes = outcomes_of(pools, program)
    for stage, outcome in outcomes.items():
        if not outcome.startswith("diverged") or program.mixed:  # bf16: no float64 re-run
            continue
        again = outcomes_of(pools, dataclasses.replace(program, dtype="float64"), (stage,))[stage]
        outcomes[stage] = "noise" if again == "exact" else again
    finding = Finding(program, outcomes)
    bad = [s for s, o in outcomes.items() if is_silent(o)]
    if bad and shrink_found:
        stage = bad[0]
        kind = outcomes[stage].split(":")[0]  # a crash shrinks to a crash, not to a smaller program's fp32 noise
        wide = dataclasses.replace(program, dtype="float64") if kind == "diverged" and not program.mixed else program
        finding.shrunk = shrink(wide, lambda q: outcomes_of(pools, q, (stage,))[stage].startswith(kind))
    return finding
