"""Run under torchrun (2 ranks): save a good checkpoint at step 2, then kill rank 1 with SIGKILL in the
middle of the step-3 save, right after it wrote its model shard (tests/test_reliability.py)."""

import os
import signal
import sys
from dataclasses import replace

import torch.distributed as dist

import hf_zero.checkpoint.save as save_module
from tests._training import Scenario, sharded_run


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    sc = Scenario(model="llama", stage=3, world=2, steps=5)
    sharded_run(replace(sc, stop_step=2, save_to=os.path.join(out, "step_2")))

    write = save_module._write_streamed

    def write_then_die(staging, name, *args, **kwargs):  # noqa: ANN001
        write(staging, name, *args, **kwargs)
        if dist.get_rank() == 1 and name.startswith("model-"):
            os.kill(os.getpid(), signal.SIGKILL)

    save_module._write_streamed = write_then_die
    sharded_run(replace(sc, start_step=2, stop_step=3, load_from=os.path.join(out, "step_2"),
                        save_to=os.path.join(out, "step_3")))
    print("unreachable: the save should not have finished", flush=True)


if __name__ == "__main__":
    main()
