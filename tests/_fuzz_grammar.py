"""The fuzzer's grammar (tests/_fuzz.py runs it): a `Program` is a model (blocks, an optional BatchNorm, optionally a
tied weight, the data flow between its blocks: plain, mixtures of experts with a router loss, a long skip connection,
a root parameter every block reads, the first block's bias passed to the rest; tests/_fuzz_models.py), an optimizer
(torch's and the ones users pick) and scheduler, engine settings (offload, prefetch, buckets, unsharded gradients
kept under `no_sync`, a shard group per rank, each rank's buffers, the backend's own collectives, bf16 mixed
precision, of a model in fp32 or loaded in bf16), a world of 2 or 3 ranks, and a list of operations between steps:
training steps of 1-3 micro-batches (the first ones under `no_sync` or not; one under mixed precision; rank 1's first
one smaller, or not), clipping by torch's `clip_grad_norm_` (2, 1, inf) or `clip_grad_value_` or hf_zero's own,
`zero_grad(set_to_none=...)`, freezing and unfreezing a block, evaluation forwards, a forward without grad in train
mode, a learning-rate change, and a checkpoint saved and resumed into a fresh model at another stage (its blocks
frozen at the start frozen again before `initialize`, as the same script does, or not). A step's forwards are plain,
or skip a block (on every rank), or run block 0 twice, or recompute every block in backward (activation
checkpointing), or add the otherwise unused spare head, or run in eval mode (BatchNorm's running statistics, no
update); the weights may be snapshotted (`state_dict()`) and rewound to the snapshot later (`load_state_dict`, the
optimizer's state kept); a checkpoint may be saved asynchronously, training going on while it is written, and loaded
back later (DDP: the model's and optimizer's state dicts kept and loaded); the optimizer's parameters are one group,
or the Trainer's two (no weight decay on biases and norms), or a group per block with its own learning rate, in one
optimizer or in two over disjoint parameters (the blocks' and the rest, `initialize(model, [a, b])`), a block may be left out of it (its gradients adding up through `optimizer.zero_grad()`
as in torch) and added as a group later (`add_param_group`); the gradients are dropped by the optimizer's
`zero_grad` or the model's. Every program
is made from its seed (`draw`), so a seed names it; a setting added later is drawn after the others, so a seed keeps
what it drew.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import torch

from tests._fuzz_models import FLOWS

STAGES = (1, 2, 3)


@dataclasses.dataclass(frozen=True)
class Program:
    """One training program (see the module docstring); `ops` are tuples `(kind, *arguments)`."""

    seed: int
    blocks: int = 3
    batchnorm: bool = False
    tie: bool = False
    optimizer: str = "adamw"  # adamw | sgd | adam_amsgrad | rmsprop | adafactor (whole parameters, each on its
    # owner) | muon_adamw (Muon on the matrices, AdamW on the rest: whole parameters) | one of MORE_OPTIMIZERS
    scheduler: bool = False
    offload: str = "none"  # none | optimizer | params | disk (optimizer state and masters in files)
    prefetch: int = 1
    bucket_mb: int = 0  # ZeroConfig.bucket_size_mb: 0, a bucket per unit; 25, every unit of this model in one
    ops: tuple[tuple[Any, ...], ...] = ()  # a step: ("step", micros, no_sync, clip, set_to_none[, forward])
    frozen: tuple[int, ...] = ()  # blocks frozen before the model is wrapped (unfrozen later by a `freeze` op)
    amp: bool = False  # steps through torch.amp.GradScaler (scale, unscale_ before clipping, step, update)
    groups: str = "one"  # one | decay (the Trainer's: none on biases and norms) | blocks (a learning rate per block)
    # | named (torch's named parameters, `model.named_parameters()`: one optimizer of torch's)
    keep_grads: bool = False  # ZeroConfig.no_sync_keeps_grads: unsharded gradients kept through a no_sync window
    replicas: bool = False  # ZeroConfig.shard_group_size=1: each rank a shard group of its own (hybrid sharding)
    flow: str = "plain"  # how tensors move between the blocks (tests/_fuzz_models.py: FLOWS)
    local_buffers: bool = False  # each rank's buffers (DDP's and ZeroConfig's broadcast_buffers=False)
    native: bool = False  # ZeroConfig.collectives="native": the backend's own collectives (NCCL's path; gloo composes)
    uneven: bool = False  # rank 1's first micro-batch of each step has 3 rows, the others 4
    world: int = 2  # ranks (3: shards of units whose sizes 3 does not divide, padded)
    mixed: bool = False  # bf16 mixed precision, against hf_zero's stage 0 under it ([Note: fuzz mixed precision])
    refrozen: bool = False  # a `resume` freezes `frozen` again before `initialize` (the same script), unfreezes after
    optimizers: int = 1  # 2: the blocks' parameters in one optimizer, the rest in another (`initialize(model, [a, b])`)
    dtype: str = "float32"  # the model's: float64, the re-run that tells fp32 rounding from a real difference ([Note:
    # fuzz noise]); bfloat16, under mixed precision (a bf16 checkpoint as transformers loads it)
    left_out: int = -1  # a block left out of the optimizer (it trains, its gradients add up through
    # `optimizer.zero_grad()`); a `join` op adds it as a group later (`add_param_group`)
    tied_head: bool = False  # `flow="tokens"`: a second head tied to the embedding (tests/_fuzz_models.py)
    zero: str = "optimizer"  # who drops the gradients after a step: `optimizer.zero_grad()`, or `model.zero_grad()`
    # (the Trainer's: every parameter's, the left-out block's too)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> Program:
        raw = json.loads(text)
        raw["ops"] = tuple(tuple(tuple(a) if isinstance(a, list) else a for a in op) for op in raw["ops"])
        raw["frozen"] = tuple(raw.get("frozen", ()))
        return Program(**raw)


def draw(seed: int) -> Program:
    """The program of `seed`: its settings and 2-6 operations, at least one training step."""
    rng = random.Random(seed)
    blocks = rng.choice((2, 3))
    ops: list[tuple[Any, ...]] = []
    for _ in range(rng.randint(2, 6)):
        kind = rng.choices(("step", "eval", "nograd", "freeze", "lr", "resume"), weights=(8, 2, 1, 2, 1, 1))[0]
        if kind == "step":
            clip = rng.choice((None, None, ("norm", 0.5, 2.0), ("norm", 0.3, 1.0), ("norm", 0.2, "inf"),
                               ("value", 0.05), ("optimizer", 0.4), ("model", 0.4)))
            ops.append(("step", rng.randint(1, 3), rng.random() < 0.7, clip, rng.random() < 0.7))
        elif kind == "freeze":
            ops.append(("freeze", rng.randrange(blocks), rng.random() < 0.5))
        elif kind == "lr":
            ops.append(("lr", rng.choice((0.5, 2.0))))
        elif kind == "resume":
            ops.append(("resume", rng.choice(STAGES)))
        else:
            ops.append((kind,))
    if not any(op[0] == "step" for op in ops):
        ops.append(("step", 2, True, None, True))
    program = Program(
        seed=seed,
        blocks=blocks,
        batchnorm=rng.random() < 0.4,
        tie=blocks == 3 and rng.random() < 0.3,
        optimizer=rng.choice(("adamw", "adamw", "sgd", "adam_amsgrad", "rmsprop")),
        scheduler=rng.random() < 0.3,
        offload=rng.choice(("none", "none", "optimizer", "params")),
        prefetch=rng.choice((0, 1, 2)),
        ops=tuple(ops),
        frozen=(rng.randrange(blocks),) if rng.random() < 0.25 else (),
        amp=rng.random() < 0.25,
    )
    # drawn after the settings above, so that a seed keeps what it drew before these were added
    whole, disk, bucket = rng.random() < 0.15, rng.random() < 0.15, rng.random() < 0.3
    # and these after those
    groups = rng.choice(("one", "one", "decay", "blocks"))
    forwards = [op + (_draw_forward(rng, blocks),) if op[0] == "step" else op for op in program.ops]
    keep_grads, replicas = rng.random() < 0.2, rng.random() < 0.15
    frozen = program.frozen
    if frozen and rng.random() < 0.4:  # two neighbouring blocks frozen at set-up (gradual unfreezing's start)
        frozen = (0, 1)
    if rng.random() < 0.25:  # a snapshot of the weights, and a rewind to it later
        at = rng.randrange(len(forwards) + 1)
        forwards.insert(at, ("snapshot",))
        forwards.insert(rng.randrange(at + 1, len(forwards) + 1), ("rewind",))
    flow = rng.choices(FLOWS, weights=(4, 1, 1, 1, 1))[0]  # and this after those
    optimizer = "adafactor" if whole else program.optimizer  # and these after that
    if rng.random() < 0.3 and not whole:
        optimizer = rng.choice(tuple(MORE_OPTIMIZERS))
    if rng.random() < 0.25:  # an asynchronous save, training on while it writes, and a load of it later
        at = rng.randrange(len(forwards) + 1)
        forwards.insert(at, ("asave", rng.choice((None, 0))))  # the snapshot budget: unbounded, or none
        forwards.insert(rng.randrange(at + 1, len(forwards) + 1), ("aload",))
    local_buffers, native, uneven = rng.random() < 0.2, rng.random() < 0.3, rng.random() < 0.2  # and these after
    world = 3 if rng.random() < 0.25 else 2  # and this after those
    mixed = rng.random() < 0.2  # and this after that: one micro-batch a step ([Note: fuzz mixed precision])
    bf16_model = rng.random() < 0.5  # and this after that: under mixed precision, the model loaded in bf16
    if rng.random() < 0.08:  # and this after that: Muon on the matrices beside AdamW, as one optimizer
        optimizer = "muon_adamw"
    optimizers = 2 if rng.random() < 0.12 else 1  # and this after that: two optimizers over disjoint parameters
    refrozen = rng.random() < 0.5  # and this after that
    left_out = rng.randrange(blocks) if rng.random() < 0.15 else -1  # and these after that
    if left_out >= 0 and optimizer in JOINABLE and not program.scheduler and rng.random() < 0.6:  # (torch's
        # schedulers refuse a group added after them)
        forwards.insert(_join_at(forwards, rng), ("join",))
    zero = "model" if rng.random() < 0.25 else "optimizer"  # and this after those
    if flow == "plain" and rng.random() < 0.3:  # and this after that: the input as token ids into an embedding
        flow = "tokens"
    tied_head = flow == "tokens" and rng.random() < 0.5  # and this after that
    if groups == "one" and optimizers == 1 and optimizer != "muon_adamw" and rng.random() < 0.3:  # and this after
        groups = "named"
    if mixed:
        forwards = [op[:1] + (1,) + op[2:] if op[0] == "step" else op for op in forwards]
    return dataclasses.replace(
        program,
        optimizer=optimizer,
        offload=("disk" if optimizers == 1 else "optimizer") if disk else program.offload,  # the files: one optimizer's
        bucket_mb=25 if bucket else 0,
        groups=groups,
        ops=tuple(forwards),
        frozen=frozen,
        keep_grads=keep_grads,
        replicas=replicas,
        flow=flow,
        local_buffers=local_buffers,
        native=native,
        uneven=uneven,
        world=world,
        mixed=mixed,
        amp=program.amp and not mixed and optimizers == 1,  # a scaler steps each: one without gradients raises
        dtype="bfloat16" if mixed and bf16_model else program.dtype,
        optimizers=optimizers,
        refrozen=refrozen and bool(frozen),
        left_out=left_out,
        zero=zero,
        tied_head=tied_head,
    )


# the optimizers whose torch implementation takes a group added later (torch's Adagrad makes its state at
# construction only; the composite Muon pairing splits groups itself)
JOINABLE = ("adamw", "sgd", "adam_amsgrad", "rmsprop", "adafactor", "adamw_fused", "adamw_foreach", "nadam", "radam",
            "adamax", "sgd_nesterov", "adam_maximize")


def _join_at(ops: list[tuple[Any, ...]], rng: random.Random) -> int:
    """Where a `join` goes: anywhere but between an `asave` and its `aload` (a load of a state saved with other
    groups is refused by torch's `load_state_dict` as by hf_zero's)."""
    kinds = [op[0] for op in ops]
    start = kinds.index("asave") if "asave" in kinds else None
    end = kinds.index("aload") if "aload" in kinds else None
    spots = [i for i in range(len(ops) + 1) if start is None or end is None or not start < i <= end]
    return rng.choice(spots)


FORWARDS = ("plain", "skip", "reuse", "recompute", "spare", "evalmode")


def _draw_forward(rng: random.Random, blocks: int) -> str:
    """A step's forward: `plain`, `skip:<block>`, `reuse` (block 0 twice), `recompute` (activation checkpointing) or
    `spare` (the spare head added) or `evalmode` (the model in eval mode)."""
    kind = rng.choices(FORWARDS, weights=(4, 1, 1, 1, 1, 1))[0]
    return f"skip:{rng.randrange(blocks)}" if kind == "skip" else kind



# torch's other optimizers and implementations users pick (`--optim adamw_torch_fused`, Adagrad's state made at
# construction, NAdam's and RAdam's step-dependent terms)
MORE_OPTIMIZERS: dict[str, Any] = {
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, fused=True),
    "adamw_foreach": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, foreach=True),
    "nadam": lambda params: torch.optim.NAdam(params, lr=0.01, weight_decay=0.01, decoupled_weight_decay=True),
    "radam": lambda params: torch.optim.RAdam(params, lr=0.01, weight_decay=0.01),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05, initial_accumulator_value=0.1, lr_decay=0.01),
    "adamax": lambda params: torch.optim.Adamax(params, lr=0.01),
    "sgd_nesterov": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, dampening=0),
    "adam_maximize": lambda params: torch.optim.Adam(params, lr=0.01, maximize=True),
}


def muon_and_adamw(params: Any) -> torch.optim.Optimizer:
    """Muon on the 2-D weights and AdamW on the rest, as one optimizer (tests/_optimizers.py `MuonAndAdamW`): each
    group of `params` split in two with its settings."""
    from tests._optimizers import MuonAndAdamW

    given = list(params)
    groups = given if given and isinstance(given[0], dict) else [{"params": given}]
    matrices, rest = [], []
    for group in groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        mats = [p for p in group["params"] if p.ndim == 2]
        others = [p for p in group["params"] if p.ndim != 2]
        matrices += [{"params": mats, **settings}] if mats else []
        rest += [{"params": others, **settings}] if others else []
    return MuonAndAdamW(matrices, rest, dict(lr=0.02), dict(lr=0.01, weight_decay=0.1))
