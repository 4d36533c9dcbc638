"""Corpus preparation shared by the examples: local files -> tokenized, packed blocks, held-out split.

Accepts text (`.txt`, `.md`), JSON lines (`.jsonl`, `.json`) and Parquet files, given as paths,
globs or folders (searched recursively). Documents are tokenized with the model's tokenizer,
an end-of-sequence token is appended to each, and the stream is cut into `block_size` blocks
(the remainder is dropped), as continued pretraining does. With `packing=True` the blocks keep the document
boundaries instead: `position_ids` restart at each document (or piece of a long one), whose first token is not
predicted from the one before (label -100), so no token attends across a boundary (what transformers'
`DataCollatorWithFlattening` gives; the model must run without a KV cache, `use_cache=False`). The held-out split is either given as
its own files (`validation_patterns`, the better choice: whole documents the model never sees) or
taken from the blocks with a fixed seed, so every script that uses the same arguments sees the
same split.
"""

from __future__ import annotations

import glob
import os
from typing import Any

from datasets import Dataset, DatasetDict, load_dataset

_BUILDERS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def resolve_files(patterns: list[str], option: str = "--train_files") -> tuple[str, list[str]]:
    """Expand paths, globs and folders; returns the `datasets` builder and the sorted files."""
    files: list[str] = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            for root, _, names in os.walk(pattern):
                files += [os.path.join(root, n) for n in names if os.path.splitext(n)[1] in _BUILDERS]
        else:
            matched = glob.glob(pattern, recursive=True)
            if not matched:
                raise FileNotFoundError(f"{option}: nothing matches {pattern!r}.")
            files += matched
    files = sorted(set(files))
    if not files:
        raise FileNotFoundError(f"{option}: no .txt, .md, .jsonl, .json or .parquet file in {patterns}.")
    builders = {_BUILDERS.get(os.path.splitext(f)[1]) for f in files}
    if None in builders:
        bad = [f for f in files if os.path.splitext(f)[1] not in _BUILDERS]
        raise ValueError(f"{option}: unsupported file type(s) {bad[:3]}; use .txt, .md, .jsonl, .json or .parquet.")
    if len(builders) > 1:
        raise ValueError(f"{option} mixes file kinds {sorted(builders)}; pass one kind per run.")
    return builders.pop(), files


def load_corpus(
    patterns: list[str],
    tokenizer: Any,
    *,
    block_size: int,
    validation_split_percentage: float,
    seed: int,
    validation_patterns: list[str] | None = None,
    text_column: str = "text",
    num_proc: int | None = None,
    packing: bool = False,
) -> DatasetDict:
    """Tokenized, packed `train` and `validation` splits of the corpus.

    Example:
        >>> data = load_corpus(["corpus/train.jsonl"], tokenizer, block_size=128, validation_split_percentage=5,
        ...                    seed=42, validation_patterns=["corpus/held_out.jsonl"])  # doctest: +SKIP
    """
    train = _blocks(patterns, "--train_files", tokenizer, block_size, text_column, num_proc, packing)
    if validation_patterns:
        validation = _blocks(validation_patterns, "--validation_files", tokenizer, block_size, text_column, num_proc,
                             packing)
        return DatasetDict(train=train, validation=validation)
    if len(train) < 2:
        raise ValueError(f"The corpus gives {len(train)} block(s) of {block_size} tokens; add text or lower --block_size.")
    test_size = max(1, int(len(train) * validation_split_percentage / 100))
    split = train.train_test_split(test_size=test_size, seed=seed, shuffle=True)
    return DatasetDict(train=split["train"], validation=split["test"])


def pack_documents(documents: list[list[int]], block_size: int) -> dict[str, list[list[int]]]:
    """Whole documents into blocks of exactly `block_size` tokens, their boundaries kept: a document that does not
    fit in what is left of a block is cut there and goes on in the next one as a document of its own; the last,
    partial block is dropped. Returns `input_ids`, `position_ids` (restarting at each document or piece) and
    `labels` (-100 at each one's first token).

    Example:
        >>> pack_documents([[1, 2, 3], [4, 5, 6, 7]], 4)["position_ids"]
        [[0, 1, 2, 0]]
    """
    blocks: dict[str, list[list[int]]] = {"input_ids": [], "position_ids": [], "labels": []}
    ids: list[int] = []
    pos: list[int] = []
    labels: list[int] = []
    for doc in documents:
        while doc:
            piece, doc = doc[: block_size - len(ids)], doc[block_size - len(ids):]
            ids += piece
            pos += list(range(len(piece)))
            labels += [-100] + piece[1:]
            if len(ids) == block_size:
                for key, value in (("input_ids", ids), ("position_ids", pos), ("labels", labels)):
                    blocks[key].append(value)
                ids, pos, labels = [], [], []
    return blocks


def _blocks(patterns: list[str], option: str, tokenizer: Any, block_size: int, text_column: str,
            num_proc: int | None, packing: bool = False) -> Dataset:
    builder, files = resolve_files(patterns, option)
    raw: Dataset = load_dataset(builder, data_files=files, split="train")
    if text_column not in raw.column_names:
        raise ValueError(f"{option}: the corpus has no column {text_column!r} (it has {raw.column_names}); "
                         "set --text_column.")
    raw = raw.filter(lambda batch: [bool(t and t.strip()) for t in batch[text_column]], batched=True)
    eos = tokenizer.eos_token_id

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] if eos is not None else x for x in ids]}

    def pack(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        if packing:
            return pack_documents(batch["input_ids"], block_size)
        stream = [t for ids in batch["input_ids"] for t in ids]
        n = len(stream) // block_size * block_size
        blocks = [stream[i : i + block_size] for i in range(0, n, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    tokens = raw.map(tokenize, batched=True, remove_columns=raw.column_names, num_proc=num_proc, desc="tokenizing")
    blocks = tokens.map(pack, batched=True, batch_size=1000, num_proc=num_proc, desc=f"packing into {block_size}-token blocks")
    if len(blocks) < 1:
        raise ValueError(f"{option} gives no block of {block_size} tokens; add text or lower --block_size.")
    return blocks
