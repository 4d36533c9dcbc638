"""QLoRA on a sharded 4-bit base (tests/test_peft.py): a tiny model quantized by transformers + bitsandbytes on
the CPU, LoRA by peft, under hf_zero on every rank and in one process on both ranks' batches."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

import hf_zero

DEVICE = torch.device("cpu")  # where the models, their batches and the engine live (the GPU check sets its GPU)


def qlora_model(
    base: str, quant_type: str, double: bool, storage: str = "float32", repack: bool = False
) -> torch.nn.Module:
    """transformers' 4-bit load, `prepare_model_for_kbit_training`, LoRA. bitsandbytes' repacking of the codes for its
    CPU kernel at eval forwards ([Note: codes repacked on the CPU]) is off, as hf_zero turns it off, so that both sides
    of a comparison take bitsandbytes' one generic kernel on any CPU; `repack`: on, as on a CPU with AVX512-BF16."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double,
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=getattr(torch, storage),
    )
    model = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=q, dtype=torch.float32, device_map={"": DEVICE}
    )
    if model.config.model_type == "falcon":
        _quantize_falcon(model, q)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    targets = (
        ["q_proj", "v_proj", "up_proj"] if model.config.model_type == "llama" else ["query_key_value", "dense_h_to_4h"]
    )
    model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, lora_dropout=0.0))
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = repack
    return model


def _quantize_falcon(model: torch.nn.Module, q: Any) -> None:
    """Falcon's blocks hold `FalconLinear` (a subclass of nn.Linear), which transformers' bitsandbytes loader leaves
    unquantized (it converts only modules whose type is exactly nn.Linear): quantize them as it would."""
    import bitsandbytes as bnb

    for block in model.transformer.h:
        for owner in list(block.modules()):
            for name, child in list(owner.named_children()):
                if type(child).__name__ != "FalconLinear":
                    continue
                new = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=q.bnb_4bit_compute_dtype,
                    quant_type=q.bnb_4bit_quant_type,
                    compress_statistics=q.bnb_4bit_use_double_quant,
                    quant_storage=q.bnb_4bit_quant_storage,
                    device="meta",
                )
                new.weight = bnb.nn.Params4bit(
                    child.weight.data.clone(),
                    requires_grad=False,
                    quant_type=q.bnb_4bit_quant_type,
                    quant_storage=q.bnb_4bit_quant_storage,
                    compress_statistics=q.bnb_4bit_use_double_quant,
                )
                if child.bias is not None:
                    new.bias = torch.nn.Parameter(child.bias.data.clone(), requires_grad=False)
                setattr(owner, name, new.to(DEVICE))


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(rank)).to(DEVICE)


def _train(model: torch.nn.Module, opt: Any, x: torch.Tensor, evaluate: bool = False) -> dict[str, list[float]]:
    """3 steps in train mode; `evaluate`: an eval-mode forward without grad after the first (a Trainer evaluation)."""
    record: dict[str, list[float]] = {"loss": [], "norm": [], "eval": []}
    model.train()
    for step in range(3):
        if evaluate and step == 1:
            model.eval()
            with torch.no_grad():
                record["eval"].append(float(model(input_ids=x, labels=x).loss))
            model.train()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        record["norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        record["loss"].append(float(loss.detach()))
    return record


def _codes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The packed 4-bit codes of every quantized weight, as bytes (whole: gathered at stage 3)."""
    with hf_zero.gathered_parameters(model) if hasattr(model, "zero_engine") else contextlib.nullcontext():
        return {
            n: p.detach().view(torch.uint8).clone() for n, p in model.named_parameters() if hasattr(p, "quant_state")
        }


def qlora_against_one_process(
    base: str, stage: int, quant_type: str, double: bool, storage: str = "float32", evaluate: bool = False,
    **config: Any
) -> dict[str, Any]:
    """3 steps (clipping at 0.5) of QLoRA under hf_zero at `stage` (and `config`), and in this process alone on
    both ranks' batches; the losses (mean over ranks), norms and adapter weights of each, and whether the packed
    codes came out of training byte for byte as they went in. `evaluate`: an evaluation after the first step, the
    sharded model's bitsandbytes layers set to repack their codes as on an AVX512-BF16 CPU ([Note: codes repacked
    on the CPU])."""
    ref = qlora_model(base, quant_type, double, storage)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    ref_record = _train(ref, ref_opt, torch.cat([_batch(r) for r in range(dist.get_world_size())]), evaluate)
    model = qlora_model(base, quant_type, double, storage, repack=evaluate)
    before = _codes(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = hf_zero.initialize(model, opt, hf_zero.ZeroConfig(stage=stage, **config))
    record = _train(model, opt, _batch(dist.get_rank()), evaluate)
    after = _codes(model)
    codes_kept = before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    for key in ("loss", "eval"):
        losses = torch.tensor(record[key])
        dist.all_reduce(losses)
        record[key] = (losses / dist.get_world_size()).tolist()
    state = hf_zero.full_state_dict(model, rank0_only=False)
    return {
        "reference": ref_record,
        "record": record,
        "codes_kept": codes_kept and len(before) > 0,
        "ref_adapters": {k: v.detach().clone() for k, v in ref.state_dict().items() if "lora_" in k},
        "adapters": {k: v.detach().clone() for k, v in state.items() if "lora_" in k},
    }


def qlora_refusals(base: str) -> dict[str, str]:
    """What `initialize` refuses for a 4-bit base: a quantized weight left trainable; codes repacked for
    bitsandbytes' CPU kernel by an eval forward before `initialize` (its `quant_state` says so)."""
    out = {}
    for case in ("trainable_base", "repacked"):
        model = qlora_model(base, "nf4", True)
        weight = next(p for n, p in model.named_parameters() if "base_layer" in n)
        if case == "trainable_base":
            weight.requires_grad_(True)
        else:
            weight.quant_state.packing_format_for_cpu = True
        try:
            hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=2))
            out[case] = ""
        except ValueError as e:
            out[case] = str(e)
    return out


def qlora_memory(base: str, stage: int) -> dict[str, int]:
    """The model state this rank holds after one QLoRA step at `stage` (hf_zero's count of its shards), and the
    bytes of the 4-bit weights' quantization state it keeps whole beside them."""
    model = qlora_model(base, "nf4", True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scales = 0
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        if state is not None:
            held = [state.absmax, state.code, state.offset] + (
                [state.state2.absmax, state.state2.code] if state.nested else []
            )
            scales += sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))
    model, opt = hf_zero.initialize(model, opt, hf_zero.ZeroConfig(stage=stage))
    x = _batch(dist.get_rank())
    model(input_ids=x, labels=x).loss.backward()
    opt.step()  # the state after a step, its gradients still held (what the estimate counts)
    return {"measured": hf_zero.model_state_memory(model).total(), "scales": scales}


def qlora_loaded_both_ways(base: str, stage: int, storage: str) -> dict[str, Any]:
    """QLoRA built two ways on every rank: transformers' 4-bit load + peft + `initialize` (the user's), and
    `hf_zero.from_pretrained(..., quantization_config=..., peft_config=...)` reading its slices; whether the packed
    codes and the scales agree, and 3 steps of each (losses, norms, adapters)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=getattr(torch, storage),
    )
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    torch.manual_seed(0)
    user = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=q, dtype=torch.float32, device_map={"": DEVICE}
    )
    torch.manual_seed(0)
    user = get_peft_model(user, lora)
    theirs = _codes(user)
    scales = {n: p.quant_state.absmax.clone() for n, p in user.named_parameters() if hasattr(p, "quant_state")}
    opt = torch.optim.AdamW([p for p in user.parameters() if p.requires_grad], lr=1e-2)
    user, opt = hf_zero.initialize(user, opt, hf_zero.ZeroConfig(stage=stage))
    want = _train(user, opt, _batch(dist.get_rank()))
    torch.manual_seed(0)
    loaded, opt2 = hf_zero.from_pretrained(
        AutoModelForCausalLM,
        base,
        hf_zero.ZeroConfig(stage=stage),
        quantization_config=q,
        peft_config=lora,
        dtype=torch.float32,
        device=DEVICE,
        optimizer_fn=lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2),
    )
    loaded.train()
    mine = _codes(loaded)
    with hf_zero.gathered_parameters(loaded):  # stage 3: the parameters themselves, not their resting stand-ins
        own_scales = {n: p.quant_state.absmax for n, p in loaded.named_parameters() if hasattr(p, "quant_state")}
    got = _train(loaded, opt2, _batch(dist.get_rank()))
    adapters = [
        {k: v.detach().clone() for k, v in hf_zero.full_state_dict(m, rank0_only=False).items() if "lora_" in k}
        for m in (user, loaded)
    ]
    return {
        "codes_equal": theirs.keys() == mine.keys()
        and len(mine) > 0
        and all(torch.equal(theirs[n], mine[n]) for n in theirs),
        "scales_equal": scales.keys() == own_scales.keys()
        and all(torch.equal(scales[n], own_scales[n]) for n in scales),
        "want": want,
        "got": got,
        "adapters": adapters,
    }


def qlora_from_a_saved_4bit_checkpoint(saved: str, stage: int) -> dict[str, Any]:
    """A directory transformers saved with its 4-bit weights, loaded by transformers (whole, on every rank) and by
    `hf_zero.from_pretrained` (each rank its slices): whether the codes and scales agree, and the logits of each."""
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(saved, device_map={"": DEVICE})
    for module in theirs.modules():  # bitsandbytes' one generic kernel on both sides ([Note: codes repacked on the
        if hasattr(module, "support_avx512bf16_for_cpu"):  # CPU]: its bf16 CPU kernel's logits differ by 3e-3)
            module.support_avx512bf16_for_cpu = False
    codes = _codes(theirs)
    scales = {n: p.quant_state.absmax.clone() for n, p in theirs.named_parameters() if hasattr(p, "quant_state")}
    x = _batch(dist.get_rank())
    with torch.no_grad():
        want = theirs(input_ids=x).logits
    model, _ = hf_zero.from_pretrained(AutoModelForCausalLM, saved, hf_zero.ZeroConfig(stage=stage), device=DEVICE)
    mine = _codes(model)
    with hf_zero.gathered_parameters(model):
        own = {n: p.quant_state.absmax for n, p in model.named_parameters() if hasattr(p, "quant_state")}
    with torch.no_grad():
        got = model(input_ids=x).logits
    return {
        "codes_equal": codes.keys() == mine.keys()
        and len(mine) > 0
        and all(torch.equal(codes[n], mine[n]) for n in codes),
        "scales_equal": scales.keys() == own.keys() and all(torch.equal(scales[n], own[n]) for n in scales),
        "logits": float((got - want).abs().max()),
    }
