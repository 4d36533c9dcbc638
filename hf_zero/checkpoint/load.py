"""`load_checkpoint`: restore parameters and optimizer state on any world size and any stage.

Each rank reads, from whichever files hold them, only the ranges of each parameter that its own
shard covers now (over the manifest's slice index), so a checkpoint saved by 3 ranks at stage 3
loads on 2 ranks at stage 2, and back. The manifest, names, shapes and sizes are checked and agreed on
by all ranks before anything is read; then every file is read once, its checksum from the same bytes,
the optimizer state first, the masters last, once a copy of them is held ([Note: one-pass load],
[Note: master backup]): a failure on any rank puts every rank's masters back.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ..engine.checks.call_order import Call
from ..engine.collectives import CommGroup, digest_of, first_to_differ, raise_if_any_failed
from ..engine.facade import EngineFacade, facade_of
from ..engine.flat import FlatPart
from ..engine.step.optim import ShardedOptimizer, sharded_list
from ..engine.step.pieces import Piece, hand_over
from .background import finish_previous
from .backup import MasterBackup
from .format import (
    BUFFERS_FILE,
    STATE_SEP,
    Digest,
    Manifest,
    check_checksum,
    check_files,
    check_sizes,
    optim_file_for,
    sharded_state_dir,
)
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
from .sequential import RangeReads

Staged = list[tuple[Piece, dict[str, Any], set[str]]]  # an optimizer's state read ahead: (piece, state, flat keys)

logger = logging.getLogger(__name__)


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: ShardedOptimizer | Sequence[ShardedOptimizer] | None = None,
    *,
    verify: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by `save_checkpoint` into a sharded model (and optimizer).

    A collective: every rank must call it. The world size and stage may differ from the ones
    that saved. Each rank reads only the byte ranges its shards need. Into a live model and optimizer (a rewind
    mid-run) it acts as torch's `load_state_dict` does: each parameter's optimizer state becomes the saved one (none
    where the checkpoint holds none), and the gradients are left as they are.

    Args:
        path (`str` or `os.PathLike`): the checkpoint directory, or a Trainer's `checkpoint-N` (an Accelerate
            `save_state` folder) whose `hf_zero/` holds it.
        model (`nn.Module`): a model returned by `hf_zero.initialize`, of the same architecture.
        optimizer (`ShardedOptimizer` or a list or tuple of them, *optional*): restored too (state, param-group
            hyperparameters); several optimizers in the order they were saved.
        verify (`bool`, *optional*, defaults to `True`): check every file's checksum against the
            manifest (from the bytes as they are read; the weights are put back if one fails);
            sizes are always checked.

    Returns:
        `dict`: the `metadata` given to `save_checkpoint`.

    Raises:
        FileNotFoundError: no checkpoint (or an incomplete one) at `path`, or a file missing.
        ValueError: a damaged file, another model's checkpoint (names or shapes differ), an
            unknown format version, or an optimizer that does not match. Raised on every rank, the
            model's weights as they were; the optimizer's previous state may be gone by then
            (it is being replaced, and is released before the new one is read, to keep memory flat).

    Example:

    ```python
    >>> model, optimizer = hf_zero.initialize(model, optimizer, hf_zero.ZeroConfig(stage=2))
    >>> meta = hf_zero.load_checkpoint("ckpt/step-1000", model, optimizer)
    >>> start_step = meta["step"]
    ```
    """
    started = time.perf_counter()
    engine = facade_of(model)
    engine.begin_call(Call.LOAD_CHECKPOINT)  # [Note: call order]
    finish_previous(engine)  # [Note: asynchronous save]: a checkpoint being written is read once committed
    directory = sharded_state_dir(path)  # a Trainer's checkpoint-N: its hf_zero/
    manifest: Manifest | None = None
    needed: list[str] = []
    error: BaseException | None = None
    try:
        manifest = Manifest.read(directory)
        _check_model_matches(manifest, engine, directory)
        optimizers = sharded_list(optimizer, "load_checkpoint")
        _check_optimizer_matches(manifest, optimizers, directory)
        needed = _files_needed(manifest, engine, optimizers)
        check_sizes(directory, manifest, needed)
        flat = {n for o in optimizers if not o.steps_whole_parameters for names in o.group_param_names for n in names}
        if flat:
            with FileCache(directory) as cache:
                check_flat_loadable(manifest, cache, flat)
    except Exception as e:  # noqa: BLE001 - whatever the type, every rank raises it
        error = e
    raise_if_any_failed(error, engine.world, "hf_zero.load_checkpoint")
    if manifest is None:  # unreachable: a missing manifest raised above
        raise RuntimeError(f"[rank {engine.world.global_rank}] hf_zero.load_checkpoint read no manifest")
    _refuse_other_checkpoints(manifest, directory, engine.world)
    engine.wait_reductions()
    staged: list[Staged] = []
    backup: MasterBackup | None = None
    in_pass = not engine.masters_on_disk  # the masters read in the one pass ([Note: master backup])
    try:  # every file read once, checked from the same bytes ([Note: one-pass load])
        reads = RangeReads(directory, direct=True)  # read once: around the page cache
        if optimizers and manifest.optimizer is not None and _one_pass(engine, optimizers):
            staged = _stage_optimizers(engine, optimizers, manifest, reads)
        if in_pass:
            backup = MasterBackup(engine.parts) if verify else None
            _plan_masters(engine, manifest, reads)
        read_already = _read_all(reads, manifest, directory, needed, verify, backup)
        check_files(directory, manifest, [n for n in needed if n not in read_already], verify)
    except Exception as e:  # noqa: BLE001 - whatever the type, every rank raises it
        error = e
    try:
        raise_if_any_failed(error, engine.world, "hf_zero.load_checkpoint")
    except Exception:
        for each in optimizers:  # read into in part: no rank keeps a state that is neither the old nor the new
            each.optimizer.state.clear()
        if backup is not None:  # the masters as they were
            backup.restore()
        raise
    finally:
        if backup is not None:
            backup.release()
    with torch.no_grad():
        for part in engine.parts:  # one unit's master at a time ([Note: disk offload])
            master = part.store.read()
            if not in_pass:  # the model files were just checked: from the page cache
                reads = RangeReads(directory)
                _plan_masters(engine, manifest, reads, part, master)
                for file in list(reads.wants):
                    reads.read(file)
            part.store.replace(master)
    engine.loaded_masters({name: entry["dtype"] for name, entry in manifest.params.items()})
    with FileCache(directory) as cache:
        with torch.no_grad():
            _load_buffers(model, manifest, cache)
        for i, (each, saved_part) in enumerate(zip(optimizers, optimizer_parts(manifest))):
            _load_optimizer(engine, each, saved_part, manifest, cache, staged[i] if staged else None)
    if "loss_scale" in manifest.engine:
        engine.set_loss_scale(float(manifest.engine["loss_scale"]))
    if engine.world.rank == 0:
        logger.info(manifest.figure("loaded", directory, time.perf_counter() - started))
    return dict(manifest.user)


def _one_pass(engine: EngineFacade, optimizers: list[ShardedOptimizer]) -> bool:
    """Whether the optimizer state is read ahead in one pass ([Note: one-pass load]): it stays in memory (no
    `offload_dir`, whose state goes to its files piece by piece) and is kept on flat shards."""
    return not engine.masters_on_disk and all(o.whole_step is None for o in optimizers)


def _stage_optimizers(
    engine: EngineFacade, optimizers: list[ShardedOptimizer], manifest: Manifest, reads: RangeReads
) -> list[Staged]:
    """Every optimizer's state, its elementwise entries planned in `reads` (read with the pass). They go into the
    optimizer's own state tensors where it has them all (memory that is in use already: fresh memory's first
    touch cost 1-4 s per GB on the VMs measured), else into fresh tensors, the old state released first."""
    staged: list[Staged] = []
    saved = (manifest.optimizer or {})["state"]
    with FileCache(reads.directory) as cache:
        for optimizer in optimizers:
            inner = optimizer.optimizer
            group_of = {id(t): g for g in inner.param_groups for t in g["params"]}
            pieces = [
                p for p in engine.pieces if saved.get(p.name) and p.optim_params and id(p.optim_params[0]) in group_of
            ]
            in_place = all(
                _live_chunks(p, key, inner.state) is not None for p in pieces for key in _elementwise(saved, p)
            )
            if in_place:  # a tensor without saved state has none after the load, as torch's load_state_dict leaves it
                refilled = {id(t) for p in pieces for t in p.optim_params}
                for t in [t for t in inner.state if id(t) not in refilled]:
                    del inner.state[t]
            else:
                inner.state.clear()  # the state being replaced: released before the new one is allocated
            state: Staged = []
            for piece in pieces:
                group = group_of[id(piece.optim_params[0])]
                live = inner.state if in_place else None
                whole, flat = _piece_state(piece, saved[piece.name], manifest, cache, group, reads, live)
                state.append((piece, whole, flat))
            staged.append(state)
    return staged


def _plan_masters(
    engine: EngineFacade,
    manifest: Manifest,
    reads: RangeReads,
    part: FlatPart | None = None,
    master: torch.Tensor | None = None,
) -> None:
    """Plan the model files' bytes into the master shards (of one `part`, into `master`, or of every part)."""
    for piece in engine.pieces:
        if part is None or piece.part is part:
            shard = piece.part.store.read() if master is None else master
            out = shard[piece.local[0] : piece.local[1]]
            reads.add(piece.name, manifest.slices[piece.name], piece.start, piece.end, out)


def _read_all(
    reads: RangeReads,
    manifest: Manifest,
    directory: Path,
    needed: list[str],
    verify: bool,
    backup: MasterBackup | None,
) -> set[str]:
    """Read every planned file once, the optimizer files first, each checked from its bytes (with `verify`);
    the model files, which write into the live masters, only once `backup` holds them. Returns the files
    checked."""
    checked = set()
    optimizer_files = [n for n in needed if n.startswith("optim-")]
    for file in optimizer_files + sorted(set(reads.wants) - set(optimizer_files)):
        if file not in reads.wants:
            continue
        if backup is not None and not file.startswith("optim-"):
            backup.wait()
        digest = Digest.matching(manifest.files[file].checksum) if verify and file in manifest.files else None
        checksum = reads.read(file, digest)
        if checksum is not None:
            check_checksum(directory, manifest, file, checksum)
            checked.add(file)
    return checked


def _elementwise(saved: dict[str, dict[str, str]], piece: Piece) -> list[str]:
    return [key for key, kind in saved[piece.name].items() if kind == "elementwise"]


def _live_chunks(piece: Piece, key: str, live: dict[Any, Any]) -> list[torch.Tensor] | None:
    """The optimizer's own `key` tensors of the piece's chunks, when every chunk has one of its size (contiguous,
    on the master's device) to read into; else None."""
    out = []
    for t, (a, b) in zip(piece.optim_params, piece.bounds):
        value = live.get(t, {}).get(key)
        if not (
            isinstance(value, torch.Tensor)
            and value.numel() == b - a
            and value.is_contiguous()
            and value.device == piece.master.device
        ):
            return None
        out.append(value.view(-1))
    return out


def _files_needed(manifest: Manifest, engine: EngineFacade, optimizers: list[ShardedOptimizer]) -> list[str]:
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


def _refuse_other_checkpoints(manifest: Manifest, directory: Path, world: CommGroup) -> None:
    """Every rank must load the same checkpoint: each reads only its own shards from the one it was given, so ranks
    given different ones (paths that differ, a "latest" each rank resolved on its own while a save was being
    committed) would resume a model whose shards come from different steps, silently. One all-reduce of the
    manifest's digest; on a difference every rank raises, naming both."""
    if world.size == 1:
        return
    mine = (str(directory), manifest.user)
    differs = first_to_differ(digest_of(manifest.to_json()), mine, world)
    if differs is None:
        return
    other, (theirs, metadata) = differs
    raise ValueError(
        f"[rank {world.global_rank}] hf_zero.load_checkpoint: the ranks load different checkpoints: {mine[0]} "
        f"(metadata {mine[1]}) here, {theirs} (metadata {metadata}) on rank {other}. Pass the same checkpoint on "
        "every rank (resolve 'latest' once, e.g. on rank 0, and broadcast it)."
    )


def _check_model_matches(manifest: Manifest, engine: EngineFacade, directory: Path) -> None:
    ours = engine.slot_shapes()
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
    """The `load_state_dict` the model's own class defines, or `nn.Module`'s: hf_zero's classes are passed over (the
    mixin; the class `attach` in model.py makes from it and the model's own defines none)."""
    for klass in cls.__mro__:
        if klass is nn.Module or klass.__module__.startswith("hf_zero.") or not issubclass(klass, nn.Module):
            continue
        if "load_state_dict" in vars(klass):
            return cast(Callable[..., Any], vars(klass)["load_state_dict"])
    return nn.Module.load_state_dict


def _load_optimizer(
    engine: EngineFacade,
    optimizer: ShardedOptimizer,
    part: dict[str, Any],
    manifest: Manifest,
    cache: FileCache,
    staged: Staged | None,
) -> None:
    saved = manifest.optimizer or {}
    for group, saved_group in zip(optimizer.param_groups, part["param_groups"]):
        for key, value in saved_group.items():
            if key != "params":
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    optimizer.choose_kernel()  # [Note: fused step]
    inner = optimizer.optimizer
    if staged is not None:  # [Note: one-pass load]: read and checked already
        for piece, whole, flat in staged:
            whole = {k: v.value() if isinstance(v, _Unread) else v for k, v in whole.items()}
            hand_over(inner, piece, whole, flat)
        return
    inner.state.clear()
    if optimizer.whole_step is not None:  # [Note: owned optimizer state]
        load_owned(optimizer.whole_step, inner, manifest, cache)
        return
    group_of = {id(t): g for g in inner.param_groups for t in g["params"]}
    for piece in engine.pieces:
        kinds = saved["state"].get(piece.name)
        if kinds and piece.optim_params and id(piece.optim_params[0]) in group_of:  # another optimizer's: skipped
            whole, flat = _piece_state(piece, kinds, manifest, cache, group_of[id(piece.optim_params[0])])
            hand_over(inner, piece, whole, flat)


def _piece_state(
    piece: Piece,
    kinds: dict[str, str],
    manifest: Manifest,
    cache: FileCache,
    group: dict[str, Any],
    reads: RangeReads | None = None,
    live: dict[Any, Any] | None = None,
) -> tuple[dict[str, Any], set[str]]:
    """The state of one piece, and the keys that are elementwise (cut into the piece's chunks); with `reads`, the
    elementwise entries are planned there and filled when it reads their files: into the optimizer's own chunks
    of `live` (the entry is then None: kept where it is), or into a fresh tensor."""
    owner = (manifest.optimizer or {}).get("owners", {}).get(piece.name)
    stored = [[owner, 0, 0]] if owner else [[optim_file_for(f), s, e] for f, s, e in manifest.slices[piece.name]]
    state: dict[str, Any] = {}
    flat: set[str] = set()
    # the elementwise entries first: they decide which files this rank reads (`add_whole` reads from those)
    for key, kind in sorted(kinds.items(), key=lambda item: item[1] != "elementwise"):
        tkey = f"{piece.name}{STATE_SEP}{key}"
        chunks = _live_chunks(piece, key, live) if kind == "elementwise" and live is not None else None
        if chunks is not None and reads is not None:
            for chunk, (a, b) in zip(chunks, piece.bounds):
                reads.add(tkey, stored, piece.start + a, piece.start + b, chunk)
            state[key] = None
            flat.add(key)
        elif kind == "elementwise":
            out = torch.empty(piece.end - piece.start, dtype=piece.master.dtype, device=piece.master.device)
            if reads is not None:
                reads.add(tkey, stored, piece.start, piece.end, out)
            else:
                read_pieces(cache, tkey, stored, piece.start, piece.end, out)
            state[key] = out
            flat.add(key)
        elif kind == PARAM and owner and len(cache.get(owner).get_slice(tkey).get_shape()) > 0:
            value = piece_param_state(piece, key, manifest, cache)  # [Note: owned optimizer state]
            state[key] = value.to(piece.master.device, piece.master.dtype if value.is_floating_point() else value.dtype)
            flat.add(key)
        elif reads is not None:  # the file's bytes come with the pass: the value once they are read
            read = reads.add_whole(tkey, [f for f, _, _ in stored])
            state[key] = _Unread(key, kind, read, group, piece.master)
        else:
            state[key] = restore_value(key, kind, read_whole(cache, tkey, stored), group, piece.master)
    return {key: state[key] for key in kinds}, flat  # in the saved order


@dataclass(frozen=True)
class _Unread:
    """A non-elementwise state entry planned in the one pass, made the optimizer's value once read."""

    key: str
    kind: str
    read: torch.Tensor
    group: dict[str, Any]
    like: torch.Tensor  # the tensor the state belongs to: its device and dtype

    def value(self) -> Any:
        return restore_value(self.key, self.kind, self.read, self.group, self.like)
