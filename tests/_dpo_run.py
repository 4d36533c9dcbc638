"""A tiny DPO run for tests/test_examples.py, under `accelerate launch`: TRL's DPOTrainer with hf_zero mixed in
(`--zero_stage N`), or TRL's stock DPOTrainer under DDP (`--stock`). Writes the logged losses and the weights."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

import hf_zero  # noqa: E402


@dataclass
class ZeroDPOConfig(hf_zero.ZeroArgumentsMixin, DPOConfig):
    pass


class ZeroDPOTrainer(hf_zero.ZeroTrainerMixin, DPOTrainer):
    pass


def main() -> None:
    model_dir, out, stage = sys.argv[1], sys.argv[2], sys.argv[3]
    sync = "--sync_ref_model" in sys.argv[4:]  # TR-DPO: the reference follows the policy every step
    pairs = [{"prompt": f"Turbine {i} reports", "chosen": f" blade pitch nominal, unit {i} ok.",
              "rejected": f" fire fire fire {i}"} for i in range(16)]
    common = dict(output_dir=out, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1,
                  report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", beta=0.1, seed=0, bf16=False,
                  adam_epsilon=1e-6, max_length=48)
    if sync:
        common.update(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    if stage == "stock":
        trainer_cls, args = DPOTrainer, DPOConfig(**common)
    else:
        trainer_cls, args = ZeroDPOTrainer, ZeroDPOConfig(zero_stage=int(stage), **common)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = trainer_cls(model=model, args=args, train_dataset=Dataset.from_list(pairs), processing_class=tokenizer)
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    if trainer.args.process_index == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        json.dump(losses, open(os.path.join(out, "losses.json"), "w"))
        reference = getattr(trainer, "ref_model", None)
        json.dump({"ref_sharded": hf_zero.api.is_sharded(reference)}, open(os.path.join(out, "ref.json"), "w"))


if __name__ == "__main__":
    main()
