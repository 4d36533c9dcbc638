"""Where an offline tool writes: never over files it did not write there.

[Note: output record]
`consolidate` (and `hf-zero consolidate`) writes a model directory. A directory that already holds
files is written into only when they are all hf_zero's earlier output there: `hf_zero_output.json`,
written last, names every file the last consolidation wrote. Anything else (the base model the run
started from, a run folder, a file at the path) is refused before a byte is written, naming what is
there, unless the caller passes `overwrite=True` (`--overwrite`). Temporary files of an interrupted
write (`.hf_zero-*`, `*.partial`) count as our own.
"""

from __future__ import annotations

import json
from pathlib import Path

from .format import write_bytes_atomically

OUTPUT_RECORD = "hf_zero_output.json"
_SHOWN = 6  # names listed in a refusal


def ours(directory: Path) -> set[str]:
    """The names in `directory` that an earlier consolidation wrote, by its record (empty without one)."""
    record = directory / OUTPUT_RECORD
    if not record.is_file():
        return set()
    try:
        files = json.loads(record.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return set()  # a damaged record vouches for nothing
    return {OUTPUT_RECORD, *(f for f in files if isinstance(f, str))}


def check_target(directory: Path, *, overwrite: bool, flag: str = "overwrite=True") -> None:
    """Refuse to write into `directory` where it holds anything but our earlier output ([Note: output record]).

    Args:
        directory (`Path`): the output directory (may not exist yet).
        overwrite (`bool`): the caller was told to replace what is there.
        flag (`str`, *optional*): how the caller says "overwrite", for the message (`--overwrite` on the CLI).

    Raises:
        `ValueError`: `directory` is a file, or holds files hf_zero did not write there and `overwrite` is False.
    """
    if directory.exists() and not directory.is_dir():
        raise ValueError(
            f"{directory} is a file; a from_pretrained directory is written there. Pass a directory path "
            "(the file is left as it is)."
        )
    if overwrite or not directory.is_dir():
        return
    own = ours(directory)
    foreign = sorted(
        p.name
        for p in directory.iterdir()
        if p.name not in own and not p.name.startswith(".hf_zero-") and not p.name.endswith(".partial")
    )
    if not foreign:
        return
    shown = ", ".join(f"{name}/" if (directory / name).is_dir() else name for name in foreign[:_SHOWN])
    more = f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN else ""
    kind = "a model directory" if {"config.json", "model.safetensors"} & set(foreign) else "a folder of other files"
    raise ValueError(
        f"{directory} is {kind} that hf_zero did not write ({shown}{more}); writing the model there would replace "
        f"or mix with them. Nothing was written. Pass a new or empty directory, or {flag} to write into it anyway "
        "(same-named files are replaced, the others are left)."
    )


def record_output(directory: Path, files: list[str]) -> None:
    """Name the files just written into `directory` ([Note: output record]); the record is written last."""
    listed = sorted(set(files) - {OUTPUT_RECORD})
    write_bytes_atomically(directory / OUTPUT_RECORD, (json.dumps({"files": listed}, indent=2) + "\n").encode())
