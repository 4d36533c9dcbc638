"""Sequence parallelism cases ([Note: sequence parallelism]): the same training single-process on whole
sequences and sharded with `sequence_parallel`; functions run on every rank of a pool (importable by name)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import hf_zero
from transformers import LlamaForCausalLM
from tests._training import VOCAB, make_model, make_optimizer

STEPS, ACCUM, MICRO, SEQ = 3, 2, 2, 16


def batches(groups: int) -> list[list[list[dict[str, torch.Tensor]]]]:
    """[step][group][micro-batch] -> input_ids, attention_mask, labels: one row right-padded, one left-padded
    (in some micro-batches), and some labels ignored."""
    g = torch.Generator().manual_seed(99)
    out = []
    for step in range(STEPS):
        per_group = []
        for d in range(groups):
            micro = []
            for a in range(ACCUM):
                ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
                mask = torch.ones(MICRO, SEQ, dtype=torch.long)
                if (step + d + a) % 2 == 0:
                    mask[0, SEQ - 3 :] = 0  # right padding
                    mask[1, :2] = 0  # left padding
                labels = ids.masked_fill(mask == 0, -100)
                labels[torch.rand(MICRO, SEQ, generator=g) < 0.15] = -100  # ignored tokens
                micro.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
            per_group.append(micro)
        out.append(per_group)
    return out


def _model(kind: str) -> Any:
    """The cases' model; Falcon under sdpa (its attention is split around torch's sdpa call)."""
    model = make_model(kind)
    if kind == "falcon":
        model.config._attn_implementation = "sdpa"  # as from_pretrained(..., attn_implementation="sdpa") sets it
    return model


def reference(groups: int, kind: str = "llama") -> dict[str, Any]:
    """One process, whole sequences, every group's micro-batches: the mean over groups of the accumulated loss."""
    torch.set_num_threads(1)
    model = _model(kind)
    opt = make_optimizer(model, 1e-3)
    losses, norms = [], []
    for step in batches(groups):
        micro = []
        for per_group in step:
            for batch in per_group:
                loss = model(**batch).loss
                (loss / (ACCUM * groups)).backward()
                micro.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(float(np.mean(micro)))
    return {
        "losses": losses,
        "norms": norms,
        "state": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
    }


def split_run(stage: int, size: int, checkpointing: bool = False, tiled: bool = False, kind: str = "llama"
              ) -> dict[str, Any]:
    """Each group of `size` ranks trains on its group's micro-batches, each rank on 1/size of every sequence;
    `tiled`: with `tiled_mlp`, tiles of 3 tokens ([Note: tiled MLP]), the tiles run counted."""
    from hf_zero.features import tiled_mlp

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(kind)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = make_optimizer(model, 1e-3)
    config = hf_zero.ZeroConfig(stage=stage, sequence_parallel=size, tiled_mlp=tiled)
    model, opt = hf_zero.initialize(model, opt, config)
    tiles = [0]
    saved = tiled_mlp.TILE_BYTES, tiled_mlp.checkpoint

    def counted(*args: Any, **kwargs: Any) -> Any:
        tiles[0] += 1
        return saved[1](*args, **kwargs)

    tiled_mlp.TILE_BYTES, tiled_mlp.checkpoint = MICRO * 128 * 4 * 3, counted  # (batch, intermediate, fp32, tokens)
    try:
        result = _train_split(model, opt, rank, world, size)
    finally:
        tiled_mlp.TILE_BYTES, tiled_mlp.checkpoint = saved
    return {**result, "tiles": tiles[0]}


def _train_split(model: Any, opt: Any, rank: int, world: int, size: int) -> dict[str, Any]:
    model.train()
    losses, norms, local_losses = [], [], []
    for step in batches(world // size):
        micro = []
        for batch in step[rank // size]:
            out = model(**batch)
            if size > 1 and out.logits is not None:  # [Note: tiled loss]: no logits in training with labels
                raise RuntimeError("the split model returned logits in training")
            (out.loss / ACCUM).backward()
            micro.append(out.loss.detach())
        local_losses.append(float(torch.stack(micro).mean()))
        norms.append(float(opt.clip_grad_norm_(1.0)))
        opt.step()
        opt.zero_grad()
        mean = torch.stack(micro).mean().reshape(1)
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    state = hf_zero.full_state_dict(model, rank0_only=False)
    return {
        "losses": losses,
        "local_losses": local_losses,
        "norms": norms,
        "state": {k: v.numpy().copy() for k, v in state.items()},
    }


def logits_without_labels(size: int) -> dict[str, Any]:
    """Without labels, the logits come back whole (gathered along the sequence), equal to the unsplit model's;
    `generate` (a cache, lengths that do not split) gives the unsplit model's tokens on every rank."""
    torch.set_num_threads(1)
    plain = make_model("llama")
    batch = batches(1)[0][0][0]
    expected = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    prompt = batch["input_ids"][:1, :5]  # generation (a cache, odd lengths): runs unsplit on every rank
    plain_tokens = plain.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    model = make_model("llama")
    model, _ = hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=3, sequence_parallel=size))
    got = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    tokens = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return {"shape": list(got.shape), "err": float((got - expected).abs().max()),
            "generated": tokens.tolist() == plain_tokens.tolist()}


class _ScaledLogits(LlamaForCausalLM):
    """A model that changes its head's output before returning it (as logit scaling or soft-capping do)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        out["logits"] = out.logits * 2.0
        return out


def refused(size: int, what: str) -> dict[str, Any]:
    """An input sequence parallelism cannot take: the error each rank raises."""
    model = make_model("falcon" if what == "falcon" else "llama")
    if what == "scaled":
        model.__class__ = _ScaledLogits
    try:
        model, _ = hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=3, sequence_parallel=size))
        model.train()
        ids = torch.randint(0, VOCAB, (1, 15 if what == "odd" else 16))
        positions = torch.arange(16).remainder(8).unsqueeze(0) if what == "packed" else None
        model(input_ids=ids, labels=ids, position_ids=positions)
    except Exception as e:  # noqa: BLE001 - the test reads it
        return {"type": type(e).__name__, "error": str(e)}
    return {"type": None, "error": None}


def accelerate_batches(size: int, via: str = "plugin") -> dict[str, Any]:
    """The samples a `ZeroAccelerator` data loader gives this rank under `zero_sequence_parallel` (or Accelerate's
    `ParallelismConfig(sp_size=)`, `via="parallelism_config"`), and the loss of one step through it (the loss of
    the whole batch, on every rank of a group)."""
    from accelerate import ParallelismConfig
    from torch.utils.data import DataLoader

    from hf_zero.integrations.accelerate import ZeroAccelerator, ZeroPlugin

    torch.set_num_threads(1)
    if via == "plugin":
        accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(zero_stage=3, zero_sequence_parallel=size))
    else:
        accelerator = ZeroAccelerator(
            zero_plugin=ZeroPlugin(zero_stage=3), parallelism_config=ParallelismConfig(sp_size=size)
        )
    samples = [{"input_ids": torch.full((SEQ,), i), "labels": torch.full((SEQ,), i)} for i in range(8)]
    model = make_model("llama")
    opt = make_optimizer(model, 1e-3)
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(samples, batch_size=1))
    seen = [int(batch["input_ids"][0, 0]) for batch in loader]
    loss = float(model(**next(iter(loader))).loss)
    held_out = accelerator.prepare(DataLoader(samples[:7], batch_size=2))  # 7: the last global batch is short
    gathered, objects = [], []
    for batch in held_out:
        gathered += accelerator.gather_for_metrics(batch["input_ids"][:, 0]).tolist()
        objects += accelerator.gather_for_metrics([f"sample {int(i)}" for i in batch["input_ids"][:, 0]])
    return {"seen": seen, "loss": loss, "sequence_parallel": model.zero_engine.config.sequence_parallel,
            "gathered": gathered, "objects": objects}


def one_unit_model_loss(size: int) -> dict[str, Any]:
    """A one-layer model, whose layer shares the root's unit (the engine's root hooks map over the forward's
    keyword arguments and rebuild dataclasses in them): the split loss is the unsplit one, and its backward runs."""
    from transformers import LlamaConfig

    torch.set_num_threads(1)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config)
    batch = batches(1)[0][0][0]
    expected = plain(**batch).loss
    torch.manual_seed(0)
    model, _ = hf_zero.initialize(LlamaForCausalLM(config), None, hf_zero.ZeroConfig(stage=3, sequence_parallel=size))
    model.train()
    got = model(**batch).loss
    got.backward()
    return {"loss": float(got.detach()), "expected": float(expected.detach())}


def user_loops(size: int) -> dict[str, Any]:
    """Two ways a DDP user's loop reaches the split model, each beside the unsplit model on the same micro-batches:
    two forwards before one backward, then torch's own `clip_grad_norm_` over `model.parameters()`; and a peft
    LoRA model (the split hooks on the peft wrapper, the head found through it), its loss and gradient norm."""
    from tests._training import with_lora

    torch.set_num_threads(1)
    first, second = batches(1)[0][0]
    plain = make_model("llama")
    (plain(**first).loss + plain(**second).loss).backward()
    expected_norm = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9))
    model = make_model("llama")
    config = hf_zero.ZeroConfig(stage=3, sequence_parallel=size)
    model, _ = hf_zero.initialize(model, make_optimizer(model, 1e-3), config)
    model.train()
    (model(**first).loss + model(**second).loss).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))

    plain_lora = with_lora(make_model("llama"), "llama")
    expected_lora = plain_lora(**first).loss
    expected_lora.backward()
    expected_lora_norm = float(torch.nn.utils.clip_grad_norm_(plain_lora.parameters(), 1e9))
    lora = with_lora(make_model("llama"), "llama")
    lora, _ = hf_zero.initialize(lora, None, config)
    lora.train()
    loss = lora(**first).loss
    loss.backward()
    lora_norm = float(torch.nn.utils.clip_grad_norm_(lora.parameters(), 1e9))
    return {
        "norm": norm,
        "expected_norm": expected_norm,
        "lora_loss": float(loss.detach()),
        "expected_lora_loss": float(expected_lora.detach()),
        "lora_norm": lora_norm,
        "expected_lora_norm": expected_lora_norm,
    }


def trl_fused_head(size: int) -> dict[str, Any]:
    """TRL's fused LM head (`add_fused_lm_head`; `fused_lm_head=True`, what DPO, KTO, GRPO and SFT compute their
    log-probabilities with) on the split model, beside the unsplit one, in training on a padded micro-batch with
    ignored labels: each sequence's summed log-probability (DPO's quantity), entropy and label mask, and the
    gradient norm after a backward of the summed log-probabilities."""
    from trl.trainer.utils import add_fused_lm_head

    torch.set_num_threads(1)
    batch = batches(1)[0][0][0]
    plain = make_model("llama")
    add_fused_lm_head(plain, outputs=("log_probs", "entropy"))
    plain.train()
    want = plain(**batch, fused_lm_head=True)
    want.log_probs.sum().backward()
    want_norm = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9))
    model = make_model("llama")
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=3, sequence_parallel=size))
    model.zero_engine.use_directly(model.get_output_embeddings())  # TRL reads the head's weight (as ZeroTrainer sets)
    model.train()
    got = model(**batch, fused_lm_head=True)
    got.log_probs.sum().backward()
    norm = float(opt.clip_grad_norm_(1e9))
    return {
        "shape": list(got.log_probs.shape) == list(want.log_probs.shape),
        "sums": (got.log_probs.sum(-1) - want.log_probs.sum(-1)).abs().max().item(),
        "scale": want.log_probs.sum(-1).abs().max().item(),
        "entropy": (got.entropy - want.entropy).abs().max().item(),
        "mask": bool((got.label_mask == want.label_mask).all()),
        "norm": norm,
        "want_norm": want_norm,
    }
