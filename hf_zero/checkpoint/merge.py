"""A LoRA adapter merged into its base model's weights: a `from_pretrained` directory of the domain-adapted model.

[Note: merged export]
QLoRA trains adapters beside a 4-bit base; what a user ships is usually the base with the adapter merged in, in
the base's own precision (what PEFT's `merge_and_unload` gives on the base loaded in bf16, not on the dequantized
4-bit weights, whose rounding the merge would bake in). `merge_adapter` does that offline, one tensor at a time: it
streams the base directory's safetensors files, adds `scale * B @ A` to each weight the adapter targets (in
float32, then back to the base tensor's dtype or `dtype`), takes the adapter's trained copies of
`modules_to_save` in place of the originals, and writes the result as `consolidate` writes a model (temporary
names, then renamed; the output folder checked first: [Note: output record] in target.py). `scale` is PEFT's:
`lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`, per module where `rank_pattern` / `alpha_pattern`
say. The adapter is a directory `PeftModel.save_pretrained` (or `hf-zero consolidate` of a PEFT checkpoint) wrote,
or such a checkpoint itself. What no plain weight sum expresses is refused by name: DoRA, adapters on embeddings
or convolutions, trained biases, other PEFT methods.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..dtypes import parse_dtype
from .format import set_config_dtype, side_files
from .target import check_target, record_output
from .writer import INDEX_FILE, HFShardWriter

_PREFIX = "base_model.model."
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)(?:\.[^.]+)?\.weight$")
_SAVED = re.compile(r"^(?P<module>.+)\.modules_to_save(?:\.[^.]+)?\.(?P<leaf>[^.]+)$")


def merge_adapter(
    adapter: str | os.PathLike[str],
    base: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> list[str]:
    """Write `base` with the LoRA `adapter` merged in ([Note: merged export]); returns the weight files written.

    Args:
        adapter (`str` or `os.PathLike`): a PEFT adapter directory (`adapter_config.json`,
            `adapter_model.safetensors`), or an hf_zero checkpoint of a PEFT model.
        base (`str` or `os.PathLike`): the base model's directory (safetensors), in the precision to merge into
            (for QLoRA: the bf16 checkpoint that was quantized on load).
        output_dir (`str` or `os.PathLike`): where the merged model is written (`hf-zero consolidate`'s rules:
            a folder holding other files is refused unless `overwrite`).
        dtype (`str` or `torch.dtype`, *optional*): `"bf16"`, `"fp16"` or `"fp32"`; defaults to each base tensor's.
        max_shard_size (`int` or `str`, *optional*, defaults to `"5GB"`): the largest weight file.
        overwrite (`bool`, *optional*, defaults to `False`): write into a folder holding other files.

    Raises:
        FileNotFoundError: a missing adapter or base file.
        ValueError: an adapter that is not a plain LoRA (DoRA, embeddings, trained biases), or whose modules the
            base does not hold.

    Example:

    ```python
    >>> hf_zero.checkpoint.merge.merge_adapter("out/final", "./llama-base", "llama-domain", dtype="bf16")
    >>> model = AutoModelForCausalLM.from_pretrained("llama-domain")
    ```
    """
    base_dir, out = Path(base), Path(output_dir)
    out_dtype = parse_dtype(dtype)
    files = _base_files(base_dir)
    check_target(out, overwrite=overwrite)
    with tempfile.TemporaryDirectory(prefix="hf_zero-adapter-") as scratch:
        adapter_dir = _adapter_dir(Path(adapter), Path(scratch))
        config = _lora_config(adapter_dir)
        deltas, saved = _adapter_tensors(adapter_dir, config.get("modules_to_save") or [])
        written = _write_merged(files, deltas, saved, config, out, out_dtype, max_shard_size)
    weights = {f.name for f in files} | {INDEX_FILE, "hf_zero_output.json"}
    copied = [name for name in side_files(base_dir) if name not in weights and not name.endswith(".bin")]
    for name in copied:  # config, tokenizer, a remote-code model's code
        shutil.copyfile(base_dir / name, out / name)
    if out_dtype is not None:
        set_config_dtype(out / "config.json", out_dtype)
    record_output(out, [*written, *([INDEX_FILE] if len(written) > 1 else []), *copied])
    return written


def _base_files(base: Path) -> list[Path]:
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"{base} is not a model directory (no config.json): give the base model's directory.")
    files = sorted(base.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{base} holds no safetensors weights: save the base with save_pretrained (safetensors) first."
        )
    return files


def _adapter_dir(adapter: Path, scratch: Path) -> Path:
    """The adapter's directory; an hf_zero checkpoint of a PEFT model is first written as one ([Note: adapter
    export])."""
    if (adapter / "adapter_config.json").is_file():
        return adapter
    from .consolidate import consolidate
    from .format import sharded_state_dir

    try:
        sharded_state_dir(adapter)
    except (FileNotFoundError, ValueError):
        raise FileNotFoundError(
            f"{adapter} is neither a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) nor an "
            "hf_zero checkpoint of a PEFT model."
        ) from None
    consolidate(adapter, scratch / "adapter", progress=False)
    if not (scratch / "adapter" / "adapter_config.json").is_file():
        raise ValueError(f"{adapter} is a checkpoint of a model without an adapter: there is nothing to merge.")
    return scratch / "adapter"


def _lora_config(adapter: Path) -> dict[str, Any]:
    config = json.loads((adapter / "adapter_config.json").read_text())
    kind = config.get("peft_type")
    if kind != "LORA":
        raise ValueError(f"{adapter}: a {kind} adapter; only LoRA adapters merge into plain weights.")
    if config.get("use_dora"):
        raise ValueError(
            f"{adapter}: a DoRA adapter (use_dora=True) rescales each weight by its norm; merge it with PEFT's "
            "merge_and_unload on the base loaded in full precision."
        )
    if config.get("bias", "none") != "none":
        raise ValueError(f"{adapter}: bias={config['bias']!r} trains the base's biases too; merge it with PEFT.")
    return config


def _adapter_tensors(
    adapter: Path, to_save: list[str]
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The LoRA factors by the base weight they change (`{"A": ..., "B": ...}`), and the trained copies of
    `modules_to_save` (`to_save`; PEFT stores them under the base tensor's name) by the base tensor they replace."""
    path = adapter / "adapter_model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: the adapter's weights are missing.")
    deltas: dict[str, dict[str, torch.Tensor]] = {}
    saved: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            name = key.removeprefix(_PREFIX)
            lora, kept = _LORA.match(name), _SAVED.match(name)
            if lora:
                deltas.setdefault(lora["module"] + ".weight", {})[lora["which"]] = f.get_tensor(key)
            elif kept:
                saved[f"{kept['module']}.{kept['leaf']}"] = f.get_tensor(key)
            elif any(re.search(rf"(^|\.){re.escape(m)}\.[^.]+$", name) for m in to_save):
                saved[name] = f.get_tensor(key)
            else:
                raise ValueError(
                    f"{path}: '{key}' is not a LoRA factor of a linear layer nor a module to save (an adapter on "
                    "embeddings or convolutions, or another method's weight): merge it with PEFT's merge_and_unload."
                )
    incomplete = sorted(name for name, ab in deltas.items() if set(ab) != {"A", "B"})
    if incomplete:
        raise ValueError(f"{path}: {incomplete[:3]} hold only one of their two LoRA factors.")
    return deltas, saved


def _scale(config: dict[str, Any], weight: str) -> float:
    """PEFT's scaling of one module's update: `lora_alpha / r` (rsLoRA: over sqrt(r)), with the per-module
    patterns."""
    module = weight.removesuffix(".weight")
    r = _pattern(config.get("rank_pattern") or {}, module, config["r"])
    alpha = _pattern(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    for key, value in patterns.items():
        if re.search(rf"(^|\.){key}$", module):
            return value
    return default


def _write_merged(
    files: list[Path],
    deltas: dict[str, dict[str, torch.Tensor]],
    saved: dict[str, torch.Tensor],
    config: dict[str, Any],
    out: Path,
    dtype: torch.dtype | None,
    max_shard_size: int | str,
) -> list[str]:
    """Stream the base's tensors into the writer, each merged where the adapter changes it."""
    writer = HFShardWriter(out, max_shard_size, dtype)
    done: set[str] = set()
    transpose = bool(config.get("fan_in_fan_out"))
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    value = f.get_tensor(name)
                    if name in deltas:
                        ab = deltas[name]
                        update = ab["B"].float() @ ab["A"].float()
                        value = (value.float() + _scale(config, name) * (update.T if transpose else update)).to(
                            value.dtype
                        )
                        done.add(name)
                    elif name in saved:
                        value = saved[name].to(value.dtype)
                        done.add(name)
                    writer.add(name, value)
        missing = sorted((set(deltas) | set(saved)) - done)
        if missing:
            raise ValueError(
                f"the adapter changes {missing[:3]}, which the base's files do not hold: give the base model the "
                "adapter was trained on (its directory as save_pretrained wrote it)."
            )
        return writer.close()
    except BaseException:
        writer.abort()
        raise
