"""Run alone (no torch.distributed) with an accelerator faked present: where each entry point computes.

    python tests/_device_choice.py OUT_DIR    # prints one JSON line: the device each path computed on

The process pretends to have a CUDA GPU (`hf_zero.engine.placement._process_accelerator`), and the engine's
pick of it is recorded instead of made (`_rank_accelerator`), so a path that ignores the device its
training loop uses shows up as "cuda:0" here (on a real GPU machine: the Trainer's CUDA batches meeting
host weights at the first embedding, as `accelerate launch` with one process did before).
"""

from __future__ import annotations

import json
import sys

import torch

import hf_zero
from hf_zero.engine import placement

picked: list[str] = []


def fake_pick(kind: str, world: object) -> torch.device:
    picked.append(kind)
    return torch.device("cpu")  # records the pick; computes on the host so the run can go on


placement._process_accelerator = lambda: "cuda"
placement._rank_accelerator = fake_pick


def main(out: str) -> None:
    from torch.utils.data import Dataset

    from tests._training import make_model

    class Rows(Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            row = torch.arange(16) * (i + 1) % 97
            return {"input_ids": row, "labels": row}

    seen: dict[str, object] = {}
    model, _ = hf_zero.initialize(make_model("llama"), None, hf_zero.ZeroConfig(stage=3))
    seen["initialize"] = picked[:]  # alone with an accelerator: the engine picks it
    picked.clear()

    args = hf_zero.ZeroTrainingArguments(
        output_dir=out, zero_stage=3, use_cpu=True, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        max_steps=2, report_to="none", save_strategy="no", disable_tqdm=True,
    )
    trainer = hf_zero.ZeroTrainer(model=make_model("llama"), args=args, train_dataset=Rows(), eval_dataset=Rows())
    before = trainer.evaluate()["eval_loss"]  # sharded for evaluation first, as examples/train_clm.py does
    trainer.train()
    seen["trainer"] = {"picked": picked[:], "engine": str(trainer.model.zero_engine.device),
                       "args": str(args.device), "eval_before": before, "eval_after": trainer.evaluate()["eval_loss"]}
    picked.clear()

    accelerator = hf_zero.ZeroAccelerator(zero_plugin=hf_zero.ZeroPlugin(zero_stage=3), cpu=True)
    other = make_model("llama")
    other, _ = accelerator.prepare(other, torch.optim.AdamW(other.parameters()))
    seen["accelerator"] = {"picked": picked[:], "engine": str(other.zero_engine.device),
                           "accelerator": str(accelerator.device)}
    print("DEVICES " + json.dumps(seen))


if __name__ == "__main__":
    main(sys.argv[1])
