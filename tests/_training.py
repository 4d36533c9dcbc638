"""Training scenarios shared by the tests: tiny models, deterministic data, the sharded loop that
runs on every rank, and the single-process reference it must match.

Batch layout: a step's global batch has `world * accum * micro_bs` sequences of equal length (no
padding), so the mean of the per-micro-batch losses over ranks and micro-batches equals the
loss of the whole global batch, and the averaged gradients equal its gradient.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class Scenario:
    model: str = "llama"  # "llama", "llama_8", "llama_deep", "falcon" or "toy"
    stage: int = 3
    world: int = 2
    steps: int = 5
    accum: int = 2
    micro_bs: int = 2
    seq: int = 16
    lr: float = 1e-3
    max_grad_norm: float | None = 1.0
    mixed_precision: str = "no"
    use_no_sync: bool = False
    wrap: Any = "auto"
    frozen: tuple[str, ...] = ()  # parameter name substrings to freeze
    lora: bool = False  # peft LoRA (rank 8 on the attention projections) around the model
    repeat_batch: bool = False  # every step trains on step 0's batch (learnable: the loss falls fast)
    checkpointing: bool = False  # activation checkpointing (non-reentrant) on the sharded model
    reentrant: bool = False  # with `checkpointing`: transformers' reentrant variant (it makes the embeddings' output
    #   require grad itself, `enable_input_require_grads`, which frozen embeddings under LoRA need)
    ac: str = ""  # activation checkpointing users' other ways: "wrapper", "wrapper_reentrant" (torch's
    #               checkpoint_wrapper on every block), "user", "user_reentrant" (checkpoint(block, x) in forward)
    seed: int = 0  # model init seed (a resumed run starts from another init to prove the load)
    start_step: int = 0  # first step to run (after load_from)
    stop_step: int | None = None  # run steps [start_step, stop_step), then save_to
    load_from: str | None = None
    save_to: str | None = None
    config_overrides: tuple[tuple[str, Any], ...] = ()  # extra ZeroConfig fields
    stream_ordered: bool = False  # the backward-prefetch policy the engine picks for NCCL, forced on gloo
    optimizer: str = "adamw"  # tests._optimizers.build_optimizer

    @property
    def global_batch(self) -> int:
        return self.world * self.accum * self.micro_bs

    def single(self) -> "Scenario":
        """The reference's key: everything that changes the math, nothing that only changes sharding."""
        return replace(self, stage=0, mixed_precision="no", use_no_sync=False, wrap="auto", config_overrides=(), checkpointing=False, ac="",
            stream_ordered=False,
            seed=0, start_step=0, stop_step=None, load_from=None, save_to=None)


VOCAB = 256


def make_model(kind: str, seed: int = 0) -> nn.Module:
    from transformers import AutoModelForCausalLM, FalconConfig, LlamaConfig

    torch.manual_seed(seed)
    if kind == "llama":
        cfg = LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        )
    elif kind == "llama_8":  # the "llama" blocks, 8 of them
        cfg = LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        )
    elif kind == "llama_deep":  # 4 blocks of 2 K parameters under a 4 K head: stage 3's backward prefetch is gated
        cfg = LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        )
    elif kind == "falcon":
        cfg = FalconConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False,
            max_position_embeddings=128,
        )
    elif kind in OTHER_ARCHITECTURES:
        cfg = _other_config(kind)
    elif kind == "toy":
        return ToyLM()
    elif kind == "moe":
        return MoELM()
    elif kind == "layerdrop":
        return ToyLM(layer_drop=True)
    elif kind in ("opt", "opt_layerdrop", "opt_dropout"):  # OPT's own LayerDrop (each block skipped with probability
        from transformers import OPTConfig  # 0.5), or its dropout (0.1 on activations and attention)

        drop = 0.1 if kind == "opt_dropout" else 0.0
        cfg = OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=4, num_attention_heads=4,
                        word_embed_proj_dim=64, max_position_embeddings=128, dropout=drop, attention_dropout=drop,
                        layerdrop=0.5 if kind == "opt_layerdrop" else 0.0)
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg)
    model.train()
    return model


# Architectures users fine-tune beside LLaMA and Falcon, each a different shape of block: sliding windows and
# soft-capping (Gemma), QK norms (Qwen3, OLMo 2), fused QKV (Phi-3), Conv1D weights and tied embeddings (GPT-2),
# parallel attention (GPT-NeoX), grouped KV heads in Falcon's new decoder, experts fused into 3-D parameters with
# routers that pick different experts on each rank (Mixtral, Qwen3-MoE). (OPT is left out: its attention's key bias
# gets no gradient, softmax being shift-invariant, so Adam moves it by the sign of rounding noise, differently
# under any two reduction orders, as under two DDP runs.)
OTHER_ARCHITECTURES = (
    "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt2", "gpt_neox", "mixtral", "qwen3_moe",
    "falcon_new", "olmo2", "llama_tied",
)


def _other_config(kind: str) -> Any:
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128)
    gqa = dict(common, intermediate_size=128, num_key_value_heads=2)
    configs = {
        "mistral": lambda: tf.MistralConfig(**gqa),
        "qwen2": lambda: tf.Qwen2Config(**gqa),
        "qwen3": lambda: tf.Qwen3Config(head_dim=16, **gqa),
        "gemma2": lambda: tf.Gemma2Config(head_dim=16, **gqa),
        "gemma3": lambda: tf.Gemma3TextConfig(head_dim=16, **gqa),
        "phi3": lambda: tf.Phi3Config(pad_token_id=0, **gqa),
        "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),  # the reference is one rank
        "gpt_neox": lambda: tf.GPTNeoXConfig(intermediate_size=128, **common),
        "mixtral": lambda: tf.MixtralConfig(**dict(gqa, intermediate_size=64), num_local_experts=4,
                                            num_experts_per_tok=2),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(moe_intermediate_size=32, head_dim=16, num_experts=4,
                                               num_experts_per_tok=2, **gqa),
        "falcon_new": lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                                              bias=False),
        "olmo2": lambda: tf.Olmo2Config(**gqa),
        "llama_tied": lambda: tf.LlamaConfig(tie_word_embeddings=True, **gqa),
    }
    return configs[kind]()


class ToyBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class ToyGain(nn.Module):
    """A unit of 2 elements: smaller than the world size."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.tensor([1.0, 0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g.sum()


class ToyLM(nn.Module):
    """A non-HF model: no `_no_split_modules`, an odd number of parameters (not divisible by 2 or 3).

    `checkpoint_blocks` ("reentrant" / "non_reentrant") calls each block through
    `torch.utils.checkpoint.checkpoint`, as user code does; with `layer_drop`, `drop_block = True`
    skips the middle block (LayerDrop with a schedule every rank shares)."""

    def __init__(self, d: int = 13, layer_drop: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList([ToyBlock(d) for _ in range(3)])
        self.gain = ToyGain()
        self.head = nn.Linear(d, VOCAB)
        self.checkpoint_blocks: str | None = None
        if layer_drop:
            self.drop_block = False

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        from torch.utils.checkpoint import checkpoint

        x = self.emb(input_ids)
        for i, block in enumerate(self.blocks):
            if i == 1 and getattr(self, "drop_block", False):
                continue
            if self.checkpoint_blocks is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpoint_blocks == "reentrant")
        logits = self.head(self.gain(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return out


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class MoEBlock(nn.Module):
    """Top-1 routing over an `nn.ModuleList` of experts, by token id (expert `(id // 64) % 4`), each
    expert's output weighted by a learned router's probability for it; an expert that gets no token
    is not called at all, so its parameters are unused on that rank in that step."""

    def __init__(self, d: int, n_experts: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList([Expert(d) for _ in range(n_experts)])

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        route = (ids // 64) % len(self.experts)
        gate = torch.softmax(self.router(h), dim=-1).gather(-1, route.unsqueeze(-1))
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen = route == e
            if chosen.any():
                out = out.index_put((chosen,), expert(h[chosen]) * gate[chosen])
        return x + out


class MoELM(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList([MoEBlock(d) for _ in range(2)])
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        x = self.emb(input_ids)
        for block in self.blocks:
            x = block(x, input_ids)
        logits = self.head(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return out


class FusedHead(torch.autograd.Function):
    """What Liger's fused linear cross-entropy does with the head: `lm_head.weight` is an argument of an autograd
    Function, so the head's module is never called and no `__torch_function__` sees the weight go in."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        return hidden @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        return grad @ weight, rows.t() @ hidden.reshape(-1, hidden.shape[-1])


def apply_liger_like(model: nn.Module, kernel_config: Any = None) -> None:
    """Liger's `apply_liger_kernel_to_llama(model=model)` (and transformers' `apply_liger_kernel`, the Trainer's
    `--use_liger_kernel`) without triton: the model's forward replaced by one from a `liger_kernel` module that
    passes `lm_head.weight` to a fused loss without calling the head, as Liger's `lce_forward` does. Its loss is
    the model's own loss function, so the same forward on the unsharded model is the reference."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def lce_forward(input_ids: Any = None, attention_mask: Any = None, labels: Any = None, skip_logits: Any = None,
                    **kwargs: Any) -> CausalLMOutputWithPast:
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = FusedHead.apply(hidden, model.lm_head.weight)
        loss = None if labels is None else model.loss_function(
            logits=logits, labels=labels, vocab_size=model.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    lce_forward.__module__ = "liger_kernel.transformers.model.llama"  # where Liger's forwards live
    model.forward = lce_forward


def make_batches(sc: Scenario) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, VOCAB, (sc.steps, sc.global_batch, sc.seq), generator=g)
    if sc.repeat_batch:
        data[:] = data[0].clone()
    if sc.model == "moe":  # rank 0's micro-batches only reach experts 0-1; the other ranks', all four
        for a in range(sc.accum):
            start = a * sc.world * sc.micro_bs
            data[:, start : start + sc.micro_bs] %= 128
    return data


def _set_step(model: nn.Module, step: int) -> None:
    """Per-step switches a model offers (LayerDrop's schedule: the middle block is skipped on odd steps)."""
    if hasattr(model, "drop_block"):
        model.drop_block = step % 2 == 1


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW with the Trainer's two groups: weight decay on matrices, none on biases and norms.

    eps=1e-6 rather than 1e-8: Adam's first updates are about lr * sign(grad), so elements whose
    gradient is near zero turn fp32 rounding into O(lr) weight differences. Measured on the llama
    scenario, merely re-ordering the reference's own summation moves a weight by 3.8e-6 relative
    with eps=1e-8 but by 1.5e-7 with eps=1e-6; the latter leaves the 1e-5 parity bound ~60x
    headroom above the noise floor, so it still catches real errors.
    """
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-6
    )


LORA_TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj"], "falcon": ["query_key_value", "dense"]}


def with_lora(model: nn.Module, kind: str) -> nn.Module:
    """`get_peft_model` with LoRA rank 8 on the attention projections (seeded: the same adapter everywhere)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS[kind]))


def freeze(model: nn.Module, patterns: tuple[str, ...]) -> None:
    for name, p in model.named_parameters():
        if any(pat in name for pat in patterns):
            p.requires_grad_(False)


def _loss(out: Any) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) else out.loss


def reference_run(sc: Scenario, accumulate: bool = False) -> dict[str, Any]:
    """Single-process training on the whole global batch: in one backward, or (`accumulate`) one backward per
    micro-batch of the sharded run, in its order (the same math summed in another order: the fp32 noise)."""
    from tests._optimizers import build_optimizer

    torch.set_num_threads(1)
    model = make_model(sc.model)
    if sc.lora:
        model = with_lora(model, sc.model)
    freeze(model, sc.frozen)
    opt = build_optimizer(sc.optimizer, model, sc.lr)
    data = make_batches(sc)
    losses, norms = [], []
    for step in range(sc.steps):
        batch = data[step]
        _set_step(model, step)
        if accumulate:
            parts = batch.split(sc.micro_bs)
            micro = []
            for b in parts:
                part = _loss(model(input_ids=b, labels=b))
                (part / len(parts)).backward()
                micro.append(part.detach())
            loss = torch.stack(micro).mean()
        else:
            loss = _loss(model(input_ids=batch, labels=batch))
            loss.backward()
        if sc.max_grad_norm is not None:
            params = [p for p in model.parameters() if p.grad is not None]
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, sc.max_grad_norm)))
        for each in opt if isinstance(opt, list) else [opt]:
            each.step()
            each.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "state": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}}


def sharded_run(sc: Scenario) -> dict[str, Any]:
    """The same training under hf_zero on this rank; rank 0 returns the gathered weights."""
    import torch.distributed as dist

    import hf_zero
    from tests._dist import device

    rank, world = dist.get_rank(), dist.get_world_size()
    if world != sc.world:
        raise RuntimeError(f"scenario for world {sc.world} run on {world} ranks")
    model = make_model(sc.model, seed=sc.seed)
    if sc.lora:
        model = with_lora(model, sc.model)
    freeze(model, sc.frozen)
    if sc.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": sc.reentrant})
    _activation_checkpointing(model, sc.ac)
    from tests._optimizers import build_optimizer

    opt = build_optimizer(sc.optimizer, model, sc.lr)
    config = hf_zero.ZeroConfig(stage=sc.stage, mixed_precision=sc.mixed_precision, wrap=sc.wrap, **dict(sc.config_overrides))
    model, opt = hf_zero.initialize(model, opt, config)
    opts = opt if isinstance(opt, list) else [opt]  # several optimizers come back as the list they were given
    if sc.stream_ordered:
        hooks = model.zero_engine.hooks
        hooks.settings = replace(hooks.settings, gate_on_reductions=False)
    gathers = _count_gathers(model)
    if sc.load_from is not None:
        meta = hf_zero.load_checkpoint(sc.load_from, model, opt)
        if meta.get("step") != sc.start_step:
            raise RuntimeError(f"checkpoint says step {meta.get('step')}, scenario resumes at {sc.start_step}")
    data = make_batches(sc)
    losses, norms, memory = [], [], None
    max_gathers = 0  # the most all-gathers of one unit in one forward + backward pass
    for step in range(sc.start_step, sc.stop_step or sc.steps):
        _set_step(model, step)
        micro_losses = []
        for a in range(sc.accum):
            gathers.clear()
            start = (a * sc.world + rank) * sc.micro_bs
            batch = data[step, start : start + sc.micro_bs].to(device())
            last = a == sc.accum - 1
            ctx = model.no_sync() if (sc.use_no_sync and not last) else contextlib.nullcontext()
            with ctx:
                loss = _loss(model(input_ids=batch, labels=batch))
                (loss / sc.accum).backward()
            micro_losses.append(loss.detach().float())
            max_gathers = max([max_gathers, *gathers.values()])
        mean = torch.stack(micro_losses).mean()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        if sc.max_grad_norm is not None:
            norms.append(float(opts[0].clip_grad_norm_(sc.max_grad_norm)))  # over the model: every optimizer's
        for each in opts:
            each.step()
        if step == sc.start_step:  # at the step: zero_grad frees the gradient shards
            memory = hf_zero.model_state_memory(model)
        for each in opts:
            each.zero_grad()
    if sc.save_to is not None and sc.lora:
        model.save_pretrained(sc.save_to)  # PEFT's adapter files
    elif sc.save_to is not None:
        hf_zero.save_checkpoint(sc.save_to, model, opt, metadata={"step": sc.stop_step or sc.steps})
    disk = model.zero_engine.disk
    disk_read_bytes = disk.read_bytes if disk is not None else 0
    state = hf_zero.full_state_dict(model)
    scaler = model.zero_engine.scaler
    return {
        "loss_scale": scaler.scale if scaler is not None else None,
        "disk_read_bytes": disk_read_bytes,
        "losses": losses,
        "norms": norms,
        "state": {k: v.float().cpu().numpy().copy() for k, v in state.items()},
        "memory": memory,
        "numel": sum(p.numel() for p in model.parameters()),
        "max_gathers": max_gathers,
        "parts": [{"frozen": u.spec.frozen, "trainable": u.has_trainable, "shard": u.layout.shard_numel,
                   "local": sum(pc.end - pc.start for pc in model.zero_engine.pieces if pc.part is u)}
                  for u in model.zero_engine.parts],
        "trainable_numel": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def same_global_batch(sc: Scenario, world: int, stage: int, global_batch: int) -> Scenario:
    """`sc` on `world` ranks at `stage` with the same global batch (micro-batch 2, accumulation fills the rest)."""
    return replace(sc, world=world, stage=stage, micro_bs=2, accum=global_batch // (2 * world))


def interrupted_run(pools: Any, before: Scenario, after: Scenario, checkpoint: str, save_at: int,
                    run_before: Any = None, run_after: Any = None) -> dict[str, Any]:
    """`before` trains steps [0, save_at) and saves to `checkpoint`; `after` starts from another init (seed 1),
    loads it and trains the rest. The losses of both parts and the final weights (rank 0's)."""
    first = pools(before.world).values(run_before or sharded_run, replace(before, stop_step=save_at, save_to=checkpoint))[0]
    second = pools(after.world).values(run_after or sharded_run,
                                       replace(after, seed=1, start_step=save_at, load_from=checkpoint))[0]
    return {"losses": first["losses"] + second["losses"], "state": second["state"]}


def _activation_checkpointing(model: nn.Module, how: str) -> None:
    """Activation checkpointing as users of FSDP write it (`Scenario.ac`)."""
    if not how:
        return
    if how.startswith("user"):
        model.checkpoint_blocks = "reentrant" if how.endswith("reentrant") else "non_reentrant"
        return
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    if hasattr(model, "config"):
        model.config.use_cache = False  # a replayed layer would append to the KV cache twice (sharded or not)
    impl = CheckpointImpl.REENTRANT if how == "wrapper_reentrant" else CheckpointImpl.NO_REENTRANT
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]  # under a PEFT wrapper too
    block = type(layers[0]) if layers else type(model.blocks[0])
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=impl),
                                   check_fn=lambda m: isinstance(m, block))


def _count_gathers(model: nn.Module) -> dict[str, int]:
    """Count every all-gather of each unit (prefetches included) into the returned dict."""
    counts: dict[str, int] = {}
    for unit in model.zero_engine.parts:
        def counting(*args: Any, _unit: Any = unit, _unshard: Any = unit.gather, **kwargs: Any) -> Any:
            pending = _unshard(*args, **kwargs)
            if _unit.sharded_param is not None:
                counts[_unit.spec.name] = counts.get(_unit.spec.name, 0) + 1
            return pending
        unit.gather = counting
    return counts


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """‖a − b‖ / ‖b‖ (absolute when b is all zeros)."""
    denom = float(np.linalg.norm(b))
    diff = float(np.linalg.norm(a.astype(np.float64) - b.astype(np.float64)))
    return diff / denom if denom > 0 else diff


def make_tokenizer(directory: str, texts: list[str] | None = None) -> None:
    """Train a tiny byte-level BPE tokenizer offline and save it with `save_pretrained`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = texts or ["the quick brown fox jumps over the lazy dog " * 4, "sharded training of language models"] * 8
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(directory)


@contextlib.contextmanager
def hf_zero_records() -> Any:
    """The messages logged on the "hf_zero" logger inside the block (a list, filled as they come)."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    keep = Keep()
    logging.getLogger("hf_zero").addHandler(keep)
    try:
        yield records
    finally:
        logging.getLogger("hf_zero").removeHandler(keep)
