"""Small data sets for the data tests, built here (no downloads): a BPE tokenizer trained on a few
lines with the `tokenizers` library, JSONL / text / Parquet sources of short documents."""

from __future__ import annotations

import json
from pathlib import Path

LINES = ["the quick brown fox jumps over the lazy dog", "a packed sequence holds several documents",
         "attention must not cross document boundaries", "meshplan trains on real data now",
         "every rank reads its own rows of the batch", "validation runs without gradients"]


def documents(n: int, offset: int = 0) -> list[str]:
    """n documents of 1..5 lines each (deterministic)."""
    return [" ".join(LINES[(i + j) % len(LINES)] for j in range((i + offset) % 5 + 1)) for i in range(n)]


def bpe_tokenizer(root: Path, vocab_size: int = 120) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(LINES * 3, trainers.BpeTrainer(vocab_size=vocab_size,
                                                           special_tokens=["[UNK]", "<|endoftext|>"]))
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    return root


def wordlevel_tokenizer(root: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(LINES, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    return root


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path
