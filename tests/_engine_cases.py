"""Engine API cases: settings, wrapping, evaluation and generation, tied weights, gradient memory, lookup gradients, optimizer chunks. Functions run on every rank of a pool (importable by name)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import hf_zero
from tests._training import make_model, make_optimizer


def config_error(kwargs: dict[str, Any]) -> str:
    """Build a ZeroConfig from `kwargs` on this rank; return the error text (no collective involved)."""
    try:
        hf_zero.ZeroConfig(**kwargs)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def initialize_with_wrap(wrap_by_rank: list[Any]) -> float:
    """initialize with a per-rank wrap setting; returns the seconds it took to fail (it must fail)."""
    model = make_model("llama")
    start = time.monotonic()
    try:
        hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=3, wrap=wrap_by_rank[dist.get_rank()]))
    except Exception:
        dist.barrier()  # the process group is still healthy: every rank got here
        raise
    return time.monotonic() - start


def initialize_a_model_changed_on_rank_1(change: str, stage: int) -> None:
    """initialize a model that rank 1 alone changed before: `change` is "resize" (the embeddings grown, as a main
    process adding tokens), "freeze" (a layer frozen) or "config" (one layer fewer); the process group must stay
    usable after the error (a barrier)."""
    from transformers import LlamaForCausalLM

    model = make_model("llama")
    if dist.get_rank() == 1:
        if change == "resize":
            model.resize_token_embeddings(model.config.vocab_size + 8)
        elif change == "freeze":
            model.model.layers[0].requires_grad_(False)
        else:
            config = model.config
            config.num_hidden_layers -= 1
            model = LlamaForCausalLM(config)
    try:
        hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=stage))
    except Exception:
        dist.barrier()
        raise


def from_pretrained_with_a_directory_per_rank(paths: list[str]) -> None:
    """`hf_zero.from_pretrained` of `paths[rank]` (one rank's directory missing or incomplete); the process group
    must stay usable after the error (a barrier)."""
    from transformers import LlamaForCausalLM

    try:
        hf_zero.from_pretrained(LlamaForCausalLM, paths[dist.get_rank()], hf_zero.ZeroConfig(stage=3))
    except Exception:
        dist.barrier()
        raise


def from_pretrained_with_a_read_failing_on_rank_1(path: str, stage: int) -> None:
    """`hf_zero.from_pretrained` of `path` where rank 1's third read of the files fails with an I/O error (a node's
    copy on a flaky filesystem); the process group must stay usable after the error (a barrier)."""
    import errno

    from transformers import LlamaForCausalLM

    from hf_zero.checkpoint import sequential

    reads = sequential.RangeReads.read
    calls = [0]

    def failing(self: Any, file: str, digest: Any = None) -> Any:
        calls[0] += 1
        if dist.get_rank() == 1 and calls[0] == 3:
            raise OSError(errno.EIO, "Input/output error (injected)", file)
        return reads(self, file, digest)

    sequential.RangeReads.read = failing  # type: ignore[method-assign]
    try:
        hf_zero.from_pretrained(LlamaForCausalLM, path, hf_zero.ZeroConfig(stage=stage))
    except Exception:
        dist.barrier()
        raise
    finally:
        sequential.RangeReads.read = reads  # type: ignore[method-assign]


def train_with_a_config_per_rank(kwargs_by_rank: list[dict[str, Any]]) -> float:
    """initialize with `kwargs_by_rank[rank]` as the ZeroConfig, then two steps; the last loss (the process group
    must stay usable after an error: a barrier)."""
    model = make_model("llama")
    try:
        model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3),
                                        hf_zero.ZeroConfig(**kwargs_by_rank[dist.get_rank()]))
    except Exception:
        dist.barrier()
        raise
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return float(loss)


def group_timeouts(overrides: dict[str, Any]) -> list[float]:
    """The timeouts (s) of the groups hf_zero made for a hybrid ZeRO-3 model (shard groups of one rank, a replicate
    group of all: their creation is what the timeout guards): the world's, the shard, replicate and save groups'."""
    def seconds(pg: Any) -> float:
        return float(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())

    model, _ = hf_zero.initialize(make_model("llama"), None,
                                  hf_zero.ZeroConfig(stage=3, shard_group_size=1, **overrides))
    engine = model.zero_engine
    return [seconds(dist.group.WORLD), seconds(engine.plan.shard_group.pg), seconds(engine.plan.replicate_group.pg),
            seconds(engine.save_group.pg)]


def initialize_with_config(kwargs: dict[str, Any]) -> None:
    model = make_model("llama")
    hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(**kwargs))


def eval_and_generate(kind: str, stage: int) -> dict[str, Any]:
    """Eval logits and greedy generation through the sharded model (every rank calls them)."""
    model = make_model(kind)
    model, _ = hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=stage))
    model.eval()
    prompt = torch.tensor([[5, 17, 42, 7]])
    with torch.no_grad():
        logits = model(input_ids=prompt).logits
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return {
        "logits": logits.numpy().copy(),
        "generated": generated.tolist(),
        "class_name": type(model).__name__,
        "is_original_class": isinstance(model, type(make_model(kind))),
        "has_config": model.config.model_type,
    }


def tied_weights_stay_tied() -> dict[str, Any]:
    model = make_model("falcon")
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=3))
    same_object = model.lm_head.weight is model.transformer.word_embeddings.weight
    batch = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad()
    state = hf_zero.full_state_dict(model)
    if dist.get_rank() != 0:
        return {"same_object": same_object}
    return {
        "same_object": same_object and model.lm_head.weight is model.transformer.word_embeddings.weight,
        "equal_values": bool(torch.equal(state["lm_head.weight"], state["transformer.word_embeddings.weight"])),
    }


def gradient_memory_over_steps(stage: int) -> dict[str, Any]:
    """Gradient bytes this rank holds at each point of two training steps ([Note: gradient shard
    lifetime]): none before the first backward and after each zero_grad."""
    model = make_model("llama")
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=stage))
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    engine = model.zero_engine

    def grads() -> int:
        return sum(hf_zero.model_state_memory(model).gradients.values())

    seen = {"initialized": grads()}
    for i in range(2):
        model(input_ids=batch, labels=batch).loss.backward()
        seen[f"backward{i}"] = grads()
        opt.step()
        seen[f"step{i}"] = grads()
        opt.zero_grad()
        seen[f"zero_grad{i}"] = grads()
    seen["shard_bytes"] = sum(u.layout.shard_numel * 4 for u in engine.parts if u.has_trainable)
    seen["grads_bound_after_zero_grad"] = sum(p.grad is not None for g in opt.param_groups for p in g["params"])
    return seen


def lookup_gradient_rows(stage: int, tokens_per_rank: int, bypass_rank: int | None = None) -> dict[str, Any]:
    """One backward of a LLaMA (vocab 256 x 64) under hf_zero: the input embedding's gradient shard
    against the dense gradient of an unsharded replica that ran every rank's batch, and how the
    embedding's reduction travelled ([Note: sparse lookup gradients]). `bypass_rank` computes its
    embedding output with `F.embedding` on the weight directly (a dense gradient on that rank)."""
    import torch.nn.functional as F

    from hf_zero.engine import grads  # where a part's reductions are issued

    rank, world = dist.get_rank(), dist.get_world_size()
    reference = make_model("llama")
    model = make_model("llama")
    # Token ids with repeats; each rank's batch differs. Row 255 is used by no rank.
    batches = [torch.randint(0, 255, (1, tokens_per_rank), generator=torch.Generator().manual_seed(r)) for r in range(world)]
    for b in batches:
        (reference(input_ids=b, labels=b).loss / world).backward()
    expected = reference.model.embed_tokens.weight.grad.reshape(-1)

    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=stage))
    unit = next(u for u in model.zero_engine.parts if u.spec.name == "model.embed_tokens")
    paths: list[str] = []
    inside: list[bool] = []  # whether the embedding part's reduction is being issued
    gather, scatter, reduce = grads.all_gather_rows, grads.reduce_scatter_into, unit.grads.reduce
    grads.all_gather_rows = lambda *a, **k: (paths.append("rows"), gather(*a, **k))[1]
    grads.reduce_scatter_into = lambda *a, **k: (paths.append("dense") if inside else None, scatter(*a, **k))[1]
    unit.grads.reduce = lambda *a, **k: (inside.append(True), reduce(*a, **k), inside.clear())[1]
    try:
        batch = batches[rank]
        if rank == bypass_rank:
            embeds = F.embedding(batch, model.model.embed_tokens.weight)
            loss = model(inputs_embeds=embeds, labels=batch).loss
        else:
            loss = model(input_ids=batch, labels=batch).loss
        sparse_after_forward = model.model.embed_tokens.sparse
        loss.backward()
        opt.clip_grad_norm_(float("inf"))  # waits for every reduction
    finally:
        grads.all_gather_rows, grads.reduce_scatter_into = gather, scatter
    lo, hi = unit.layout.shard_range(unit.shard_group.rank)
    padded = torch.cat([expected, expected.new_zeros(unit.layout.padded_numel - expected.numel())])
    got = unit.grads.shard
    return {
        "paths": paths,
        "max_abs_err": float((got - padded[lo:hi]).abs().max()),
        "scale": float(padded.abs().max()),
        "sparse_after_forward": sparse_after_forward,
        "sparse_lookup": unit.sparse_lookup,
    }


def optimizer_chunks(stage: int, chunk: int, tmp: str) -> dict[str, Any]:
    """[Note: optimizer chunks] with a tiny chunk size: 3 AdamW steps (clipping on) give the same
    weights as unchunked pieces; a checkpoint saved from the chunked run and loaded without chunks
    (and the reverse) restores the same optimizer state, so the next step agrees too."""
    from hf_zero.engine.step import pieces as engine_module

    rank = dist.get_rank()
    default = engine_module.OPTIMIZER_CHUNK_NUMEL
    batches = torch.randint(0, 256, (4, 2, 16), generator=torch.Generator().manual_seed(100 + rank))

    def build(chunk_numel: int) -> tuple[Any, Any]:
        engine_module.OPTIMIZER_CHUNK_NUMEL = chunk_numel
        try:
            model = make_model("llama")
            return hf_zero.initialize(model, make_optimizer(model, 1e-2), hf_zero.ZeroConfig(stage=stage))
        finally:
            engine_module.OPTIMIZER_CHUNK_NUMEL = default

    def train(model: Any, opt: Any, steps: range) -> None:
        for i in steps:
            model(input_ids=batches[i], labels=batches[i]).loss.backward()
            opt.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()

    def weights(model: Any) -> dict[str, torch.Tensor]:
        return model.zero_engine.full_state_dict(rank0_only=False)

    out: dict[str, Any] = {}
    chunked, chunked_opt = build(chunk)
    plain, plain_opt = build(default)
    out["chunks"] = sum(len(g["params"]) for g in chunked_opt.param_groups)
    out["pieces"] = sum(len(g["params"]) for g in plain_opt.param_groups)
    train(chunked, chunked_opt, range(3))
    train(plain, plain_opt, range(3))
    a, b = weights(chunked), weights(plain)
    out["weights_err"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    # Checkpoints across chunkings: chunked -> plain and plain -> chunked, then one more step each.
    hf_zero.save_checkpoint(f"{tmp}/chunked", chunked, chunked_opt)
    hf_zero.save_checkpoint(f"{tmp}/plain", plain, plain_opt)
    to_plain, to_plain_opt = build(default)
    hf_zero.load_checkpoint(f"{tmp}/chunked", to_plain, to_plain_opt)
    to_chunked, to_chunked_opt = build(chunk)
    hf_zero.load_checkpoint(f"{tmp}/plain", to_chunked, to_chunked_opt)
    for model, opt in ((to_plain, to_plain_opt), (to_chunked, to_chunked_opt), (plain, plain_opt)):
        train(model, opt, range(3, 4))
    ref = weights(plain)
    out["resumed_err"] = max(
        float((w[k] - ref[k]).abs().max()) for w in (weights(to_plain), weights(to_chunked)) for k in ref
    )
    out["scale"] = max(float(v.abs().max()) for v in ref.values())
    return out


class FeatureRegressor(torch.nn.Module):
    """A model fed floating-point features (not token ids) with float regression targets as `labels`, as a
    custom model or one fed `inputs_embeds` is; it records the dtypes its forward receives."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(6, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(2))
        self.head = torch.nn.Linear(16, 1)
        self.seen: list[tuple[torch.dtype, ...]] = []

    def forward(self, features: torch.Tensor, extra: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        self.seen.append((features.dtype, extra["scale"].dtype, extra["ids"].dtype, labels.dtype))
        h = self.inp(features) * extra["scale"]
        for block in self.blocks:
            h = h + block(h)
        return torch.nn.functional.mse_loss(self.head(h).squeeze(-1).float(), labels)


def float_inputs_under_mixed_precision(stage: int, precision: str) -> dict[str, Any]:
    """Train a FeatureRegressor at `stage` in `precision` on every rank's copy of one batch (4 steps), beside
    the same model in fp32 in this process: the sharded losses, and the dtypes its forward received."""
    g = torch.Generator().manual_seed(3)
    features, labels = torch.randn(8, 6, generator=g), torch.randn(8, generator=g) * 3
    extra = {"scale": torch.full((1, 16), 0.5), "ids": torch.arange(8)}
    reference = FeatureRegressor()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model = FeatureRegressor()
    model, opt = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    hf_zero.ZeroConfig(stage=stage, mixed_precision=precision, wrap=["Sequential"]))
    losses, ref_losses = [], []
    for _ in range(4):
        for net, optimizer, out in ((model, opt, losses), (reference, ref_opt, ref_losses)):
            loss = net(features, extra, labels=labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(float(loss))
    return {"losses": losses, "reference": ref_losses, "seen": [str(d) for d in model.seen[0]]}


def replaced_param_data(stage: int) -> str:
    """`param.data = tensor` between steps, then the next forward: the error it raises on this rank ("" if none)."""
    from tests._peer_harness import Net

    torch.manual_seed(0)
    model = Net()
    model, opt = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    hf_zero.ZeroConfig(stage=stage, wrap=["Block"]))
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        model.head.weight.data = model.head.weight.data.clone() * 0.5
    try:
        model(x)
    except ValueError as e:
        return str(e)
    return ""


def changed_in_forward_then_step() -> str:
    """Stage 3: a step trained as usual, then a forward with grad that clamps the input layer's weight in place (a
    pre-hook), an optimizer step (of the first step's gradients) before its backward, then that backward: the error
    this rank raises ("" if none)."""
    from tests._peer_harness import Net

    torch.manual_seed(0)
    model = Net()
    model, opt = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    hf_zero.ZeroConfig(stage=3, wrap=["Block"]))

    def clamp(module: torch.nn.Module, args: object) -> None:
        with torch.no_grad():
            module.weight.clamp_(-0.2, 0.2)

    x, y = torch.randn(4, 6), torch.randn(4, 3)
    torch.nn.functional.mse_loss(model(x), y).backward()
    model.inp.register_forward_pre_hook(clamp)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.step()
    try:
        loss.backward()
    except ValueError as e:
        return str(e)
    return ""


def parallel_wrapper_before_initialize(kind: str) -> str:
    """`hf_zero.initialize` given a model inside DDP or `nn.DataParallel` (`kind`), or holding one as a submodule
    ("inner"): the error this rank raises ("" if none)."""
    from tests._peer_harness import Net

    torch.manual_seed(0)
    model: torch.nn.Module = Net()
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif kind == "data_parallel":
        model = torch.nn.DataParallel(model)
    else:
        model.blocks[1] = torch.nn.parallel.DistributedDataParallel(model.blocks[1])
    try:
        hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), hf_zero.ZeroConfig(stage=3))
    except TypeError as e:
        return str(e)
    return ""


def replaced_data_in_gathered_parameters(stage: int) -> dict[str, Any]:
    """Rank 0 replaces a parameter's `.data` inside `gathered_parameters(modifier_rank=0)`: the error each rank
    raises, whether the weights stayed as they were, and the loss of a training step after it against one of a
    model that never went through the block."""
    from tests._peer_harness import Net

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = Net()
        return hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  hf_zero.ZeroConfig(stage=stage, wrap=["Block"]))

    x, y = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), torch.randn(4, 3)
    model, opt = build()
    before = hf_zero.full_state_dict(model, rank0_only=False)
    error = ""
    try:
        with hf_zero.gathered_parameters(model.head, modifier_rank=0):
            if dist.get_rank() == 0:
                model.head.weight.data = model.head.weight.data.clone() * 0.5
    except ValueError as e:
        error = str(e)
    after = hf_zero.full_state_dict(model, rank0_only=False)
    losses = []
    for m, o in ((model, opt), build()):
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        losses.append(float(torch.nn.functional.mse_loss(m(x), y)))
    return {"error": error, "unchanged": all(torch.equal(before[k], after[k]) for k in before), "losses": losses}


def _sharded_net(**config: Any) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    """The peer harness's `Net` (seed 0) sharded with AdamW under `ZeroConfig(wrap=["Block"], **config)`, and this
    rank's batch."""
    from tests._peer_harness import Net

    torch.manual_seed(0)
    model = Net()
    zero = hf_zero.ZeroConfig(wrap=["Block"], **config)
    model, opt = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), zero)
    g = torch.Generator().manual_seed(dist.get_rank())
    return model, opt, torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def grad_under_no_sync(stage: int, keeps_grads: bool) -> dict[str, Any]:
    """A first micro-batch's backward under no_sync, then `p.grad` read; then the synchronising micro-batch and a
    step. What the read gave, and whether the step equals that of a run that never read."""
    losses = []
    for read in (True, False):
        model, opt, x, y = _sharded_net(stage=stage, no_sync_keeps_grads=keeps_grads)
        with model.no_sync():
            torch.nn.functional.mse_loss(model(x), y).backward()
        seen = "None"
        if read:
            grad = model.head.weight.grad
            try:
                seen = "None" if grad is None else f"value {float(grad.norm())}"
            except TypeError as e:
                seen = str(e)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(torch.nn.functional.mse_loss(model(x), y)))
        if read:
            result = {"seen": seen}
    return {**result, "losses": losses}


def weights_edited_between_steps(stage: int, mixed_precision: str, how: str, offload_dir: str = "") -> dict[str, Any]:
    """Three steps, each followed by every weight halved in place (`how`: under no_grad, through `.data`, inside
    `gathered_parameters(modifier_rank=0)`, or not at all), the masters in memory, offloaded to the host
    (`offload_dir="host"`) or to files under `offload_dir`; the losses, the full state right after the first edit,
    and the final full state."""
    import contextlib

    offload: dict[str, Any] = {}
    if offload_dir:
        offload = {"offload_optimizer": True, **({} if offload_dir == "host" else {"offload_dir": offload_dir})}
    model, opt, x, y = _sharded_net(stage=stage, mixed_precision=mixed_precision, **offload)
    losses, after_first = [], None
    for step in range(3):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if how != "none":
            params = list(model.parameters())
            gathered = hf_zero.gathered_parameters(params, modifier_rank=0)
            with gathered if how == "gathered" else contextlib.nullcontext(), torch.no_grad():
                for p in params:
                    (p.data if how == "data" else p).mul_(0.5)
        if step == 0:
            after_first = hf_zero.full_state_dict(model, rank0_only=False)
    return {"losses": losses, "after_first": after_first, "final": hf_zero.full_state_dict(model, rank0_only=False)}


def compiled_steps(stage: int, backend: str) -> dict[str, Any]:
    """Three steps of the sharded `Net` called through `torch.compile(model, backend=backend)` (a user's
    `model = torch.compile(model)` after `initialize`) and through the model itself: the losses, the final states,
    and dynamo's compiled frames."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    runs = []
    for compiled in (True, False):
        model, opt, x, y = _sharded_net(stage=stage)
        call = torch.compile(model, backend=backend) if compiled else model
        losses = []
        for _ in range(3):
            loss = torch.nn.functional.mse_loss(call(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        runs.append((losses, hf_zero.full_state_dict(model, rank0_only=False)))
    return {"compiled": runs[0], "eager": runs[1], "frames": counters["frames"]["ok"]}


def groups_after_engines(count: int) -> list[int]:
    """The number of process groups this process has after each of `count` engines with hybrid sharding and
    sequence parallelism ([Note: groups made once] in collectives/group.py), each released before the next."""
    from torch.distributed import distributed_c10d

    seen = []
    for _ in range(count):
        model = make_model("llama")
        config = hf_zero.ZeroConfig(stage=3, shard_group_size=1, sequence_parallel=2)
        model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), config)
        del model, opt
        seen.append(len(distributed_c10d._world.pg_map))
    return seen


def repeated_token_in_bf16(stage: int, distinct: int) -> dict[str, Any]:
    """An embedding (64 x 8) trained under bf16 mixed precision on 1000 lookups of token 0 per rank plus `distinct`
    other tokens, every output row's gradient 0.01: two SGD steps (lr 1) from the same weights, each step's change of
    token 0's fp32 master row (its gradient, the mean over ranks), and the paths its reductions took ([Note: sparse
    lookup gradients]). Summed in bf16 the 1000 rows stall at 4.0; in float32 they give 10.0."""
    from hf_zero.engine import grads

    class Lookup(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(64, 8)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return (self.emb(ids) * 0.01).sum()

    torch.manual_seed(0)
    model = Lookup()
    zero = hf_zero.ZeroConfig(stage=stage, wrap=["Embedding"], mixed_precision="bf16")
    model, opt = hf_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), zero)
    ids = torch.cat([torch.zeros(1000, dtype=torch.long), torch.arange(1, distinct + 1)])
    paths: list[str] = []
    gather = grads.all_gather_rows
    grads.all_gather_rows = lambda *a, **k: (paths.append("rows"), gather(*a, **k))[1]
    changes = []
    try:
        for _ in range(2):
            before = hf_zero.full_state_dict(model, rank0_only=False)["emb.weight"][0].clone()
            model(ids).backward()
            opt.step()
            opt.zero_grad()
            changes.append((before - hf_zero.full_state_dict(model, rank0_only=False)["emb.weight"][0]).tolist())
    finally:
        grads.all_gather_rows = gather
    return {"changes": changes, "paths": paths}
