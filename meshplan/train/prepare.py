"""Tokenise training text once into token shards: `meshplan data prepare`, and the reader of what
it writes (`open_prepared`).

A prepared directory holds, per source file (in the order the sources were given, a directory's
files sorted), one shard:

    shard_00000.bin        the shard's tokens, headerless little-endian uint16 (vocabularies of
                           at most 65,536 tokens) or uint32
    shard_00000.docs.npy   int64 offset of each document's first token in the shard
    shard_00000.json       what the shard was made from (source file, its size and mtime, the
                           tokenizer, the text field) and its counts; written last, so a shard
                           without it is unfinished
    index.json             the data set: format, tokenizer, vocab_size, eos_id, dtype, the shards
                           in order with their token and document counts

Each document is tokenised without special tokens and followed by the tokenizer's end-of-text
token (when it has one), so document boundaries are known twice: from the offsets, which the
sampler uses for document masking, and from the EOS token, which the model learns to predict.

Resuming: a rerun skips every shard whose JSON matches its source file, tokenizer and settings
and whose token file has the recorded size; any other shard (never written, interrupted, or its
source changed) is tokenised again. Each file is written under a temporary name and renamed, so
an interrupted run leaves nothing a later run would trust.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from meshplan.errors import ConfigError
from meshplan.train.jsonfile import read_json, write_json
from meshplan.train.sources import read_documents, source_files

__all__ = [
    "PREPARED_FORMAT",
    "PrepareResult",
    "ShardedTokens",
    "is_prepared",
    "open_prepared",
    "prepare",
    "token_dtype",
]

PREPARED_FORMAT = "meshplan-prepared"
PREPARED_VERSION = 1
_PROGRESS_EVERY_S = 10.0


def token_dtype(vocab_size: int) -> str:
    """The smallest token dtype that holds every id of a `vocab_size` vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True, kw_only=True)
class PrepareResult:
    out: Path
    shards: int
    skipped: int             # shards already complete from an earlier run
    num_tokens: int
    num_docs: int


def prepare(sources: list[str | Path], out: str | Path, *, tokenizer=None, text_field: str = "text",
            progress: IO[str] | None = sys.stderr) -> PrepareResult:
    """Tokenise `sources` (files or directories, see meshplan.train.sources) into shards in `out`.

    `tokenizer` is a loaded tokenizer (meshplan.train.tokenizer.load) or None for the byte tokenizer.
    """
    from meshplan.train import tokenizer as tokenizers
    tok = tokenizer if tokenizer is not None else tokenizers.ByteTokenizer()
    if not sources:
        raise ConfigError("no data sources given; name text/JSONL/Parquet files or directories to prepare")
    files = _files(sources)
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tmp"):
        stale.unlink()                     # left by an interrupted run
    dtype = token_dtype(tok.vocab_size)
    settings = {"tokenizer": tok.id, "text_field": text_field, "dtype": dtype}
    shards, skipped, t0 = [], 0, time.perf_counter()
    for i, f in enumerate(files):
        name = f"shard_{i:05d}"
        want = _wanted(f, settings)
        meta = _finished(out, name, want)
        if meta is not None:
            skipped += 1
            _say(progress, f"[{i + 1}/{len(files)}] {f.name}: done in an earlier run, skipped")
        else:
            (out / f"{name}.json").unlink(missing_ok=True)    # the shard is unfinished until it is rewritten
            meta = {"name": name, **want, **_tokenize_file(f, out / name, tok, text_field, dtype, progress,
                                                           f"[{i + 1}/{len(files)}] {f.name}")}
            write_json(out / f"{name}.json", meta)
        shards.append({"name": name, "source": meta["source"], "num_tokens": meta["num_tokens"],
                       "num_docs": meta["num_docs"]})
    total = sum(s["num_tokens"] for s in shards)
    if total < 2:
        raise ConfigError(f"the sources hold {total} token(s) after tokenising; give them some text")
    write_json(out / "index.json", {"format": PREPARED_FORMAT, "version": PREPARED_VERSION,
                                     "tokenizer_name": tok.name, "vocab_size": tok.vocab_size,
                                     "eos_id": tok.eos_id, **settings, "num_tokens": total,
                                     "num_docs": sum(s["num_docs"] for s in shards), "shards": shards})
    _say(progress, f"prepared {len(shards)} shard(s) ({skipped} from an earlier run), {total:,} tokens, "
                   f"{sum(s['num_docs'] for s in shards):,} documents in {time.perf_counter() - t0:.1f} s -> {out}")
    return PrepareResult(out=out, shards=len(shards), skipped=skipped, num_tokens=total,
                         num_docs=sum(s["num_docs"] for s in shards))


def up_to_date(sources: list[str | Path], out: str | Path, *, tokenizer, text_field: str = "text") -> bool:
    """Whether `out` already holds exactly what `prepare` would write (reads only: ranks that
    open a prepared cache after rank 0 made it check this instead of preparing again)."""
    out = Path(out).expanduser()
    index = read_json(out / "index.json", strict=False)
    files = _files(sources)
    if not index or len(index.get("shards", [])) != len(files):
        return False
    settings = {"tokenizer": tokenizer.id, "text_field": text_field, "dtype": token_dtype(tokenizer.vocab_size)}
    return all(_finished(out, f"shard_{i:05d}", _wanted(f, settings)) is not None for i, f in enumerate(files))


def _files(sources) -> list[Path]:
    files = [f for s in sources for f in source_files(s)]
    if len({f.resolve() for f in files}) != len(files):
        raise ConfigError("a data file is named twice (directly and through its directory?); name each once")
    return files


def _wanted(f: Path, settings: dict) -> dict:
    st = f.stat()
    return {"source": str(f.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, **settings}


def _finished(out: Path, name: str, want: dict) -> dict | None:
    """The shard's JSON when the shard is complete and made from `want`'s source and settings."""
    meta = read_json(out / f"{name}.json", strict=False)
    itemsize = np.dtype(want["dtype"]).itemsize
    if meta and {k: meta.get(k) for k in want} == want and (out / f"{name}.bin").is_file() \
            and (out / f"{name}.bin").stat().st_size == itemsize * meta["num_tokens"] \
            and (out / f"{name}.docs.npy").is_file():
        return meta
    return None


def _tokenize_file(path: Path, stem: Path, tok, text_field: str, dtype: str, progress, label: str) -> dict:
    """Write one shard's tokens and document offsets (each via a temporary file); their counts."""
    np_dtype = np.dtype(dtype).newbyteorder("<")
    starts: list[int] = []
    count, t0, last = 0, time.perf_counter(), time.perf_counter()
    fd, tmp = tempfile.mkstemp(dir=stem.parent, prefix=stem.name, suffix=".bin.tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            for docs in read_documents(path, text_field=text_field):
                docs = [d for d in docs if d]           # an empty document has no tokens to learn from
                encoded = tok.encode_ids(docs) if hasattr(tok, "encode_ids") else \
                    [tok.encode_array(d).tolist() for d in docs]
                for ids in encoded:
                    if tok.eos_id is not None:
                        ids = list(ids) + [tok.eos_id]
                    if not ids:
                        continue
                    starts.append(count)
                    out.write(np.asarray(ids, dtype=np_dtype).tobytes())
                    count += len(ids)
                if progress is not None and time.perf_counter() - last > _PROGRESS_EVERY_S:
                    last = time.perf_counter()
                    _say(progress, f"{label}: {len(starts):,} documents, {count:,} tokens so far")
        docs_tmp = stem.with_name(stem.name + ".docs.npy.tmp")
        with open(docs_tmp, "wb") as f:
            np.save(f, np.asarray(starts, dtype=np.int64))
        os.replace(tmp, stem.with_name(stem.name + ".bin"))
        os.replace(docs_tmp, stem.with_name(stem.name + ".docs.npy"))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dt = time.perf_counter() - t0
    _say(progress, f"{label}: {len(starts):,} documents, {count:,} tokens ({count / max(dt, 1e-9):,.0f} tok/s)")
    return {"num_tokens": count, "num_docs": len(starts)}


# ---- reading a prepared directory -------------------------------------------------------------
def is_prepared(path: str | Path) -> bool:
    return (Path(path).expanduser() / "index.json").is_file()


class ShardedTokens:
    """Several memory-mapped shards (or any 1-D arrays) read as one 1-D token array, optionally a
    window [lo, hi) of it: integer-array indexing and slicing, which is what the sampler and the
    vocabulary scan use, without concatenating the shards in memory."""

    ndim = 1

    def __init__(self, parts: list[np.ndarray], lo: int = 0, hi: int | None = None):
        self.parts = parts
        self.bounds = np.cumsum([0] + [len(p) for p in parts], dtype=np.int64)     # (shards + 1,)
        self.dtype = parts[0].dtype
        self.lo, self.hi = lo, int(self.bounds[-1]) if hi is None else hi

    @property
    def shape(self) -> tuple[int]:
        return (self.hi - self.lo,)

    def __len__(self) -> int:
        return self.hi - self.lo

    def view(self, lo: int, hi: int) -> ShardedTokens:
        return ShardedTokens(self.parts, self.lo + lo, self.lo + hi)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("ShardedTokens slices must be contiguous")
            return self[np.arange(start, stop, dtype=np.int64)]
        idx = np.asarray(index, dtype=np.int64) + self.lo
        shard = np.searchsorted(self.bounds, idx, side="right") - 1               # same shape as idx
        out = np.empty(idx.shape, dtype=self.dtype)
        for s in np.unique(shard):
            m = shard == s
            out[m] = self.parts[s][idx[m] - self.bounds[s]]
        return out


def open_prepared(path: str | Path) -> tuple[ShardedTokens, np.ndarray, dict]:
    """(tokens, document start offsets into them, the index) of a prepared directory."""
    path = Path(path).expanduser()
    index = read_json(path / "index.json", strict=False)
    if not index or index.get("format") != PREPARED_FORMAT:
        raise ConfigError(f"{str(path / 'index.json')!r} is not a meshplan prepared-data index; "
                          "write one with `meshplan data prepare`")
    if index.get("version") != PREPARED_VERSION:
        raise ConfigError(f"{path}: prepared-data version {index.get('version')!r} is not supported "
                          f"(this meshplan reads {PREPARED_VERSION}); prepare the data again")
    np_dtype = np.dtype(index["dtype"]).newbyteorder("<")
    parts, starts, offset = [], [], 0
    for shard in index["shards"]:
        bin_path = path / f"{shard['name']}.bin"
        if not bin_path.is_file() or bin_path.stat().st_size != np_dtype.itemsize * shard["num_tokens"]:
            raise ConfigError(f"{bin_path} is missing or incomplete; rerun `meshplan data prepare` with the "
                              "same arguments to finish it")
        if shard["num_tokens"] == 0:
            continue
        parts.append(np.memmap(bin_path, dtype=np_dtype, mode="r"))
        starts.append(np.load(path / f"{shard['name']}.docs.npy") + offset)
        offset += shard["num_tokens"]
    return ShardedTokens(parts), np.concatenate(starts), index


def _say(stream, line: str) -> None:
    if stream is not None:
        print(line, file=stream, flush=True)
