"""A directory every rank writes into must be the same directory on every rank.

[Note: shared directory]
`save_checkpoint` and a sharded `save_pretrained` have every rank write its own files into one directory, which
rank 0 then completes (the manifest, the index) and, for a checkpoint, renames into place. On a multi-node job
whose output path is a node-local disk, each node's ranks would write into a directory of their own: rank 0's
would be committed without the other nodes' files, a checkpoint or model that cannot be loaded, found only when
it is (at the resume after a preemption, say). So before anything is written, rank 0 creates the directory and a
small file named by a token it broadcasts, and every other rank looks for that file: one that does not see it
within `VISIBLE_WITHIN_S` (network filesystems may cache a name's absence for up to a minute) makes every rank
raise, naming the ranks and the fix, with nothing written and the previous checkpoint untouched. The file is
removed once the ranks agree.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from ..engine.collectives import CommGroup, agreement, broadcast_object, raise_if_any_failed
from .writer import make_directory

VISIBLE_WITHIN_S = 120.0  # NFS keeps a name's absence up to its attribute cache's acdirmax (60 s by default)


def require_shared(directory: Path, world: CommGroup, what: str) -> None:
    """[Note: shared directory]: create `directory` (rank 0) and make sure every rank of `world` sees it; a
    collective. `ValueError` on every rank where some rank does not, the directory then removed if it was made
    here and is empty."""
    if world.size == 1:
        return
    token = broadcast_object(uuid.uuid4().hex, world)
    probe = directory / f".hf_zero-shared-{token}"
    made = False
    with agreement(world, f"{what} (creating {directory})"):
        if world.rank == 0:
            made = not directory.exists()
            make_directory(directory)
            probe.write_text(token)
    unseen = None
    if world.rank != 0 and not _sees(probe, token):
        unseen = ValueError(
            f"[rank {world.global_rank}] {what}: {directory}, which rank 0 created, is not there for this rank "
            f"after {VISIBLE_WITHIN_S:.0f} s: it is not on a filesystem every rank shares (a node-local disk?), so "
            "each node would hold only its own ranks' files and the result could not be loaded. Write to a "
            "directory every node mounts (NFS, Lustre, a cloud filesystem)."
        )
    try:
        raise_if_any_failed(unseen, world, what)
    except ValueError:
        if world.rank == 0:
            probe.unlink(missing_ok=True)
            if made and not any(directory.iterdir()):
                directory.rmdir()
        raise
    if world.rank == 0:
        probe.unlink(missing_ok=True)


def _sees(probe: Path, token: str) -> bool:
    """Whether `probe` holds `token`, looked for until `VISIBLE_WITHIN_S` have passed."""
    deadline = time.monotonic() + VISIBLE_WITHIN_S
    pause = 0.05
    while True:
        try:
            if probe.read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(2.0, pause * 2)
