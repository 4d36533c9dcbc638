"""A tiny GRPO run for tests/test_examples.py, under `accelerate launch`: TRL's GRPOTrainer with hf_zero mixed in
(`N`: `--zero_stage N`), or TRL's stock GRPOTrainer under DDP (`stock`). Online RL: each step generates completions
on every rank (half of the vocabulary ends a completion, so ranks finish generating at different steps), scores
them, and trains on them against a reference model (`beta`: the KL term). Writes the logged figures and the
weights."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import hf_zero  # noqa: E402

LOGGED = ("loss", "grad_norm", "reward", "kl", "completions/mean_length", "completions/min_length",
          "completions/max_length")


@dataclass
class ZeroGRPOConfig(hf_zero.ZeroArgumentsMixin, GRPOConfig):
    pass


class ZeroGRPOTrainer(hf_zero.ZeroTrainerMixin, GRPOTrainer):
    pass


def length_reward(completions: list[str], **kwargs: object) -> list[float]:
    """Longer completions score higher: the policy's gradient depends on every sampled length."""
    return [len(c) / 10.0 for c in completions]


def main() -> None:
    model_dir, out, stage = sys.argv[1], sys.argv[2], sys.argv[3]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    stops = list(range(3, len(tokenizer) // 2))  # many end-of-completion tokens: completions of uneven lengths
    common = dict(output_dir=out, max_steps=2, per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True,
                  disable_tqdm=True, save_strategy="no", seed=0, bf16=False, adam_epsilon=1e-6, beta=0.04,
                  generation_kwargs={"eos_token_id": stops})
    if stage == "stock":
        trainer_cls, args = GRPOTrainer, GRPOConfig(**common)
    else:
        trainer_cls, args = ZeroGRPOTrainer, ZeroGRPOConfig(zero_stage=int(stage), **common)
    prompts = Dataset.from_list([{"prompt": f"the quick fox {i}"} for i in range(16)])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = trainer_cls(model=model, args=args, reward_funcs=length_reward, train_dataset=prompts,
                          processing_class=tokenizer)
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    if trainer.args.process_index == 0:
        logged = [{k: h[k] for k in LOGGED if k in h} for h in trainer.state.log_history if "loss" in h]
        json.dump(logged, open(os.path.join(out, "logged.json"), "w"))


if __name__ == "__main__":
    main()
