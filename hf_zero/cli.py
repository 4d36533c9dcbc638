"""The `hf-zero` command.

hf-zero consolidate CKPT OUT [--dtype bf16] [--max-shard-size 5GB] [--overwrite]
hf-zero merge-adapter ADAPTER BASE OUT [--dtype bf16] [--overwrite]
hf-zero leftovers RUN_DIR [--remove]
hf-zero preemptible OUTPUT_DIR -- LAUNCH COMMAND...
hf-zero from-deepspeed DS_CONFIG_JSON | --fsdp ACCELERATE_CONFIG_YAML
hf-zero estimate MODEL_DIR_OR_HUB_ID --world-size N [--nodes M] [--seq-len L] [--micro-batch B] [--attention sdpa]
                 [--gradient-checkpointing] [--dtype bf16] [--device-memory 80GB] [--host-memory 1TB]
                 [--disk 4TB]
hf-zero env
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from . import __version__

if TYPE_CHECKING:
    from torch import nn


def _consolidate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .checkpoint.consolidate import consolidate
    from .checkpoint.target import check_target

    check_target(Path(args.output), overwrite=args.overwrite, flag="--overwrite")  # [Note: output record]
    files = consolidate(
        args.checkpoint,
        args.output,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        verify=not args.no_verify,
        progress=not args.quiet,
        overwrite=args.overwrite,
    )
    if files == ["adapter_model.safetensors"]:  # [Note: adapter export] a PEFT model's checkpoint
        print(
            f"wrote the PEFT adapter (adapter_model.safetensors, adapter_config.json) to {args.output}: load it with "
            f"PeftModel.from_pretrained(base_model, {args.output!r}) or hf_zero.from_pretrained(..., "
            f"peft_config={args.output!r})"
        )
    else:
        print(f"wrote {len(files)} weight file(s) to {args.output}: {', '.join(files)}")
    return 0


def _leftovers(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .checkpoint import leftovers

    root = Path(args.run_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"no such run folder: {root}")
    found = leftovers.under(root)
    for path in found:
        print(f"{path}{'/' if path.is_dir() else ''}")
    if args.remove:
        freed = leftovers.remove(found)
        print(f"removed {len(found)} leftover(s) of killed saves, {freed / 2**20:.1f} MiB")
    else:
        print(f"{len(found)} leftover(s) of killed saves" + (" (--remove deletes them)" if found else ""))
    return 0


def _preemptible(args: argparse.Namespace) -> int:
    """[Note: preemption marker] run the launch command; 75 if the job left the marker, else its own exit code."""
    import json
    from pathlib import Path

    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    if not command:
        raise ValueError("give the launch command after --, e.g. hf-zero preemptible out -- accelerate launch train.py")
    marker = Path(args.output_dir) / "hf_zero_preempted.json"
    marker.unlink(missing_ok=True)  # a stale one, from a launch before
    code = _run_forwarding_signals(command)
    if marker.is_file():
        record = json.loads(marker.read_text())
        print(
            f"hf-zero preemptible: preempted, {record['checkpoint']} is complete; exit {record['exit_code']} "
            f"(the launcher exited {code}): requeue the job",
            file=sys.stderr,
        )
        return int(record["exit_code"])
    return code


def _run_forwarding_signals(command: list[str]) -> int:
    """Run `command`; SIGTERM, SIGUSR1 and SIGINT sent to this process go to it (this process keeps waiting)."""
    import signal
    import subprocess

    proc = subprocess.Popen(command)
    forwarded = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    previous = {sig: signal.signal(sig, lambda signum, frame: proc.send_signal(signum)) for sig in forwarded}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _estimate(args: argparse.Namespace) -> int:
    from .checkpoint.writer import parse_size
    from .estimate import Workload, estimate, format_table, recommend

    if (args.model_path is None) == (args.model is None):
        raise ValueError("give the model once: hf-zero estimate MODEL_DIR_OR_HUB_ID (or --model PATH).")
    if args.qlora and (args.time or args.dtype == "fp16"):
        raise ValueError("--qlora estimates memory with --dtype bf16 or fp32 (the dtype the 4-bit base is loaded in).")
    dtype = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}[args.dtype] if args.qlora else "float32"
    hf_config, model = _meta_model(args.model_path or args.model, dtype)
    if args.time:
        return _step_time(model, hf_config, args)
    if args.qlora and not args.lora_rank:
        args.lora_rank = 16
    trainable_note = _trainable(model, args)
    n = sum(p.numel() for p in model.parameters())  # before a 4-bit base packs two weights in a byte
    scales = 0
    if args.qlora:  # [Note: quantized base]: the packed codes in the loaded dtype, computed in it (no mixed precision)
        from .estimate import as_4bit

        scales = as_4bit(model)
        trainable_note += f"; 4-bit base (NF4, double quantization), {scales / 2**30:.2f} GiB of scales on every rank"
    device_memory = parse_size(args.device_memory, "--device-memory") if args.device_memory else None
    host_memory = parse_size(args.host_memory, "--host-memory") if args.host_memory else None
    disk = parse_size(args.disk, "--disk") if args.disk else None
    workload = Workload(
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        gradient_checkpointing=args.gradient_checkpointing,
        sequence_parallel=args.sequence_parallel,
        attention=args.attention,
        tiled_mlp=args.tiled_mlp,
    )
    mixed = "no" if args.qlora else {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[args.dtype]
    rows = estimate(
        model,
        hf_config,
        world_size=args.world_size,
        nodes=args.nodes,
        workload=workload,
        mixed_precision=mixed,
        optimizer=args.optimizer,
        whole_state_bytes=scales,
    )
    state = (
        f"{'Adam' if args.optimizer == 'adamw' else 'Adafactor'} in {args.dtype}, no fp32 master"
        if args.qlora
        else ("fp32 Adam on flat shards" if args.optimizer == "adamw" else "Adafactor on whole parameters")
    )
    print(
        f"{type(model).__name__}: {n / 1e9:.2f}B parameters; {args.world_size} ranks on {args.nodes} node(s); "
        f"micro-batch {args.micro_batch} x {args.seq_len} tokens; {args.attention} attention; compute {args.dtype}, "
        f"{state}; "
        f"activation checkpointing {'on' if args.gradient_checkpointing else 'off'}"
        + (f"; sequence parallelism {args.sequence_parallel}" if args.sequence_parallel > 1 else "")
        + ("; tiled MLP" if args.tiled_mlp else "")
        + f"{trainable_note}. "
        "GiB per device / per node:"
    )
    print(format_table(rows, device_memory, host_memory, disk))
    budget = device_memory or 80 * 10**9
    row, why = recommend(rows, budget, host_memory, disk)
    assumed = "" if device_memory else " (80GB devices assumed: pass --device-memory)"
    if row is None:
        print(f"Recommended: none{assumed}: {why}")
    else:
        flags = (
            f"--zero_stage {row.stage}"
            + {
                "none": "",
                "optimizer": " --zero_offload_optimizer",
                "optimizer+params": " --zero_offload_optimizer --zero_offload_params",
                "disk": " --zero_offload_optimizer --zero_offload_dir DIR",
                "disk+params": " --zero_offload_optimizer --zero_offload_params --zero_offload_dir DIR",
            }[row.offload]
        )
        print(f"Recommended{assumed}: {why} Trainer flags: {flags}")
    return 0


def _step_time(model: Any, hf_config: Any, args: argparse.Namespace) -> int:
    from dataclasses import replace

    from .steptime import GPUS, Job, ModelShape, format_predictions

    hw = GPUS[args.gpu]
    overrides = {
        "peak_flops": args.peak_tflops and args.peak_tflops * 1e12,
        "compute_efficiency": args.compute_efficiency,
        "intra_node_bandwidth": args.intra_node_gbps and args.intra_node_gbps * 1e9,
        "inter_node_bandwidth": args.inter_node_gbps and args.inter_node_gbps * 1e9,
        "devices_per_node": args.world_size // args.nodes if args.nodes > 1 else None,
    }
    hw = replace(hw, **{k: v for k, v in overrides.items() if v})
    worlds = [int(w) for w in args.world_sizes.split(",")] if args.world_sizes else [args.world_size]
    if any(w < 1 for w in worlds):
        raise ValueError(f"--world-sizes must be positive integers; got {args.world_sizes!r}.")
    job = Job(
        world_size=worlds[0],
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        accum=args.accum,
        gradient_checkpointing=args.gradient_checkpointing,
        param_bytes=4 if args.dtype == "fp32" else 2,
        reduce_bytes=4,
        sequence_parallel=args.sequence_parallel,
    )
    print(format_predictions(ModelShape.from_model(model, hf_config), job, hw, worlds))
    print("How the model predicts, and how it compares with measured step times: docs/performance.md.")
    return 0


def _trainable(model: Any, args: argparse.Namespace) -> str:
    """Apply `--lora-rank` / `--trainable` to the meta model; returns a note for the header."""
    import re

    if args.lora_rank:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as e:
            raise ValueError("--lora-rank needs peft (pip install 'hf_zero[peft]').") from e
        targets = args.lora_targets.split(",") if args.lora_targets else None
        model = get_peft_model(model, LoraConfig(r=args.lora_rank, target_modules=targets))
    if args.trainable:
        try:
            pattern = re.compile(args.trainable)
        except re.error as e:
            raise ValueError(f"--trainable {args.trainable!r} is not a regular expression: {e}") from e
        for name, p in model.named_parameters():
            p.requires_grad_(bool(pattern.search(name)))
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trained == 0:
        raise ValueError("No parameter is trainable with these --trainable / --lora-rank settings.")
    return (
        ""
        if trained == total
        else f"; trainable {trained / 1e6:.1f}M of {total / 1e9:.2f}B (frozen weights in the compute dtype only)"
    )


def _meta_model(path: str, dtype: str = "float32") -> tuple[Any, nn.Module]:
    """A model built on the meta device from a config.json, a model directory, or a hub id whose config is in the
    local hub cache (no weights read, nothing downloaded)."""
    import json
    import os

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.isdir(path):
        config = AutoConfig.from_pretrained(path)
    elif os.path.isfile(path):
        raw = json.loads(open(path).read())
        if "model_type" not in raw:
            raise ValueError(f"{path} has no 'model_type'; pass a Hugging Face config.json.")
        config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    elif path.count("/") == 1 and not path.startswith((".", "/")):
        config = _cached_hub_config(path)
    else:
        raise FileNotFoundError(f"{path}: no such config.json or model directory.")
    with torch.device("meta"):  # the checkpoint's own dtype does not matter: master weights are fp32 (QLoRA: `dtype`)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return config, model


def _cached_hub_config(repo_id: str) -> Any:
    """The config of hub model `repo_id` from the local hub cache; `FileNotFoundError` saying how to get it."""
    from huggingface_hub import try_to_load_from_cache
    from transformers import AutoConfig

    cached = try_to_load_from_cache(repo_id, "config.json")
    if not isinstance(cached, str):
        raise FileNotFoundError(
            f"{repo_id}: not a local directory, and its config.json is not in the hub cache. Fetch it (only the "
            f"config is read): `hf download {repo_id} config.json --local-dir ./{repo_id.split('/')[1]}`, then pass "
            "that directory."
        )
    return AutoConfig.from_pretrained(os.path.dirname(cached))


def _from_peer(args: argparse.Namespace) -> int:
    from .migrate import read_config

    kind = "fsdp" if args.fsdp else "deepspeed"
    t = read_config(args.config, kind)
    head = ("key", "value", "hf_zero")
    widths = [max(len(row[i]) for row in [head, *t.rows]) for i in range(2)]
    print(f"{args.config} ({'Accelerate FSDP plugin' if args.fsdp else 'DeepSpeed'} settings):")
    for row in [head, *t.rows]:
        print(f"  {row[0].ljust(widths[0])}  {row[1][:40].ljust(min(widths[1], 40))}  {row[2]}")
    print(f"\nTrainer flags:  {t.flags() or '(none: the defaults)'}")
    print(f"In code:        hf_zero.{t.code()}")
    unmapped = t.unmapped
    if unmapped:
        print(f"{len(unmapped)} key(s) have no hf_zero counterpart: {', '.join(row[0] for row in unmapped)}")
    return 0


def _merge_adapter(args: argparse.Namespace) -> int:
    from .checkpoint.merge import merge_adapter

    files = merge_adapter(
        args.adapter,
        args.base,
        args.output,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
    )
    print(f"wrote {args.output} ({len(files)} weight file(s)): AutoModelForCausalLM.from_pretrained({args.output!r})")
    return 0


def _add_consolidate(sub: Any) -> None:
    """`hf-zero consolidate CHECKPOINT OUTPUT`."""
    c = sub.add_parser(
        "consolidate",
        help="write a sharded hf_zero checkpoint as a from_pretrained directory (offline, bounded memory)",
    )
    c.add_argument(
        "checkpoint", help="checkpoint directory written by hf_zero.save_checkpoint, or a Trainer's checkpoint-N"
    )
    c.add_argument("output", help="output directory for the Hugging Face model")
    c.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="dtype of the written weights (default: the saved master dtype, fp32)",
    )
    c.add_argument("--max-shard-size", default="5GB", help="largest weight file, e.g. 5GB, 500MB (default 5GB)")
    c.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of the checkpoint files")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument(
        "--overwrite",
        action="store_true",
        help="write into OUTPUT even where it holds files hf_zero did not write there (a model directory, other "
        "files): same-named files are replaced. Without it such an OUTPUT is refused and left as it is",
    )
    c.set_defaults(func=_consolidate)


def _add_merge_adapter(sub: Any) -> None:
    """`hf-zero merge-adapter ADAPTER BASE OUTPUT`."""
    m = sub.add_parser(
        "merge-adapter",
        help="write a base model with a LoRA adapter merged in, as a from_pretrained directory (offline, one tensor "
        "at a time; for QLoRA: the bf16 base that was quantized on load)",
    )
    m.add_argument("adapter", help="a PEFT adapter directory, or an hf_zero checkpoint of a PEFT model")
    m.add_argument("base", help="the base model's directory (safetensors), in the precision to merge into")
    m.add_argument("output", help="output directory for the merged model")
    m.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="default: each base tensor's")
    m.add_argument("--max-shard-size", default="5GB", help="largest weight file (default 5GB)")
    m.add_argument("--overwrite", action="store_true", help="write into OUTPUT even where it holds other files")
    m.set_defaults(func=_merge_adapter)


def _add_leftovers(sub: Any) -> None:
    """`hf-zero leftovers RUN_DIR`."""
    left = sub.add_parser(
        "leftovers",
        help="list (and --remove) the temporary files and folders that killed or interrupted saves left under a "
        "run folder",
    )
    left.add_argument("run_dir", help="a run's output folder (the Trainer's output_dir)")
    left.add_argument("--remove", action="store_true", help="delete them")
    left.set_defaults(func=_leftovers)


def _add_preemptible(sub: Any) -> None:
    """`hf-zero preemptible OUTPUT_DIR -- COMMAND`."""
    pre = sub.add_parser(
        "preemptible",
        help="run a launch command; exit 75 when the job was preempted with a complete checkpoint (requeue on it)",
    )
    pre.add_argument("output_dir", help="the job's output_dir (where the preemption marker is left)")
    pre.add_argument("command_line", nargs=argparse.REMAINDER, help="-- then the launch command")
    pre.set_defaults(func=_preemptible)


def _add_from_deepspeed(sub: Any) -> None:
    """`hf-zero from-deepspeed CONFIG`."""
    peer = sub.add_parser(
        "from-deepspeed",
        help="translate a DeepSpeed config (or, with --fsdp, an accelerate config with the FSDP plugin) into "
        "hf_zero's flags and ZeroConfig, naming each key that has no counterpart",
    )
    peer.add_argument("config", help="a ds_config.json (as given to --deepspeed), or an accelerate config YAML")
    peer.add_argument("--fsdp", action="store_true", help="CONFIG is an accelerate config YAML with fsdp_config")
    peer.set_defaults(func=_from_peer)


def _add_estimate(sub: Any) -> None:
    """`hf-zero estimate MODEL`: memory per device, or step time with `--time`."""
    e = sub.add_parser(
        "estimate",
        help="memory per device and per node for every stage and offload setting, and the configuration to use",
    )
    e.add_argument(
        "model_path",
        nargs="?",
        metavar="MODEL_DIR_OR_HUB_ID",
        help="a model directory, a config.json, or a hub id whose config is in the local hub cache (only the config "
        "is read)",
    )
    e.add_argument("--model", default=None, help="the same, as a flag")
    e.add_argument("--world-size", type=int, required=True, help="number of ranks (GPUs) in all")
    e.add_argument("--nodes", type=int, default=1, help="number of machines (default 1)")
    e.add_argument("--seq-len", type=int, default=2048)
    e.add_argument(
        "--sequence-parallel",
        type=int,
        default=1,
        help="ranks per sequence (ZeroConfig.sequence_parallel): activations per rank for seq-len / N tokens",
    )
    e.add_argument(
        "--attention",
        choices=["sdpa", "eager"],
        default="sdpa",
        help="the model's attention implementation: sdpa (transformers' default; also for flash attention) keeps "
        "no attention probabilities, eager keeps heads x seq-len per token and layer (default sdpa)",
    )
    e.add_argument(
        "--tiled-mlp",
        action="store_true",
        help="ZeroConfig.tiled_mlp: each layer's MLP intermediates are those of one 16 MB tile, not the sequence's",
    )
    e.add_argument("--micro-batch", type=int, default=1, help="sequences per device per micro-batch")
    e.add_argument("--gradient-checkpointing", action="store_true")
    e.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="compute dtype (default bf16)")
    e.add_argument(
        "--optimizer",
        choices=["adamw", "adafactor"],
        default="adamw",
        help="adamw: two moments on flat shards; adafactor: factored moments on whole parameters, each on "
        "the rank that owns it (default adamw)",
    )
    e.add_argument("--device-memory", default=None, help="device size, e.g. 80GB: adds a 'fits' column")
    e.add_argument("--host-memory", default=None, help="host memory per node, e.g. 1TB: counted in 'fits'")
    e.add_argument("--disk", default=None, help="free disk per node for offload_dir, e.g. 4TB: counted in 'fits'")
    e.add_argument(
        "--trainable",
        default=None,
        metavar="REGEX",
        help="only parameters whose names match are trained (the others frozen: no gradient, no optimizer "
        "state, no fp32 master), e.g. 'layers\\.(30|31)\\.'",
    )
    e.add_argument("--lora-rank", type=int, default=0, help="estimate LoRA training (peft) of this rank")
    e.add_argument(
        "--qlora",
        action="store_true",
        help="QLoRA: the base's linear weights in 4 bits (NF4, double quantization, stored as --dtype elements), "
        "LoRA of --lora-rank (default 16) trained in --dtype, no mixed precision",
    )
    e.add_argument(
        "--lora-targets", default=None, help="comma-separated module names for LoRA (default: peft's for the model)"
    )
    t = e.add_argument_group("step time (--time): predicted compute, communication, step time and MFU")
    t.add_argument("--time", action="store_true", help="predict step time instead of memory")
    t.add_argument("--gpu", choices=["h100", "h200", "a100"], default="h100", help="device preset (default h100)")
    t.add_argument("--world-sizes", default=None, help="comma-separated device counts, e.g. 8,64,512,1024")
    t.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    t.add_argument("--peak-tflops", type=float, default=None, help="override the device's dense peak")
    t.add_argument("--compute-efficiency", type=float, default=None, help="override the share of peak matmuls reach")
    t.add_argument("--intra-node-gbps", type=float, default=None, help="override the bus bandwidth in a node (GB/s)")
    t.add_argument("--inter-node-gbps", type=float, default=None, help="override the bandwidth per device across nodes")
    e.set_defaults(func=_estimate)


_PACKAGES = ("transformers", "accelerate", "safetensors", "peft", "trl", "bitsandbytes", "torchao", "deepspeed")


def _env(args: argparse.Namespace) -> int:
    """What a bug report needs: the versions, the devices and the launch this process sees (nothing imported but
    torch)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch
    import torch.distributed as dist

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    rows = [
        ("hf_zero", __version__),
        ("platform", platform.platform()),
        ("python", platform.python_version()),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
        ("GPUs", ", ".join(gpus) or "none"),
        ("NCCL", ".".join(map(str, torch.cuda.nccl.version())) if cuda and dist.is_nccl_available() else "none"),
        ("gloo", "yes" if dist.is_gloo_available() else "no"),
        ("CPU capability", torch.backends.cpu.get_cpu_capability()),
        *((name, installed(name)) for name in _PACKAGES),
        *((var, os.environ[var]) for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR") if var in os.environ),
    ]
    print("Paste this into a bug report:\n")
    print("\n".join(f"- {key}: {value}" for key, value in rows))
    return 0


def _add_env(sub: Any) -> None:
    """`hf-zero env`."""
    e = sub.add_parser("env", help="print the versions, devices and launch this machine has, for a bug report")
    e.set_defaults(func=_env)


def build_parser() -> argparse.ArgumentParser:
    """The `hf-zero` parser: one subcommand per tool."""
    parser = argparse.ArgumentParser(
        prog="hf-zero",
        description="hf_zero's tools: plan a run (estimate, from-deepspeed), turn its checkpoints into models "
        "(consolidate, merge-adapter), keep long jobs safe (preemptible, leftovers), and report a bug (env).",
        epilog="Run `hf-zero COMMAND --help` for a command's options. Docs: docs/guide.md.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _add_estimate,
        _add_from_deepspeed,
        _add_consolidate,
        _add_merge_adapter,
        _add_preemptible,
        _add_leftovers,
        _add_env,
    ):
        add(sub)
    return parser


# Optional packages' import-time notes, not about the command: torchao's "Failed to load ..._C_*.so" for GPU
# kernels a CPU machine cannot load and torch's pytree deprecation per enum it registers; bitsandbytes' missing CPU
# kernels. Harmless, but they read as errors above a table. Set to ERROR unless the user configured them.
_IMPORT_NOTES = ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops")


def _quiet_import_notes() -> None:
    import logging

    for name in _IMPORT_NOTES:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    _quiet_import_notes()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"hf-zero {args.command}: error: {e}", file=sys.stderr)
        return 2


def run() -> None:
    """The `hf-zero` console command: `main`, then exit with its code.

    After `preemptible` the process leaves at once, without unloading the modules `import hf_zero` brought in
    (torch's among them: about a second of the scheduler's grace period); it holds nothing to finalize.
    """
    code = main()
    if sys.argv[1:2] == ["preemptible"]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
