"""`hf_zero.from_pretrained`: build a model on the meta device and fill its shards from the files.

[Note: agreed load]
Each rank reads its own copy of the model directory: on a multi-node job without a shared filesystem, a directory
copied to the first node only, or copied there in full and elsewhere in part, fails on some ranks and not others.
The load's steps that read files or run the caller's code (the config, the model built on the meta device, an
adapter's config and weights, `optimizer_fn`) raise nothing at once: each runs under `agreement`, and before the
next collective (rank 0's values of what the files lack, broadcast; `initialize`'s exchanges) the ranks agree
whether any of them failed, so every rank raises, the failing one its own error and the others the same type naming
it, instead of waiting in that collective until the process group's timeout. The parameters broadcast are agreed on
too (their shapes): copies that differ between nodes are refused rather than met as a size mismatch in the backend.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..api import initialize
from ..checkpoint.conversions import checkpoint_conversions
from ..checkpoint.pretrained import NOT_FROM_FILES, PretrainedSource, files_dtype, saved_4bit_config, trained_copy
from ..config import ZeroConfig
from ..dtypes import dtype_from_name, parse_dtype
from ..engine.collectives import CommGroup, agreement, all_agree, broadcast_tensors, digest_of
from ..engine.facade import facade_of
from ..engine.step.optim import ShardedOptimizer
from .quantized_load import attach_saved_states, attach_states, to_4bit_on_meta

logger = logging.getLogger(__name__)


def from_pretrained(
    model_class: Any,
    path: str | os.PathLike[str],
    config: ZeroConfig | None = None,
    *,
    optimizer_fn: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    peft_config: Any = None,
    quantization_config: Any = None,
    ignore_mismatched_sizes: bool = False,
    **config_overrides: Any,
) -> tuple[nn.Module, ShardedOptimizer | None]:
    """Load a Hugging Face model straight into shards: no rank ever holds the whole model.

    The model is built on the meta device (buffers such as RoPE tables are built for real), then
    each rank reads only its slices of the weights' files. The result equals
    `model_class.from_pretrained(path)` followed by `hf_zero.initialize`, in eval mode like
    `from_pretrained` (call `model.train()` before training).

    Args:
        model_class: a transformers model class (`AutoModelForCausalLM`, `LlamaForCausalLM`, ...).
        path (`str` or `os.PathLike`): a local `save_pretrained` directory: safetensors weights, or
            `pytorch_model*.bin` files where it has none ([Note: .bin weights]). A directory transformers saved
            from a bitsandbytes 4-bit load is read as stored (each rank its slice of the codes); other quantized
            checkpoints (`quantization_config` in config.json: FP8, GPTQ, AWQ, 8-bit) are refused: load those
            with transformers' `from_pretrained`, then `hf_zero.initialize`.
        config (`ZeroConfig`, *optional*): the engine settings (default `ZeroConfig()`, stage 3).
        optimizer_fn (`Callable[[nn.Module], Optimizer]`, *optional*): builds the optimizer over the
            (not yet sharded) model's parameters, e.g. `lambda m: torch.optim.AdamW(m.parameters())`.
        dtype (`str` or `torch.dtype`, *optional*, defaults to `"auto"`): the model's dtype; `"auto"`
            takes the one in `config.json`, as `from_pretrained` does.
        device (`torch.device` or `str`, *optional*): the device to compute on, as `hf_zero.initialize`'s
            (by default this rank's GPU when there is one).
        attn_implementation (`str`, *optional*): the attention kernel (`"sdpa"`, `"flash_attention_2"`,
            `"eager"`, ...), as `from_pretrained(..., attn_implementation=...)`; by default transformers' choice.
        trust_remote_code (`bool`, *optional*, defaults to `False`): allow a model whose code lives in the
            directory (`auto_map` in its `config.json`), as `from_pretrained` allows it.
        peft_config (`peft.LoraConfig`, `str` or `os.PathLike`, *optional*): wrap the model with
            `get_peft_model(model, peft_config)` before it is sharded: LoRA on a model no rank ever holds whole
            ([Note: LoRA on a sharded load]); the adapter is initialized as PEFT initializes it, rank 0's values on
            every rank. A directory of an adapter saved with `save_pretrained` gives its config and its weights,
            trainable (`PeftModel.from_pretrained(model, dir, is_trainable=True)`). `optimizer_fn` then sees the
            PEFT model's parameters.
        quantization_config (`transformers.BitsAndBytesConfig`, *optional*): QLoRA's 4-bit base
            (`load_in_4bit=True`), quantized as it is read, each rank keeping its slice of the packed codes ([Note:
            quantized load] in integrations/quantized_load.py): the same codes and scales transformers'
            `from_pretrained(path, quantization_config=...)` gives, no rank holding the whole model.
        ignore_mismatched_sizes (`bool`, *optional*, defaults to `False`): as transformers' `from_pretrained`: a
            weight whose shape in the files differs from the model's (a 5-label head loaded as a 3-label one) is
            initialized anew, rank 0's values on every rank, and named in a warning; by default such files are
            refused.
        config_overrides: attributes of the model's config to change before it is built, as `from_pretrained`
            takes them (`use_cache=False`, `max_position_embeddings=8192`, `rope_parameters={...}`); a name the config
            does not have raises `TypeError`. `subfolder="..."` reads the model from that folder of `path`, as
            `from_pretrained` does.

    Returns:
        `tuple[nn.Module, ShardedOptimizer | None]`: as `hf_zero.initialize`.

    Example:

    ```python
    >>> model, optimizer = hf_zero.from_pretrained(
    ...     AutoModelForCausalLM, "./llama-base", hf_zero.ZeroConfig(stage=3, mixed_precision="bf16"),
    ...     optimizer_fn=lambda m: torch.optim.AdamW(m.parameters(), lr=2e-5),
    ... )
    ```
    """
    world = CommGroup.world()
    subfolder = config_overrides.pop("subfolder", None)  # as transformers': config and weights both from there
    if subfolder:
        path = os.path.join(path, subfolder)
    if config_overrides.get("gguf_file") is not None:  # the config would come from it, the weights not
        raise TypeError(
            "hf_zero.from_pretrained reads safetensors (or pytorch_model*.bin) weights, not GGUF: load it with "
            "transformers' from_pretrained(path, gguf_file=...), save_pretrained(new_dir), and load new_dir."
        )
    # [Note: agreed load]: local steps, each agreed on before the next collective
    with agreement(world, "hf_zero.from_pretrained"):
        model, fresh = _build_from(
            path, model_class, dtype, attn_implementation, trust_remote_code, ignore_mismatched_sizes, config_overrides
        )
    _share(fresh, world, "the weights the files lack")  # rank 0's values on every rank, as DDP's first broadcast
    four_bit = None
    saved = saved_4bit_config(Path(path))  # a directory saved with its 4-bit weights: read as they are stored
    if quantization_config is not None or saved is not None:  # [Note: quantized load]
        with agreement(world, "hf_zero.from_pretrained (quantization_config)"):
            four_bit = to_4bit_on_meta(model, quantization_config or _bnb_config(saved), next(model.parameters()).dtype)
    if peft_config is not None:
        with agreement(world, "hf_zero.from_pretrained (peft_config)"):
            adapter_dir, peft_config = _adapter(peft_config)
            model, fresh = _with_lora(model, peft_config, path)
        _share(fresh, world, "the adapter's matrices")
        if adapter_dir is not None:
            with agreement(world, "hf_zero.from_pretrained (the adapter's weights)"):
                _load_adapter(model, adapter_dir)
            # each rank read its own copy of the adapter, whose shards it fills from it: rank 0's values on every
            # rank, as DDP's first broadcast gives (copies that differ between nodes would mix, silently)
            _share([p for p in model.parameters() if not p.is_meta], world, "the adapter's weights")
    model.eval()
    with agreement(world, "hf_zero.from_pretrained (optimizer_fn)"):
        optimizer = optimizer_fn(model) if optimizer_fn is not None else None
    if four_bit is None:
        return initialize(model, optimizer, config, weights_from=path, device=device)
    if saved is None:  # quantized as read: initialize's conversions build the codes ([Note: quantized load])
        setattr(model, "hf_zero_four_bit", four_bit)  # noqa: B010
    sharded, sharded_optimizer = initialize(model, optimizer, config, weights_from=path, device=device)
    with agreement(world, "hf_zero.from_pretrained (the 4-bit weights' scales)"):
        if saved is None:
            attach_states(sharded, four_bit, _whole_reader(path))
        else:
            attach_saved_states(sharded, four_bit, str(path), facade_of(sharded).device)
    return sharded, sharded_optimizer


def _bnb_config(saved: dict[str, Any] | None) -> Any:
    """The `BitsAndBytesConfig` a directory's config.json records."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig.from_dict(dict(saved or {}))


def _whole_reader(path: str | os.PathLike[str]) -> Callable[[str], torch.Tensor]:
    """A tensor of the directory's safetensors files, whole, by its key."""
    from pathlib import Path

    from safetensors import safe_open

    from ..checkpoint.reader import hf_weight_map

    weight_map = hf_weight_map(Path(path))

    def read(key: str) -> torch.Tensor:
        with safe_open(str(Path(path) / weight_map[key]), framework="pt") as f:
            return f.get_tensor(key)

    return read


def _build_from(
    path: str | os.PathLike[str],
    model_class: Any,
    dtype: str | torch.dtype,
    attn_implementation: str | None,
    trust_remote_code: bool,
    ignore_mismatched_sizes: bool,
    config_overrides: dict[str, Any],
) -> tuple[nn.Module, list[nn.Parameter]]:
    """This rank's part of the load before any collective: the directory checked, the config read, the model built
    on the meta device with its generation config; returns it and the parameters made here (`_build_empty`)."""
    from transformers import GenerationConfig

    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"hf_zero.from_pretrained reads a local model directory; {path} is not one on this machine (every node "
            "reads its own copy: put the directory on a filesystem all nodes share, or copy it to each)."
        )
    has = os.path.isfile
    if has(os.path.join(path, "adapter_config.json")) and not has(os.path.join(path, "config.json")):
        raise ValueError(
            f"{path} holds a PEFT adapter, not a model (transformers' from_pretrained would load the base model its "
            "adapter_config.json names, then the adapter): pass the base model's directory as path and this one as "
            f"peft_config, hf_zero.from_pretrained(model_class, <base model directory>, peft_config={str(path)!r})."
        )
    hf_config = _config(path, trust_remote_code, config_overrides)
    if dtype == "auto":
        dtype = getattr(hf_config, "dtype", None) or files_dtype(path)  # the files' where the config names none
        dtype = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
    if isinstance(dtype, str) and dtype in ("fp32", "bf16", "fp16", "float32", "bfloat16", "float16"):
        dtype = parse_dtype(dtype) or dtype  # "bfloat16", as transformers' from_pretrained takes it, or "bf16"
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be 'auto', a torch.dtype or its name ('bfloat16', 'bf16', ...); got {dtype!r}.")
    model: Any
    model, fresh = _build_empty(
        model_class, hf_config, dtype, path, attn_implementation, trust_remote_code, ignore_mismatched_sizes
    )
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model, fresh


def _share(fresh: list[nn.Parameter], world: CommGroup, what: str) -> None:
    """Rank 0's values of `fresh` on every rank, once the ranks agree on which parameters those are (each found them
    in its own copy of the files: copies that differ between nodes are refused, not waited on)."""
    if world.size == 1:
        return
    if not all_agree(digest_of(";".join(f"{tuple(p.shape)}:{p.dtype}" for p in fresh)), world):
        raise ValueError(
            f"[rank {world.global_rank}] hf_zero.from_pretrained: the ranks disagree on {what} ({len(fresh)} here): "
            "their copies of the model directory differ. Give every node the same files."
        )
    broadcast_tensors([p.detach() for p in fresh], world)


def _config(path: str | os.PathLike[str], trust_remote_code: bool, overrides: dict[str, Any]) -> Any:
    """The model's config from `path`, with `overrides` set on it; a name it does not have is refused (transformers
    would pass it on to the model's constructor, which the meta-device build does not take)."""
    from transformers import AutoConfig

    hf_config, unused = AutoConfig.from_pretrained(
        path, trust_remote_code=trust_remote_code, return_unused_kwargs=True, **overrides
    )
    if unused:
        hints = "".join(f" {name}: {_LOADER_KEYWORDS[name]}." for name in sorted(unused) if name in _LOADER_KEYWORDS)
        raise TypeError(
            f"hf_zero.from_pretrained got {sorted(unused)}, which {type(hf_config).__name__} has no attribute for: "
            "the keywords beyond hf_zero's own set attributes of the model's config (use_cache=False, "
            f"max_position_embeddings=...).{hints} Check the spelling, or build the model yourself and call "
            "hf_zero.initialize(model, optimizer, config, weights_from=path)."
        )
    return hf_config


# transformers' loading keywords with no meaning for a sharded load, and what takes their place
_LOADER_KEYWORDS = {
    "low_cpu_mem_usage": "drop it: no rank ever holds the whole model here (each reads its slices of the files)",
    "device_map": "drop it: the engine places the shards; device= picks the compute device",
    "max_memory": "drop it: the engine places the shards; ZeroConfig(offload_dir=...) moves them off the device",
    "offload_folder": "use ZeroConfig(offload_dir=...)",
    "revision": "hf_zero.from_pretrained reads a local directory (download it first, e.g. huggingface-cli download)",
    "variant": "it reads model.safetensors (or its index); save the variant's weights under those names "
    "(transformers' from_pretrained(path, variant=...).save_pretrained(new_dir)) and load new_dir",
    "use_safetensors": "drop it: safetensors weights are read where there are any, else pytorch_model*.bin",
    "output_loading_info": "drop it: weights the files lack are refused or named in a warning",
    "key_mapping": "save the model with transformers' names (from_pretrained(path, key_mapping=...)"
    ".save_pretrained(new_dir)) and load new_dir",
    "tp_plan": "drop it: hf_zero shards the model itself (ZeroConfig)",
    "cache_dir": "hf_zero.from_pretrained reads a local directory (download it first, e.g. huggingface-cli download)",
}


def _build_empty(
    model_class: Any,
    hf_config: Any,
    dtype: torch.dtype,
    path: str | os.PathLike[str],
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    ignore_mismatched_sizes: bool = False,
) -> tuple[nn.Module, list[nn.Parameter]]:
    """The model with its parameters on the meta device and its buffers real, initialized as
    transformers' `from_pretrained` initializes them; with the parameters made and initialized here.

    Parameters come from the files, so their initializers are skipped while the model is built (on the
    meta device they would do nothing, yet in a fresh process their dispatch costs seconds); then, as
    `from_pretrained` does, the parameters are marked initialized and `initialize_weights` runs for the
    rest: the buffers (rotary tables, norms' running statistics), the parameters the files lack (a new head:
    `_materialize_missing`) and, with `ignore_mismatched_sizes`, those the files hold in another shape.
    """
    from accelerate import init_empty_weights
    from transformers import initialization

    build = getattr(model_class, "from_config", None) or model_class._from_config
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if trust_remote_code and hasattr(model_class, "from_config"):  # an Auto class: it finds the directory's code
        kwargs["trust_remote_code"] = True
    with init_empty_weights(include_buffers=False), initialization.no_init_weights():
        model = build(hf_config, **kwargs)
    # init_empty_weights re-creates each registered parameter, which unties tied weights: tie again (before the
    # files are asked which weights they lack: a tied head is its embeddings).
    if hasattr(model, "tie_weights"):
        model.tie_weights()
        _untie_what_the_files_keep_apart(model, path)
    fresh = _materialize_missing(model, path)
    if ignore_mismatched_sizes:
        fresh += _materialize_mismatched(model, path)
    made = {id(p) for p in fresh}
    for param in model.parameters():
        if id(param) not in made:
            param._is_hf_initialized = True
    if hasattr(model, "initialize_weights"):
        model.initialize_weights()
    return model, fresh  # the caller gives `fresh` rank 0's values on every rank, as DDP's first broadcast does


def _untie_what_the_files_keep_apart(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """[Note: names in the files] as transformers' `from_pretrained`: a pair of weights the config ties
    (`tie_word_embeddings=True`) whose files hold both with different values is not tied (the config does not
    describe the checkpoint), each filled from its own; named in transformers' warning. Equal values (a `.bin`
    checkpoint keeps both names of one tensor) stay tied."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if not tied:
        return
    source = PretrainedSource(path, model, checkpoint_conversions(model), names_only=True)
    for target, origin in list(tied.items()):
        if not source.differ(target, origin):
            continue
        shared = model.get_parameter(origin)
        owner, _, attr = target.rpartition(".")
        untied = nn.Parameter(torch.empty(shared.shape, dtype=shared.dtype, device="meta"), shared.requires_grad)
        setattr(model.get_submodule(owner), attr, untied)
        tied.pop(target)
        if CommGroup.world().rank == 0:
            logger.warning(
                "The tied weights mapping and config for this model specifies to tie %s to %s, but both are present "
                "in the checkpoints with different values, so we will NOT tie them. You should update the config "
                "with `tie_word_embeddings=False` to silence this warning.",
                origin,
                target,
            )


def _materialize_missing(model: nn.Module, path: str | os.PathLike[str]) -> list[nn.Parameter]:
    """[Note: names in the files] the parameters of the model's head that `path` holds no weight for (a
    classification head on a causal LM's weights), made real on the host and left for `initialize_weights` to
    initialize, as transformers' `from_pretrained` initializes them; named in a warning, as transformers names
    them. A weight of the body (`model.base_model`) the files lack is not made up: `initialize` refuses it (the
    files hold another model)."""
    base = getattr(model, "base_model", model)  # the body; a weight it lacks is another model's files: refused
    body = {id(p) for p in base.parameters()} if isinstance(base, nn.Module) else set()
    params = dict(model.named_parameters())
    missing = [
        name
        for name in PretrainedSource(path, model, checkpoint_conversions(model), names_only=True).missing(model)
        if id(params[name]) not in body
    ]
    if not missing:
        return []
    fresh = _make_real(model, set(missing))
    if CommGroup.world().rank == 0:
        logger.warning(
            "Some weights of %s were not initialized from the model checkpoint at %s and are newly initialized: "
            "%s\nYou should probably TRAIN this model on a down-stream task to be able to use it for predictions "
            "and inference.",
            type(model).__name__,
            path,
            missing,
        )
    return fresh


def _materialize_mismatched(model: nn.Module, path: str | os.PathLike[str]) -> list[nn.Parameter]:
    """`ignore_mismatched_sizes=True`, as transformers' `from_pretrained`: the parameters `path` holds in another shape
    than the model's (a classifier of another number of labels) made real on the host, marked not to be read from
    the files ([Note: names in the files]) and left for `initialize_weights`; named in a warning."""
    found = PretrainedSource(path, model, checkpoint_conversions(model), names_only=True).mismatched(model)
    if not found:
        return []
    fresh = _make_real(model, {name for name, _, _ in found})
    for param in fresh:
        setattr(param, NOT_FROM_FILES, True)
    if CommGroup.world().rank == 0:
        logger.warning(
            "Some weights of %s were not initialized from the model checkpoint at %s and are newly initialized because "
            "the shapes did not match:\n%s\nYou should probably TRAIN this model on a down-stream task to be able to "
            "use it for predictions and inference.",
            type(model).__name__,
            path,
            "\n".join(
                f"- {name}: found shape {tuple(stored)} in the checkpoint and {tuple(own)} in the model instantiated"
                for name, stored, own in found
            ),
        )
    return fresh


def _make_real(model: nn.Module, names: set[str]) -> list[nn.Parameter]:
    """Replace the meta-device parameters among `names` (and their tied aliases) with real, uninitialized ones on
    the host, keeping shape, dtype and `requires_grad`; returns the new parameters. One made real before (a new head,
    under the adapter `_with_lora` adds) keeps its values."""
    fresh: dict[int, nn.Parameter] = {}
    for name, old in list(model.named_parameters(remove_duplicate=False)):
        if (name not in names and id(old) not in fresh) or not old.is_meta:  # a real one keeps its values
            continue
        new = fresh.get(id(old))
        if new is None:
            new = fresh[id(old)] = nn.Parameter(
                torch.empty(old.shape, dtype=old.dtype), requires_grad=old.requires_grad
            )
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, new)
    return list(fresh.values())


def _with_lora(
    model: nn.Module, peft_config: Any, path: str | os.PathLike[str]
) -> tuple[nn.Module, list[nn.Parameter]]:
    """[Note: LoRA on a sharded load]
    `get_peft_model` on the model built on the meta device wraps its target layers, and PEFT creates the adapter's
    matrices on the host and then moves them to the device of the layer's weight: the meta device, which drops their
    values. They are made real on the host and drawn again as PEFT drew them: the random state put back to where
    `get_peft_model` started, each `nn.Linear`'s own initialization, then `reset_lora_parameters`, layer by layer
    (so under one seed the adapter equals the one `get_peft_model` gives a loaded model, and the random state ends
    where it would), and rank 0's values broadcast. The base weights then come from the files
    (their names under the wrapper, [Note: names in the files]); so do those of PEFT's trained copy of a module it
    trains whole (`modules_to_save`, `task_type="SEQ_CLS"`'s classifier): read under the original's names (a tied
    head: the embeddings'), or the new head the load initialized, copied by PEFT. A head made and initialized before
    the adapter keeps its values. Initializations that read the base weights (DoRA, PiSSA, OLoRA, LoftQ, EVA, ...,
    and `trainable_token_indices`, whose trained rows start as the embedding's) cannot run on the meta device:
    refused by name."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    if not isinstance(peft_config, LoraConfig):
        raise TypeError(
            f"hf_zero.from_pretrained(peft_config=...) takes a peft.LoraConfig; got {type(peft_config).__name__}. "
            "For other PEFT methods, load the model with from_pretrained, call get_peft_model, then "
            "hf_zero.initialize(model, optimizer, config)."
        )
    reads_weights = [
        what
        for what, bad in (
            ("use_dora=True", peft_config.use_dora),
            (
                f"init_lora_weights={peft_config.init_lora_weights!r}",
                peft_config.init_lora_weights not in (True, False, "gaussian"),
            ),
            ("trainable_token_indices", bool(getattr(peft_config, "trainable_token_indices", None))),  # embedding rows
        )
        if bad
    ]
    if reads_weights:
        raise ValueError(
            f"hf_zero.from_pretrained(peft_config=...) cannot apply {', '.join(reads_weights)}: it needs the loaded "
            "weights, and the model is still on the meta device when the adapter is added. Load the model with "
            "from_pretrained, call get_peft_model, then hf_zero.initialize(model, optimizer, config)."
        )
    drawn_from = torch.get_rng_state()  # PEFT draws the adapter on the host, then moves it to the meta device
    model = get_peft_model(model, peft_config)
    fresh = _make_real(
        model, set(PretrainedSource(path, model, checkpoint_conversions(model), names_only=True).missing(model))
    )
    torch.set_rng_state(drawn_from)  # the same draws again, into the real matrices
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for adapter in list(module.lora_A.keys()):
                for matrices in (module.lora_A, module.lora_B):  # each nn.Linear's own initialization, A then B
                    layer: Any = matrices[adapter]
                    layer.reset_parameters()
                module.reset_lora_parameters(adapter, peft_config.init_lora_weights)
    return model, fresh  # the caller broadcasts rank 0's values


def _adapter(peft_config: Any) -> tuple[str | os.PathLike[str] | None, Any]:
    """`peft_config` as given (a `LoraConfig`), or read from the directory of an adapter saved by `save_pretrained`:
    `(directory or None, config)`, a read config made trainable."""
    if not isinstance(peft_config, (str, os.PathLike)):
        return None, peft_config
    from peft import PeftConfig

    if not os.path.isfile(os.path.join(peft_config, "adapter_config.json")):
        raise FileNotFoundError(
            f"hf_zero.from_pretrained(peft_config={str(peft_config)!r}): no adapter_config.json there; give the "
            "directory an adapter's save_pretrained wrote, or a peft.LoraConfig."
        )
    config = PeftConfig.from_pretrained(str(peft_config))
    config.inference_mode = False  # trained on, as PeftModel.from_pretrained(..., is_trainable=True)
    return peft_config, config


def _load_adapter(model: nn.Module, adapter_dir: str | os.PathLike[str]) -> None:
    """The saved adapter's weights into its matrices, made real by `_with_lora` (an adapter is small: every rank
    reads it whole), and into PEFT's trained copies of the modules it trains whole (`modules_to_save`), made real
    here and marked not to be read from the base model's files; a saved weight the model has no place for is
    refused."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    copies = {name for name, p in model.named_parameters() if p.is_meta and trained_copy(name)}
    fresh = _make_real(model, copies)  # `modules_to_save`: the adapter holds the trained copies, not the base files
    with torch.no_grad():
        for param in fresh:
            param.fill_(float("nan"))  # what the load does not fill stays NaN: found below
    result: Any = set_peft_model_state_dict(model, load_peft_weights(str(adapter_dir), device="cpu"))
    names = {id(p): name for name, p in model.named_parameters()}
    unloaded = [names.get(id(p), "?") for p in fresh if bool(p.detach().isnan().all())]
    if unloaded:
        raise ValueError(
            f"{adapter_dir} does not hold the trained copies of the modules its config trains whole (modules_to_save), "
            f"e.g. {unloaded[:3]}: it is incomplete, or was saved by another PEFT version."
        )
    for param in fresh:
        setattr(param, NOT_FROM_FILES, True)  # its values are the adapter's, not the base model's
    unexpected = list(result.unexpected_keys)
    if unexpected:
        raise ValueError(
            f"{adapter_dir} holds adapter weights this model has no place for, e.g. {unexpected[:3]}: "
            "the adapter was trained on another model or with other target modules."
        )
