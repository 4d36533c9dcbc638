"""QLoRA capacity (`benchmarks/capacity.py --qlora`): the engines, and the 4-bit model directories they load.

Every engine trains LoRA (r=8, alpha 16, dropout 0.1, every linear layer of the decoder: PEFT's FSDP-QLoRA
example) with activation checkpointing (`use_reentrant=False`) and AdamW, on a base in 4 bits: NF4, double
quantization, compute dtype fp32 (this CPU has no bf16 matrix instructions; the report says so), the codes stored
as float32 (`bnb_4bit_quant_storage`, what FSDP needs to flatten them with the fp32 parameters; the bytes are the
same as uint8 storage). The base is read from a directory transformers would save from its 4-bit load
(`write_4bit_weights`): the codes and scales of one random weight per shape, repeated in every layer (quantizing
every weight of a 20B model with bitsandbytes' CPU kernels would take an hour per size; the bytes each engine holds
are the same).
- `hf_zero3_qlora`: `hf_zero.from_pretrained(..., peft_config=...)` of that directory, stage 3: each rank reads its
  slices of the codes.
- `fsdp_qlora`: FSDP as PEFT's and bitsandbytes' FSDP-QLoRA guides set it up through Accelerate
  (`fsdp_config_qlora.yaml`): `FSDP_CPU_RAM_EFFICIENT_LOADING` (rank 0 loads the model, the others build it on the
  meta device and receive it: `sync_module_states`), `use_orig_params=False`, PEFT's `fsdp_auto_wrap_policy`,
  FULL_SHARD, BACKWARD_PRE, sharded state dict saved with `torch.distributed.checkpoint`. The guide's
  `fsdp_offload_params` is left off: on a CPU host and device are one memory. FSDP's check that
  `sync_module_states` broadcasts GPU tensors is lifted so that it broadcasts over gloo.
- `ds3_qlora`: DeepSpeed ZeRO-3 as PEFT's DeepSpeed-QLoRA guide sets it up (the HF Trainer's ZeRO-3 file,
  `HfDeepSpeedConfig` alive while transformers loads the model, so it builds it under `zero.Init`).
- `hf_zero3_lora`: the same LoRA on the base in fp32 (not quantized), hf_zero stage 3: the size QLoRA is measured
  against.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

QLORA_ENGINES = ("hf_zero3_qlora", "fsdp_qlora", "ds3_qlora", "hf_zero3_lora")
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.1, target_modules="all-linear", task_type="CAUSAL_LM")
CHECKPOINTING = {"use_reentrant": False}


def bnb_config() -> Any:
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32)


def write_4bit_weights(config: Any, directory: Path) -> None:
    """A directory as transformers' `save_pretrained` writes a 4-bit model: the quantized linear weights as their
    codes (`<weight>`) and scales (`<weight>.absmax`, `.quant_map`, `.nested_*`, `.quant_state.bitsandbytes__nf4`),
    the rest in fp32, `quantization_config` in config.json. One random weight is quantized per shape and its bytes
    written for every layer; the files are written one tensor at a time."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    from hf_zero.checkpoint.stream import Entry, write_streamed

    directory.mkdir(parents=True, exist_ok=True)
    config = type(config).from_dict(config.to_dict())
    config.quantization_config = bnb_config().to_dict()
    config.torch_dtype = "float32"
    config.save_pretrained(directory)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    by_shape: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
    settings = bnb_config()

    def quantized(shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        if shape not in by_shape:
            w = torch.empty(shape).normal_(0.0, 0.02, generator=g)
            p = bnb.nn.Params4bit(w, requires_grad=False, quant_type=settings.bnb_4bit_quant_type,
                                  compress_statistics=True, quant_storage=torch.float32).to("cpu")
            parts = {"": p.data.contiguous()}
            parts |= {f".{k}": v.contiguous() for k, v in p.quant_state.as_dict(packed=True).items()}
            by_shape[shape] = parts
        return by_shape[shape]

    entries = []
    for name, shape in shapes.items():
        if ".layers." in name and name.endswith("proj.weight"):
            for suffix, value in quantized(shape).items():
                entries.append(Entry(name + suffix, value.dtype, tuple(value.shape), _const(value)))
        else:
            entries.append(Entry(name, torch.float32, shape, _random(name, shape, g)))
    write_streamed(directory / "model.safetensors", entries, {"format": "pt"})


def _const(value: torch.Tensor):  # noqa: ANN202
    def pieces():  # noqa: ANN202
        yield value
    return pieces


def _random(name: str, shape: tuple[int, ...], g: torch.Generator):  # noqa: ANN202
    def pieces():  # noqa: ANN202
        yield torch.ones(shape) if name.endswith("norm.weight") else torch.empty(shape).normal_(0.0, 0.02, generator=g)
    return pieces


def _lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(**LORA)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)


def build_qlora(engine: str, args: argparse.Namespace, peer_config: dict) -> tuple:
    """Returns (train_step(batch) -> loss, save(path), extra_stats()) of a QLoRA (or LoRA) engine."""
    if engine in ("hf_zero3_qlora", "hf_zero3_lora"):
        return _hf_zero(args)
    if engine == "fsdp_qlora":
        return _fsdp(args, peer_config)
    if engine == "ds3_qlora":
        return _deepspeed(args, peer_config)
    raise ValueError(engine)


def _hf_zero(args: argparse.Namespace) -> tuple:
    from transformers import AutoModelForCausalLM

    import hf_zero

    model, opt = hf_zero.from_pretrained(AutoModelForCausalLM, args.weights, hf_zero.ZeroConfig(stage=3),
                                         dtype=torch.float32, peft_config=_lora(),
                                         optimizer_fn=lambda m: _adamw([p for p in m.parameters()
                                                                        if p.requires_grad]))
    scales = _scales(model)  # counted as loaded: at stage 3 the resting weights do not carry them after a step
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINTING)
    model.train()

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def stats() -> dict:
        return {"model_states": hf_zero.model_state_memory(model).__dict__, "quant_state_bytes": scales}

    return step, lambda path: hf_zero.save_checkpoint(path, model, opt), stats


def _scales(model: torch.nn.Module) -> int:
    """Bytes of the 4-bit weights' quantization states this rank holds (block scales, second-level scales, code
    tables)."""
    total = 0
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is None:
            continue
        tensors = [state.absmax, state.code]
        if state.nested:
            tensors += [state.state2.absmax, state.state2.code, state.offset]
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def _user_step(module: torch.nn.Module, opt: torch.optim.Optimizer, clip: Any) -> Any:
    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = module(input_ids=batch, labels=batch).loss
        loss.backward()
        clip(1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def _kbit_peft(model: torch.nn.Module) -> torch.nn.Module:
    """What PEFT's QLoRA recipe does to the loaded model: `prepare_model_for_kbit_training`, then LoRA."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs=CHECKPOINTING)
    return get_peft_model(model, _lora())


def _fsdp(args: argparse.Namespace, peer_config: dict) -> tuple:
    import torch.distributed.checkpoint as dcp
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers import AutoModelForCausalLM

    # what `accelerate launch` with fsdp_cpu_ram_efficient_loading exports: transformers then loads the weights on
    # rank 0 only and builds the model on the meta device elsewhere
    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
    model = AutoModelForCausalLM.from_pretrained(args.weights, quantization_config=bnb_config(), dtype=torch.float32)
    model = _kbit_peft(model)
    rank0 = dist.get_rank() == 0
    # FSDP refuses `sync_module_states` for tensors on the CPU (a check written for GPUs); lifted, its broadcast
    # runs over gloo as it runs over NCCL
    import torch.distributed.fsdp._init_utils as fsdp_init

    fsdp_init._check_module_states_for_sync_module_states = lambda states: None
    settings = dict(sharding_strategy=ShardingStrategy.FULL_SHARD, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                    use_orig_params=False, sync_module_states=True, limit_all_gathers=True, forward_prefetch=False)
    peer_config.update({k: str(v) for k, v in settings.items()}, auto_wrap_policy="peft fsdp_auto_wrap_policy",
                       cpu_ram_efficient_loading=True, state_dict_type="SHARDED_STATE_DICT", offload_params=False)
    fsdp = FSDP(model, auto_wrap_policy=fsdp_auto_wrap_policy(model), device_id=torch.device("cpu"),
                param_init_fn=None if rank0 else (lambda m: m.to_empty(device="cpu", recurse=False)), **settings)
    opt = _adamw([p for p in fsdp.parameters() if p.requires_grad])

    def save(path: str) -> None:
        with FSDP.state_dict_type(fsdp, StateDictType.SHARDED_STATE_DICT):
            dcp.save({"model": fsdp.state_dict(), "optimizer": FSDP.optim_state_dict(fsdp, opt)}, checkpoint_id=path)

    return _user_step(fsdp, opt, fsdp.clip_grad_norm_), save, dict


def _deepspeed(args: argparse.Namespace, peer_config: dict) -> tuple:
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from _capacity_model import SHAPE
    from _peers import deepspeed_config

    ds_config = deepspeed_config(SHAPE["hidden_size"], micro=1, bf16=False)
    peer_config.update(ds_config)
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841  (transformers builds under zero.Init while it lives)
    model = AutoModelForCausalLM.from_pretrained(args.weights, quantization_config=bnb_config(), dtype=torch.float32)
    model = _kbit_peft(model)
    opt = _adamw([p for p in model.parameters() if p.requires_grad])
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step, lambda path: engine.save_checkpoint(path), dict
