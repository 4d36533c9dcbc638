"""The demo's last step: reload the consolidated model with `from_pretrained` and report what adaptation did.

    python examples/demo_report.py --assets outputs/demo --trained outputs/demo/model --run outputs/demo/run

Held-out perplexity of the base and the domain-adapted model on the domain (standard-library
modules never trained on) and on general text (packages never trained on: what adaptation
costs), the runtime of each phase, and a sample generation. Writes `<assets>/report.json` and
exits non-zero when the adapted model is not clearly better on the domain.
"""

from __future__ import annotations

import _quiet  # noqa: F401 - first: silences optional packages' import-time notes

import argparse
import json
import math
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator

from clm_data import load_corpus

PROMPT = "json.dumps(obj, *, skipkeys=False, ensure_ascii=True, indent=None)\n   "
# The domain-adapted model must reach at most this share of the base model's domain perplexity.
REQUIRED_RATIO = 0.75


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
    p.add_argument("--assets", required=True, help="the --out folder of make_demo_assets.py")
    p.add_argument("--trained", required=True, help="the consolidated from_pretrained directory")
    p.add_argument("--run", default=None, help="the training run's --output_dir (for its runtime)")
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--started", type=float, default=None, help="the demo's start, in seconds since the epoch")
    args = p.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.trained)
    held_out = {
        name: load_corpus([os.path.join(args.assets, folder, "train.jsonl")], tokenizer, block_size=args.block_size,
                          validation_split_percentage=0, seed=0,
                          validation_patterns=[os.path.join(args.assets, folder, "held_out.jsonl")])["validation"]
        for name, folder in (("domain", "corpus"), ("general", "general"))
    }
    base = AutoModelForCausalLM.from_pretrained(os.path.join(args.assets, "base"))
    trained = AutoModelForCausalLM.from_pretrained(args.trained)
    results = {name: {"blocks": len(blocks), "base": perplexity(base, blocks), "adapted": perplexity(trained, blocks)}
               for name, blocks in held_out.items()}
    with open(os.path.join(args.assets, "assets.json")) as f:
        assets = json.load(f)
    runtime = {"pretraining_s": assets["pretraining"]["seconds"], "pretraining_cached": assets["pretraining"]["cached"]}
    if args.run:
        state = os.path.join(args.run, "domain_adaptation.json")
        if os.path.isfile(state):
            with open(state) as f:
                runtime["adaptation_s"] = json.load(f).get("train_runtime")
    if args.started:
        runtime["demo_total_s"] = round(time.time() - args.started, 1)

    inputs = tokenizer(PROMPT, return_tensors="pt")
    out = trained.generate(**inputs, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    sample = tokenizer.decode(out[0], skip_special_tokens=True)
    with open(os.path.join(args.assets, "report.json"), "w") as f:
        json.dump({"perplexity": results, "runtime": runtime, "sample": sample}, f, indent=2)

    domain, general = results["domain"], results["general"]
    print("\n=== hf_zero domain-adaptation demo (ZeRO-3, 2 processes) ===")
    print(f"domain:  Python standard-library docs, {domain['blocks']} held-out blocks of {args.block_size} tokens "
          f"from modules never trained on")
    print(f"general: installed packages' READMEs and licenses, {general['blocks']} held-out blocks")
    print(f"{'held-out perplexity':<22}{'base':>10}{'adapted':>10}")
    for name, r in results.items():
        print(f"{name:<22}{r['base']:>10.1f}{r['adapted']:>10.1f}   ({r['adapted'] / r['base']:.2f}x)")
    cached = " (cached from an earlier run)" if runtime["pretraining_cached"] else ""
    line = f"runtime: general pretraining {runtime['pretraining_s']:.0f} s{cached}"
    if runtime.get("adaptation_s") is not None:
        line += f", domain adaptation {float(runtime['adaptation_s']):.0f} s"
    if "demo_total_s" in runtime:
        line += f", whole demo {runtime['demo_total_s']:.0f} s"
    print(line)
    print(f"model reloaded with AutoModelForCausalLM.from_pretrained({args.trained!r})")
    print("sample generation (greedy):\n" + sample)
    if not domain["adapted"] <= REQUIRED_RATIO * domain["base"]:
        raise SystemExit(f"domain perplexity went from {domain['base']:.1f} to {domain['adapted']:.1f}, "
                         f"not below {REQUIRED_RATIO:.0%} of the base model's: no real adaptation")


if __name__ == "__main__":
    main()
