"""A PEFT model's checkpoint written as its adapter: what `PeftModel.save_pretrained` writes, offline.

[Note: adapter export]
A checkpoint of a PEFT model (LoRA) holds the whole wrapped model under PEFT's names
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`, `...q_proj.base_layer.weight`): written as
a transformers model directory, transformers would load a model initialized at random. What trained is the
adapter, and that is what `hf-zero consolidate` writes for such a checkpoint: `adapter_config.json` and
`adapter_model.safetensors`, the files `PeftModel.save_pretrained` writes, which `PeftModel.from_pretrained(base,
dir)` and `hf_zero.from_pretrained(..., peft_config=dir)` load.

`save_checkpoint` records each adapter's config in the manifest (`peft`). The consolidation builds the base model
its `config.json` names on the meta device, wraps it with `get_peft_model` under that config, and asks PEFT's own
`get_peft_model_state_dict` which weights an adapter save holds and under which keys (given the model's names as
tags, so no weight is read for it); then it reads those weights from the checkpoint and writes them, and PEFT's
config writer writes the config.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"  # what PEFT's config writer names it


def peft_configs(model: nn.Module) -> dict[str, dict[str, Any]] | None:
    """Each adapter's config of a PEFT model, as `PeftConfig.save_pretrained` writes it (for the manifest, [Note:
    adapter export]); None for another model, or a config that is not plain JSON."""
    if "peft" not in sys.modules:  # a PEFT model was built with it imported
        return None
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return None
    configs: dict[str, dict[str, Any]] = {}
    for name, config in model.peft_config.items():
        values = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
        try:
            configs[name] = json.loads(json.dumps(values))
        except (TypeError, ValueError):
            return None
    return configs


def adapter_weights(ckpt: Path, configs: dict[str, dict[str, Any]], params: list[str]) -> tuple[dict[str, str], type]:
    """`{key in adapter_model.safetensors: the checkpoint's parameter name}` of the one adapter `configs` holds, as
    PEFT's `get_peft_model_state_dict` chooses and names them ([Note: adapter export]), and the base model's class."""
    import transformers
    from peft import PeftConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict

    (adapter, raw), *more = configs.items()
    if more:
        raise ValueError(
            f"{ckpt} holds a PEFT model with {len(configs)} adapters ({', '.join(configs)}); hf-zero consolidate "
            "writes one. Save each with the PEFT model's save_pretrained(dir, selected_adapters=[name])."
        )
    config = PeftConfig.from_peft_type(**raw)
    hf_config = transformers.AutoConfig.from_pretrained(ckpt)
    hf_config._name_or_path = raw.get("base_model_name_or_path") or ""  # PEFT keeps the config's, as it was saved
    names = getattr(hf_config, "architectures", None) or []
    model_class = getattr(transformers, names[0], None) if names else None
    if model_class is None:
        raise ValueError(
            f"{ckpt}/config.json names no transformers model class ({names}): the adapter's weights cannot be named "
            "as PEFT names them. Save the adapter from the PEFT model with save_pretrained(dir)."
        )
    with torch.device("meta"):
        model = get_peft_model(model_class(hf_config), config, adapter_name=adapter)
    own = [name for name, _ in model.named_parameters()]
    if sorted(own) != sorted(params):
        missing = sorted(set(params) ^ set(own))[:4]
        raise ValueError(
            f"{ckpt}: the model its config.json and adapter config describe has other parameters than the checkpoint "
            f"(e.g. {missing}); save the adapter from the PEFT model with save_pretrained(dir)."
        )
    tags = {name: torch.tensor(i) for i, name in enumerate(own)}
    chosen = get_peft_model_state_dict(model, state_dict=tags, adapter_name=adapter)
    return {key: own[int(tag)] for key, tag in chosen.items()}, model_class


def write_adapter_config(configs: dict[str, dict[str, Any]], out: Path, model_class: type) -> None:
    """`adapter_config.json`, by PEFT's own config writer, as `PeftModel.save_pretrained` has it write: in inference
    mode, and without a task type, with the base model's class (`auto_mapping`)."""
    from peft import PeftConfig

    (raw,) = configs.values()
    config = PeftConfig.from_peft_type(**raw)
    config.inference_mode = True
    mapping = None
    if config.task_type is None:
        mapping = {"base_model_class": model_class.__name__, "parent_library": model_class.__module__}
    config.save_pretrained(os.fspath(out), auto_mapping_dict=mapping)
