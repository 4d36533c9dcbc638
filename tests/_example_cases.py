"""Rank functions for tests/test_examples.py: an example script run on a pool's ranks, as `accelerate launch`
runs it."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def run_example(script: str, argv: list[str]) -> None:
    """Run `script` with `argv` as its `__main__` on this rank. The worker holds what `accelerate launch` gives each
    process (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK, ACCELERATE_USE_CPU, one thread, the process group
    from them), so the script's Trainer and Accelerator find a 2-process CPU run; Accelerate's process-wide state
    is reset first, as each launched process starts without one."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))  # the script's own folder, as `python script.py` puts first
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
