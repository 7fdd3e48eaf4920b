"""Byte-level tokenizer: token id = byte value of the UTF-8 text, nothing to download.

The vocabulary is exactly the 256 byte values, so it matches meshplan's tiny model presets
(``vocab=256``) and any model with a larger vocabulary. There is no room for extra special
tokens, so the end-of-document marker reuses the NUL byte (id 0), which text files do not
contain: `encode(text, eos=True)` appends it, the data pipeline puts it between documents,
and `decode` drops it. Every byte sequence decodes (invalid UTF-8 becomes U+FFFD), and
``decode(encode(s)) == s`` for every str without NUL characters.

`load(directory)` returns a Hugging Face tokenizer read from a local directory instead
(`HFTokenizer`); both kinds have the same small interface: `vocab_size`, `eos_id`, `id` (recorded
in token caches), `encode_array(text, eos=)`, `decode(ids)`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from meshplan.errors import ConfigError

__all__ = ["VOCAB_SIZE", "EOS_ID", "TOKENIZER_ID", "encode", "encode_array", "decode", "ByteTokenizer",
           "HFTokenizer", "load", "check_model_vocab"]

VOCAB_SIZE = 256
EOS_ID = 0                      # the NUL byte doubles as the end-of-document token
TOKENIZER_ID = "meshplan-bytes-v1"   # recorded in token-cache manifests; change it if encoding changes


def encode_array(text: str | bytes, *, eos: bool = False) -> np.ndarray:
    """Token ids of `text` as a uint16 array (the dtype of meshplan's token files)."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    ids = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)     # (n,)
    if eos:
        ids = np.append(ids, np.uint16(EOS_ID))
    return ids


def encode(text: str | bytes, *, eos: bool = False) -> list[int]:
    """Token ids of `text` (its UTF-8 bytes), plus `EOS_ID` at the end when eos=True."""
    return encode_array(text, eos=eos).tolist()


def decode(ids: Iterable[int]) -> str:
    """Text of token ids; EOS tokens are dropped and invalid UTF-8 becomes U+FFFD.

    Ids outside 0..255 cannot come from this tokenizer (a model with a padded vocabulary may
    still sample them): they decode to U+FFFD too instead of raising mid-generation.
    """
    out = bytearray()
    for i in ids:
        i = int(i)
        if i == EOS_ID:
            continue
        out += bytes((i,)) if 0 <= i < VOCAB_SIZE else "\ufffd".encode()
    return out.decode("utf-8", errors="replace")


# ---- tokenizers loaded from a directory ---------------------------------------------------
# Tokens tried, in order, as the end-of-document marker of a tokenizer that does not name one
# (tokenizer.json alone has no "eos" notion): GPT-2/Llama-3, Llama/Mistral, Gemma, BERT-style.
_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class ByteTokenizer:
    """The byte tokenizer above as an object with the interface of `HFTokenizer`."""

    name = "bytes"
    id = TOKENIZER_ID
    vocab_size = VOCAB_SIZE
    eos_id: int | None = EOS_ID

    def encode_array(self, text: str | bytes, *, eos: bool = False) -> np.ndarray:
        return encode_array(text, eos=eos)

    def decode(self, ids: Iterable[int]) -> str:
        return decode(ids)


class HFTokenizer:
    """A Hugging Face tokenizer read from a local directory: `tokenizers.Tokenizer` from its
    tokenizer.json, or `transformers.AutoTokenizer` for a directory without one (sentencepiece
    files), when transformers is installed. Nothing is downloaded.

    `vocab_size` counts added special tokens too (the ids the tokenizer can emit), which is what
    the model's embedding must hold. `id` names the tokenizer's exact contents (a hash of its
    files) so token caches re-tokenise when the tokenizer changes.
    """

    def __init__(self, path: str | Path):
        import hashlib
        import json
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise ConfigError(f"--tokenizer {str(self.path)!r} is not a directory; give a directory holding "
                              "tokenizer.json (or a transformers tokenizer: tokenizer_config.json and its "
                              "vocabulary files), or leave --tokenizer out for the byte tokenizer")
        files = sorted(p for p in self.path.iterdir() if p.is_file() and p.suffix in (".json", ".model", ".txt"))
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.name.encode() + f.read_bytes())
        self.id = f"hf-{digest.hexdigest()[:16]}"
        self.name = self.path.name
        config = {}
        if (self.path / "tokenizer_config.json").is_file():
            config = json.loads((self.path / "tokenizer_config.json").read_text())
        self._tok = self._hf = None
        if (self.path / "tokenizer.json").is_file():
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise ConfigError("reading tokenizer.json needs the `tokenizers` package: pip install tokenizers") from None
            self._tok = Tokenizer.from_file(str(self.path / "tokenizer.json"))
            self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
            eos = config.get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            names = ([eos] if eos else []) + list(_EOS_CANDIDATES)
            self.eos_id = next((i for i in (self._tok.token_to_id(n) for n in names) if i is not None), None)
        else:
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise ConfigError(f"{str(self.path)!r} has no tokenizer.json; reading another tokenizer format needs "
                                  "transformers (pip install transformers), or save the tokenizer with "
                                  "tokenizer.save_pretrained() to get a tokenizer.json") from None
            try:
                self._hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
            except (OSError, ValueError) as e:
                raise ConfigError(f"transformers could not load a tokenizer from {str(self.path)!r}: {e}") from None
            self.vocab_size = len(self._hf)
            self.eos_id = self._hf.eos_token_id

    def encode_ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens (documents are joined with `eos_id` only)."""
        if self._tok is not None:
            return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        return self._hf(texts, add_special_tokens=False)["input_ids"]

    def encode_array(self, text: str | bytes, *, eos: bool = False) -> np.ndarray:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        ids = self.encode_ids([text])[0] + ([self.eos_id] if eos and self.eos_id is not None else [])
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        return self._tok.decode(ids) if self._tok is not None else self._hf.decode(ids)


def load(path: str | Path | None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer in directory `path` (None or "bytes": the byte tokenizer)."""
    if path is None or str(path) in ("bytes", "byte"):
        return ByteTokenizer()
    return HFTokenizer(path)


def check_model_vocab(tok, model_vocab: int | None) -> None:
    """Refuse a tokenizer whose ids would index past the model's embedding rows."""
    if model_vocab is not None and tok.vocab_size > model_vocab:
        raise ConfigError(f"the tokenizer ({tok.name}) has a vocabulary of {tok.vocab_size} tokens, but the "
                          f"model's embedding has only {model_vocab} rows; build the model with vocab>="
                          f"{tok.vocab_size} (e.g. a config with vocab_size={tok.vocab_size}, padded to a "
                          "multiple of 64 for speed) or use a tokenizer with a smaller vocabulary")
