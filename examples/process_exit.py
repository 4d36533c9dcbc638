"""Leaving a multi-process run on gloo without the interpreter's teardown.

With torch 2.13 on gloo, a process that exits through interpreter shutdown right after its last
collective can abort ("terminate called without an active exception", SIGABRT) after all its work
is done: a gloo worker thread still releasing that collective's tensors needs the GIL while the
interpreter is being torn down (pytorch/pytorch#179291). The examples finish their work, flush their
output, destroy the process group and leave at once instead.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def exit_without_teardown(code: int = 0) -> None:
    """Flush, destroy the default process group (if any) and end the process with `code`.

    Example:

    ```python
    >>> if __name__ == "__main__":
    ...     main()
    ...     exit_without_teardown()
    ```
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
