"""A quantized base under the engine: QLoRA's 4-bit weights, sharded as frozen parameters.

[Note: quantized base]
QLoRA keeps a model's linear weights in 4 bits (bitsandbytes' `Params4bit`: the packed codes as the parameter's
data, their scales in its `quant_state`) and trains LoRA adapters beside them. The engine shards the packed codes
like any frozen parameter, in a part of their own dtype (uint8, bitsandbytes' default storage, or the model's
dtype with `bnb_4bit_quant_storage`, as FSDP-QLoRA loads it): [Note: parameters kept in their own dtype] in
unit.py. A frozen part holds this rank's slice of the bytes, a unit's bytes are gathered for its forward and
backward (stage 3) and bitsandbytes dequantizes them inside its own layer; the scales stay whole on every rank
beside the parameter. The bytes are never cast (mixed precision casts the rest of the model, not them) nor
requantized (`quantized_weights` leaves kept parts exact). Refused at `initialize`, on every rank, naming what
works: an 8-bit base, or a quantized parameter left trainable. Exact against single-process QLoRA with the same
kernels (tests/test_peft.py).

[Note: codes repacked on the CPU]
bitsandbytes (0.49 and later), on a CPU with AVX512-BF16, repacks a `Linear4bit`'s codes into another layout at
its first forward in eval mode without grad (`weight.data` replaced, `quant_state.packing_format_for_cpu` set): an
evaluation between training steps would replace the bytes the engine shards (stages 0-2: a parameter whose data
moved, refused at the next forward; stage 3: a gathered copy repacked and freed while its `quant_state` says
"repacked", the next gather's codes read in the wrong layout). So `initialize` turns that repacking off on the
layers it shards (`support_avx512bf16_for_cpu = False`: bitsandbytes' generic path, the one training takes), and
refuses a model whose codes were repacked already (an eval forward before `initialize`), naming the order that
works. GPUs have no such path.
"""

from __future__ import annotations

from torch import nn

from ..config import ZeroConfig

_FOUR_BIT = ("Params4bit",)
_EIGHT_BIT = ("Int8Params",)


def quantized_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The model's parameters that hold quantized codes (bitsandbytes' 4- and 8-bit parameters)."""
    return [
        (name, p)
        for name, p in model.named_parameters()
        if type(p).__name__ in _FOUR_BIT + _EIGHT_BIT or hasattr(p, "quant_state")
    ]


def check_quantized(model: nn.Module, config: ZeroConfig) -> None:
    """`ValueError` for a quantized base the engine cannot shard exactly ([Note: quantized base]); nothing for a
    model without one."""
    held = quantized_params(model)
    if not held:
        return
    name, p = held[0]
    if type(p).__name__ in _EIGHT_BIT:
        raise ValueError(
            f"hf_zero: '{name}' is an 8-bit bitsandbytes weight (load_in_8bit), which hf_zero does not shard. Load the "
            "base in 4 bits for QLoRA: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
            "bnb_4bit_quant_storage=<the dtype you load the model in>)."
        )
    repacked = [n for n, q in held if getattr(getattr(q, "quant_state", None), "packing_format_for_cpu", False)]
    if repacked:  # [Note: codes repacked on the CPU]
        raise ValueError(
            f"hf_zero: the 4-bit weight '{repacked[0]}' was repacked by bitsandbytes for its CPU kernel (an eval-mode "
            "forward without grad ran before hf_zero.initialize on an AVX512-BF16 CPU), a layout only that process "
            "reads. Call hf_zero.initialize before any forward of the model (or reload it), and evaluate after it."
        )
    trained = [n for n, q in held if q.requires_grad]
    if trained:
        raise ValueError(
            f"hf_zero: the 4-bit weight '{trained[0]}' requires grad: its data are packed codes, which no optimizer "
            "can step. Freeze the quantized base (peft's get_peft_model does) and train adapters beside it."
        )


def keep_codes_in_place(model: nn.Module) -> None:
    """[Note: codes repacked on the CPU] bitsandbytes' repacking of the codes at an eval forward, turned off."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010 - bitsandbytes' attribute, untyped
