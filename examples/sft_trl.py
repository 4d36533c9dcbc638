"""Instruction tuning with TRL's `SFTTrainer` on hf_zero: the step after domain adaptation.

    ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu_2proc.yaml examples/sft_trl.py \
        --model_name_or_path outputs/demo/model --dataset_file outputs/demo/instructions.jsonl \
        --output_dir outputs/sft --zero_stage 3 --max_steps 50 --use_cpu

The dataset is a JSON-lines file of `{"prompt": ..., "completion": ...}` records (TRL's
prompt-completion format: the loss is taken on the completion only). `make demo` writes one made
from the domain corpus: "What does `json.dumps(obj, ...)` do?" answered by the first paragraph of
the docstring.

QLoRA (a 4-bit NF4 base, LoRA adapters trained; what most people fine-tune on a few GPUs): `--qlora` (with
`--lora_rank 16`); the adapter is what `final/` holds (`adapter_model.safetensors`, loadable by PEFT).

Long examples: `--zero_sequence_parallel 2 --pad_to_multiple_of 2` splits every sequence over two ranks (the
two read the same batches; TRL's fused loss and its metrics see whole sequences).

The only hf_zero-specific lines are the two classes below: TRL's `SFTConfig` and `SFTTrainer`
with hf_zero's `--zero_*` settings and engine mixed in. `--use_stock_trainer` runs the same job with
TRL's own classes (plain DDP under the same launcher), for comparison.
"""

from __future__ import annotations

import _quiet  # noqa: F401 - first: silences optional packages' import-time notes

import dataclasses
import json
import os
from dataclasses import dataclass, field

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import SFTConfig, SFTTrainer

import hf_zero


@dataclass
class ZeroSFTConfig(hf_zero.ZeroArgumentsMixin, SFTConfig):
    """TRL's `SFTConfig` with every `--zero_*` setting."""


class ZeroSFTTrainer(hf_zero.ZeroTrainerMixin, SFTTrainer):
    """TRL's `SFTTrainer` trained by hf_zero's engine."""


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a local model directory (e.g. the domain-adapted model)"})
    dataset_file: str = field(metadata={"help": "JSON lines of {prompt, completion} records"})
    use_stock_trainer: bool = field(default=False, metadata={"help": "TRL's own SFTTrainer (DDP), for comparison"})
    qlora: bool = field(default=False, metadata={"help": "load the base in 4-bit NF4 and train LoRA adapters"})
    lora_rank: int = field(default=16, metadata={"help": "the LoRA rank (with --qlora)"})


def qlora_parts(script: ScriptArguments, config: SFTConfig) -> tuple[dict, object]:
    """The 4-bit load's arguments and the LoRA config TRL applies (it prepares the 4-bit model for training)."""
    import torch
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    compute = torch.bfloat16 if config.bf16 else torch.float32
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=compute)
    lora = LoraConfig(r=script.lora_rank, lora_alpha=2 * script.lora_rank, lora_dropout=0.0, target_modules="all-linear")
    return {"quantization_config": quant, "dtype": compute}, lora


def instructions(path: str) -> Dataset:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--dataset_file {path!r} does not exist (make demo writes outputs/demo/instructions.jsonl).")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows or not all({"prompt", "completion"} <= set(r) for r in rows):
        raise ValueError(f"--dataset_file {path!r} needs records with 'prompt' and 'completion' fields.")
    return Dataset.from_list(rows)


def main() -> None:
    script, config = HfArgumentParser((ScriptArguments, ZeroSFTConfig)).parse_args_into_dataclasses()
    if script.use_stock_trainer:  # the same settings through TRL's own classes
        config = SFTConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(SFTConfig) if f.init})
        trainer_cls = SFTTrainer
    else:
        trainer_cls = ZeroSFTTrainer
    tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
    load, peft_config = qlora_parts(script, config) if script.qlora else ({}, None)
    model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path, **load)
    trainer = trainer_cls(model=model, args=config, train_dataset=instructions(script.dataset_file),
                          processing_class=tokenizer, peft_config=peft_config)
    result = trainer.train()
    trainer.save_model(os.path.join(config.output_dir, "final"))
    if trainer.args.process_index == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        with open(os.path.join(config.output_dir, "losses.json"), "w") as f:
            json.dump(losses, f)
        accuracy = [h["mean_token_accuracy"] for h in trainer.state.log_history if "mean_token_accuracy" in h]
        with open(os.path.join(config.output_dir, "accuracy.json"), "w") as f:
            json.dump(accuracy, f)
        print(f"trained {result.global_step} steps; losses {losses}")


if __name__ == "__main__":
    main()
