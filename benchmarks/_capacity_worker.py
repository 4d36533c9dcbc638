"""One rank of a capacity job (benchmarks/capacity.py): build the engine, train `--steps` steps, save one
checkpoint with the engine's own sharded save; report resident-memory peaks, step times and save time."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from _capacity_model import SEQ, SHAPE, hf_config, n_params


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _phase(rank: int, what: str) -> None:
    """A line the driver reads to say in which phase a job that went over budget was."""
    if rank == 0:
        print(f"[capacity phase] {what}", flush=True)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM restarts from the current resident set
        f.write("5")


_KEPT = {"peak": 0}
PEER_CONFIG: dict = {}  # the configuration the peer of this run was built with, recorded beside its figures


def _keep_peak(value: int) -> None:
    """Phases reset VmHWM to measure themselves; the run's peak is kept here."""
    _KEPT["peak"] = max(_KEPT["peak"], value)


def _adamw(params):  # noqa: ANN001, ANN202
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)


def _init_meta_llama(model: torch.nn.Module, config) -> None:  # noqa: ANN001
    """Materialized-after-meta init: normal(0.02) weights, ones for norms, RoPE tables rebuilt."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)


def _torch_step(module: torch.nn.Module, opt: torch.optim.Optimizer, autocast: bool):  # noqa: ANN202
    """A training step as a plain PyTorch user writes it (DDP under bf16 autocast, FSDP2 with its policy)."""
    def step(batch):  # noqa: ANN001, ANN202
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = module(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def build(engine: str, args: argparse.Namespace):  # noqa: ANN201
    """Returns (train_step(batch) -> loss, save(path), extra_stats())."""
    from transformers import AutoModelForCausalLM

    from _capacity_qlora import QLORA_ENGINES, build_qlora

    if engine in QLORA_ENGINES:
        return build_qlora(engine, args, PEER_CONFIG)
    config = hf_config(args.layers)
    bf16 = args.precision == "bf16"
    if engine.startswith("hf_zero"):
        import hf_zero

        extra = {}
        if engine.startswith("hf_zero3_disk"):
            extra = dict(offload_optimizer=True, offload_dir=str(Path(args.work) / "offload"),
                         offload_params=engine == "hf_zero3_disk_params")
        zc = hf_zero.ZeroConfig(stage=3, mixed_precision="bf16" if bf16 else "no", **extra)
        model, opt = hf_zero.from_pretrained(AutoModelForCausalLM, args.weights, zc,
                                             optimizer_fn=lambda m: _adamw(m.parameters()))
        model.train()
        disk = model.zero_engine.disk
        timing: dict[str, list] = {"optimizer_s": [], "phase_peaks": []}

        def step(batch):  # noqa: ANN001, ANN202
            peaks = {}
            began = _status("VmHWM:")
            _reset_peak()
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            peaks["forward_backward"] = _status("VmHWM:")
            _reset_peak()
            opt.clip_grad_norm_(1.0)
            began_s = time.perf_counter()
            opt.step()
            timing["optimizer_s"].append(time.perf_counter() - began_s)
            peaks["optimizer"] = _status("VmHWM:")
            opt.zero_grad()
            timing["phase_peaks"].append(peaks)
            _keep_peak(max(began, *peaks.values()))
            return loss.detach()

        def stats() -> dict:
            out = {"optimizer_s": timing["optimizer_s"], "phase_peaks": timing["phase_peaks"],
                   "model_states": hf_zero.model_state_memory(model).__dict__}
            if disk is not None:
                out.update(disk_read_bytes=disk.read_bytes, disk_written_bytes=disk.written_bytes,
                           disk_read_s=disk.read_s, disk_write_s=disk.write_s, disk_waited_s=disk.waited_s)
            return out

        return step, lambda path: hf_zero.save_checkpoint(path, model, opt), stats
    if engine == "ddp":
        model = AutoModelForCausalLM.from_pretrained(args.weights, dtype=torch.float32)
        model.train()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = _adamw(ddp.parameters())

        def ddp_save(path: str) -> None:
            if dist.get_rank() == 0:
                os.makedirs(path, exist_ok=True)
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, os.path.join(path, "ckpt.pt"))
            dist.barrier()

        return _torch_step(ddp, opt, autocast=bf16), ddp_save, dict
    if engine in ("fsdp2", "fsdp2_reduce_fp32"):  # as Accelerate's FSDP2 plugin builds it (benchmarks/_peers.py)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from _peers import fsdp2_setup

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        PEER_CONFIG.update(fsdp2_setup(model, bf16=bf16, reduce_fp32=engine == "fsdp2_reduce_fp32"))
        model.to_empty(device="cpu")
        _init_meta_llama(model, config)
        model.train()
        opt = _adamw(model.parameters())

        def fsdp_save(path: str) -> None:
            state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
            dcp.save(state, checkpoint_id=path)

        return _torch_step(model, opt, autocast=False), fsdp_save, dict
    if engine.startswith("ds3"):  # as the HF Trainer configures DeepSpeed (benchmarks/_peers.py)
        import deepspeed

        from _peers import deepspeed_config

        offload = {"ds3_offload": "cpu", "ds3_nvme": "nvme", "ds3_nvme_lean": "nvme"}.get(engine)
        ds_config = deepspeed_config(config.hidden_size, micro=1, bf16=bf16,
                                     flavor="raw" if engine == "ds3_raw" else "hf", offload=offload,
                                     nvme_path=str(Path(args.work) / "offload") if offload == "nvme" else None,
                                     lean=engine == "ds3_nvme_lean")
        PEER_CONFIG.update(ds_config)
        if offload == "nvme":
            (Path(args.work) / "offload").mkdir(parents=True, exist_ok=True)
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
        # resolved before zero.Init: transformers imports the modeling module lazily, and an import inside
        # zero.Init's patched Tensor.__new__ fails on torch 2.13 (DeepSpeed 0.19.8: "Signature mismatch")
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = model_class(config)
        # offloading: the configuration names AdamW and DeepSpeed builds DeepSpeedCPUAdam; otherwise the
        # Trainer's own torch AdamW is handed over
        optimizer = None if offload else _adamw(model.parameters())
        engine_, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                                optimizer=optimizer)

        def ds_step(batch):  # noqa: ANN001, ANN202
            loss = engine_(input_ids=batch, labels=batch).loss
            engine_.backward(loss)
            engine_.step()
            return loss.detach()

        return ds_step, lambda path: engine_.save_checkpoint(path), dict
    raise ValueError(engine)


def work(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    import transformers  # noqa: F401  (part of every engine's baseline)

    if args.engine.startswith("ds"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = _status("VmRSS:")
    began = time.perf_counter()
    _phase(rank, "setup")
    step, save, stats = build(args.engine, args)
    if PEER_CONFIG:
        _phase(rank, f"peer configuration {json.dumps(PEER_CONFIG, sort_keys=True)}")
    setup_s = time.perf_counter() - began
    setup_peak = _status("VmHWM:")
    dist.barrier()
    if args.drop_weights and rank == 0:  # the last engine of this size: room on disk for the checkpoint
        shutil.rmtree(args.weights, ignore_errors=True)
    _reset_peak()
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, SHAPE["vocab_size"], (args.steps, 2, SEQ), generator=g)
    losses, step_s = [], []
    for i in range(args.steps):
        _phase(rank, f"step {i + 1}")
        began = time.perf_counter()
        loss = step(data[i, rank : rank + 1])
        mean = loss.float().reshape(1).clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / 2)
        step_s.append(time.perf_counter() - began)
    train_peak = max(_status("VmHWM:"), _KEPT["peak"])
    train_end = _status("VmRSS:")
    _reset_peak()
    dist.barrier()
    began = time.perf_counter()
    _phase(rank, "save")
    save(str(Path(args.work) / "ckpt"))
    dist.barrier()
    save_s = time.perf_counter() - began
    save_peak = _status("VmHWM:")
    record = {"engine": args.engine, "layers": args.layers, "params": n_params(args.layers), "rank": rank,
              "base_rss": base, "setup_peak_rss": setup_peak, "setup_s": setup_s, "train_peak_rss": train_peak,
              "train_end_rss": train_end, "save_peak_rss": save_peak, "save_s": save_s, "step_s": step_s,
              "losses": losses, "tokens_per_s": 2 * SEQ / step_s[-1], "peer_config": PEER_CONFIG, **stats()}
    _phase(rank, "report")
    records = [None, None]
    dist.all_gather_object(records, record)
    if rank == 0:
        Path(args.result).write_text(json.dumps({"engine": args.engine, "layers": args.layers, "ranks": records},
                                                default=str))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # the figures are out; skip interpreter teardown (gloo threads, pytorch/pytorch#179291)
