"""Create the demo's bundled default: a domain corpus, a tokenizer trained on it, a small LLaMA base.

    python examples/make_demo_assets.py --out outputs/demo

Nothing is downloaded. The corpus is a deterministic, generated set of wind-turbine maintenance
logs (a stand-in for a private domain corpus: a narrow vocabulary, recurring structure and
facts, e.g. which component fails with which symptom). The tokenizer is a byte-level BPE trained
on it offline; the "base" model is a small randomly initialized LLaMA saved with
`save_pretrained`, as a real base checkpoint would be.
"""

from __future__ import annotations

import argparse
import os
import random

SITES = ["North Ridge", "Kestrel Bay", "Harlow Flats", "Dunmore Hill", "Saltmarsh", "Greywater", "Elm Crossing"]
COMPONENTS = {
    "gearbox": ("oil temperature above limit", "replaced the high-speed bearing", "metal particles in the oil filter"),
    "pitch system": ("blade angle deviation", "recalibrated the pitch encoder", "slow response of blade two"),
    "yaw drive": ("yaw misalignment alarm", "tightened the yaw brake calipers", "grinding noise during rotation"),
    "generator": ("winding temperature warning", "cleaned the cooling ducts", "insulation resistance below spec"),
    "converter": ("DC link overvoltage trip", "swapped the IGBT module", "fan failure in cabinet three"),
    "main bearing": ("vibration level rising", "regreased the main bearing", "spalling found on the outer race"),
    "anemometer": ("wind speed reading frozen", "replaced the ultrasonic sensor", "icing on the sensor head"),
}
TECHS = ["A. Moreau", "J. Okafor", "L. Brandt", "S. Ito", "M. Castillo", "R. Novak"]
PRIORITIES = ["low", "medium", "high", "critical"]


def log_entry(rng: random.Random, index: int) -> str:
    component = rng.choice(list(COMPONENTS))
    symptom, action, finding = COMPONENTS[component]
    turbine = f"WTG-{rng.randint(1, 48):02d}"
    site = rng.choice(SITES)
    day = rng.randint(1, 28)
    month = rng.choice(["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"])
    hours = rng.randint(2, 11)
    lines = [
        f"Work order {10000 + index} | site {site} | turbine {turbine} | {day} {month} 2025",
        f"Reported: {symptom} on the {component}. Priority {rng.choice(PRIORITIES)}.",
        f"Inspection: {finding}.",
        f"Action: technician {rng.choice(TECHS)} {action}; turbine back in service after {hours} hours.",
    ]
    if rng.random() < 0.4:
        lines.append(f"Follow-up: check the {component} again at the next scheduled service.")
    return "\n".join(lines)


def write_corpus(directory: str, documents: int, seed: int) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(seed)
    texts = [log_entry(rng, i) for i in range(documents)]
    per_file = max(1, len(texts) // 4)
    for k in range(0, len(texts), per_file):
        with open(os.path.join(directory, f"maintenance_logs_{k // per_file:02d}.txt"), "w") as f:
            f.write("\n\n".join(texts[k : k + per_file]) + "\n")
    return texts


def train_tokenizer(texts: list[str], directory: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(directory)


def save_base_model(directory: str, vocab_size: int, hidden: int, layers: int, seq: int, seed: int) -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 8 * 8,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 32),
                         num_key_value_heads=max(1, hidden // 64), max_position_embeddings=seq,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/demo", help="where to write corpus/, base/ (default outputs/demo)")
    parser.add_argument("--documents", type=int, default=3000, help="number of generated log entries")
    parser.add_argument("--vocab_size", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256, help="the model's maximum sequence length")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    corpus, base = os.path.join(args.out, "corpus"), os.path.join(args.out, "base")
    texts = write_corpus(corpus, args.documents, args.seed)
    train_tokenizer(texts, base, args.vocab_size)
    n = save_base_model(base, args.vocab_size, args.hidden, args.layers, args.seq, args.seed)
    size = sum(os.path.getsize(os.path.join(corpus, f)) for f in os.listdir(corpus))
    print(f"corpus: {len(texts)} documents, {size / 1e6:.1f} MB in {corpus}; base model: LLaMA with "
          f"{n / 1e6:.2f}M parameters and its tokenizer in {base}")


if __name__ == "__main__":
    main()
