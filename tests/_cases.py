"""Functions the engine tests run on every rank of a pool (they must be importable by name)."""

from __future__ import annotations

import time
from typing import Any, Callable

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


def gathered_units_during_training(stage: int, checkpointing: bool, prefetch: int = 1) -> dict[str, Any]:
    """How many units are whole (or being gathered) while each block runs forward in the second
    iteration (the first one teaches the engine the order), and what is left after backward."""
    model = make_model("llama")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = hf_zero.ZeroConfig(stage=stage, prefetch=prefetch, bucket_size_mb=0)  # one unit per block
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), config)
    engine = model.zero_engine
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad()
    counts: list[int] = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, a: counts.append(sum(u.is_unsharded for u in engine.units)))
    loss = model(input_ids=batch, labels=batch).loss
    after_forward = [u.spec.name for u in engine.units if u.is_unsharded]
    gathered_in_backward: list[str] = []
    for unit in engine.units:
        unit.unshard = _counting(unit.unshard, unit.spec.name, gathered_in_backward)
    loss.backward()
    return {
        "counts": counts,
        "after_forward": after_forward,
        "gathered_in_backward": gathered_in_backward,
        "after_backward": sum(u.is_unsharded for u in engine.units),
        "unsharded_grads_after_backward": sum(u.unsharded_grad is not None for u in engine.units),
        "n_units": len(engine.units),
    }



def _counting(fn: Any, name: str, log: list[str]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        log.append(name)
        return fn(*args, **kwargs)

    return wrapper


def fp16_overflow_is_skipped() -> dict[str, Any]:
    """An absurd initial loss scale overflows: the step is skipped (weights unchanged), the scale halves."""
    model = make_model("llama")
    config = hf_zero.ZeroConfig(stage=3, mixed_precision="fp16", initial_loss_scale=2.0**40)
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), config)
    before = hf_zero.full_state_dict(model, rank0_only=False)
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    skipped = opt.step_was_skipped
    opt.zero_grad()
    after = hf_zero.full_state_dict(model, rank0_only=False)
    return {
        "skipped": skipped,
        "scale": model.zero_engine.scaler.scale,
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
    }



def load_into_fresh_model(ckpt: str, kind: str, stage: int, verify: bool = True) -> dict[str, Any]:
    """Try to load `ckpt`; report the error and whether the model was left exactly as it was."""
    model = make_model(kind, seed=1)
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=stage))
    before = hf_zero.full_state_dict(model, rank0_only=False)
    error_type = error = None
    try:
        hf_zero.load_checkpoint(ckpt, model, opt, verify=verify)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        error_type, error = type(e).__name__, str(e)
    after = hf_zero.full_state_dict(model, rank0_only=False)
    return {
        "error_type": error_type,
        "error": error,
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "opt_state_empty": len(opt.state) == 0,
    }


PROMPT = [[5, 17, 42, 7, 99, 3]]


def train_and_export(kind: str, stage: int, ckpt: str, live_out: str, tokenizer_dir: str) -> dict[str, Any]:
    """Train 2 steps, then write a sharded checkpoint and a live from_pretrained directory."""
    from transformers import AutoTokenizer

    model = make_model(kind)
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-2), hf_zero.ZeroConfig(stage=stage))
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        batch = torch.randint(0, 256, (2, 16), generator=g)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    hf_zero.save_checkpoint(ckpt, model, opt, tokenizer=tokenizer)
    files = hf_zero.save_pretrained(model, live_out, tokenizer=tokenizer, progress=False)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT)).logits
    state = hf_zero.full_state_dict(model)
    if dist.get_rank() != 0:
        return {"files": files}
    return {"files": files, "logits": logits.numpy().copy(), "state": {k: v.clone() for k, v in state.items()}}


def train_from_pretrained(path: str, mode: str, stage: int, steps: int = 3) -> dict[str, Any]:
    """Load `path` the sharded way (hf_zero.from_pretrained) or the ordinary way, then train a few steps."""
    from transformers import AutoModelForCausalLM

    config = hf_zero.ZeroConfig(stage=stage)
    if mode == "sharded":
        model, opt = hf_zero.from_pretrained(AutoModelForCausalLM, path, config,
                                             optimizer_fn=lambda m: make_optimizer(m, 1e-3))
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
        model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), config)
    model.train()
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, 256, (2, 16), generator=g)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    state = hf_zero.full_state_dict(model)
    return {"losses": losses, "state": state, "tied": getattr(model.config, "tie_word_embeddings", False)
            and model.lm_head.weight is model.get_input_embeddings().weight}


def initialize_from(path: str) -> None:
    model = make_model("llama")
    hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=3), weights_from=path)


def initialize_with_config(kwargs: dict[str, Any]) -> None:
    model = make_model("llama")
    hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(**kwargs))


def save_with_fault(path: str, failing_rank: int, errno_code: int | None) -> dict[str, Any]:
    """Save to `path` (a good checkpoint may already be there) while `failing_rank` hits an OSError."""
    import errno as errno_module
    import os

    import hf_zero.checkpoint.save as save_module  # where the shard files are written ([Note: streamed save])

    model = make_model("llama")
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=3))
    original = save_module.write_streamed

    def failing_save_file(filename, entries, metadata=None):  # noqa: ANN001
        if dist.get_rank() == failing_rank and errno_code is not None:
            raise OSError(errno_code, os.strerror(errno_code), filename)
        return original(filename, entries, metadata)

    save_module.write_streamed = failing_save_file
    start = time.monotonic()
    try:
        hf_zero.save_checkpoint(path, model, opt, metadata={"attempt": "second"})
        outcome = {"error_type": None, "error": None}
    except Exception as e:  # noqa: BLE001
        outcome = {"error_type": type(e).__name__, "error": str(e)}
    finally:
        save_module.write_streamed = original
    outcome["seconds"] = time.monotonic() - start
    del errno_module
    return outcome


def pool_counts_per_iteration(layers: int, options: tuple[tuple[str, Any], ...] = ()) -> dict[str, int]:
    """Pool fills of one steady-state stage-3 iteration of a LLaMA with `layers` blocks (`options`: more
    ZeroConfig fields)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    config = hf_zero.ZeroConfig(stage=3, bucket_size_mb=0, **dict(options))  # one block per unit: the count follows the depth
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), config)
    pool = model.zero_engine.pool
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(3):
        before = (pool.reused, pool.allocated)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return {"reused": pool.reused - before[0], "allocated": pool.allocated - before[1], "pooled_after": pool.pooled_bytes}


def large_head_backward(vocab: int) -> dict[str, Any]:
    """The second stage-3 iteration of a LLaMA whose head (vocab x 32) may dwarf its blocks: what is
    pooled when the head starts its forward, which block is whole when the head's backward starts,
    and whether the head's reduction read autograd's own gradient tensor (no second buffer)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=3, bucket_size_mb=0))
    engine = model.zero_engine
    units = {u.spec.name: u for u in engine.units}
    head, last_block = units["lm_head"], units["model.layers.2"]
    batch = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad()
    seen: dict[str, Any] = {}
    model.lm_head.register_forward_pre_hook(lambda m, a: seen.update(pooled_at_head=engine.pool.pooled_bytes))
    out = model(input_ids=batch, labels=batch)
    out.logits.register_hook(lambda g: seen.update(block_whole_in_head_backward=last_block.is_unsharded))
    model.lm_head.weight.register_hook(lambda g: seen.update(autograd_grad=g.data_ptr()))
    reduce = head.reduce_grads

    def reduce_and_record(*args: Any, **kwargs: Any) -> Any:
        seen["reduced"] = head.unsharded_grad.data_ptr()
        return reduce(*args, **kwargs)

    head.reduce_grads = reduce_and_record
    out.loss.backward()
    return {
        "pooled_at_head": seen["pooled_at_head"],
        "block_whole_in_head_backward": seen["block_whole_in_head_backward"],
        "adopted": seen["reduced"] == seen["autograd_grad"],
        "adopts": head.adopts_grads,
    }


def block_buffers_in_backward(layers: int = 5, checkpointing: bool = False, stream_ordered: bool = False) -> dict[str, Any]:
    """The second stage-3 iteration of a LLaMA of `layers` equal blocks (one unit each, prefetch 1)
    whose head is over twice a block (1024 x 32 vs 9 K parameters, as in a 32000-word model), so the
    head's parameters and gradients leave room for four blocks' buffers:
    at every gradient of a block, how many block-sized buffers are alive (gathered parameters,
    unsharded gradients being filled, and reductions issued but not finished), and which blocks the
    backward gathered asynchronously (prefetched) rather than on demand."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = hf_zero.ZeroConfig(stage=3, prefetch=1, bucket_size_mb=0)
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), config)
    if stream_ordered:  # the policy the engine picks for NCCL, here on gloo
        model.zero_engine.hooks.gate_on_reductions = False
    units = {u.spec.name: u for u in model.zero_engine.units}
    blocks = [units[f"model.layers.{i}"] for i in range(layers)]
    batch = torch.randint(0, 1024, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad()
    in_flight: set[str] = set()
    gathered: list[tuple[str, bool]] = []
    for unit in blocks:
        unit.reduce_grads = _tracking(unit.reduce_grads, lambda name=unit.spec.name: in_flight.add(name))
        unit.finish_reduction = _tracking(unit.finish_reduction, lambda name=unit.spec.name: in_flight.discard(name))
        unit.unshard = _logging_gathers(unit.unshard, unit.spec.name, gathered)
    alive: list[int] = []

    def count(_: torch.Tensor) -> None:
        whole = sum(u.is_unsharded for u in blocks)
        filling = sum(u.unsharded_grad is not None and u.spec.name not in in_flight for u in blocks)
        alive.append(whole + filling + len(in_flight))

    for layer in model.model.layers:  # after the engine's own hooks, which may have issued a prefetch
        for param in layer.parameters():
            param.register_post_accumulate_grad_hook(count)
    loss = model(input_ids=batch, labels=batch).loss
    gathered.clear()  # the forward's gathers
    loss.backward()
    return {"max_alive": max(alive), "prefetched": [name for name, is_async in gathered if is_async],
            "on_demand": [name for name, is_async in gathered if not is_async]}


def _tracking(fn: Any, after: Callable[[], None]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        after()
        return out

    return wrapper


def _logging_gathers(fn: Any, name: str, log: list[tuple[str, bool]]) -> Any:
    def wrapper(async_op: bool = False) -> Any:
        log.append((name, async_op))
        return fn(async_op=async_op)

    return wrapper


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
    seen["shard_bytes"] = sum(u.layout.shard_numel * 4 for u in engine.units if u.has_trainable)
    seen["grads_bound_after_zero_grad"] = sum(p.grad is not None for g in opt.param_groups for p in g["params"])
    return seen


def lookup_gradient_rows(stage: int, tokens_per_rank: int, bypass_rank: int | None = None) -> dict[str, Any]:
    """One backward of a LLaMA (vocab 256 x 64) under hf_zero: the input embedding's gradient shard
    against the dense gradient of an unsharded replica that ran every rank's batch, and how the
    embedding's reduction travelled ([Note: sparse lookup gradients]). `bypass_rank` computes its
    embedding output with `F.embedding` on the weight directly (a dense gradient on that rank)."""
    import torch.nn.functional as F
    from hf_zero.engine import flat

    rank, world = dist.get_rank(), dist.get_world_size()
    reference = make_model("llama")
    model = make_model("llama")
    # Token ids with repeats; each rank's batch differs. Row 255 is used by no rank.
    batches = [torch.randint(0, 255, (1, tokens_per_rank), generator=torch.Generator().manual_seed(r)) for r in range(world)]
    for b in batches:
        (reference(input_ids=b, labels=b).loss / world).backward()
    expected = reference.model.embed_tokens.weight.grad.reshape(-1)

    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=stage))
    unit = next(u for u in model.zero_engine.units if u.spec.name == "model.embed_tokens")
    paths: list[str] = []
    inside: list[bool] = []  # whether the embedding unit's reduce_grads is running
    gather, scatter, reduce = flat.all_gather_rows, flat.reduce_scatter_into, unit.reduce_grads
    flat.all_gather_rows = lambda *a, **k: (paths.append("rows"), gather(*a, **k))[1]
    flat.reduce_scatter_into = lambda *a, **k: (paths.append("dense") if inside else None, scatter(*a, **k))[1]
    unit.reduce_grads = lambda *a, **k: (inside.append(True), reduce(*a, **k), inside.clear())[1]
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
        flat.all_gather_rows, flat.reduce_scatter_into = gather, scatter
    lo, hi = unit.layout.shard_range(unit.shard_group.rank)
    padded = torch.cat([expected, expected.new_zeros(unit.layout.padded_numel - expected.numel())])
    got = unit.sharded_grad
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
    from hf_zero.engine import pieces as engine_module

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


def frozen_block_state_at_embedding_grad() -> dict[str, Any]:
    """Stage 3, block 0 of the tiny LLaMA entirely frozen (one unit per block): whether block 0 is still
    gathered when the embedding (after it in backward) gets its gradient."""
    model = make_model("llama")
    for name, p in model.named_parameters():
        if name.startswith("model.layers.0."):
            p.requires_grad_(False)
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=3, bucket_size_mb=0))
    units = {u.spec.name: u for u in model.zero_engine.units}
    seen: list[str] = []
    model.model.embed_tokens.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(units["model.layers.0"].state.value))
    batch = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return {"block0_at_embedding_grad": seen, "frozen": units["model.layers.0"].spec.frozen}
