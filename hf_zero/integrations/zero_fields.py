"""The integrations' settings, derived from `ZeroConfig`, and the launcher's environment, read once.

[Note: one source of truth]
Every `ZeroConfig` field is exposed by both integrations under one name, `zero_<field>`: as
`--zero_<field>` on the Trainer's command line (`ZeroTrainingArguments`) and as
`ZeroPlugin(zero_<field>=...)` for Accelerate. Names, defaults, help texts and choices are read
from `ZeroConfig`'s fields here, so a field added there is exposed everywhere, and
`to_zero_config` turns the values back. The one exception is `mixed_precision` (`host_owned` in
its metadata): the host owns precision (the Trainer's `--bf16`/`--fp16`, Accelerate's
`mixed_precision`), so there is one switch for it.

Environment variables are read in `hf_zero.launch.launch_env()` only: the launcher's precision, node
size and local rank, and the switches that would turn the host's own DeepSpeed or FSDP on.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from ..checkpoint.writer import parse_size
from ..config import ZeroConfig
from ..launch import LaunchEnv, launch_env

__all__ = [
    "LaunchEnv",
    "PREFIX",
    "exposed_fields",
    "field_specs",
    "launch_env",
    "save_specs",
    "snapshot_budget",
    "to_zero_config",
]

PREFIX = "zero_"


def exposed_fields() -> list[dataclasses.Field]:
    """The `ZeroConfig` fields the integrations expose (all but the host-owned precision)."""
    return [f for f in dataclasses.fields(ZeroConfig) if not f.metadata.get("host_owned")]


def field_specs(*, cli: bool) -> list[tuple[str, Any, Any]]:
    """`(zero_<name>, type, dataclasses.field(...))` for every exposed setting, for `make_dataclass`.
    With `cli`, types are those `HfArgumentParser` parses (a sequence of names becomes one
    comma-separated string); the help text and the choices come from `ZeroConfig`."""
    hints = typing.get_type_hints(ZeroConfig)
    specs = []
    for f in exposed_fields():
        kind = hints[f.name]
        if cli and f.name == "wrap":
            kind = str
        metadata = {"help": f.metadata["help"]}
        choices = _choices(kind)
        if choices:
            metadata["choices"] = choices
        specs.append((PREFIX + f.name, kind, dataclasses.field(default=f.default, metadata=metadata)))
    return specs


def save_specs() -> list[tuple[str, Any, Any]]:
    """The checkpointing settings both integrations add beside the engine's (`zero_async_save`,
    `zero_snapshot_budget`, `zero_save_on_preemption`), made anew for each `make_dataclass` that takes them."""
    help_text = (
        "Write the checkpoints in the background (the sharded state and, with the Trainer, checkpoint-N's model "
        "weights): each save returns once they are snapshotted to "
        "host memory, training goes on while they are written, and the next save (or the end of training) waits "
        "for it ([Note: asynchronous save]). A checkpoint is never half-written either way."
    )
    preemption_help = (
        "On SIGTERM or SIGUSR1 (a scheduler preempting the job), every rank finishes its step, they agree, a "
        "checkpoint of that step is saved, and the process exits with code 75 (EX_TEMPFAIL); resuming continues "
        "from it ([Note: preemption]). With Accelerate, ask `accelerator.preempted()` once per step."
    )
    budget_help = (
        "With zero_async_save, the most host memory (per rank) a save's snapshot takes, as '8GB', '512MiB' or a "
        "number of bytes; the state beyond it is written from the training tensors before the save returns. "
        "Unset: the whole of the rank's share is snapshotted."
    )
    return [
        ("zero_async_save", bool, dataclasses.field(default=False, metadata={"help": help_text})),
        ("zero_snapshot_budget", str | None, dataclasses.field(default=None, metadata={"help": budget_help})),
        ("zero_save_on_preemption", bool, dataclasses.field(default=False, metadata={"help": preemption_help})),
    ]


def snapshot_budget(settings: object) -> int | None:
    """The snapshot budget in bytes `settings` (a `ZeroTrainingArguments` or `ZeroPlugin`) ask for, checked.

    Example:

    ```python
    >>> snapshot_budget(ZeroPlugin(zero_async_save=True, zero_snapshot_budget="2GB"))
    2000000000
    ```
    """
    value = getattr(settings, "zero_snapshot_budget", None)
    if value is None:
        return None
    if not getattr(settings, "zero_async_save", False):
        raise ValueError(
            f"zero_snapshot_budget={value!r} bounds an asynchronous save's snapshot, but zero_async_save is off. "
            "Turn it on (--zero_async_save / ZeroPlugin(zero_async_save=True)) or drop the budget."
        )
    return parse_size(value, "zero_snapshot_budget")


def _choices(kind: Any) -> list[Any] | None:
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) is Literal:
        return list(typing.get_args(kind))
    if len(args) == 1 and typing.get_origin(args[0]) is Literal:
        return list(typing.get_args(args[0]))
    return None


def to_zero_config(values: Any, mixed_precision: str, **overrides: Any) -> ZeroConfig:
    """The `ZeroConfig` of an object with `zero_<name>` attributes (the Trainer's arguments, a plugin),
    with the host's precision; `overrides` replace settings the host computed itself."""
    kwargs: dict[str, Any] = {f.name: getattr(values, PREFIX + f.name) for f in exposed_fields()}
    wrap = kwargs["wrap"]
    if isinstance(wrap, str) and wrap.strip() != "auto":  # the command line's comma-separated names
        kwargs["wrap"] = tuple(name.strip() for name in wrap.split(",") if name.strip())
        if not kwargs["wrap"]:
            raise ValueError("--zero_wrap must be 'auto' or comma-separated module class names.")
    elif isinstance(wrap, str):
        kwargs["wrap"] = "auto"
    kwargs.update(overrides)
    return ZeroConfig(mixed_precision=mixed_precision, **kwargs)  # type: ignore[arg-type]  # a str the caller checked against the Literal


def sequence_size(parallelism: Any, requested: int) -> int:
    """The sequence-parallel size of a run given Accelerate's `ParallelismConfig` (`parallelism`, or None) beside
    hf_zero's own `requested` setting ([Note: sequence parallelism]): a `sp_size` or `cp_size` above 1 asks for
    sequence parallelism over that many ranks; its other dimensions are hf_zero's to choose or are refused."""
    if parallelism is None:
        return requested
    size = {name: int(getattr(parallelism, f"{name}_size", None) or 1) for name in ("tp", "sp", "cp", "dp_replicate")}
    if size["tp"] > 1:
        raise ValueError(
            f"ParallelismConfig(tp_size={size['tp']}): hf_zero does not split layers by tensor parallelism; it "
            "shards the model states over every rank (ZeRO). Drop tp_size."
        )
    if size["dp_replicate"] > 1:
        raise ValueError(
            f"ParallelismConfig(dp_replicate_size={size['dp_replicate']}): hf_zero's hybrid sharding is "
            "--zero_hybrid_shard (or --zero_shard_group_size N); drop dp_replicate_size."
        )
    asked = max(size["sp"], size["cp"])  # ParallelismConfig refuses both above 1
    if asked == 1:
        return requested
    if requested > 1 and requested != asked:
        raise ValueError(
            f"ParallelismConfig asks for sequence parallelism {asked} and zero_sequence_parallel is {requested}; "
            "give one of them (or the same size)."
        )
    return asked
