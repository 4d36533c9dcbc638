"""What a killed save leaves behind, found and removed.

[Note: leftovers]
A save writes under temporary names and renames at the end ([Note: atomic save] in save.py), so a process killed
mid-save leaves the previous checkpoint whole, plus temporary names: the staging folder
`.NAME.incomplete-TOKEN/` beside the target, and `.<file>.partial` files (the weight files of a
`from_pretrained` folder, streamed shard files, a manifest being written). Nothing reads them (`load_checkpoint`
opens the target's manifest; `last_complete_checkpoint` and the Trainer's search look at `checkpoint-N`
folders with a manifest), but they hold disk space. `save_checkpoint` removes those beside its target before it
writes (on every rank, agreed, after the previous background save finished: none of them is being written);
`hf-zero leftovers RUN_DIR` lists every one under a run folder and `--remove` deletes them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

PARTIAL_FILES = (".*.safetensors.partial", ".hf_zero-shard-*.partial", "*.json.partial", ".*.pt.partial")


def beside(target: Path) -> list[Path]:
    """The leftovers of killed saves of `target`: its staging folders, and the temporary files in its folder."""
    parent = target.parent
    if not parent.is_dir():
        return []
    found = [p for p in parent.glob(f".{target.name}.incomplete-*") if p.is_dir()]
    for pattern in PARTIAL_FILES:
        found += [p for p in parent.glob(pattern) if p.is_file()]
    return sorted(set(found))


def under(root: Path) -> list[Path]:
    """Every leftover of a killed save anywhere under `root` (a run's output folder)."""
    found = [p for p in root.rglob(".*.incomplete-*") if p.is_dir()]
    found = [p for p in found if not any(q in p.parents for q in found)]  # not the inside of another
    for pattern in PARTIAL_FILES:
        found += [p for p in root.rglob(pattern) if p.is_file() and not any(q in p.parents for q in found)]
    return sorted(set(found))


def _bytes(path: Path) -> int:
    """The size of a file, or of the files in a folder; what vanished meanwhile (another rank removing the same
    leftover from a shared folder) counts 0."""
    try:
        if path.is_dir() and not path.is_symlink():
            return sum(_bytes(p) for p in path.iterdir())
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def remove(paths: list[Path]) -> int:
    """Delete `paths` (folders with their contents); the bytes freed. A path gone already, or going while it is
    removed (every rank removes the leftovers beside a target in a shared folder at once), is no error."""
    freed = 0
    for path in paths:
        freed += _bytes(path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return freed
