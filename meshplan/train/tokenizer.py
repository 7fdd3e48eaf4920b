"""Byte-level tokenizer: token id = byte value of the UTF-8 text, nothing to download.

The vocabulary is exactly the 256 byte values, so it matches meshplan's tiny model presets
(``vocab=256``) and any model with a larger vocabulary. There is no room for extra special
tokens, so the end-of-document marker reuses the NUL byte (id 0), which text files do not
contain: `encode(text, eos=True)` appends it, the data pipeline puts it between documents,
and `decode` drops it. Every byte sequence decodes (invalid UTF-8 becomes U+FFFD), and
``decode(encode(s)) == s`` for every str without NUL characters.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["VOCAB_SIZE", "EOS_ID", "TOKENIZER_ID", "encode", "encode_array", "decode"]

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
