"""A quantized base under the engine: QLoRA's 4-bit weights, sharded as frozen parameters.

[Note: quantized base]
QLoRA keeps a model's linear weights in 4 bits (bitsandbytes' `Params4bit`: the packed codes as the parameter's
data, their scales in its `quant_state`) and trains LoRA adapters beside them. Loaded with
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=<the model's dtype>)`, as FSDP-QLoRA loads it, the
packed codes are stored as elements of the model's own dtype, so the engine shards them like any frozen
parameter: a frozen part holds this rank's slice of the bytes, a unit's bytes are gathered for its forward and
backward (stage 3) and bitsandbytes dequantizes them inside its own layer; the scales stay whole on every rank
beside the parameter. The bytes are never cast, so whatever would cast them is refused at `initialize`, on every
rank, naming what works: mixed precision (the cast on gather, [Note: cast on gather] in flat.py), int8 gathers
(`quantized_weights`), codes stored as integers (`bnb_4bit_quant_storage` left at uint8), an 8-bit base, or a
quantized parameter left trainable. Exact against single-process QLoRA with the same kernels (tests/test_peft.py).
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
    trained = [n for n, q in held if q.requires_grad]
    if trained:
        raise ValueError(
            f"hf_zero: the 4-bit weight '{trained[0]}' requires grad: its data are packed codes, which no optimizer "
            "can step. Freeze the quantized base (peft's get_peft_model does) and train adapters beside it."
        )
    dtypes = {q.dtype for _, q in held}
    others = {q.dtype for q in model.parameters() if not any(q is h for _, h in held)}
    if not all(d.is_floating_point for d in dtypes) or (others and dtypes != others):
        want = next(iter(others)) if others else "torch.float32"
        raise ValueError(
            f"hf_zero: the 4-bit weights (e.g. '{name}') store their codes as {sorted(map(str, dtypes))}, while "
            f"the rest of the model is {sorted(map(str, others))}. Load the base with "
            f"BitsAndBytesConfig(load_in_4bit=True, ..., bnb_4bit_quant_storage={want}) (the dtype the model is "
            "loaded in, as FSDP-QLoRA does), so the packed codes are elements of the model's dtype and shard like "
            "any frozen weight."
        )
    if config.mixed_precision != "no":
        raise ValueError(
            f"hf_zero: a 4-bit base (e.g. '{name}') with ZeroConfig(mixed_precision={config.mixed_precision!r}): the "
            "engine would cast the packed codes to the compute dtype and destroy them. Load the model in the dtype to "
            "compute in (dtype=torch.bfloat16 with bnb_4bit_quant_storage=torch.bfloat16 and "
            "bnb_4bit_compute_dtype=torch.bfloat16) and keep mixed_precision='no' (the Trainer without --bf16)."
        )
    if config.quantized_weights:
        raise ValueError(
            f"hf_zero: a 4-bit base (e.g. '{name}') with ZeroConfig(quantized_weights=True): the int8 gathers would "
            "quantize the packed codes again. Drop quantized_weights (the 4-bit bytes are already a quarter of bf16's)."
        )
