"""Domain adaptation (continued pretraining) of a causal LM with the Hugging Face Trainer and hf_zero.

    ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu_2proc.yaml \\
        examples/train_clm.py --model_name_or_path ./llama-base --train_files corpus/ \\
        --output_dir out --zero_stage 3 --per_device_train_batch_size 4 --gradient_accumulation_steps 4

Works with LLaMA, Falcon or any Hugging Face decoder with safetensors weights. The model is loaded
straight into shards (each rank reads only its slices), trained with `ZeroTrainer`, evaluated on a
held-out split before and after (perplexity), and saved with its tokenizer to `<output_dir>/final`,
a directory `from_pretrained` loads. Periodic checkpoints (`--save_steps`) are hf_zero sharded
checkpoints; `--resume_from_checkpoint <output_dir>/checkpoint-N` (or `True` for the last one)
continues a run, on any number of processes.
"""

from __future__ import annotations

import _quiet  # noqa: F401 - first: silences optional packages' import-time notes

import json
import math
import os
import sys
from dataclasses import dataclass, field

from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, default_data_collator, set_seed

import hf_zero
from clm_data import load_corpus


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "A local from_pretrained directory (safetensors weights)."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer directory, if not the model's."})
    sharded_loading: bool = field(
        default=True,
        metadata={"help": "Each rank reads only its slices of the weights (host memory ~ one model copy per node). "
                          "--no_sharded_loading loads the whole model on every rank first."},
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={"help": "The attention kernel: sdpa, flash_attention_2, eager, ... (default: transformers' choice)."},
    )


@dataclass
class DataArguments:
    train_files: list[str] = field(metadata={"help": "Corpus files, globs or folders (.txt, .md, .jsonl, .json, .parquet)."})
    validation_files: list[str] | None = field(
        default=None,
        metadata={"help": "Held-out files, globs or folders; without them --validation_split_percentage of the "
                          "training blocks is held out."},
    )
    text_column: str = field(default="text", metadata={"help": "Text column of JSON / Parquet files."})
    block_size: int = field(default=512, metadata={"help": "Tokens per training block."})
    validation_split_percentage: float = field(
        default=5.0, metadata={"help": "Share of training blocks held out, in percent, without --validation_files."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenizing."})
    packing: bool = field(
        default=False,
        metadata={"help": "Keep document boundaries in each block (position_ids restart at each document, no token "
                          "attends across one; with --zero_sequence_parallel too) instead of run_clm's "
                          "concatenate-and-cut."},
    )


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataArguments, hf_zero.ZeroTrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, args = parser.parse_json_file(os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, args = parser.parse_args_into_dataclasses()
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with args.main_process_first(desc="preparing the corpus"):
        data = load_corpus(data_args.train_files, tokenizer, block_size=data_args.block_size,
                           validation_split_percentage=data_args.validation_split_percentage, seed=args.seed,
                           validation_patterns=data_args.validation_files, text_column=data_args.text_column,
                           num_proc=data_args.preprocessing_num_workers, packing=data_args.packing)

    attention = {"attn_implementation": model_args.attn_implementation} if model_args.attn_implementation else {}
    if model_args.sharded_loading:
        model, _ = hf_zero.from_pretrained(AutoModelForCausalLM, model_args.model_name_or_path, args.to_zero_config(),
                                           **attention)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **attention)
    model.train()
    if data_args.packing:  # transformers masks within documents only when the forward keeps no KV cache
        model.config.use_cache = False

    trainer = hf_zero.ZeroTrainer(
        model=model, args=args, train_dataset=data["train"], eval_dataset=data["validation"],
        processing_class=tokenizer, data_collator=default_data_collator,
    )
    resume = args.resume_from_checkpoint
    if resume in ("True", "true", True):
        resume = True  # ZeroTrainer takes the last *complete* checkpoint-N
    before = trainer.evaluate(metric_key_prefix="before")
    result = trainer.train(resume_from_checkpoint=resume)
    after = trainer.evaluate(metric_key_prefix="after")
    final_dir = os.path.join(args.output_dir, "final")
    trainer.save_model(final_dir)

    metrics = {
        "train_blocks": len(data["train"]), "held_out_blocks": len(data["validation"]),
        "perplexity_before": math.exp(before["before_loss"]), "perplexity_after": math.exp(after["after_loss"]),
        "train_loss": result.training_loss, "global_step": result.global_step,
        "train_runtime": result.metrics.get("train_runtime"),
    }
    if trainer.is_world_process_zero():
        with open(os.path.join(args.output_dir, "domain_adaptation.json"), "w") as f:
            json.dump(metrics, f, indent=2)
        print(f"held-out perplexity: {metrics['perplexity_before']:.2f} before -> {metrics['perplexity_after']:.2f} "
              f"after {result.global_step} steps; model saved to {final_dir}")


if __name__ == "__main__":
    main()
