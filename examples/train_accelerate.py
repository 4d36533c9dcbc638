"""Domain adaptation of a causal LM with a plain Accelerate loop and hf_zero's `ZeroAccelerator`.

    ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu_2proc.yaml \\
        examples/train_accelerate.py --model_name_or_path ./llama-base --train_files corpus/ \\
        --output_dir out --zero_stage 3 --max_train_steps 200 --checkpointing_steps 50

The loop is the DDP loop of any Accelerate script; the one hf_zero line is
`ZeroAccelerator(zero_plugin=ZeroPlugin(zero_stage=...), ...)` in place of `Accelerator(...)`.
Every `--checkpointing_steps` it saves `<output_dir>/step_N` with `accelerator.save_state` (the
model and optimizer as hf_zero shards; with `--zero_async_save` written in the background while
training goes on); `--resume_from_checkpoint latest` (or a path) continues from there. At the end
it writes `<output_dir>/final`, a `from_pretrained` directory, and `<output_dir>/log.jsonl` with
the loss of every step.
"""

from __future__ import annotations

import _quiet  # noqa: F401 - first: silences optional packages' import-time notes

import argparse
import json
import math
import os
import re

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_scheduler, set_seed

import hf_zero
from clm_data import load_corpus


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", required=True, help="a local from_pretrained directory")
    p.add_argument("--train_files", nargs="+", required=True, help="corpus files, globs or folders")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--zero_stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--zero_wrap", default="auto", help="'auto' or comma-separated block class names")
    p.add_argument("--block_size", type=int, default=512)
    p.add_argument("--validation_files", nargs="+", default=None,
                   help="held-out files, globs or folders (default: --validation_split_percentage of the training blocks)")
    p.add_argument("--validation_split_percentage", type=float, default=5.0)
    p.add_argument("--text_column", default="text")
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--per_device_eval_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=5e-5)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--max_train_steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--lr_scheduler_type", default="linear")
    p.add_argument("--num_warmup_steps", type=int, default=0)
    p.add_argument("--checkpointing_steps", type=int, default=None, help="save_state every N optimizer steps")
    p.add_argument("--resume_from_checkpoint", default=None, help="a step_N directory, or 'latest'")
    p.add_argument("--zero_async_save", action="store_true",
                   help="write each checkpoint's shards in the background: training goes on once they are copied to "
                        "host memory")
    p.add_argument("--zero_snapshot_budget", default=None,
                   help="with --zero_async_save, the most host memory a checkpoint's copy takes per rank ('8GB')")
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args()
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "max_train_steps", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete step_N (a save that was interrupted is skipped)."""
    last = hf_zero.last_complete_checkpoint(output_dir, r"step_(\d+)")
    return str(last) if last is not None else None


def evaluate(accelerator: hf_zero.ZeroAccelerator, model: torch.nn.Module, loader: DataLoader) -> float:
    """Held-out perplexity: every rank takes part (the model may be sharded)."""
    model.eval()
    losses = []
    with torch.no_grad():
        for batch in loader:
            loss = model(**batch).loss
            losses.append(accelerator.gather_for_metrics(loss.detach().repeat(batch["input_ids"].shape[0])))
    model.train()
    return math.exp(torch.cat(losses).mean().item())


def main() -> None:
    args = parse_args()
    wrap = "auto" if args.zero_wrap == "auto" else tuple(w.strip() for w in args.zero_wrap.split(","))
    accelerator = hf_zero.ZeroAccelerator(
        zero_plugin=hf_zero.ZeroPlugin(zero_stage=args.zero_stage, zero_wrap=wrap, zero_async_save=args.zero_async_save,
                                       zero_snapshot_budget=args.zero_snapshot_budget),
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    )
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    with accelerator.main_process_first():
        data = load_corpus(args.train_files, tokenizer, block_size=args.block_size,
                           validation_split_percentage=args.validation_split_percentage, seed=args.seed,
                           validation_patterns=args.validation_files, text_column=args.text_column)
    train_loader = DataLoader(data["train"], shuffle=True, batch_size=args.per_device_train_batch_size,
                              collate_fn=default_data_collator, generator=torch.Generator().manual_seed(args.seed))
    eval_loader = DataLoader(data["validation"], batch_size=args.per_device_eval_batch_size, collate_fn=default_data_collator)

    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.learning_rate)
    # Accelerate's prepared scheduler steps once per process at each optimizer step: scale to match.
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer,
                              num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
                              num_training_steps=args.max_train_steps * accelerator.num_processes)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    step = 0
    resume = latest_checkpoint(args.output_dir) if args.resume_from_checkpoint == "latest" else args.resume_from_checkpoint
    if resume is not None:
        accelerator.load_state(resume)
        step = int(re.fullmatch(r"step_(\d+)", os.path.basename(os.path.normpath(resume))).group(1))
        accelerator.print(f"resumed from {resume} at step {step}")
    perplexity_before = evaluate(accelerator, model, eval_loader)

    batches_per_epoch = len(train_loader)
    bar = tqdm(total=args.max_train_steps, initial=step, desc="training", disable=not accelerator.is_main_process)
    log = open(os.path.join(args.output_dir, "log.jsonl"), "a") if accelerator.is_main_process else None
    micro_losses: list[torch.Tensor] = []
    while step < args.max_train_steps:
        epoch, done_in_epoch = divmod(step * args.gradient_accumulation_steps, batches_per_epoch)
        train_loader.set_epoch(epoch)
        loader = accelerator.skip_first_batches(train_loader, done_in_epoch) if done_in_epoch else train_loader
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                micro_losses.append(loss.detach())
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm) if accelerator.sync_gradients else None
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            mean_loss = accelerator.gather(torch.stack(micro_losses).mean()).mean().item()
            micro_losses.clear()
            bar.update(1)
            bar.set_postfix(loss=f"{mean_loss:.4f}")
            if log is not None:
                log.write(json.dumps({"step": step, "loss": mean_loss, "grad_norm": float(grad_norm),
                                      "lr": scheduler.get_last_lr()[0]}) + "\n")
                log.flush()
            if args.checkpointing_steps and step % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{step}"))
            if step >= args.max_train_steps:
                break
    bar.close()

    perplexity_after = evaluate(accelerator, model, eval_loader)
    final_dir = os.path.join(args.output_dir, "final")
    accelerator.save_model(model, final_dir)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(final_dir)
        log.close()
    accelerator.wait_for_checkpoints()  # with --zero_async_save: the last step_N is committed
    accelerator.print(f"held-out perplexity: {perplexity_before:.2f} before -> {perplexity_after:.2f} after "
                      f"{step} steps; model saved to {final_dir}")


if __name__ == "__main__":
    main()
