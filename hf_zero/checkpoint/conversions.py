"""transformers' checkpoint conversions, for the sharded load: which of the files' tensors each model weight is.

[Note: converted weights]
Since transformers 5 a model's weights are not always stored under the names and in the shapes its modules have:
`save_pretrained` writes the layout the model's checkpoints have always had, and `from_pretrained` converts on
load, by the rules `transformers.conversion_mapping` keeps per model type. Some rules rename (GPT-NeoX's
`embed_out` is the model's `lm_head`, Mixtral's `block_sparse_moe` its `mlp`); others build one weight from
several tensors (Mixtral's and Qwen-MoE's experts, stored one matrix per expert, fused into 3-D `gate_up_proj`
and `down_proj`). Looked up by its module's name alone, such a head would be found missing and initialized at
random (a silent wrong model), and the experts refused as another model's.

`checkpoint_conversions(model)` gives the sharded load transformers' own rules, applied as `from_pretrained`
applies them (each file key renamed, then at most one converter; the base model's prefix added or taken away):
a renamed weight is read by byte range under its file key, as any other; a built one is built on each rank that
holds a piece of it, from its source tensors read whole, by the converter's own operations, and that rank's
range copied out (so each such rank reads the whole sources: a node's page cache shares them). The operations
run once at the start on meta tensors, which gives each built weight's name and shape without reading a byte.
"""

from __future__ import annotations

import copy
import math
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..engine.module import wrapped_model
from .pretrained import Built, Conversions, FileNames
from .stream import FileLayout, Parts


@dataclass
class _Built:
    """A model weight that transformers' converter builds from the files' tensors `sources` (source pattern ->
    file keys, in transformers' order)."""

    converter: Any
    sources: dict[str, list[str]]
    layer_name: str  # the name the sources were collected under (the converter's first target)
    name: str  # this output's full name
    config: Any
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32

    def build(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The whole weight, from its sources read by `read(file key)`."""
        inputs = {pattern: [read(key) for key in keys] for pattern, keys in self.sources.items()}
        return _convert(self.converter, inputs, self.layer_name, self.config)[self.name]


def with_built(conversions: Conversions | None, extra: Mapping[str, Built]) -> Conversions:
    """`conversions` (or the files' own names) with `extra` weights built from the files by their own rules (QLoRA's
    4-bit weights, quantized as they are read: [Note: quantized load] in integrations/quantized_load.py); each built
    weight's file key is its renamed spelling where the conversions rename it."""

    def names(file_keys: list[str], meta_of: Callable[[str], torch.Tensor]) -> FileNames:
        base = conversions(file_keys, meta_of) if conversions is not None else FileNames({k: k for k in file_keys}, {})
        renamed = dict(base.renamed)
        for name, weight in extra.items():
            weight.key = renamed.pop(name, weight.key)  # type: ignore[attr-defined]  # read under the files' key
        return FileNames(renamed, {**base.built, **extra})

    return names


@dataclass
class FourBitWeight:
    """One linear weight of a QLoRA base quantized as it is read ([Note: quantized load] in
    integrations/quantized_load.py): a `Built` of the conversions."""

    key: str  # the files' key of the full-precision weight
    shape: tuple[int, ...]  # the packed codes' shape
    dtype: torch.dtype  # their storage dtype
    load_dtype: torch.dtype  # what the weight is cast to before it is quantized (the load's dtype)
    settings: dict[str, Any]  # blocksize, compress_statistics, quant_type, quant_storage
    state: Any = field(default=None, repr=False)  # bitsandbytes' QuantState, once built
    # where it is quantized and its state lives: the engine's compute device (`place`), as transformers' loader
    # quantizes on the device the model is loaded to (bitsandbytes' CUDA kernels on a GPU)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def build(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        import bitsandbytes as bnb

        weight = read(self.key).to(self.load_dtype)
        params: Any = bnb.nn.Params4bit(weight, requires_grad=False, **self.settings)
        quantized = params.to(self.device)  # bitsandbytes quantizes as the parameter moves (as transformers' loader)
        self.state = quantized.quant_state
        return quantized.data.reshape(self.shape)


def place(model: nn.Module, device: torch.device) -> None:
    """Quantize the model's 4-bit weights built on load ([Note: quantized load]) on `device`, the engine's compute
    device, and keep their states there: what `initialize` calls once it has decided that device."""
    for weight in (getattr(model, "hf_zero_four_bit", None) or {}).values():
        weight.device = device


def checkpoint_conversions(model: nn.Module) -> Conversions | None:
    """transformers' conversion rules for `model`'s files ([Note: converted weights]), or None where `model` is not
    a transformers model (or this transformers has no such rules)."""
    base = _pretrained_model(model)
    if base is None:
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:  # a transformers before its conversion rules: the files use the modules' names
        return None
    transforms = get_model_conversion_mapping(base)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    prefix = getattr(base, "base_model_prefix", None) or None
    own = base.state_dict(keep_vars=True)

    def names(file_keys: list[str], meta_of: Callable[[str], torch.Tensor]) -> FileNames:
        renamed: dict[str, str] = {}
        groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
        for key in sorted(file_keys, key=dot_natural_key):
            name, pattern = rename_source_key(key, renamings, converters, prefix, own)
            if name not in own and key in own:  # as transformers: a key the model has as it is is not renamed
                name, pattern = rename_source_key(key, [], [], prefix, own)
            if pattern is None:
                renamed.setdefault(name, key)
            else:
                converter, sources = groups.setdefault(name, (copy.deepcopy(by_pattern[pattern]), {}))
                sources.setdefault(pattern, []).append(key)
        built: dict[str, Any] = {}
        for layer_name, (converter, sources) in groups.items():
            metas = {pattern: [meta_of(key) for key in keys] for pattern, keys in sources.items()}
            try:
                outputs = _convert(converter, metas, layer_name, base.config)
            except Exception as e:  # noqa: BLE001 - an operation that needs the values: named, with the way round
                raise ValueError(
                    f"hf_zero cannot build {layer_name} from the files' {sum(map(len, sources.values()))} tensors "
                    f"({type(converter).__name__} {converter.source_patterns} -> {converter.target_patterns}: {e}). "
                    "Load the model with transformers' from_pretrained, then hf_zero.initialize(model, optimizer, "
                    "config)."
                ) from e
            for name, meta in outputs.items():
                built[name] = _Built(converter, sources, layer_name, name, base.config, tuple(meta.shape), meta.dtype)
        return FileNames(renamed, built)

    return names if (renamings or converters) else None


def _convert(converter: Any, inputs: dict[str, list[torch.Tensor]], layer_name: str, config: Any) -> dict[str, Any]:
    """The converter's operations on `inputs` (source pattern -> tensors), each output under its full name, as
    transformers' `WeightConverter.convert` names them."""
    collected: dict[str, Any] = {pattern: list(tensors) for pattern, tensors in inputs.items()}
    for op in converter.operations:
        collected = op.convert(
            collected,
            source_patterns=converter.source_patterns,
            target_patterns=converter.target_patterns,
            full_layer_name=layer_name,
            model=None,
            config=config,
            missing_keys=None,
        )
    full = layer_name.replace("*.", "0.")
    parts = next((full.partition(k) for k in collected if k in full), None)
    if parts is None:
        return dict(collected)
    before, _, after = parts
    return {before + k + after: v for k, v in collected.items()}


def _pretrained_model(model: nn.Module) -> Any:
    """The transformers model in `model` (itself, or the one a PEFT model wraps), or None."""
    inner = wrapped_model(model)
    config = getattr(inner, "config", None)
    if getattr(config, "model_type", None) is None or not hasattr(inner, "base_model_prefix"):
        return None
    return inner


def save_layout(model: nn.Module) -> FileLayout:
    """The names (and for a fused weight, the run of tensors) transformers' `save_pretrained` stores each of
    `model`'s tensors under, where they differ from the model's own ([Note: file layout] in stream.py); empty for
    a model that is not a transformers model (or a PEFT wrapper, whose saves are its adapter's)."""
    found = _pretrained_model(model)
    if found is None or found is not model:
        return {}
    base: Any = found
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            Concatenate,
            MergeModulelist,
            WeightConverter,
            WeightRenaming,
            rename_source_key,
            revert_weight_conversion,
        )
    except ImportError:
        return {}
    own = base.state_dict(keep_vars=True)
    stored = revert_weight_conversion(
        base, {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in own.items()}
    )
    if list(stored) == list(own):
        return {}
    transforms = get_model_conversion_mapping(base)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    prefix = getattr(base, "base_model_prefix", None) or None
    runs: dict[str, list[tuple[str, tuple[int, ...], str | None]]] = {}
    for key, meta in stored.items():  # each stored tensor back to the model tensor it comes from
        name, pattern = rename_source_key(key, renamings, converters, prefix, own)
        runs.setdefault(name, []).append((key, tuple(meta.shape), pattern))
    layout: dict[str, Parts] = {}
    for name, run in runs.items():
        if name not in own or [key for key, _, _ in run] == [name]:
            continue
        if len(run) == 1 and run[0][2] is None and run[0][1] == tuple(own[name].shape):
            layout[name] = ((run[0][0], run[0][1]),)  # renamed
            continue
        tiles = _tiles(tuple(own[name].shape), run, by_pattern, (MergeModulelist, Concatenate))
        if tiles is not None:
            layout[name] = tiles
    return layout


def _tiles(
    shape: tuple[int, ...],
    run: list[tuple[str, tuple[int, ...], str | None]],
    by_pattern: dict[str, Any],
    ops: tuple[type, type],
) -> Parts | None:
    """[Note: file layout] the stored tensors `run` of a fused weight of `shape`, in the order they lie in its
    row-major bytes, where the converter is one whose pieces are such a run: the experts stacked on dim 0
    (`MergeModulelist(dim=0)`), each expert's sources then joined on its rows (`Concatenate(dim=1)`), so that
    expert e's p-th source is piece `e * sources + p`. None where it is another (the model's own name is kept)."""
    merge, concat = ops
    patterns = [pattern for _, _, pattern in run]
    if not patterns or any(pattern is None for pattern in patterns):
        return None
    converter = by_pattern[str(patterns[0])]
    kinds = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
    if kinds not in ([(merge, 0)], [(merge, 0), (concat, 1)]) or len(shape) < 2:
        return None
    sources = list(converter.source_patterns)
    per_expert = len(sources)
    size = math.prod(shape) // (shape[0] * per_expert)
    placed: dict[int, tuple[str, tuple[int, ...]]] = {}
    for key, stored_shape, pattern in run:
        found = re.search(re.escape(pattern or "").replace(r"\*", r"(\d+)"), key)
        if found is None or math.prod(stored_shape) != size:
            return None
        placed[int(found.group(1)) * per_expert + sources.index(pattern)] = (key, stored_shape)
    if sorted(placed) != list(range(shape[0] * per_expert)):
        return None
    return tuple(placed[i] for i in range(len(placed)))


def model_layout(model: torch.nn.Module) -> FileLayout:
    """The names transformers' `save_pretrained` stores the model's tensors under where they differ from the
    model's own ([Note: file layout]); empty for a model that is not a transformers model."""
    if "transformers" not in sys.modules:  # a transformers model was built with it imported
        return {}
    return save_layout(model)
