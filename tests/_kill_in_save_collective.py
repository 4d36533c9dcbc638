"""One rank of a 2-process job (the test sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): train a step of a
sharded LLaMA and save a checkpoint, rank 1 killing itself (SIGKILL) right before the K-th collective of that save
(K = 0: before `initialize` makes the background saves' group). Usage: _kill_in_save_collective.py OUT K.
Rank 0 writes OUT/status-0.json: the error it raised (or none) and how long after rank 1's death it took."""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

import hf_zero.checkpoint.save as save_module  # noqa: E402
import hf_zero.engine.engine as engine_module  # noqa: E402
from tests._training import Scenario, sharded_run  # noqa: E402

COLLECTIVES = ("agreement", "broadcast_object", "failed_ranks", "gather_objects")  # the save path's, by name


def die_at(k: int) -> None:
    """Wrap the save path's collectives so that rank 1 dies before the k-th (k = 0: before the group creation)."""
    calls = {"n": 0}

    def wrap(fn):  # noqa: ANN001, ANN202
        def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls["n"] += 1
            if dist.get_rank() == 1 and calls["n"] == k:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)

        return wrapped

    if k == 0:
        make = engine_module.host_side_group

        def make_then(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return make(*args, **kwargs)

        engine_module.host_side_group = make_then
        return
    for name in COLLECTIVES:
        setattr(save_module, name, wrap(getattr(save_module, name)))


def main(out: str, k: int) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    die_at(k)
    status: dict = {"error": None}
    start = time.monotonic()
    try:
        sharded_run(Scenario(model="llama", stage=3, world=2, steps=1, accum=1, save_to=os.path.join(out, "ckpt"),
                             config_overrides=(("group_timeout_s", 10.0),)))
    except Exception as e:  # noqa: BLE001 - reported to the test
        status["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    status["seconds"] = time.monotonic() - start
    with open(os.path.join(out, f"status-{dist.get_rank()}.json"), "w") as f:
        json.dump(status, f)
    os._exit(1 if status["error"] else 0)  # the group has a dead member: no orderly teardown


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
