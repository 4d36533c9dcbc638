"""`load_checkpoint`: restore parameters and optimizer state on any world size and any stage.

Each rank reads, from whichever files hold them, only the ranges of each parameter that its own
shard covers now (`read_pieces` over the manifest's slice index), so a checkpoint saved by 3
ranks at stage 3 loads on 2 ranks at stage 2, and back. Everything is checked (manifest, names
and shapes, files, sizes, checksums) and agreed on by all ranks before any tensor is touched.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ..engine.collectives import raise_if_any_failed
from ..engine.engine import ZeroEngine
from ..engine.module import get_engine
from ..engine.step.optim import ShardedOptimizer, sharded_list
from ..engine.step.pieces import Piece
from .background import finish_previous
from .format import BUFFERS_FILE, STATE_SEP, Manifest, check_files, optim_file_for
from .owned_state import (
    PARAM,
    check_flat_loadable,
    load_owned,
    owned_files,
    piece_param_state,
    read_whole,
    restore_value,
)
from .reader import FileCache, read_pieces


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: ShardedOptimizer | Sequence[ShardedOptimizer] | None = None,
    *,
    verify: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by `save_checkpoint` into a sharded model (and optimizer).

    A collective: every rank must call it. The world size and stage may differ from the ones
    that saved. Each rank reads only the byte ranges its shards need.

    Args:
        path (`str` or `os.PathLike`): the checkpoint directory.
        model (`nn.Module`): a model returned by `hf_zero.initialize`, of the same architecture.
        optimizer (`ShardedOptimizer` or a list or tuple of them, *optional*): restored too (state, param-group
            hyperparameters); several optimizers in the order they were saved.
        verify (`bool`, *optional*, defaults to `True`): check every file's SHA-256 against the
            manifest before reading (costs one read of the files); sizes are always checked.

    Returns:
        `dict`: the `metadata` given to `save_checkpoint`.

    Raises:
        FileNotFoundError: no checkpoint (or an incomplete one) at `path`, or a file missing.
        ValueError: a damaged file, another model's checkpoint (names or shapes differ), an
            unknown format version, or an optimizer that does not match. Raised on every rank,
            before anything is modified.

    Example:

    ```python
    >>> model, optimizer = hf_zero.initialize(model, optimizer, hf_zero.ZeroConfig(stage=2))
    >>> meta = hf_zero.load_checkpoint("ckpt/step-1000", model, optimizer)
    >>> start_step = meta["step"]
    ```
    """
    engine = get_engine(model)
    finish_previous(engine)  # [Note: asynchronous save]: a checkpoint being written is read once committed
    directory = Path(path)
    manifest: Manifest | None = None
    error: BaseException | None = None
    try:
        manifest = Manifest.read(directory)
        _check_model_matches(manifest, engine, directory)
        optimizers = sharded_list(optimizer, "load_checkpoint")
        _check_optimizer_matches(manifest, optimizers, directory)
        check_files(directory, manifest, _files_needed(manifest, engine, optimizers), verify)
        flat = {n for o in optimizers if not o.steps_whole_parameters for names in o.group_param_names for n in names}
        if flat:
            with FileCache(directory) as cache:
                check_flat_loadable(manifest, cache, flat)
    except Exception as e:  # noqa: BLE001 - whatever the type, every rank raises it
        error = e
    raise_if_any_failed(error, engine.world, "hf_zero.load_checkpoint")
    if manifest is None:  # unreachable: a missing manifest raised above
        raise RuntimeError(f"[rank {engine.world.global_rank}] hf_zero.load_checkpoint read no manifest")

    engine.hooks.wait_reductions()
    with FileCache(directory) as cache:
        with torch.no_grad():
            for part in engine.parts:  # one unit's master at a time ([Note: disk offload])
                master = part.store.read()
                for piece in engine.pieces:
                    if piece.part is part:
                        out = master[piece.local[0] : piece.local[1]]
                        read_pieces(cache, piece.name, manifest.slices[piece.name], piece.start, piece.end, out)
                part.store.replace(master)
            _load_buffers(model, manifest, cache)
        for each, saved_part in zip(optimizers, optimizer_parts(manifest)):
            _load_optimizer(engine, each, saved_part, manifest, cache)
    if engine.scaler is not None and "loss_scale" in manifest.engine:
        engine.scaler.scale = float(manifest.engine["loss_scale"])
    engine.zero_grad()
    return dict(manifest.user)


def _files_needed(manifest: Manifest, engine: ZeroEngine, optimizers: list[ShardedOptimizer]) -> list[str]:
    needed: set[str] = set()
    with_state = bool(optimizers) and manifest.optimizer is not None
    owners: dict[str, str] = (manifest.optimizer or {}).get("owners", {})
    for piece in engine.pieces:
        for file, s, e in manifest.slices[piece.name]:
            if s < piece.end and e > piece.start:
                needed.add(file)
                if with_state and piece.name not in owners:
                    needed.add(optim_file_for(file))
        if with_state and piece.name in owners:
            needed.add(owners[piece.name])
    for optimizer in optimizers if with_state else []:
        if optimizer.whole_step is not None:
            needed |= owned_files(optimizer.whole_step, manifest)
    if manifest.buffers:
        needed.add(BUFFERS_FILE)
    return sorted(needed)


def _check_model_matches(manifest: Manifest, engine: ZeroEngine, directory: Path) -> None:
    ours = {slot.name: list(slot.shape) for part in engine.parts for slot in part.layout.slots}
    theirs = {name: info["shape"] for name, info in manifest.params.items()}
    missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if missing or unexpected:
        raise ValueError(
            f"The checkpoint at {directory} is for another model: it lacks {len(missing)} parameter(s) of this "
            f"model {missing[:5]} and has {len(unexpected)} this model does not have {unexpected[:5]}."
        )
    wrong = [f"{n}: checkpoint {theirs[n]} vs model {ours[n]}" for n in ours if ours[n] != theirs[n]]
    if wrong:
        raise ValueError(f"The checkpoint at {directory} has parameters of other shapes: {wrong[:5]}.")
    for name, entries in manifest.slices.items():
        covered = sum(e - s for _, s, e in entries)
        if covered != math.prod(theirs[name]):
            raise ValueError(
                f"{directory}/hf_zero_manifest.json covers {covered} elements of {name}; the index is damaged."
            )


def optimizer_parts(manifest: Manifest) -> list[dict[str, Any]]:
    """The class and param groups of each optimizer the checkpoint holds state of (none, one, or several)."""
    if manifest.optimizer is None:
        return []
    return list(manifest.optimizer.get("parts") or [manifest.optimizer])


def _check_optimizer_matches(manifest: Manifest, optimizers: list[ShardedOptimizer], directory: Path) -> None:
    if not optimizers:
        return
    if manifest.optimizer is None:
        raise ValueError(f"The checkpoint at {directory} holds no optimizer state; load it with optimizer=None.")
    parts = optimizer_parts(manifest)
    if len(parts) != len(optimizers):
        raise ValueError(
            f"The checkpoint at {directory} holds the state of {len(parts)} optimizer(s) "
            f"({', '.join(p['class'] for p in parts)}); {len(optimizers)} were given. Pass the same optimizers, in "
            "the order they were saved."
        )
    for optimizer, part in zip(optimizers, parts):
        saved_class = part["class"]
        if saved_class != type(optimizer.optimizer).__name__:
            raise ValueError(
                f"The checkpoint at {directory} holds {saved_class} state but the optimizer is "
                f"{type(optimizer.optimizer).__name__}; build the same optimizer class to resume."
            )
        saved_groups = [g["params"] for g in part["param_groups"]]
        if saved_groups != optimizer.group_param_names:
            raise ValueError(
                f"The optimizer's param groups differ from the checkpoint's at {directory} ({len(saved_groups)} saved "
                f"group(s) vs {len(optimizer.group_param_names)}, or other parameters in them); build the optimizer "
                "with the same groups to resume."
            )


def _load_buffers(model: nn.Module, manifest: Manifest, cache: FileCache) -> None:
    """The saved buffers, through the model's own loading: a `load_state_dict` its class overrides (one that
    resizes a buffer whose shape changes during training, as the stock Trainer's resume calls it), else
    `nn.Module.load_state_dict` (every module's `_load_from_state_dict` override), with the buffers only."""
    if not manifest.buffers:
        return
    handle = cache.get(BUFFERS_FILE)
    live = dict(model.named_buffers())
    saved = {name: handle.get_tensor(name) for name in manifest.buffers if name in live}
    load = _own_load_state_dict(type(model))
    with torch.no_grad():
        load(model, saved, strict=False)


def _own_load_state_dict(cls: type) -> Callable[..., Any]:
    """The `load_state_dict` the model's own class defines (below hf_zero's mixin), or `nn.Module`'s."""
    from ..model import ZeroModel

    for klass in cls.__mro__:
        if klass in (cls, ZeroModel, nn.Module) or not issubclass(klass, nn.Module):
            continue
        if "load_state_dict" in vars(klass):
            return cast(Callable[..., Any], vars(klass)["load_state_dict"])
    return nn.Module.load_state_dict


def _load_optimizer(
    engine: ZeroEngine, optimizer: ShardedOptimizer, part: dict[str, Any], manifest: Manifest, cache: FileCache
) -> None:
    saved = manifest.optimizer or {}
    for group, saved_group in zip(optimizer.param_groups, part["param_groups"]):
        for key, value in saved_group.items():
            if key != "params":
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    inner = optimizer.optimizer
    inner.state.clear()
    if optimizer.whole_step is not None:  # [Note: owned optimizer state]
        load_owned(optimizer.whole_step, inner, manifest, cache)
        return
    group_of = {id(t): g for g in inner.param_groups for t in g["params"]}
    for piece in engine.pieces:
        kinds = saved["state"].get(piece.name)
        if kinds and piece.optim_params and id(piece.optim_params[0]) in group_of:  # another optimizer's: skipped
            whole, flat = _piece_state(piece, kinds, manifest, cache, group_of[id(piece.optim_params[0])])
            if piece.part.store.take_state(piece.local[0], whole, flat):  # [Note: master stores]: into the files
                for t in piece.optim_params:
                    inner.state[t] = {
                        k: v.clone() if isinstance(v, torch.Tensor) and v.numel() else v for k, v in whole.items()
                    }
                continue
            for t, (a, b) in zip(piece.optim_params, piece.bounds):  # [Note: optimizer chunks]
                inner.state[t] = {
                    key: value[a:b] if key in flat else value.clone() if isinstance(value, torch.Tensor) else value
                    for key, value in whole.items()
                }


def _piece_state(
    piece: Piece, kinds: dict[str, str], manifest: Manifest, cache: FileCache, group: dict[str, Any]
) -> tuple[dict[str, Any], set[str]]:
    """The state of one piece, and the keys that are elementwise (cut into the piece's chunks)."""
    owner = (manifest.optimizer or {}).get("owners", {}).get(piece.name)
    stored = [[owner, 0, 0]] if owner else [[optim_file_for(f), s, e] for f, s, e in manifest.slices[piece.name]]
    state: dict[str, Any] = {}
    flat: set[str] = set()
    for key, kind in kinds.items():
        tkey = f"{piece.name}{STATE_SEP}{key}"
        if kind == "elementwise":
            out = torch.empty(piece.end - piece.start, dtype=piece.master.dtype, device=piece.master.device)
            read_pieces(cache, tkey, stored, piece.start, piece.end, out)
            state[key] = out
            flat.add(key)
        elif kind == PARAM and owner and len(cache.get(owner).get_slice(tkey).get_shape()) > 0:
            state[key] = piece_param_state(piece, key, manifest, cache).to(
                piece.master.device
            )  # [Note: owned optimizer state]
            flat.add(key)
        else:
            state[key] = restore_value(key, kind, read_whole(cache, tkey, stored), group, piece.master.device)
    return state, flat
