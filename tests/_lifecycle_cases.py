"""Lifecycle and memory cases: what is gathered when, buffer pooling, the backward of a large head, the fp16 overflow skip, frozen blocks. Functions run on every rank of a pool (importable by name)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist

import hf_zero
from tests._training import VOCAB, make_model, make_optimizer


def _holds_memory(unit: Any) -> bool:
    """Whether a unit's parameters are whole or being gathered ([Note: unit lifecycle]): not SHARDED."""
    from hf_zero.engine.lifecycle import ShardState

    return unit.shard_state is not ShardState.SHARDED


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
    forward = [True]  # the forward pass only: a checkpointed block's recomputation in backward calls its hooks too

    def count(module: Any, args: Any) -> None:
        if forward[0]:
            counts.append(sum(_holds_memory(u) for u in engine.units))

    for layer in model.model.layers:
        layer.register_forward_pre_hook(count)
    loss = model(input_ids=batch, labels=batch).loss
    forward[0] = False
    after_forward = [u.spec.name for u in engine.units if _holds_memory(u)]
    gathered_in_backward: list[str] = []
    for unit in engine.parts:
        unit.gather = _counting(unit.gather, unit.spec.name, gathered_in_backward)
    loss.backward()
    return {
        "counts": counts,
        "after_forward": after_forward,
        "gathered_in_backward": gathered_in_backward,
        "after_backward": sum(_holds_memory(u) for u in engine.units),
        "unsharded_grads_after_backward": sum(u.grads.unsharded is not None for u in engine.parts),
        "n_units": len(engine.parts),
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
    units = {u.spec.name: u for u in engine.parts}
    head = units["lm_head"]
    last_block = next(u for u in engine.units if u.spec.name == "model.layers.2")
    batch = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad()
    seen: dict[str, Any] = {}
    model.lm_head.register_forward_pre_hook(lambda m, a: seen.update(pooled_at_head=engine.pool.pooled_bytes))
    out = model(input_ids=batch, labels=batch)
    out.logits.register_hook(lambda g: seen.update(block_whole_in_head_backward=_holds_memory(last_block)))
    model.lm_head.weight.register_hook(lambda g: seen.update(autograd_grad=g.data_ptr()))
    reduce = head.grads.reduce

    def reduce_and_record(*args: Any, **kwargs: Any) -> Any:
        seen["reduced"] = head.grads.unsharded.data_ptr()
        return reduce(*args, **kwargs)

    head.grads.reduce = reduce_and_record
    out.loss.backward()
    return {
        "pooled_at_head": seen["pooled_at_head"],
        "block_whole_in_head_backward": seen["block_whole_in_head_backward"],
        "adopted": seen["reduced"] == seen["autograd_grad"],
        "adopts": head.grads.adopts,
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
        hooks = model.zero_engine.hooks
        hooks.settings = dataclasses.replace(hooks.settings, gate_on_reductions=False)
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
        unit.prefetch = _logging_gathers(unit, unit.prefetch, True, gathered)
        unit.unshard = _logging_gathers(unit, unit.unshard, False, gathered)
    alive: list[int] = []

    def count(_: torch.Tensor) -> None:
        whole = sum(_holds_memory(u) for u in blocks)
        filling = sum(bool(u.unsharded_grads) and u.spec.name not in in_flight for u in blocks)
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


def _logging_gathers(unit: Any, fn: Any, ahead: bool, log: list[tuple[str, bool]]) -> Any:
    """`fn` (the unit's prefetch or unshard), logging `(name, ahead)` when it issues a gather."""

    def wrapper() -> Any:
        if unit.needs_gather:
            log.append((unit.spec.name, ahead))
        return fn()

    return wrapper


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
        lambda p: seen.append(units["model.layers.0"].shard_state.value))
    batch = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return {"block0_at_embedding_grad": seen, "frozen": units["model.layers.0"].spec.frozen}


def backbone_called_directly(bucket_size_mb: float) -> dict[str, Any]:
    """Stage 3, the tiny 8-layer LLaMA with its layers joined three by three (`bucket_size_mb`): two steps whose loss
    comes from the backbone called directly (`model.model(...)`, then `model.lm_head`: TRL's fused-loss paths), the
    same batch on every rank. The final weights' worst difference from one plain model trained the same way, and how
    many times each bucketed unit began a forward in one backbone call."""
    reference, model = make_model("llama_8"), make_model("llama_8")
    ref_opt = make_optimizer(reference, 1e-3)
    config = hf_zero.ZeroConfig(stage=3, bucket_size_mb=bucket_size_mb)
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), config)
    bucketed = [u for u in model.zero_engine.units if len(u.spec.all_modules) > 1]
    begun: dict[str, int] = {u.spec.name: 0 for u in bucketed}
    for unit in bucketed:
        unit.begin_forward = _tracking(unit.begin_forward, lambda name=unit.spec.name: begun.__setitem__(name, begun[name] + 1))
    batch = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    for m, o in ((reference, ref_opt), (model, opt)):
        for _ in range(2):
            for name in begun:
                begun[name] = 0
            logits = m.lm_head(m.model(input_ids=batch).last_hidden_state)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            o.step()
            o.zero_grad()
    full = hf_zero.full_state_dict(model, rank0_only=False)
    worst = max(float((full[k] - v).abs().max() / (v.abs().max() + 1e-12)) for k, v in reference.state_dict().items())
    return {"worst": worst, "begun": begun}
