"""QLoRA's 4-bit base read straight into shards: `hf_zero.from_pretrained(..., quantization_config=...)`.

[Note: quantized load]
transformers loads a QLoRA base whole on every process, then quantizes each linear weight (bitsandbytes' NF4 or
FP4: a scale per block of 64 weights, with double quantization a second level over the whole tensor's scales);
hf_zero would then shard the packed codes ([Note: quantized base] in engine/quantized.py). Loaded through
`hf_zero.from_pretrained`, the model is built on the meta device and transformers' own `replace_with_bnb_linear`
puts bitsandbytes' `Linear4bit` where it would (the same `modules_to_not_convert`); each 4-bit weight becomes a
meta parameter of its packed shape and storage dtype, which the engine shards in a part of its own. Its codes are
built from the files' weight ([Note: converted weights] in checkpoint/conversions.py: read whole, cast to the
load's dtype, quantized by bitsandbytes exactly as transformers' loader does) when a rank fills its slice; the
rank keeps that slice and the weight's quantization state (scales, code table), which every rank needs whole.
A rank whose shards hold no byte of a weight quantizes it once more for its state after `initialize`. So host
memory holds one weight at a time beside the shards, and every rank reads each 4-bit weight once. A directory
transformers saved from its 4-bit load (bitsandbytes' `quantization_config` in its `config.json`) holds the codes
as the parameters store them: they are read by slice like any weight, and each weight's state is rebuilt from the
scales saved beside it (`attach_saved_states`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..checkpoint.conversions import FourBitWeight

# what transformers saves beside a 4-bit weight's codes (bitsandbytes' `QuantState.as_dict(packed=True)`)
SCALE_SUFFIXES = (
    "absmax",
    "quant_map",
    "nested_absmax",
    "nested_quant_map",
    "quant_state.bitsandbytes__nf4",
    "quant_state.bitsandbytes__fp4",
)


def to_4bit_on_meta(model: nn.Module, quantization_config: Any, load_dtype: torch.dtype) -> dict[str, FourBitWeight]:
    """Replace the linear layers transformers would quantize by 4-bit ones on the meta device; returns, by the
    model's parameter name, how each 4-bit weight is built from the files."""
    import bitsandbytes as bnb
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    if not getattr(quantization_config, "load_in_4bit", False):
        raise ValueError(
            "hf_zero.from_pretrained quantizes on load in 4 bits only (QLoRA): BitsAndBytesConfig(load_in_4bit=True, "
            "bnb_4bit_quant_type='nf4', ...); an 8-bit base is not sharded."
        )
    skip = list(getattr(quantization_config, "llm_int8_skip_modules", None) or get_keys_to_not_convert(model))
    replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=quantization_config)
    built: dict[str, FourBitWeight] = {}
    for name, module in model.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        weight: Any = module.weight  # bitsandbytes' Params4bit, its settings as attributes
        settings = {
            "blocksize": weight.blocksize,
            "compress_statistics": weight.compress_statistics,
            "quant_type": weight.quant_type,
            "quant_storage": weight.quant_storage,
        }
        numel = weight.numel()
        storage = weight.quant_storage
        packed = ((numel + 1) // 2 // storage.itemsize, 1)
        module.weight = bnb.nn.Params4bit(
            torch.empty(packed, dtype=storage, device="meta"), requires_grad=False, bnb_quantized=True, **settings
        )
        key = f"{name}.weight"
        built[key] = FourBitWeight(key, packed, storage, load_dtype, settings)
    if not built:
        raise ValueError(
            f"quantization_config: {type(model).__name__} has no layer transformers' bitsandbytes loader quantizes "
            "(it converts only modules whose type is exactly nn.Linear)."
        )
    return built


def attach_saved_states(model: nn.Module, built: dict[str, FourBitWeight], path: str, device: torch.device) -> None:
    """After `initialize`, for a directory saved with its 4-bit weights: each weight's quantization state, rebuilt
    from the scales saved beside its codes (`<weight>.absmax`, `.quant_map`, ...) on the compute `device`, as
    transformers' loader does."""
    from pathlib import Path

    import bitsandbytes as bnb
    from safetensors import safe_open

    from ..checkpoint.reader import hf_weight_map

    weight_map = hf_weight_map(Path(path))
    with contextlib.ExitStack() as stack:
        opened: dict[str, Any] = {}  # each file opened once: its header read once, not once per scale

        def read(key: str) -> torch.Tensor:
            file = weight_map[key]
            if file not in opened:
                opened[file] = stack.enter_context(safe_open(str(Path(path) / file), framework="pt"))
            return opened[file].get_tensor(key)

        for name, param in model.named_parameters():
            weight = _find(built, name)
            if weight is None:
                continue
            parts = {k: read(k) for k in (f"{weight.key}.{s}" for s in SCALE_SUFFIXES) if k in weight_map}
            if not parts:
                raise ValueError(
                    f"{path} holds the 4-bit weight {weight.key} without its scales ({weight.key}.absmax, ...)."
                )
            param.quant_state = bnb.functional.QuantState.from_dict(parts, device=device)  # type: ignore[attr-defined]


def attach_states(model: nn.Module, built: dict[str, FourBitWeight], read: Callable[[str], torch.Tensor]) -> None:
    """After `initialize`: each 4-bit weight's quantization state on its parameter (built on this rank, or built
    now from the files where this rank's shards hold none of its bytes)."""
    for name, param in model.named_parameters():
        weight = _find(built, name)
        if weight is None:
            continue
        if weight.state is None:
            weight.build(read)
        param.quant_state = weight.state  # type: ignore[attr-defined]  # what bitsandbytes' Linear4bit reads


def _find(built: dict[str, FourBitWeight], name: str) -> FourBitWeight | None:
    """The 4-bit weight `name` is, by the model's name or under a PEFT wrapper's."""
    from ..checkpoint.pretrained import PEFT_ROOT

    if name in built:
        return built[name]
    if name.startswith(PEFT_ROOT):
        return built.get(name[len(PEFT_ROOT) :].replace(".base_layer.", "."))
    return None
