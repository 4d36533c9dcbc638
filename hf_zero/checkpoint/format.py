"""The hf_zero checkpoint format: file names, the manifest, the version, checksums.

[Note: checkpoint layout]
A checkpoint is a directory:

    hf_zero_manifest.json                    written last; its presence marks a complete checkpoint
    model-rank00000-of-00002.safetensors     rank 0's pieces of the fp32 master weights
    optim-rank00000-of-00002.safetensors     rank 0's pieces of the optimizer state
    ...                                      one pair per writing rank
    buffers.safetensors                      persistent buffers (rank 0)
    config.json, generation_config.json, tokenizer files   when given to `save_checkpoint`

Tensors are keyed by the parameter's name (the first of its tied names). A model file holds,
under the name `model.layers.0.mlp.up_proj.weight`, the 1D piece `[start, end)` of the flattened
parameter; an optimizer file holds `model.layers.0.mlp.up_proj.weight::exp_avg` for the same
range, and scalar state (`::step`) whole; an optimizer that steps on whole parameters has its state
written whole by each parameter's owner instead ([Note: owned optimizer state]). Each file's
safetensors metadata repeats its ranges, the format version and the world size, so a file
describes itself; the manifest indexes all of them with sizes and checksums ([Note: checksums]),
the parameter shapes, the tied aliases, the optimizer's param groups and (version 3) the names transformers'
`save_pretrained` stores the model's weights under where they differ from the model's ([Note: file layout] in
stream.py), which `consolidate` writes without building the model. Nothing is pickled.

[Note: checksums]
Each file's checksum is an `"algorithm:hex"` string: `xxh3_128` (format version 2) or `sha256` (version 1,
still read). The checksums are there to find damage (a truncated copy, a flipped bit, a file of another
checkpoint), not tampering, and they are computed from the bytes as they are written and read again from
the bytes as they are loaded, so their speed is the save's and the load's: SHA-256 ran at 1.1-1.4 GB/s on
one core of the machine these figures come from, below an NVMe drive's 3-7 GB/s and close to this
machine's disk; XXH3-128 at 6 GB/s. A 128-bit XXH3 misses random damage with probability 2^-128.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import nn

from ..dtypes import dtype_name
from ..engine.module import wrapped_model

FORMAT_NAME = "hf_zero"
FORMAT_VERSION = 3  # 3: the manifest's `layout`; 2: xxh3_128 checksums ([Note: checksums]); 1: sha256
READABLE_VERSIONS = (1, 2, 3)
CHECKSUM = "xxh3_128"
MANIFEST = "hf_zero_manifest.json"
SUBDIR = "hf_zero"  # where the Trainer (`checkpoint-N/`) and Accelerate (`save_state(dir)`) keep the sharded state
BUFFERS_FILE = "buffers.safetensors"
STATE_SEP = "::"  # between a parameter name and an optimizer state key
SHARD_FILE = re.compile(r"(model|optim)-rank\d{5}-of-\d{5}\.safetensors")  # `model_file`, `optim_file`


def side_files(directory: Path) -> list[str]:
    """The files of a checkpoint that belong to the model directory it becomes (`config.json`, the tokenizer's
    files, a remote-code model's `*.py`, ...): every regular file but hf_zero's own (the manifest, the shards,
    the buffers) and temporary ones."""
    own = {MANIFEST, BUFFERS_FILE}
    return sorted(
        f.name
        for f in directory.iterdir()
        if f.is_file() and f.name not in own and not SHARD_FILE.fullmatch(f.name) and not f.name.startswith(".")
    )


def model_file(rank: int, world: int) -> str:
    return f"model-rank{rank:05d}-of-{world:05d}.safetensors"


def optim_file(rank: int, world: int) -> str:
    return f"optim-rank{rank:05d}-of-{world:05d}.safetensors"


def optim_file_for(model_file_name: str) -> str:
    """The optimizer file written by the rank that wrote `model_file_name`."""
    return "optim-" + model_file_name.removeprefix("model-")


@dataclass
class FileEntry:
    bytes: int
    checksum: str  # "algorithm:hex" ([Note: checksums])


class Digest:
    """A running checksum of a file's bytes ([Note: checksums]); `update` takes any buffer, in file order."""

    def __init__(self, algorithm: str = CHECKSUM) -> None:
        if algorithm == "xxh3_128":
            self._hash: Any = xxhash.xxh3_128()
        elif algorithm == "sha256":
            self._hash = hashlib.sha256()
        else:
            raise ValueError(
                f"Unknown checksum algorithm {algorithm!r}; this release of hf_zero knows xxh3_128, sha256."
            )
        self.algorithm = algorithm

    @staticmethod
    def matching(checksum: str) -> Digest:
        """A digest of the algorithm that `checksum` ("algorithm:hex") was computed with."""
        return Digest(checksum.split(":", 1)[0])

    def update(self, data: Any) -> None:
        self._hash.update(data)

    def value(self) -> str:
        return f"{self.algorithm}:{self._hash.hexdigest()}"


@dataclass
class Manifest:
    """The index of a checkpoint (see [Note: checkpoint layout])."""

    stage: int
    world_size: int
    params: dict[str, dict[str, Any]]  # name -> {"shape": [...], "dtype": "float32"} (saved master dtype)
    slices: dict[str, list[list[Any]]]  # name -> [[file, start, end], ...] covering the flattened parameter
    aliases: dict[str, str]  # tied name -> the name it is stored under
    buffers: dict[str, dict[str, Any]]  # persistent buffer name -> {"shape", "dtype"}
    files: dict[str, FileEntry]
    optimizer: dict[str, Any] | None = None  # {"class", "param_groups": [{hyperparams, "params": [names]}],
    #                                           "state": {name: {key: "elementwise" | "whole" | "param" | ...}},
    #                                           "owners": {name: file} on the whole-parameter path}
    engine: dict[str, Any] = field(default_factory=dict)  # {"loss_scale": ...}
    user: dict[str, Any] = field(default_factory=dict)  # free-form metadata from the caller
    layout: dict[str, list[list[Any]]] | None = None  # name -> [[stored name, shape], ...] where transformers' files
    #   store a parameter otherwise ([Note: file layout] in stream.py); None in checkpoints before version 3
    peft: dict[str, dict[str, Any]] | None = None  # a PEFT model's adapter configs by adapter name ([Note: adapter
    #   export] in checkpoint/peft_export.py); None for another model
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    def figure(self, verb: str, directory: str | os.PathLike[str], seconds: float) -> str:
        """The line rank 0 logs at the end of a save or a load (`verb`: "saved", "loaded"): the checkpoint's
        files in all, their bytes and the time it took: `hf_zero: saved DIR (SIZE in N files written by R ranks) in
        SECONDS s, RATE/s`."""
        size = sum(entry.bytes for entry in self.files.values())
        rate = size / max(seconds, 1e-9)
        return (
            f"hf_zero: {verb} {directory} ({format_size(size)} in {len(self.files)} files written by "
            f"{self.world_size} ranks) in {seconds:.1f} s, {format_size(int(rate))}/s"
        )

    @staticmethod
    def read(directory: str | os.PathLike[str]) -> Manifest:
        """Read and check a checkpoint's manifest.

        Raises:
            FileNotFoundError: no directory, or no manifest in it (an incomplete save looks like this).
            ValueError: not an hf_zero manifest, or a format version this release does not know.
        """
        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"No hf_zero checkpoint at {directory}: the directory does not exist.")
        path = directory / MANIFEST
        if not path.is_file():
            held = sorted(c.name for c in directory.iterdir() if (c / SUBDIR / MANIFEST).is_file())
            hint = (
                f" It holds checkpoints ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): pass one of them, "
                f"e.g. hf_zero.last_complete_checkpoint({str(directory)!r})."
                if held
                else " Resume from an earlier checkpoint."
            )
            raise FileNotFoundError(
                f"{directory} has no {MANIFEST}: it is not an hf_zero checkpoint, or its save did not finish "
                f"(the manifest is written last).{hint}"
            )
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON ({e}); the checkpoint is damaged.") from e
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise ValueError(f"{path} is not an hf_zero manifest (format {raw.get('format')!r}).")
        version = raw.get("format_version")
        if version not in READABLE_VERSIONS:
            raise ValueError(
                f"{path} has hf_zero checkpoint format version {version!r}; this release of hf_zero reads "
                f"versions {', '.join(map(str, READABLE_VERSIONS))}. Upgrade hf_zero to load it."
            )
        raw["files"] = {k: _file_entry(v) for k, v in raw["files"].items()}
        return Manifest(**raw)


def _file_entry(raw: dict[str, Any]) -> FileEntry:
    """A manifest's file record; version 1 named its checksum `sha256`."""
    if "sha256" in raw:
        return FileEntry(bytes=raw["bytes"], checksum=f"sha256:{raw['sha256']}")
    return FileEntry(**raw)


def checksum_of(path: str | os.PathLike[str], algorithm: str = CHECKSUM, read_bytes: int = 16 << 20) -> str:
    """The file's checksum ([Note: checksums]), read in large spans while a second thread hashes the previous
    one, so verifying runs at the slower of the disk and the hash rather than at their sum."""
    h = Digest(algorithm)
    buffers = [bytearray(read_bytes), bytearray(read_bytes)]
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(max_workers=1) as hasher:
        hashing: Future[None] | None = None
        for i in itertools.count():
            view = memoryview(buffers[i % 2])
            n = f.readinto(view)  # the other buffer may still be hashed; this one is free
            if hashing is not None:
                hashing.result()
            if not n:
                break
            hashing = hasher.submit(h.update, view[:n])
    return h.value()


def write_file_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """[Note: atomic files] `write(tmp)` writes the file under a temporary name beside `path`; it is
    flushed to disk, then renamed: readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(path.name + ".partial")
    write(tmp)
    fsync_file(tmp)
    os.replace(tmp, path)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically ([Note: atomic files])."""
    write_file_atomically(path, lambda tmp: tmp.write_bytes(data))


def save_hf_files(model: nn.Module, tokenizer: Any, directory: Path, dtype: torch.dtype | None = None) -> None:
    """The side files of a Hugging Face model directory: `config.json` (with its `dtype` set to the
    weights' dtype when given), `generation_config.json` and the tokenizer's files."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(str(directory))
        _set_config_architectures(directory / "config.json", model)
        if dtype is not None:
            set_config_dtype(directory / "config.json", dtype)
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(str(directory))
    _save_model_code(model, directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


def _save_model_code(model: nn.Module, directory: Path) -> None:
    """As transformers' `save_pretrained`: a model whose code came with its directory (`trust_remote_code`, its
    class registered for an auto class) gets its `modeling_*.py` copied beside the weights, which `auto_map` in
    `config.json` names; without them `from_pretrained(dir, trust_remote_code=True)` cannot load it."""
    base = wrapped_model(model)  # under a PEFT wrapper, the model it wraps
    if getattr(base, "_auto_class", None) is None or "transformers" not in sys.modules:
        return
    from transformers.dynamic_module_utils import custom_object_save

    custom_object_save(base, str(directory), config=getattr(base, "config", None))


def _set_config_architectures(config_path: Path, model: nn.Module) -> None:
    """As transformers' `save_pretrained`: `architectures` names the class saved (a PEFT model's base model's), which
    a model built from a config has not set."""
    if "transformers" not in sys.modules or not config_path.is_file():
        return
    from transformers import PreTrainedModel

    base = wrapped_model(model)  # under a PEFT wrapper, the model it wraps
    if not isinstance(base, PreTrainedModel):
        return
    config = json.loads(config_path.read_text())
    config["architectures"] = [type(base).__name__]
    write_bytes_atomically(config_path, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())


def set_config_dtype(config_path: Path, dtype: torch.dtype) -> None:
    """Record the weights' dtype in a `config.json`, so `from_pretrained` loads them as written."""
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    config["dtype"] = dtype_name(dtype)
    config.pop("torch_dtype", None)
    write_bytes_atomically(config_path, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())


def check_files(directory: Path, manifest: Manifest, names: list[str], verify: bool) -> None:
    """Raise if one of the named files is missing, has the wrong size, or (with `verify`) the wrong checksum. The
    files are hashed at once, up to 4 at a time, which also leaves them in the page cache for the reads that
    follow."""
    check_sizes(directory, manifest, names)
    if not verify or not names:
        return
    with ThreadPoolExecutor(max_workers=min(4, len(names)), thread_name_prefix="hf_zero-verify") as pool:
        digests = list(
            pool.map(
                lambda name: checksum_of(directory / name, Digest.matching(manifest.files[name].checksum).algorithm),
                names,
            )
        )
    for name, digest in zip(names, digests):
        check_checksum(directory, manifest, name, digest)


def check_sizes(directory: Path, manifest: Manifest, names: list[str]) -> None:
    """Raise if one of the named files is not listed, is missing, or has another size than the manifest's."""
    for name in names:
        entry = manifest.files.get(name)
        path = directory / name
        if entry is None:
            raise ValueError(f"{directory}/{MANIFEST} does not list {name}; the checkpoint is damaged.")
        if not path.is_file():
            raise FileNotFoundError(f"Checkpoint file {path} is missing (the manifest lists it).")
        size = path.stat().st_size
        if size != entry.bytes:
            raise ValueError(
                f"Checkpoint file {path} has {size} bytes, the manifest says {entry.bytes}: it is truncated or "
                "was overwritten. Copy it again, or resume from another checkpoint."
            )


def check_checksum(directory: Path, manifest: Manifest, name: str, checksum: str) -> None:
    """Raise `ValueError` when `checksum` (of the file's bytes as read) is not the manifest's."""
    if checksum != manifest.files[name].checksum:
        raise ValueError(
            f"Checkpoint file {directory / name} is corrupted: its checksum does not match the manifest. Copy it "
            "again, or resume from another checkpoint (verify=False skips this check)."
        )


def sharded_state_dir(directory: str | os.PathLike[str]) -> Path:
    """The directory holding a checkpoint's sharded state: `directory` itself, or its `hf_zero/` where the
    Trainer's `checkpoint-N` or Accelerate's `save_state` folder is given (what `last_complete_checkpoint`
    returns)."""
    path = Path(directory)
    if not (path / MANIFEST).is_file() and (path / SUBDIR / MANIFEST).is_file():
        return path / SUBDIR
    return path


def last_complete_checkpoint(
    output_dir: str | os.PathLike[str],
    pattern: str = r"checkpoint-(\d+)",
    subdir: str = SUBDIR,
    also_required: tuple[str, ...] = (),
) -> Path | None:
    """The newest `output_dir/<pattern>` directory whose hf_zero checkpoint is complete.

    A save that was killed leaves its directory without a manifest (and, for the Trainer, without
    `trainer_state.json`): it is skipped, so a run resumes from the last checkpoint that is whole.

    Example:

    ```python
    >>> last_complete_checkpoint("out")                      # Trainer runs: out/checkpoint-N/hf_zero
    PosixPath('out/checkpoint-400')
    >>> last_complete_checkpoint("out", r"step_(\\d+)")       # Accelerate runs: out/step_N/hf_zero
    ```
    """
    root = Path(output_dir)
    if not root.is_dir():
        return None
    found = []
    for child in root.iterdir():
        match = re.fullmatch(pattern, child.name)
        if match and (child / subdir / MANIFEST).is_file() and all((child / f).exists() for f in also_required):
            found.append((int(match.group(1)), child))
    return max(found)[1] if found else None


def format_size(n: int) -> str:
    """`n` bytes as a person reads them in a log line: GiB from one GiB on, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
