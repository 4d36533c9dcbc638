"""What every rank must hold alike before `initialize` shards anything: the model and the engine's settings.

[Note: the same model on every rank]
Every rank shards its own copy of the model and the ranks exchange pieces of it by position: a rank whose
model has another parameter, shape, dtype or `requires_grad` (the embeddings resized on the main process only,
a layer frozen on one rank, another config on one node) would send pieces of other sizes, a crash in the
backend or a hang. DDP refuses such models at construction; so does `initialize`, on every rank alike (one
small all-reduce; the entries are gathered only when they differ), naming the first difference. The same holds
for the `ZeroConfig`: another stage, precision, bucket size or prefetch depth on one rank (a node launched with
another accelerate config file) changes which collectives it issues and their sizes; every setting is compared
but the offload directory's path (a node-local path may differ; whether there is one may not) and the process
groups' timeout. And for a load from files (`hf_zero.from_pretrained`, `weights_from=`), the files: each rank reads
its own shards from its own copy of the directory, so copies that hold different weights of the same shapes (another
checkpoint at the same path on one node) would make a model mixed from both, silently, where DDP broadcasts rank 0's
weights; the ranks compare a digest of the files' sizes and of their first and last 64 KiB (the header and the
values at both ends), which another checkpoint's values change and an identical copy does not.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ...config import ZeroConfig
from ..collectives import CommGroup, digest_of, first_to_differ


def _first_entry_that_differs(mine: list[str], theirs: list[str]) -> int:
    """The index of the first entry where `mine` and `theirs` differ (the shorter's length where one is a prefix)."""
    return next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))


def _entries(model: nn.Module) -> list[str]:
    """Each parameter and buffer of `model` as `name shape dtype [grad]`, in registration order."""
    params = [f"{n} {list(p.shape)} {p.dtype}{' grad' if p.requires_grad else ''}" for n, p in model.named_parameters()]
    return params + [f"{n} {list(b.shape)} {b.dtype} buffer" for n, b in model.named_buffers()]


def refuse_models_that_differ(model: nn.Module, world: CommGroup) -> None:
    """[Note: the same model on every rank]: `ValueError` on every rank when the models differ."""
    if world.size == 1:
        return
    mine = _entries(model)
    differs = first_to_differ(digest_of("\n".join(mine)), mine, world)
    if differs is None:
        return
    other, theirs = differs
    at = _first_entry_that_differs(mine, theirs)
    ours = mine[at] if at < len(mine) else "nothing"
    them = theirs[at] if at < len(theirs) else "nothing"
    raise ValueError(
        f"[rank {world.global_rank}] hf_zero.initialize: the model differs between ranks: rank {world.global_rank} "
        f"has {len(mine)} parameters and buffers, rank {other} {len(theirs)}; entry {at} is '{ours}' here and "
        f"'{them}' there. Every rank must build the same model: the same config and files, and the same changes "
        "before initialize on every rank (resize_token_embeddings, freezing, adding a head), not on the main "
        "process only."
    )


_LOCAL_SETTINGS = ("offload_dir", "group_timeout_s")  # compared as whether there is one / not at all


def refuse_configs_that_differ(config: ZeroConfig, world: CommGroup) -> None:
    """[Note: the same model on every rank]: `ValueError` on every rank when the `ZeroConfig`s differ."""
    if world.size == 1:
        return
    mine = [
        f"{f.name}={getattr(config, f.name)!r}"
        if f.name not in _LOCAL_SETTINGS
        else f"{f.name} set: {f.name == 'offload_dir' and config.offload_dir is not None}"
        for f in dataclasses.fields(config)
    ]
    differs = first_to_differ(digest_of("\n".join(mine)), mine, world)
    if differs is None:
        return
    other, theirs = differs
    at = _first_entry_that_differs(mine, theirs)
    raise ValueError(
        f"[rank {world.global_rank}] hf_zero.initialize: the ZeroConfig differs between ranks: {mine[at]} here, "
        f"{theirs[at]} on rank {other}. Every rank must pass the same settings (the same TrainingArguments, the "
        "same accelerate config file on every node), or the ranks would issue different collectives."
    )


def refuse_weights_that_differ(fingerprint: int, directory: str, world: CommGroup) -> None:
    """[Note: the same model on every rank]: `ValueError` on every rank when the model directories each rank reads its
    shards from hold other files (`PretrainedSource.fingerprint`): each rank would fill its shards from its own copy,
    a model mixed from two checkpoints, where DDP broadcasts rank 0's weights."""
    if world.size == 1:
        return
    differs = first_to_differ(fingerprint, directory, world)
    if differs is None:
        return
    other, theirs = differs
    raise ValueError(
        f"[rank {world.global_rank}] hf_zero: the ranks' model directories hold different weight files ({directory} "
        f"here, {theirs} on rank {other}): each rank reads its own shards from its own copy, so the model would mix "
        "two checkpoints. Give every node a byte-identical copy of the same directory (or one on a filesystem they "
        "share)."
    )
