"""Create the demo's bundled default from real text on this machine: corpora, a tokenizer, a base model.

    python examples/make_demo_assets.py --out outputs/demo --cache outputs/demo_cache

Nothing is downloaded (see `demo_corpus.py` for where the text comes from):

- `corpus/train.jsonl`, `corpus/held_out.jsonl`: the domain, the Python standard library's
  documentation (one record per module), split by top-level module.
- `general/train.jsonl`, `general/held_out.jsonl`: general text, the READMEs and licenses of the
  installed packages, split by distribution.
- `instructions.jsonl`: prompt/completion pairs made from the domain's training part
  ("What does `json.dumps(obj, ...)` do?" -> the first paragraph of its docstring), for
  `examples/sft_trl.py`.
- `base/`: the base model, a small LLaMA with a byte-level BPE tokenizer trained on the general
  text, *pretrained on the general text* (single process) so that the demo adapts a model that
  already knows some English and Markdown rather than training one from scratch. Pretraining
  takes about two minutes on 2 CPU cores; its result is cached under `--cache`, keyed by the
  general text and every setting, and reused on the next run.
"""

from __future__ import annotations

import _quiet  # noqa: F401 - first: silences optional packages' import-time notes

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import time

from demo_corpus import Document, package_documents, split_documents, stdlib_documents

CONFIG_KEYS = ("vocab_size", "hidden", "layers", "seq", "block_size", "pretrain_steps", "pretrain_batch",
               "pretrain_lr", "seed")


def write_jsonl(path: str, documents: list[Document]) -> int:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for doc in documents:
            f.write(json.dumps({"text": doc.text, "source": doc.group}) + "\n")
    return sum(len(d.text) for d in documents)


def instruction_pairs(documents: list[Document], limit: int, seed: int) -> list[dict[str, str]]:
    """Questions about documented functions and classes, answered by the first paragraph of their docstring."""
    pairs = []
    for doc in documents:
        for entry in doc.entries:
            head, _, body = entry.partition("\n    ")
            if head.startswith("Module ") or not body:
                continue
            answer = body.split("\n    \n")[0].replace("\n    ", " ").strip()
            if 20 <= len(answer) <= 300:
                pairs.append({"prompt": f"What does `{head}` do?\n", "completion": answer})
    random.Random(seed).shuffle(pairs)
    return pairs[:limit]


def train_tokenizer(texts: list[str], directory: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(directory)


def blocks_of(texts: list[str], tokenizer, block_size: int):
    import torch

    stream: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream += ids + [tokenizer.eos_token_id]
    n = len(stream) // block_size
    return torch.tensor(stream[: n * block_size]).view(n, block_size)


def pretrain(directory: str, train: list[str], held_out: list[str], args: argparse.Namespace) -> dict[str, float]:
    """Initialize a small LLaMA and train it on the general text (one process, plain PyTorch)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 8 // 3 // 8 * 8, num_hidden_layers=args.layers,
                         num_attention_heads=max(1, args.hidden // 32), num_key_value_heads=max(1, args.hidden // 64),
                         max_position_embeddings=args.seq, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=3)
    model = AutoModelForCausalLM.from_config(config)
    blocks = blocks_of(train, tokenizer, args.block_size)
    evaluation = blocks_of(held_out, tokenizer, args.block_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, weight_decay=0.01)
    warmup = max(1, args.pretrain_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / max(1, args.pretrain_steps)))))
    generator = torch.Generator().manual_seed(args.seed)
    started = time.perf_counter()
    model.train()
    for step in range(args.pretrain_steps):
        batch = blocks[torch.randint(len(blocks), (args.pretrain_batch,), generator=generator)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 50 == 0 or step + 1 == args.pretrain_steps:
            print(f"  pretraining step {step + 1}/{args.pretrain_steps}: loss {loss.item():.3f} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    model.eval()
    with torch.no_grad():
        losses = [model(input_ids=b, labels=b).loss.item() for b in evaluation.split(16)] if len(evaluation) else []
    model.save_pretrained(directory)
    return {"steps": args.pretrain_steps, "tokens": args.pretrain_steps * args.pretrain_batch * args.block_size,
            "train_blocks": len(blocks), "seconds": round(time.perf_counter() - started, 1),
            "general_held_out_perplexity": math.exp(sum(losses) / len(losses)) if losses else float("nan")}


def build_base(base: str, general_train: list[str], general_held: list[str], args: argparse.Namespace) -> dict:
    """The pretrained base in `base`, from the cache when the same text and settings were seen before."""
    key = hashlib.sha256(json.dumps([general_train, general_held, {k: getattr(args, k) for k in CONFIG_KEYS}])
                         .encode()).hexdigest()[:16]
    cached = os.path.join(args.cache, f"base-{key}") if args.cache else None
    if cached and os.path.isfile(os.path.join(cached, "pretraining.json")):
        shutil.copytree(cached, base, dirs_exist_ok=True)
        with open(os.path.join(base, "pretraining.json")) as f:
            info = json.load(f)
        print(f"base model: reused the pretrained base cached in {cached}")
        return {**info, "cached": True}
    work = f"{cached or base}.tmp-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    train_tokenizer(general_train, work, args.vocab_size)
    print(f"base model: pretraining on the general text for {args.pretrain_steps} steps")
    info = pretrain(work, general_train, general_held, args)
    with open(os.path.join(work, "pretraining.json"), "w") as f:
        json.dump(info, f, indent=2)
    if cached:
        shutil.rmtree(cached, ignore_errors=True)
        os.replace(work, cached)  # the cache holds only complete bases
        shutil.copytree(cached, base, dirs_exist_ok=True)
    else:
        shutil.rmtree(base, ignore_errors=True)
        os.replace(work, base)
    return {**info, "cached": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/demo", help="where to write corpus/, general/, base/")
    parser.add_argument("--cache", default=None, help="where pretrained bases are kept between runs (none: no cache)")
    parser.add_argument("--held_out_percent", type=float, default=8.0, help="share of each corpus held out")
    parser.add_argument("--max_documents", type=int, default=None, help="use only this many documents per corpus")
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256, help="the model's maximum sequence length")
    parser.add_argument("--block_size", type=int, default=128, help="tokens per pretraining block")
    parser.add_argument("--pretrain_steps", type=int, default=400, help="0 leaves the base randomly initialized")
    parser.add_argument("--pretrain_batch", type=int, default=16)
    parser.add_argument("--pretrain_lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.pretrain_steps < 0 or args.vocab_size < 300:
        raise ValueError("--pretrain_steps must be >= 0 and --vocab_size >= 300 (the byte alphabet and special tokens)")

    domain, general = stdlib_documents(), package_documents()
    if args.max_documents:
        domain, general = domain[: args.max_documents], general[: args.max_documents]
    domain_train, domain_held, domain_counts = split_documents(domain, args.held_out_percent)
    general_train, general_held, general_counts = split_documents(general, args.held_out_percent)
    if not domain_held or not general_held:
        raise ValueError("A held-out split came out empty; raise --held_out_percent or --max_documents.")

    sizes = {
        "domain_train": write_jsonl(os.path.join(args.out, "corpus", "train.jsonl"), domain_train),
        "domain_held_out": write_jsonl(os.path.join(args.out, "corpus", "held_out.jsonl"), domain_held),
        "general_train": write_jsonl(os.path.join(args.out, "general", "train.jsonl"), general_train),
        "general_held_out": write_jsonl(os.path.join(args.out, "general", "held_out.jsonl"), general_held),
    }
    with open(os.path.join(args.out, "instructions.jsonl"), "w", encoding="utf-8") as f:
        for pair in instruction_pairs(domain_train, limit=512, seed=args.seed):
            f.write(json.dumps(pair) + "\n")
    print(f"domain corpus (Python standard library docs): {sizes['domain_train'] / 1e6:.2f} MB train, "
          f"{sizes['domain_held_out'] / 1e3:.0f} kB held out from {len({d.group for d in domain_held})} modules "
          f"never trained on ({domain_counts['near_copies_dropped']} near-copies of training text dropped)")
    print(f"general corpus (installed packages' READMEs and licenses): {sizes['general_train'] / 1e6:.2f} MB train, "
          f"{sizes['general_held_out'] / 1e3:.0f} kB held out from {len({d.group for d in general_held})} packages")

    base = os.path.join(args.out, "base")
    info = build_base(base, [d.text for d in general_train], [d.text for d in general_held], args)
    with open(os.path.join(args.out, "assets.json"), "w") as f:
        json.dump({"sizes": sizes, "domain": domain_counts, "general": general_counts, "pretraining": info}, f, indent=2)
    print(f"base model in {base}: pretrained {info['steps']} steps on {info['tokens'] / 1e6:.2f}M tokens of general "
          f"text in {info['seconds']:.0f} s{' (cached)' if info['cached'] else ''}; general held-out perplexity "
          f"{info['general_held_out_perplexity']:.1f}")


if __name__ == "__main__":
    main()
