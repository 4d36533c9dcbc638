"""The demo's last step: reload the consolidated model with `from_pretrained`, compare held-out
perplexity with the base model's, and show a sample generation.

    python examples/demo_report.py --base outputs/demo/base --trained outputs/demo/model \\
        --train_files outputs/demo/corpus --block_size 128 --seed 42

`--train_files`, `--block_size`, `--validation_split_percentage` and `--seed` must be those of the
training run, so that the held-out blocks are the same ones.
"""

from __future__ import annotations

import argparse
import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator

from clm_data import load_corpus

PROMPT = "Work order 20417 | site North Ridge | turbine WTG-07 | 3 Mar 2025\nReported:"


def perplexity(model: torch.nn.Module, blocks: object, batch_size: int = 16) -> float:
    loader = torch.utils.data.DataLoader(blocks, batch_size=batch_size, collate_fn=default_data_collator)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for batch in loader:
            n = batch["input_ids"].shape[0]
            total += model(**batch).loss.item() * n
            count += n
    return math.exp(total / count)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True)
    p.add_argument("--trained", required=True, help="the consolidated from_pretrained directory")
    p.add_argument("--train_files", nargs="+", required=True)
    p.add_argument("--block_size", type=int, default=512)
    p.add_argument("--validation_split_percentage", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.trained)
    held_out = load_corpus(args.train_files, tokenizer, block_size=args.block_size,
                           validation_split_percentage=args.validation_split_percentage, seed=args.seed)["validation"]
    base = AutoModelForCausalLM.from_pretrained(args.base)
    trained = AutoModelForCausalLM.from_pretrained(args.trained)
    before, after = perplexity(base, held_out), perplexity(trained, held_out)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    out = trained.generate(**inputs, max_new_tokens=60, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    print("\n=== hf_zero domain-adaptation demo ===")
    print(f"held-out perplexity ({len(held_out)} blocks of {args.block_size} tokens): "
          f"base {before:.2f} -> domain-adapted {after:.2f}")
    print(f"model reloaded with AutoModelForCausalLM.from_pretrained({args.trained!r})")
    print("sample generation (greedy):\n" + tokenizer.decode(out[0], skip_special_tokens=True))
    if not after < before:
        raise SystemExit("the domain-adapted model is not better than the base model on held-out text")


if __name__ == "__main__":
    main()
