"""Turning shards into a `from_pretrained` directory: offline from a checkpoint, or live at the end of training.

Both stream. Offline, every model file of the checkpoint is read once, front to back, its bytes cast on the way
into the output file's write buffer ([Note: streamed consolidation] in streams.py): memory is the streams' spans
and the writer's buffers, whatever the model size. Live, a unit is gathered by one all-gather, cast, handed to
`HFShardWriter`, and dropped when its output shard is written: about one output shard plus one unit.
Tied weights are written once, under the name `save_pretrained` keeps; `from_pretrained` ties them.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ..dtypes import dtype_from_name, parse_dtype
from ..engine.collectives import agreement, broadcast_object
from ..engine.facade import facade_of
from .background import AsyncSave, chain, checkpoint_group
from .conversions import model_layout
from .format import (
    BUFFERS_FILE,
    Digest,
    Manifest,
    check_checksum,
    check_files,
    check_sizes,
    save_hf_files,
    set_config_dtype,
    sharded_state_dir,
    side_files,
    write_file_atomically,
)
from .owned import snapshot_owned, write_owned
from .pretrained import PEFT_ROOT, Staging
from .reader import FileCache, read_pieces
from .sequential import Stored, stored_tensors
from .stream import Entry, FileLayout, host_pieces, layout_from_json, write_streamed
from .streams import MAX_STREAMS, FileStream, read_bytes_for, stream_order
from .target import check_target, record_output
from .writer import INDEX_FILE, HFShardWriter, make_directory, parse_size, shard_groups

logger = logging.getLogger(__name__)


def consolidate(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    *,
    verify: bool = True,
    progress: bool = True,
    overwrite: bool = False,
) -> list[str]:
    """Write a sharded checkpoint as a Hugging Face model directory, offline and in bounded memory.

    Needs no process group and no GPU. Writes `model.safetensors` (or numbered shards and
    `model.safetensors.index.json`, as `save_pretrained` does), copies `config.json` (with its
    `dtype` set to the written one), `generation_config.json` and the tokenizer files the
    checkpoint holds. A PEFT model's checkpoint is written as its adapter instead (`adapter_model.safetensors`,
    `adapter_config.json`: what `PeftModel.save_pretrained` writes, [Note: adapter export]). Also available as
    `hf-zero consolidate CKPT OUT [--dtype bf16] [--max-shard-size 5GB]`.

    Args:
        checkpoint_dir (`str` or `os.PathLike`): a directory written by `save_checkpoint`, or a Trainer's
            `checkpoint-N` (an Accelerate `save_state` folder) whose `hf_zero/` holds one.
        output_dir (`str` or `os.PathLike`): where to write: a new or empty directory, or one an earlier
            consolidation wrote (its files are replaced). A directory holding anything else is refused
            before anything is written ([Note: output record] in target.py).
        dtype (`str` or `torch.dtype`, *optional*): `"bf16"`, `"fp16"` or `"fp32"`; defaults to the
            saved master dtype (fp32 in mixed precision).
        max_shard_size (`int` or `str`, *optional*, defaults to `"5GB"`): the largest output file.
        verify (`bool`, *optional*, defaults to `True`): check the files' checksums first.
        progress (`bool`, *optional*, defaults to `True`): show a progress bar of tensors written.
        overwrite (`bool`, *optional*, defaults to `False`): write into `output_dir` even where it holds files
            hf_zero did not write there (same-named files are replaced, the others left).

    Returns:
        `list[str]`: the weight files written.

    Example:

    ```python
    >>> hf_zero.consolidate("ckpt/step-1000", "llama-domain", dtype="bf16")
    ['model.safetensors']
    >>> model = AutoModelForCausalLM.from_pretrained("llama-domain")
    ```
    """
    ckpt, out = sharded_state_dir(checkpoint_dir), Path(output_dir)  # a Trainer's checkpoint-N: its hf_zero/
    out_dtype = parse_dtype(dtype)
    parse_size(max_shard_size)
    manifest = Manifest.read(ckpt)
    if out.exists() and out.resolve() == ckpt.resolve():
        raise ValueError("consolidate needs an output_dir other than the checkpoint directory.")
    check_target(out, overwrite=overwrite)
    if manifest.params and all(name.startswith(PEFT_ROOT) for name in manifest.params):
        return _write_adapter(ckpt, manifest, out, out_dtype, verify)  # [Note: adapter export]
    model_files = sorted({f for entries in manifest.slices.values() for f, _, _ in entries})
    check_sizes(ckpt, manifest, model_files)
    check_files(ckpt, manifest, [BUFFERS_FILE] if manifest.buffers else [], verify)
    if manifest.layout is not None:  # version 3 records it; before, it is learned from config.json beside the reads
        layout: FileLayout | Callable[[], FileLayout] = layout_from_json(manifest.layout)
    else:
        learning = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zero-layout")
        layout = learning.submit(_checkpoint_layout, ckpt).result
        learning.shutdown(wait=False)
    writer = HFShardWriter(out, max_shard_size, out_dtype, layout)
    bar = _progress(len(manifest.params) + len(manifest.buffers), "consolidating", progress, "tensor")
    try:
        held = _pieces_held(ckpt, manifest, model_files)
        order = stream_order({name: [(f, where) for f, where, _ in pieces] for name, pieces in held.items()})
        if order is not None and len(model_files) <= MAX_STREAMS:
            _write_streamed(ckpt, manifest, held, order, writer, verify, bar)
        else:  # files that disagree on the order, or too many to read side by side: through the page cache
            _write_cached(ckpt, manifest, model_files, writer, verify, bar)
        files = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    copied = side_files(ckpt)
    for name in copied:  # config, tokenizer, a remote-code model's code
        shutil.copyfile(ckpt / name, out / name)
    main = [info["dtype"] for info in manifest.params.values() if "keeps" not in info]  # the model's own dtype
    saved_dtype = dtype_from_name(main[0]) if main else torch.float32
    set_config_dtype(out / "config.json", out_dtype or saved_dtype)
    record_output(out, [*files, *([INDEX_FILE] if len(files) > 1 else []), *copied])
    return files


def save_pretrained(
    model: nn.Module,
    output_dir: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    progress: bool = True,
    parallel: bool = False,
) -> list[str]:
    """Write a sharded model as a `from_pretrained` directory: from rank 0, gathering one unit at a time, or
    (`parallel=True`) from every rank at once, each writing the tensors it owns.

    A collective: every rank must call it. Writes the weights (fp32 masters, or `dtype`), `config.json`,
    `generation_config.json` and the tokenizer. Rank 0 alone needs to see `output_dir`, unless `parallel`:
    then every rank writes its own `model-0000k-of-0000N.safetensors` there (a filesystem all ranks share),
    no rank gathers the model, and each holds at most one window of `PIECE_NUMEL` elements beyond its
    model states ([Note: owned tensors] in `hf_zero/checkpoint/owned.py`).

    Args:
        model (`nn.Module`): a model returned by `hf_zero.initialize`.
        output_dir (`str` or `os.PathLike`): where rank 0 writes.
        tokenizer (*optional*): saved beside the weights.
        dtype (`str` or `torch.dtype`, *optional*): `"bf16"`, `"fp16"` or `"fp32"`; defaults to the master dtype.
        max_shard_size (`int` or `str`, *optional*, defaults to `"5GB"`): the largest output file.
        progress (`bool`, *optional*, defaults to `True`): a progress bar on rank 0.
        parallel (`bool`, *optional*, defaults to `False`): every rank writes its share of the tensors.

    Returns:
        `list[str]`: the weight files written (on every rank).

    Example:

    ```python
    >>> save_pretrained(model, "llama-domain", tokenizer=tokenizer, dtype="bf16")
    >>> save_pretrained(model, "/shared/llama-domain", dtype="bf16", parallel=True)  # every rank writes

    Users call `model.save_pretrained` (hf_zero/model.py), which calls this.
    ```
    """
    engine = facade_of(model)
    with agreement(engine.world, "model.save_pretrained"):
        out_dtype = parse_dtype(dtype)
        max_bytes = parse_size(max_shard_size)
    if parallel:
        bar = _progress(1, "writing owned tensors", progress and engine.world.rank == 0, "round")
        written = write_owned(
            engine,
            Path(output_dir),
            out_dtype or engine.master_dtype,
            max_bytes,
            on_round=bar.update_to,
            layout=model_layout(model),
        )
        bar.close()
        with agreement(engine.world, f"model.save_pretrained ({output_dir})"):
            if engine.world.rank == 0:
                save_hf_files(model, tokenizer, Path(output_dir), out_dtype or engine.master_dtype)
        return written
    writer: HFShardWriter | None = None
    error: Exception | None = None  # rank 0's first failure; the ranks still finish every gather
    if engine.world.rank == 0:
        try:
            writer = HFShardWriter(Path(output_dir), max_shard_size, out_dtype, model_layout(model))
        except Exception as e:  # noqa: BLE001 - agreed on below
            error = e
    files: list[str] = []
    kept = {slot.name: part.spec.dtype for part in engine.parts if part.spec.dtype for slot in part.layout.slots}
    bar = _progress(len(engine.parts), "gathering", progress and engine.world.rank == 0, "unit")
    for gathered in engine.gather_units(rank0_only=True):  # every rank joins every gather
        bar.update(1)
        if writer is None or error is not None:
            continue
        try:
            for name, _, value in gathered:
                own = kept.get(name)  # [Note: parameters kept in their own dtype] in engine/unit.py
                writer.add(name, value if own is None else value.to(own), keep=own is not None)
        except Exception as e:  # noqa: BLE001 - agreed on below
            error = e
    bar.close()
    with agreement(engine.world, f"model.save_pretrained ({output_dir})"):
        if error is not None:
            raise error
        if writer is not None:
            try:
                for name, buf in engine.module_state(with_params=False).items():
                    writer.add(name, buf, is_parameter=False, keep=engine.keeps_dtype(buf))
                files = writer.close()
                save_hf_files(model, tokenizer, Path(output_dir), out_dtype or engine.master_dtype)
            except BaseException:
                writer.abort()
                raise
    return broadcast_object(files, engine.world)


def save_pretrained_async(
    model: nn.Module,
    output_dir: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> AsyncSave:
    """`save_pretrained(..., parallel=True)` written in the background ([Note: asynchronous save]).

    A collective. At the call the tensors each rank owns are exchanged ([Note: owned tensors]) and copied to host
    memory (its share of the model in `dtype`: 2 bytes per parameter / N in bf16), and rank 0 writes the side
    files; the weight files are written, renamed and indexed by the save thread once the engine's previous
    asynchronous save is committed. The next save (and `hf_zero.wait_for_saves`) waits for it.

    Returns:
        `AsyncSave`: `wait()` returns `output_dir` once every weight file is in place.

    Example:

    ```python
    >>> handle = hf_zero.checkpoint.consolidate.save_pretrained_async(model, "out/checkpoint-500", dtype="bf16")
    >>> handle.wait()
    ```
    """
    engine = facade_of(model)
    with agreement(engine.world, "model.save_pretrained"):
        out_dtype = parse_dtype(dtype) or engine.master_dtype
        max_bytes = parse_size(max_shard_size)
    target = Path(output_dir)
    work = snapshot_owned(engine, target, out_dtype, max_bytes, pin=engine.host_pinned, layout=model_layout(model))
    with agreement(engine.world, f"model.save_pretrained ({output_dir})"):
        if engine.world.rank == 0:
            make_directory(target)
            save_hf_files(model, tokenizer, target, out_dtype)
    group = checkpoint_group(engine)
    return chain(engine, target, lambda: work(group))


Held = list[tuple[str, Stored, int]]  # (file, where its bytes lie, first element) of each piece of a parameter


def _pieces_held(ckpt: Path, manifest: Manifest, model_files: list[str]) -> dict[str, Held]:
    """Where each parameter's pieces lie in the model files (from their headers), in element order."""
    headers = {f: stored_tensors(ckpt / f) for f in model_files}
    held: dict[str, Held] = {}
    for name, info in manifest.params.items():
        pieces = held[name] = []
        covered = 0
        for file, start, end in sorted(manifest.slices[name], key=lambda e: e[1]):
            where = headers[file].get(name)
            if where is None or where.numel != end - start or where.dtype != dtype_from_name(info["dtype"]):
                raise ValueError(
                    f"{ckpt / file} does not hold elements [{start}, {end}) of {name} as its manifest "
                    "says; the checkpoint is damaged."
                )
            if start != covered:
                break
            pieces.append((file, where, start))
            covered = end
        if covered != math.prod(info["shape"]):
            raise ValueError(f"The checkpoint covers only {covered} elements of {name}; its files are incomplete.")
    return held


def _write_streamed(
    ckpt: Path,
    manifest: Manifest,
    held: dict[str, Held],
    order: list[str],
    writer: HFShardWriter,
    verify: bool,
    bar: Any,
) -> None:
    """[Note: streamed consolidation] in streams.py: each model file read once, front to back, beside the casts
    and the writes; its checksum checked once it is read (the output still under temporary names)."""
    files = sorted({f for pieces in held.values() for f, _, _ in pieces})
    listed = {f for entries in manifest.slices.values() for f, _, _ in entries}
    check_files(ckpt, manifest, sorted(listed - set(files)), verify)  # a model file no piece is read from
    span = read_bytes_for(len(files))
    streams: dict[str, FileStream] = {}
    try:
        for f in files:
            streams[f] = FileStream(ckpt / f, Digest.matching(manifest.files[f].checksum) if verify else None, span)
        casting = Staging()  # host memory reused for every cast (fresh pages cost as much as the cast)
        entries = []
        for name in order:
            info = manifest.params[name]
            source = dtype_from_name(info["dtype"])
            kept = _kept(info)
            dtype = kept or (writer.dtype if writer.dtype is not None and source.is_floating_point else source)
            pieces = _cast_pieces(held[name], streams, dtype, casting, bar)
            entries.append((Entry(name, dtype, tuple(info["shape"]), pieces), math.prod(info["shape"])))
        entries += [(_buffer_entry(ckpt, name, writer.dtype, info), 0) for name, info in manifest.buffers.items()]
        for group in shard_groups([e.nbytes for e, _ in entries], writer.max_bytes):
            writer.write_file([entries[i][0] for i in group], sum(entries[i][1] for i in group))
        for f, stream in streams.items():
            digest = stream.finish()
            if digest is not None:
                check_checksum(ckpt, manifest, f, digest)
    finally:
        for stream in streams.values():
            stream.close()


def _cast_pieces(
    pieces: Held, streams: dict[str, FileStream], dtype: torch.dtype, casting: Staging, bar: Any
) -> Callable[[], Iterator[torch.Tensor]]:
    """A parameter's bytes in `dtype`, streamed from its pieces' files: views of the spans read, or those cast into
    reused memory (each piece is written out before the next is made)."""

    def each() -> Iterator[torch.Tensor]:
        for file, where, _ in pieces:
            size = where.dtype.itemsize
            carry = torch.empty(0, dtype=torch.uint8)  # an element split between two spans (unaligned files only)
            for view in streams[file].views(where.begin, where.numel * size):
                if where.begin % size or carry.numel():
                    view = torch.cat([carry, view])
                    whole = view.numel() // size * size
                    view, carry = view[:whole], view[whole:].clone()
                values = view.view(where.dtype)
                if where.dtype == dtype:
                    yield values
                    continue
                casting.reset()  # the piece before was written out: the same memory again
                cast = casting.take(values.numel(), dtype)
                cast.copy_(values)
                yield cast
        bar.update(1)

    return each


def _kept(info: dict[str, Any]) -> torch.dtype | None:
    """The dtype a saved tensor keeps whatever the folder's ([Note: parameters kept in their own dtype] in
    engine/unit.py), or `None`."""
    return dtype_from_name(info["keeps"]) if "keeps" in info else None


def _buffer_entry(ckpt: Path, name: str, dtype: torch.dtype | None, info: dict[str, Any]) -> Entry:
    with safe_open(str(ckpt / BUFFERS_FILE), framework="pt", device="cpu") as f:
        value = f.get_tensor(name)
    if dtype is not None and value.is_floating_point() and _kept(info) is None:
        value = value.to(dtype)
    return Entry(name, value.dtype, tuple(value.shape), host_pieces(value.contiguous()))


def _write_cached(
    ckpt: Path, manifest: Manifest, model_files: list[str], writer: HFShardWriter, verify: bool, bar: Any
) -> None:
    """The files checked first (which leaves them in the page cache), then each parameter assembled and queued."""
    check_files(ckpt, manifest, model_files, verify)
    with FileCache(ckpt) as cache:
        for name, info in manifest.params.items():
            full = torch.empty(math.prod(info["shape"]), dtype=dtype_from_name(info["dtype"]))
            read_pieces(cache, name, manifest.slices[name], 0, full.numel(), full)
            kept = _kept(info)
            if writer.add(name, full.view(info["shape"]).to(kept or full.dtype), keep=kept is not None):
                cache.close()  # unmap what the flushed shard was read from: keeps the resident set bounded
            bar.update(1)
        for name, info in manifest.buffers.items():
            keep = _kept(info) is not None
            writer.add(name, cache.get(BUFFERS_FILE).get_tensor(name), is_parameter=False, keep=keep)
            bar.update(1)


def _write_adapter(ckpt: Path, manifest: Manifest, out: Path, dtype: torch.dtype | None, verify: bool) -> list[str]:
    """[Note: adapter export] a PEFT model's checkpoint written as its adapter: `adapter_config.json` and
    `adapter_model.safetensors` (then the tokenizer's files), what `PeftModel.save_pretrained` writes."""
    from .peft_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_weights, write_adapter_config

    if manifest.peft is None:
        raise ValueError(
            f"{ckpt} holds a PEFT model (its weights are named {next(iter(manifest.params))!r}, ...) but records no "
            "adapter config (it was saved before hf_zero recorded them): written as a transformers model directory, "
            "transformers would load it as a model initialized at random. What trained is the adapter: "
            "hf_zero.from_pretrained(..., peft_config=<the same LoraConfig>), hf_zero.load_checkpoint(ckpt, model), "
            "then model.save_pretrained(dir) writes it."
        )
    keys, model_class = adapter_weights(ckpt, manifest.peft, list(manifest.params))
    model_files = sorted({f for name in keys.values() for f, _, _ in manifest.slices[name]})
    check_files(ckpt, manifest, model_files, verify)
    entries = []
    with FileCache(ckpt) as cache:
        for key, name in sorted(keys.items()):
            info = manifest.params[name]
            value = torch.empty(math.prod(info["shape"]), dtype=dtype_from_name(info["dtype"]))
            read_pieces(cache, name, manifest.slices[name], 0, value.numel(), value)
            value = value.view(info["shape"]).to(dtype or value.dtype)
            entries.append(Entry(key, value.dtype, tuple(value.shape), host_pieces(value)))
    make_directory(out)
    write_file_atomically(out / ADAPTER_WEIGHTS, lambda tmp: write_streamed(tmp, entries, {"format": "pt"}))
    write_adapter_config(manifest.peft, out, model_class)
    model_own = ("config.json", "generation_config.json")  # a model's config or code would make this look a model
    copied = [n for n in side_files(ckpt) if n not in model_own and not n.endswith(".py")]
    for name in copied:  # the tokenizer
        shutil.copyfile(ckpt / name, out / name)
    record_output(out, [ADAPTER_WEIGHTS, ADAPTER_CONFIG, *copied])
    return [ADAPTER_WEIGHTS]


def _checkpoint_layout(ckpt: Path) -> FileLayout:
    """`_model_layout` of the model a checkpoint's `config.json` describes (built on the meta device), for an
    offline consolidation; empty without transformers, a config or a class transformers has by that name."""
    if not (ckpt / "config.json").is_file():
        return {}
    try:
        import transformers
    except ImportError:
        return {}
    try:
        config = transformers.AutoConfig.from_pretrained(ckpt)
        names = getattr(config, "architectures", None) or []
        auto_map = getattr(config, "auto_map", None)
        model_class = getattr(transformers, names[0], None) if names and not auto_map else None
        if model_class is None:
            return {}
        with torch.device("meta"):
            model = model_class(config)
        return model_layout(model)
    except Exception as e:  # noqa: BLE001 - the weights are still written, under the model's own names
        logger.warning(
            "hf_zero.consolidate could not learn transformers' file layout from %s (%s: %s); the tensors are written "
            "under the model's own names, which transformers 5 loads as they are.",
            ckpt / "config.json",
            type(e).__name__,
            e,
        )
        return {}


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def update_to(self, done: int, total: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool, unit: str) -> Any:
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with transformers; without it, no bar
        return _NoBar()
    bar = tqdm(total=total, desc=desc, unit=unit)

    def update_to(done: int, new_total: int) -> None:  # a bar whose total is known once the work is planned
        bar.total = new_total
        bar.update(done - bar.n)

    bar.update_to = update_to
    return bar
