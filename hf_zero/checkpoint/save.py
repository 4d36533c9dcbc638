"""`save_checkpoint`: every rank writes its own shards in parallel, with no gather.

[Note: atomic save]
1. Every rank writes its files into `.NAME.incomplete-TOKEN/` beside the target (each file under
   a `.partial` name, flushed to disk, then renamed).
2. The ranks agree on success (one small all-reduce); on any failure every rank raises, and the
   temporary directory is removed; nothing that existed before is touched.
3. Rank 0 writes the manifest (checksums of every file) into the temporary directory, last.
4. Rank 0 moves any previous checkpoint at the target aside, renames the temporary directory to
   the target, then deletes the previous one. A process killed at any point leaves either the
   previous checkpoint or the new one complete at the target, plus a directory whose name says
   `incomplete` (or `previous`, which holds the last good checkpoint) and which has no manifest.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..dtypes import dtype_name
from ..engine.checks.call_order import Call
from ..engine.collectives import (
    CommGroup,
    agreement,
    broadcast_object,
    failed_ranks,
    gather_objects,
    raise_if_any_failed,
)
from ..engine.facade import EngineFacade, facade_of
from ..engine.step.optim import ShardedOptimizer, sharded_list
from ..engine.step.pieces import Piece
from .background import AsyncSave, FileJob, Snapshot, chain, checkpoint_group, finish_previous, snapshot
from .conversions import model_layout
from .format import (
    BUFFERS_FILE,
    FORMAT_VERSION,
    MANIFEST,
    SHARD_FILE,
    STATE_SEP,
    FileEntry,
    Manifest,
    model_file,
    optim_file,
    save_hf_files,
    write_bytes_atomically,
    write_file_atomically,
)
from .leftovers import beside
from .leftovers import remove as remove_leftovers
from .owned_state import owned_entries
from .peft_export import peft_configs
from .shared import require_shared
from .stream import Entry, host_pieces, layout_to_json, write_streamed

logger = logging.getLogger(__name__)


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: ShardedOptimizer | Sequence[ShardedOptimizer] | None = None,
    *,
    tokenizer: Any = None,
    metadata: dict[str, Any] | None = None,
    async_save: bool = False,
    snapshot_budget_bytes: int | None = None,
) -> Path | AsyncSave:
    """Save a sharded training checkpoint: each rank writes its own shards, nothing is gathered.

    A collective: every rank must call it. The checkpoint resumes on any number of ranks and any
    stage (`load_checkpoint`), and `consolidate` turns it into a `from_pretrained` directory.
    See [Note: checkpoint layout] in `hf_zero/checkpoint/format.py` and [Note: atomic save].

    Args:
        path (`str` or `os.PathLike`): the checkpoint directory to create; an hf_zero checkpoint already there
            is replaced, anything else at the path is refused (the directory is swapped in as a whole, so what it
            held would be deleted). Every rank must see the same filesystem at this path.
        model (`nn.Module`): a model returned by `hf_zero.initialize`. Its `config` and
            `generation_config`, when it has them, are saved beside the shards.
        optimizer (`ShardedOptimizer` or a list or tuple of them, *optional*): its state and param groups are
            saved too (for several optimizers, each one's groups; the state keyed by parameter name).
        tokenizer (*optional*): saved with its `save_pretrained`, for consolidation.
        metadata (`dict`, *optional*): JSON-serializable values stored in the manifest
            (e.g. `{"step": 1000}`) and returned by `load_checkpoint`.
        async_save (`bool`, *optional*, defaults to `False`): return as soon as the state is snapshotted to host
            memory and write in the background ([Note: asynchronous save] in `background.py`); the next save
            waits for this one.
        snapshot_budget_bytes (`int`, *optional*): with `async_save`, the most host memory the snapshot takes;
            the rest is written from the training tensors before the call returns. `None`: no bound.

    Returns:
        `Path`: the checkpoint directory; with `async_save`, an `AsyncSave` whose `wait()` returns it.

    Raises:
        ValueError: on every rank, before anything is written, where `path` holds something other than an hf_zero
            checkpoint (a file, a run folder, a model directory).
        OSError: a rank could not write (disk full, read-only folder), on that rank;
            `RuntimeError` naming it on the others. Nothing existing is deleted.

    Example:

    ```python
    >>> hf_zero.save_checkpoint("ckpt/step-1000", model, optimizer, tokenizer=tokenizer, metadata={"step": 1000})
    ```
    """
    engine = facade_of(model)
    engine.begin_call(Call.SAVE_CHECKPOINT)  # [Note: call order]
    world = engine.world
    started = time.perf_counter()
    target = Path(path)
    with agreement(world, "hf_zero.save_checkpoint"):  # arguments may differ between ranks: agree first
        optimizers = sharded_list(optimizer, "save_checkpoint")
        _check_json(metadata)
        _check_async(async_save, snapshot_budget_bytes)
        if world.rank == 0:  # the rank that swaps the new checkpoint in ([Note: atomic save])
            _refuse_other_contents(target)
    finish_previous(engine)  # [Note: asynchronous save] the next save starts after the previous one
    engine.refresh_masters()  # [Note: edits between steps]
    with agreement(world, f"hf_zero.save_checkpoint (removing what killed saves left beside {target})"):
        remove_leftovers(beside(target))  # [Note: leftovers]; every rank (node-local folders too)
    token = broadcast_object(uuid.uuid4().hex[:12], world)
    staging = target.parent / f".{target.name}.incomplete-{token}"

    record: dict[str, Any] = {"files": {}}
    jobs: list[FileJob] = []
    taken: Snapshot | None = None
    error: BaseException | None = None
    try:
        require_shared(staging, world, "hf_zero.save_checkpoint")  # [Note: shared directory]; every rank, at once
        staging.mkdir(parents=True, exist_ok=True)
        jobs, record = _rank_jobs(model, engine, optimizers)
        if async_save:
            taken = snapshot(jobs, snapshot_budget_bytes, pin=engine.host_pinned)
            jobs = taken.jobs
        else:
            _write_jobs(staging, jobs, record)
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        error = e
    _raise_if_failed(error, world, staging, "snapshot its shards for" if async_save else "write its shards to", target)
    records = gather_objects(record, world)
    manifest = None
    with agreement(world, f"hf_zero.save_checkpoint (of {target}; nothing was replaced)"):
        if world.rank == 0:
            try:
                manifest = _manifest(model, engine, optimizers, records, metadata)
                save_hf_files(model, tokenizer, staging)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
    if not async_save:
        _commit(world, staging, target, token, manifest, started)
        return target
    group = checkpoint_group(engine)

    def write_and_commit() -> None:
        files: dict[str, Any] = {"files": {}}
        failure: BaseException | None = None
        try:
            _write_jobs(staging, jobs, files)
        except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
            failure = e
        _raise_if_failed(failure, group, staging, "write its shards to", target)
        merged = {k: v for rec in gather_objects(files, group) for k, v in rec["files"].items()}
        done = None if manifest is None else replace(manifest, files={k: FileEntry(**v) for k, v in merged.items()})
        _commit(group, staging, target, token, done, started)

    handle = chain(engine, target, write_and_commit)  # the previous one is finished: it starts at once
    if taken is not None:
        taken.consumed.wait()  # the entries beyond the snapshot budget are read from the training tensors: wait
        logger.debug(
            "hf_zero: asynchronous save of %s: %.1f MB snapshotted to host memory, %.1f MB written at the call "
            "(rank %d)",
            target,
            taken.host_bytes / 1e6,
            taken.live_bytes / 1e6,
            world.global_rank,
        )
    return handle


def _commit(
    world: CommGroup, staging: Path, target: Path, token: str, manifest: Manifest | None, started: float
) -> None:
    """Rank 0 writes the manifest (last) and swaps the staging folder into place; every rank agrees on it. Rank 0
    logs the checkpoint's size and the time since the call (`started`, a `time.perf_counter()`)."""
    with agreement(world, f"hf_zero.save_checkpoint (commit of {target}; nothing was replaced)"):
        if world.rank == 0:
            try:
                if manifest is None:
                    raise RuntimeError(f"[rank {world.global_rank}] hf_zero: no manifest to commit {target} with")
                write_bytes_atomically(staging / MANIFEST, manifest.to_json().encode())
                _swap_into_place(staging, target, token)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
    if world.rank == 0 and manifest is not None:
        logger.info(manifest.figure("saved", target, time.perf_counter() - started))


def _check_async(async_save: object, budget: object) -> None:
    if not isinstance(async_save, bool):
        raise TypeError(f"save_checkpoint's async_save must be a bool; got {async_save!r}.")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise ValueError(f"save_checkpoint's snapshot_budget_bytes must be None or an int >= 0; got {budget!r}.")


def _raise_if_failed(error: BaseException | None, world: CommGroup, staging: Path, what: str, target: Path) -> None:
    if not failed_ranks(error is not None, world):
        return
    if world.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    if isinstance(error, OSError):
        error = OSError(
            f"[rank {world.global_rank}] hf_zero.save_checkpoint could not {what} {staging.parent}: {error}. "
            f"Check free space and permissions; {target} was left as it was."
        )
    raise_if_any_failed(error, world, "hf_zero.save_checkpoint")


def _rank_jobs(
    model: nn.Module, engine: EngineFacade, optimizers: list[ShardedOptimizer]
) -> tuple[list[FileJob], dict[str, Any]]:
    """The files this rank writes (their entries reading the state where it lives: [Note: streamed save]) and
    its record for the manifest (slices, state kinds, owners; `files` is filled as they are written)."""
    record: dict[str, Any] = {"files": {}, "slices": {}, "state": {}}
    jobs: list[FileJob] = []
    if engine.world.rank == 0:
        buffers = {
            k: v.detach().to("cpu", copy=True).contiguous() for k, v in engine.module_state(with_params=False).items()
        }
        if buffers:
            entries = [Entry(k, v.dtype, tuple(v.shape), host_pieces(v)) for k, v in buffers.items()]
            jobs.append(FileJob(BUFFERS_FILE, entries, {}))
    if not engine.writes_shards:
        return jobs, record  # a replica (stage 0 or hybrid): the shard-group rank 0 replica writes
    rank, size = engine.shard_rank, engine.shard_size
    mfile = model_file(rank, size)
    slices = {p.name: [p.start, p.end] for p in engine.pieces}
    masters = [Entry(p.name, p.part.master_dtype, (p.end - p.start,), _master_pieces(p)) for p in engine.pieces]
    header = {"kind": "model", "format_version": FORMAT_VERSION, "world_size": size, "rank": rank, "slices": slices}
    jobs.append(FileJob(mfile, masters, header))
    record["slices"] = {name: [mfile, s, e] for name, (s, e) in slices.items()}
    if optimizers:
        state_entries: list[Entry] = []
        kinds: dict[str, dict[str, str]] = {}
        record["owners"] = {}
        for optimizer in optimizers:  # over disjoint parameters: one file, keyed by parameter name
            if optimizer.whole_step is not None:  # [Note: owned optimizer state]
                entries, more, owners = owned_entries(optimizer.whole_step, optimizer.optimizer, optim_file(rank, size))
                record["owners"].update(owners)
            else:
                entries, more = _optimizer_pieces(engine, optimizer)
            state_entries += entries
            kinds.update(more)
        header = {
            "kind": "optimizer",
            "format_version": FORMAT_VERSION,
            "world_size": size,
            "rank": rank,
            "slices": slices,
            "state": kinds,
        }
        jobs.append(FileJob(optim_file(rank, size), state_entries, header))
        record["state"] = kinds
    return jobs, record


def _write_jobs(staging: Path, jobs: list[FileJob], record: dict[str, Any]) -> None:
    """Write each file (atomically, checksummed) into `staging`; `record["files"]` gets its size and digest."""
    for job in jobs:
        _write_streamed(staging, job.name, job.entries, job.header, record)


def _master_pieces(piece: Piece) -> Callable[[], Iterable[torch.Tensor]]:
    """The piece's master values where its store keeps them ([Note: streamed save], [Note: master stores]), as
    host tensors."""
    store, start, numel = piece.part.store, piece.local[0], piece.end - piece.start
    return lambda: (host for t in store.read_range(start, numel) for host in host_pieces(t)())


def _optimizer_pieces(
    engine: EngineFacade, optimizer: ShardedOptimizer
) -> tuple[list[Entry], dict[str, dict[str, str]]]:
    """This rank's optimizer state: elementwise tensors as pieces (the piece's chunks joined, [Note:
    optimizer chunks]; streamed from the offload files for disk units), scalars whole (the first chunk's:
    every chunk steps together), numbers as 0-d tensors."""
    entries: list[Entry] = []
    kinds: dict[str, dict[str, str]] = {}
    for piece in engine.pieces:
        found = [optimizer.optimizer.state.get(t) for t in piece.optim_params]
        states: list[dict[str, Any]] = [s for s in found if s]
        if not states or len(states) != len(found):
            continue
        kinds[piece.name] = {}
        for key, value in states[0].items():
            tkey = f"{piece.name}{STATE_SEP}{key}"
            if isinstance(value, torch.Tensor):
                parts = [state[key] for state in states]
                n = piece.end - piece.start
                stored = piece.part.store.state_reader(key, piece.local[0], n)  # [Note: master stores]
                if stored is not None:
                    kinds[piece.name][key] = "elementwise"
                    entries.append(Entry(tkey, value.dtype, (n,), stored))
                    continue
                elementwise = all(v.ndim == 1 and v.numel() == b - a for v, (a, b) in zip(parts, piece.bounds))
                kinds[piece.name][key] = "elementwise" if elementwise else "whole"
                whole = parts if elementwise else [value]
                entries.append(
                    Entry(
                        tkey,
                        value.dtype,
                        (piece.end - piece.start,) if elementwise else tuple(value.shape),
                        host_pieces(*whole),
                    )
                )
            elif isinstance(value, (bool, int, float)):
                kinds[piece.name][key] = "int" if isinstance(value, int) and not isinstance(value, bool) else "float"
                number = torch.tensor(float(value), dtype=torch.float64)
                entries.append(Entry(tkey, torch.float64, (), host_pieces(number)))
            else:
                raise TypeError(
                    f"Optimizer state {key!r} of {piece.name} is a {type(value).__name__}; hf_zero checkpoints "
                    "hold tensors and numbers only."
                )
    return entries, kinds


def _write_streamed(
    staging: Path, name: str, entries: list[Entry], header: dict[str, Any], record: dict[str, Any]
) -> None:
    final = staging / name
    digest: list[str] = []
    metadata = {"hf_zero": json.dumps(header)} if header else None
    write_file_atomically(final, lambda tmp: digest.append(write_streamed(tmp, entries, metadata)))
    record["files"][name] = {"bytes": final.stat().st_size, "checksum": digest[0]}


def _manifest(
    model: nn.Module,
    engine: EngineFacade,
    optimizers: list[ShardedOptimizer],
    records: list[dict[str, Any]],
    metadata: dict[str, Any] | None,
) -> Manifest:
    params: dict[str, dict[str, Any]] = {}
    for part in engine.parts:
        for slot in part.layout.slots:
            params[slot.name] = {"shape": list(slot.shape), "dtype": dtype_name(part.master_dtype)}
            if part.spec.dtype is not None:  # [Note: parameters kept in their own dtype] in engine/unit.py
                params[slot.name]["keeps"] = dtype_name(part.spec.dtype)
    aliases = {
        name: engine.name_of(p)
        for name, p in model.named_parameters(remove_duplicate=False)
        if name != engine.name_of(p)
    }
    buffers: dict[str, dict[str, Any]] = {}
    for k, v in engine.module_state(with_params=False).items():
        buffers[k] = {"shape": list(v.shape), "dtype": dtype_name(v.dtype)}
        if engine.keeps_dtype(v):  # [Note: parameters kept in their own dtype] in engine/unit.py
            buffers[k]["keeps"] = dtype_name(v.dtype)
    files: dict[str, FileEntry] = {}
    slices: dict[str, list[list[Any]]] = {name: [] for name in params}
    state: dict[str, dict[str, str]] = {}
    owners: dict[str, str] = {}
    for rec in records:
        owners.update(rec.get("owners", {}))
        files.update({k: FileEntry(**v) for k, v in rec["files"].items()})
        for name, entry in rec["slices"].items():
            slices[name].append(entry)
        for name, kinds in rec["state"].items():
            state.setdefault(name, {}).update(kinds)
    for entries in slices.values():
        entries.sort(key=lambda e: e[1])
    optim = None
    if optimizers:
        parts = []
        for optimizer in optimizers:
            groups = []
            for group, names in zip(optimizer.param_groups, optimizer.group_param_names):
                hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
                groups.append({**_jsonable(hyper), "params": names})
            parts.append({"class": type(optimizer.optimizer).__name__, "param_groups": groups})
        optim = {**parts[0], "state": state} if len(parts) == 1 else {"parts": parts, "state": state}
        if any(o.steps_whole_parameters for o in optimizers):
            optim["owners"] = owners
    engine_state = {"loss_scale": engine.loss_scale} if engine.loss_scale is not None else {}
    return Manifest(
        stage=engine.stage,
        world_size=engine.world.size,
        params=params,
        slices=slices,
        aliases=aliases,
        buffers=buffers,
        files=files,
        optimizer=optim,
        engine=engine_state,
        user=dict(metadata or {}),
        layout=layout_to_json(model_layout(model)),
        peft=peft_configs(model),
    )


def _refuse_other_contents(target: Path) -> None:
    """`ValueError` where `target` holds something other than an hf_zero checkpoint: the commit moves what is at
    the target aside and deletes it ([Note: atomic save]), so a run folder, a model directory or a file given as
    the path would be lost. An empty directory and a checkpoint (its manifest, or at least its shard files, there)
    are fine."""
    if not target.exists():  # nothing there, or a link to nothing (replaced by the checkpoint)
        return
    if not target.is_dir():
        raise ValueError(
            f"save_checkpoint: {target} is a file, not a checkpoint directory. Pass a directory path of its own."
        )
    if (target / MANIFEST).is_file():
        return
    held = sorted(child.name for child in target.iterdir())
    if any(SHARD_FILE.fullmatch(name) for name in held):  # a checkpoint of ours whose manifest is gone: replaced
        return
    if held:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise ValueError(
            f"save_checkpoint: {target} exists and is not an hf_zero checkpoint (no {MANIFEST}; it holds {shown}). "
            "A checkpoint replaces the directory at its path as a whole (written beside it, then swapped in), so "
            f"what is there would be deleted. Pass a path of its own, e.g. {target / 'checkpoint-1'}, or remove "
            "the directory first."
        )


def _swap_into_place(staging: Path, target: Path, token: str) -> None:
    previous = target.parent / f".{target.name}.previous-{token}"
    if target.exists() or target.is_symlink():
        os.rename(target, previous)
    os.rename(staging, target)
    _fsync_dir(target.parent)
    if previous.is_symlink():  # the path was a link (`latest` -> a checkpoint): the link goes, what it named stays
        previous.unlink()
    elif previous.exists():
        shutil.rmtree(previous)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            v = v.item()
        try:
            json.dumps(v)
        except TypeError:
            continue  # not a hyperparameter we can restore (e.g. a callable); the optimizer keeps its own
        out[k] = v
    return out


def _check_json(metadata: dict[str, Any] | None) -> None:
    if metadata is None:
        return
    try:
        json.dumps(metadata)
    except TypeError as e:
        raise TypeError(f"save_checkpoint metadata must be JSON-serializable: {e}") from e
