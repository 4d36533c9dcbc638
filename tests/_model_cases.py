"""Rank functions for tests/test_sharded_model.py: a sharded model used as a whole HF model between steps."""

from __future__ import annotations

import io
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import hf_zero
from tests._training import VOCAB, apply_liger_like, make_model, make_optimizer

STEPS = 3
MICRO_BS = 2
SEQ = 12


def batches(world: int, steps: int = STEPS + 1) -> torch.Tensor:
    """`(steps, world * MICRO_BS, SEQ)` token ids; rank r takes rows `[r*MICRO_BS, (r+1)*MICRO_BS)`."""
    return torch.randint(0, VOCAB, (steps, world * MICRO_BS, SEQ), generator=torch.Generator().manual_seed(7))


def perturbation(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict moved away from `state` by a fixed, seeded amount (the same on every process)."""
    g = torch.Generator().manual_seed(11)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v.clone()
            for k, v in sorted(state.items())}


def _numpy(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().float().cpu().numpy().copy() for k, v in state.items()}


def reference(kind: str, world: int) -> dict[str, Any]:
    """Unsharded: the state dict after init, after STEPS steps, and after loading a perturbed state
    and one more step; each step on the whole global batch (every rank's micro-batch)."""
    torch.set_num_threads(1)
    model = make_model(kind)
    opt = make_optimizer(model, 1e-2)
    data = batches(world)
    out: dict[str, Any] = {"init": _numpy(model.state_dict()), "losses": []}
    for step in range(STEPS):
        loss = model(input_ids=data[step], labels=data[step]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out["losses"].append(float(loss.detach()))
    out["trained"] = _numpy(model.state_dict())
    model.load_state_dict(perturbation(model.state_dict()))
    loss = model(input_ids=data[STEPS], labels=data[STEPS]).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    out["losses"].append(float(loss.detach()))
    out["after_load"] = _numpy(model.state_dict())
    return out


def _read_everything(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, int]:
    """Read every parameter, buffer and state_dict entry as user code does; a parameter may refuse
    with a TypeError (also a RuntimeError, as before) that names what to use, and must otherwise hold its
    state_dict value."""
    counts = {"read": 0, "refused": 0, "buffers": 0}
    for name, p in model.named_parameters():
        try:
            value = torch.tensor(p.tolist())
            torch.save(p, io.BytesIO())
            float(p.norm())
        except RuntimeError as e:
            if "gathered_parameters" not in str(e) or "state_dict()" not in str(e) or not isinstance(e, TypeError):
                raise
            counts["refused"] += 1
            continue
        if not torch.equal(value.to(state[name].dtype), state[name].cpu()):
            raise AssertionError(f"{name} reads another value than its state_dict entry")
        counts["read"] += 1
    for name, b in model.named_buffers():
        float(b.float().norm()), b.tolist()
        counts["buffers"] += 1
    buffer = io.BytesIO()
    torch.save(state, buffer)
    for v in state.values():
        float(v.float().norm()), v.tolist()
    return counts


def state_dict_lifecycle(kind: str, stage: int) -> dict[str, Any]:
    """The sharded twin of `reference`, with every read users make between steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(kind)
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-2), hf_zero.ZeroConfig(stage=stage))
    data = batches(world)
    out: dict[str, Any] = {"init": _numpy(model.state_dict()), "losses": [], "reads": []}
    rows = slice(rank * MICRO_BS, (rank + 1) * MICRO_BS)

    def step(i: int) -> None:
        loss = model(input_ids=data[i, rows], labels=data[i, rows]).loss
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out["losses"].append(float(mean) / world)
        out["reads"].append(_read_everything(model, model.state_dict()))

    for i in range(STEPS):
        step(i)
    trained = model.state_dict()
    out["trained"] = _numpy(trained)
    out["tied_shares_tensor"] = "lm_head.weight" in trained and any(
        trained["lm_head.weight"] is v for k, v in trained.items() if k != "lm_head.weight")
    out["load_result"] = model.load_state_dict(perturbation(trained))
    step(STEPS)
    out["after_load"] = _numpy(model.state_dict())
    with hf_zero.state_dict_options(model, rank0_only=True, device="cpu"):
        out["rank0_only_keys"] = len(model.state_dict())
    return out


def load_state_dict_errors(stage: int) -> dict[str, Any]:
    """strict / non-strict as PyTorch defines them; a shape error raises on every rank, unchanged model."""
    model = make_model("llama")
    model, _ = hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=stage))
    full = model.state_dict()
    partial = {k: v + 1 for k, v in full.items() if "layers.0." in k}
    partial["not.a.key"] = torch.zeros(1)
    out: dict[str, Any] = {}
    try:
        model.load_state_dict(partial)
    except RuntimeError as e:
        out["strict"] = str(e)
    result = model.load_state_dict(partial, strict=False)
    out["missing"], out["unexpected"] = len(result.missing_keys), list(result.unexpected_keys)
    after = model.state_dict()
    out["loaded"] = all(torch.equal(after[k], partial[k]) for k in partial if k != "not.a.key")
    out["kept"] = all(torch.equal(after[k], full[k]) for k in full if k not in partial)
    bad = dict(after)
    if dist.get_rank() == 1:  # only one rank has the wrong shape: every rank must still raise
        bad["lm_head.weight"] = torch.zeros(3, 3)
    try:
        model.load_state_dict(bad)
    except RuntimeError as e:
        out["shape"] = str(e)
    out["unchanged_after_error"] = all(torch.equal(model.state_dict()[k], after[k]) for k in after)
    return out


def save_pretrained_everywhere(kind: str, stage: int, directory: str, fsdp_style: str) -> dict[str, Any]:
    """Train two steps, then `model.save_pretrained(directory)` on every rank (or, FSDP's habit, a
    state_dict gathered on every rank and saved by rank 0 with the stock writer)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(kind)
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-2), hf_zero.ZeroConfig(stage=stage))
    data = batches(world)
    for i in range(2):
        model(input_ids=data[i, rank * MICRO_BS:(rank + 1) * MICRO_BS], labels=data[i, rank * MICRO_BS:(rank + 1) * MICRO_BS]).loss.backward()
        opt.step()
        opt.zero_grad()
    if fsdp_style:
        sd = model.state_dict()
        if rank == 0:
            model.save_pretrained(directory, state_dict=sd)
        dist.barrier()
    else:
        model.save_pretrained(directory)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=data[3, :2]).logits
    return {"state": _numpy(model.state_dict()), "logits": logits.numpy().copy()}


def modify_in_gathered_parameters(kind: str, stage: int, mixed_precision: str) -> dict[str, Any]:
    """Rank 0 edits weights inside `gathered_parameters(modifier_rank=0)`; rank 1 scribbles on its own
    copy too (it must be overwritten). Then one training step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(kind)
    config = hf_zero.ZeroConfig(stage=stage, mixed_precision=mixed_precision)
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), config)
    before = model.state_dict()
    head = model.get_output_embeddings()
    layer = model.model.layers[0] if kind == "llama" else model.transformer.h[0]
    read_only_error = None
    if stage == 3:  # rank 1 writes inside a read-only block: refused on both ranks, the change dropped
        try:
            with hf_zero.gathered_parameters(head.weight):
                if rank == 1:
                    head.weight[5].fill_(7.0)
        except ValueError as e:
            read_only_error = str(e)
    with hf_zero.gathered_parameters([head.weight, *layer.parameters()], modifier_rank=0):
        seen_inside = float(head.weight.float().norm())
        if rank == 0:
            head.weight[3].fill_(0.5)
            next(layer.parameters()).mul_(0.5)
        else:
            head.weight.fill_(123.0)
    after = model.state_dict()
    data = batches(world)
    rows = slice(rank * MICRO_BS, (rank + 1) * MICRO_BS)
    loss = model(input_ids=data[0, rows], labels=data[0, rows]).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    head_name = "lm_head.weight"
    layer_name = next(n for n, _ in layer.named_parameters())
    prefix = "model.layers.0." if kind == "llama" else "transformer.h.0."
    edited = {k for k in before if before[k] is before[head_name]} | {prefix + layer_name}  # tied names share one tensor
    untouched = [k for k in before if k not in edited]
    return {
        "seen_inside": seen_inside,
        "after": _numpy(after),
        "before": _numpy(before),
        "untouched_exact": all(torch.equal(after[k], before[k]) for k in untouched),
        "head_other_rows_exact": torch.equal(after[head_name][4:], before[head_name][4:]),
        "loss": float(mean) / world,
        "trained": _numpy(model.state_dict()),
        "layer_param": prefix + layer_name,
        "rests_after": type(model.get_output_embeddings().weight).__name__ if stage == 3 else None,
        "read_only_error": read_only_error,
    }


def _train_lm(model: Any, opt: Any, data: torch.Tensor, steps: int) -> list[float]:
    """`steps` plain LM steps on this rank's rows `data[i]`; the losses averaged over the ranks."""
    losses = []
    for i in range(steps):
        loss = model(input_ids=data[i], labels=data[i]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return losses


def resize_then_train(stage: int, new_vocab: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model("llama")
    model, _ = hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=stage))
    torch.manual_seed(100 + rank)  # the new rows are sampled per rank: rank 0's must win
    model.resize_token_embeddings(new_vocab)
    _, opt = hf_zero.initialize(model, make_optimizer(model, 1e-2))  # a sharded model: the optimizer is attached
    data = batches(world) % new_vocab
    rows = slice(rank * MICRO_BS, (rank + 1) * MICRO_BS)
    losses = _train_lm(model, opt, data[:, rows], 2)
    error = None
    try:
        model.resize_token_embeddings(new_vocab + 8)
    except ValueError as e:
        error = str(e)
    return {"losses": losses, "state": _numpy(model.state_dict()), "vocab": model.config.vocab_size, "error": error}


def resize_reference(new_vocab: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = make_model("llama")
    torch.manual_seed(100)
    model.resize_token_embeddings(new_vocab)
    opt = make_optimizer(model, 1e-2)
    data = batches(world) % new_vocab
    losses = []
    for i in range(2):
        loss = model(input_ids=data[i], labels=data[i]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": _numpy(model.state_dict())}


def _embeds_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """One step's loss through the model's root modules called outside its forward ([Note: direct calls]): the
    embeddings looked up first and passed as `inputs_embeds` (soft prompts, image features), and a second loss
    from `lm_head` on the hidden states the model returned."""
    embeds = model.get_input_embeddings()(ids) * 1.5
    out = model(inputs_embeds=embeds, labels=ids, output_hidden_states=True)
    return out.loss + 0.1 * model.lm_head(out.hidden_states[-1]).float().pow(2).mean()


def embeds_then_train(stage: int) -> dict[str, Any]:
    """The layers the only units: the embeddings, the final norm and the head are the root's modules."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model("llama")
    zcfg = hf_zero.ZeroConfig(stage=stage, wrap=["LlamaDecoderLayer"])
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-2), zcfg)
    data, rows = batches(world), slice(rank * MICRO_BS, (rank + 1) * MICRO_BS)
    losses = []
    for i in range(STEPS):
        loss = _embeds_step(model, data[i, rows])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    with torch.no_grad():  # the backbone alone (embeddings extracted): its embeddings and norm are the root's too
        hidden = model.model(input_ids=data[STEPS, rows]).last_hidden_state
    return {"losses": losses, "state": _numpy(model.state_dict()), "hidden": hidden.numpy()}


def embeds_reference(world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = make_model("llama")
    opt, data = make_optimizer(model, 1e-2), batches(world)
    losses = []
    for i in range(STEPS):
        loss = _embeds_step(model, data[i])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        hidden = model.model(input_ids=data[STEPS]).last_hidden_state
    return {"losses": losses, "state": _numpy(model.state_dict()), "hidden": hidden.numpy()}


def liger_then_train(stage: int) -> dict[str, Any]:
    """A forward Liger replaced (tests._training.apply_liger_like) before `initialize`, the head a unit of its own
    (`wrap="auto"`): the losses and weights of the unsharded model with the same forward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model("llama")
    apply_liger_like(model)
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-2), hf_zero.ZeroConfig(stage=stage))
    data, rows = batches(world), slice(rank * MICRO_BS, (rank + 1) * MICRO_BS)
    return {"losses": _train_lm(model, opt, data[:, rows], STEPS), "state": _numpy(model.state_dict())}


def liger_reference(world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = make_model("llama")
    apply_liger_like(model)
    opt, data, losses = make_optimizer(model, 1e-2), batches(world), []
    for i in range(STEPS):
        loss = model(input_ids=data[i], labels=data[i]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": _numpy(model.state_dict())}


PROMPTS = [[5, 17, 42, 7], [9, 3, 101, 64]]


def generate_unevenly(kind: str, eos_step: int | None) -> dict[str, Any]:
    """Each rank generates for its own prompt, rank 0 stopping earlier (by max_new_tokens, or by an
    EOS token that only its sequence reaches); greedy outputs vs the same model unsharded."""
    rank = dist.get_rank()
    prompt = torch.tensor([PROMPTS[rank % len(PROMPTS)]])
    plain = make_model(kind).eval()
    kwargs: dict[str, Any] = {"do_sample": False, "pad_token_id": 0}
    if eos_step is None:
        kwargs["max_new_tokens"] = 3 if rank == 0 else 9
    else:
        first = plain.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=9, do_sample=False, pad_token_id=0)
        kwargs.update(max_new_tokens=9, eos_token_id=int(first[0, len(PROMPTS[0]) + eos_step]))
    expected = plain.generate(prompt, **kwargs)
    model = make_model(kind)
    model, _ = hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=3))
    model.eval()
    start = time.monotonic()
    got = model.generate(prompt, **kwargs)
    return {"expected": expected.tolist(), "got": got.tolist(), "seconds": time.monotonic() - start}


class _FailingTokenizer:
    def save_pretrained(self, directory: str) -> None:
        raise ValueError("this tokenizer cannot be saved")


def save_checkpoint_commit_error(directory: str, how: str) -> dict[str, Any]:
    """A failure that only rank 0 meets while committing (or metadata only rank 0 cannot encode):
    every rank must raise, quickly, with the cause."""
    model = make_model("llama")
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=3))
    kwargs: dict[str, Any] = {}
    if how == "tokenizer":
        kwargs["tokenizer"] = _FailingTokenizer() if dist.get_rank() == 0 else None
    else:
        kwargs["metadata"] = {"step": {1, 2}} if dist.get_rank() == 0 else {"step": 1}
    start = time.monotonic()
    error_type = error = None
    try:
        hf_zero.save_checkpoint(directory, model, opt, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        error_type, error = type(e).__name__, str(e)
    dist.barrier()  # the group is still usable: every rank got here
    return {"error_type": error_type, "error": error, "seconds": time.monotonic() - start}


def seq2seq_trainer_predict(output_dir: str) -> dict[str, Any]:
    """`Seq2SeqTrainer` composed with `ZeroTrainer` at stage 3: `predict` with generation passes
    `synced_gpus=True` to every generate call, and the predictions are the unsharded model's."""
    from dataclasses import dataclass

    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    @dataclass
    class Args(hf_zero.ZeroArgumentsMixin, Seq2SeqTrainingArguments):
        pass

    class Trainer(hf_zero.ZeroTrainer, Seq2SeqTrainer):
        pass

    args = Args(output_dir=output_dir, zero_stage=3, predict_with_generate=True, per_device_eval_batch_size=2,
                report_to=[], use_cpu=True, disable_tqdm=True)
    model = make_model("llama")
    model.config.pad_token_id = model.generation_config.pad_token_id = 0
    trainer = Trainer(model=model, args=args)
    seen: list[Any] = []
    original = type(model).generate

    def recording(self: Any, *a: Any, **kw: Any) -> Any:
        seen.append(kw.get("synced_gpus"))
        return original(self, *a, **kw)

    type(model).generate = recording  # type: ignore[method-assign]
    try:
        out = trainer.predict(_Prompts(), max_new_tokens=5, do_sample=False, pad_token_id=0)
    finally:
        type(model).generate = original  # type: ignore[method-assign]
    return {"predictions": out.predictions.tolist(), "synced": seen, "sharded": hf_zero.api.is_sharded(trainer.model)}


class _Prompts(torch.utils.data.Dataset):
    ROWS = torch.randint(0, VOCAB, (8, 6), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ROWS)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ROWS[i]}


def lora_merged_on_rank_0(stage: int, directory: str) -> dict[str, Any]:
    """A LoRA model trained two steps, then DDP's end of script: `if rank == 0:
    model.merge_and_unload().save_pretrained(directory)`. Returns rank 0's expected merged weights (each base
    weight plus scale * B @ A, from the full state before the merge) and the error each rank raised."""
    from tests._training import with_lora

    model = with_lora(make_model("llama"), "llama")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = hf_zero.initialize(model, opt, hf_zero.ZeroConfig(stage=stage))
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    full = hf_zero.full_state_dict(model, rank0_only=False)
    expected = {}
    for name in full:
        if ".lora_A." in name:
            base = name.replace("lora_A.default.weight", "base_layer.weight")
            b = full[name.replace("lora_A", "lora_B")]
            plain = base.replace("base_model.model.", "", 1).replace(".base_layer", "")
            expected[plain] = full[base] + 2.0 * b @ full[name]  # lora_alpha / r = 16 / 8
    try:
        if dist.get_rank() == 0:
            model.merge_and_unload().save_pretrained(directory)
    except ValueError as e:
        return {"error": str(e), "expected": None}
    return {"error": None, "expected": expected if dist.get_rank() == 0 else None}


def lora_base_unfrozen_after_warm_up(stage: int, frozen_at_initialize: bool) -> dict[str, Any]:
    """A bf16 LLaMA with peft's LoRA (its base frozen by `get_peft_model`) under bf16 mixed precision at `stage`:
    four steps of a DDP-style loop (`clip_grad_norm_` on `model.parameters()`, `zero_grad(set_to_none=False)`, an
    eval forward after each step), the base's `q_proj` weights trained from the third step on. `frozen_at_initialize`:
    as peft left them; else made trainable before `initialize` (the optimizer's state starts at the third step
    either way). The losses, the full state, and the base's `q_proj` weights as the third step began."""
    from tests._training import with_lora

    model = with_lora(make_model("llama").to(torch.bfloat16), "llama")
    if not frozen_at_initialize:
        for name, p in model.named_parameters():
            p.requires_grad_(p.requires_grad or ("base_layer" in name and "q_proj" in name))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = hf_zero.initialize(model, opt, hf_zero.ZeroConfig(stage=stage, mixed_precision="bf16"))
    base = [p for name, p in model.named_parameters() if "base_layer" in name and "q_proj" in name]
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    before: dict[str, torch.Tensor] = {}
    for step in range(4):
        for p in base:
            p.requires_grad_(step >= 2)
        if step == 2:
            before = {k: v.float().clone() for k, v in hf_zero.full_state_dict(model, rank0_only=False).items()
                      if "base_layer" in k and "q_proj" in k}
        x = torch.randint(0, VOCAB, (2, 16), generator=g)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        model.eval()
        with torch.no_grad():
            model(input_ids=x)
        model.train()
        losses.append(float(loss))
    state = hf_zero.full_state_dict(model, rank0_only=False)
    return {"losses": losses, "state": {k: v.float().clone() for k, v in state.items()}, "before": before}
