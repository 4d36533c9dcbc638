"""One rank of a 2-process ZeroTrainer job for tests/test_reliability.py's preemption test (the test sets RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT as a launcher would). Usage: _preempt_run.py OUT MODE MAX_STEPS, MODE one
of straight, preempt (slow steps, so a signal lands mid-training) or resume (train(resume_from_checkpoint=True)).
Writes OUT/progress-RANK (the last finished step), OUT/status-RANK.json (the step it stopped at, its losses,
the exit code it leaves with) and, at exit, OUT/frozen-RANK (how many objects the collector had frozen)."""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback  # noqa: E402

import hf_zero  # noqa: E402


class _Progress(TrainerCallback):
    def __init__(self, out: str, rank: int, slow: bool) -> None:
        self.path, self.slow = os.path.join(out, f"progress-{rank}"), slow

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        with open(self.path, "w") as f:
            f.write(str(state.global_step))
        if self.slow:
            time.sleep(0.4)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _record_freeze(path: str) -> None:
    with open(path, "w") as f:  # registered first, so it runs last: after the package's own exit handlers
        f.write(str(gc.get_freeze_count()))


def main(out: str, mode: str, max_steps: int) -> None:
    rank = int(os.environ["RANK"])
    os.makedirs(out, exist_ok=True)
    atexit.register(_record_freeze, os.path.join(out, f"frozen-{rank}"))
    with open(os.path.join(out, f"pid-{rank}"), "w") as f:  # for a test that signals one rank under a launcher
        f.write(str(os.getpid()))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    args = hf_zero.ZeroTrainingArguments(
        output_dir=out, zero_stage=3, zero_save_on_preemption=True, max_steps=max_steps, save_steps=1000,
        per_device_train_batch_size=2, logging_steps=1, learning_rate=1e-3, use_cpu=True, report_to="none",
        disable_tqdm=True, seed=0, data_seed=0, save_only_model=False,
    )
    trainer = hf_zero.ZeroTrainer(model=model, args=args, train_dataset=_Tokens(),
                                  callbacks=[_Progress(out, rank, slow=mode == "preempt")])
    code = 0
    try:
        trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    except SystemExit as e:
        code = int(e.code or 0)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    with open(os.path.join(out, f"status-{rank}.json"), "w") as f:
        json.dump({"step": trainer.state.global_step, "losses": losses, "code": code}, f)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
