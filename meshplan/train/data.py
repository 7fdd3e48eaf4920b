"""Training data: a flat stream of token ids cut into fixed-length windows, shuffled by seed.

Sources, all opened with `TokenDataset.open(source)`; besides the three below, a directory written
by `meshplan data prepare` (meshplan.train.prepare: token shards with document offsets), and
JSONL / Parquet files or text read with a `tokenizer` directory, which are prepared once into the
cache (``<cache_dir>/prepared-<key>``). Prepared data knows its documents (`doc_starts`), which
document masking needs (meshplan.train.sampler); the three below are plain token streams:

- ``None`` / ``"embedded"``: the ~1 MB corpus shipped in `meshplan.train.corpus` (default).
- a directory of text files (``*.txt``, ``*.md``, ``*.text``, searched recursively, hidden
  files skipped) or one such file: read as bytes, tokenised with the byte tokenizer
  (`meshplan.train.tokenizer`), one `EOS_ID` after each file, and cached as uint16 tokens in
  ``<cache_dir>/<key>.bin`` with a manifest ``<key>.json``. The key hashes the directory and
  every file's size and mtime, so editing a file re-tokenises. The default cache dir is
  ``$MESHPLAN_CACHE/tokens`` (``~/.cache/meshplan/tokens``).
- a pre-tokenised token file ``*.bin``: raw little-endian integers with no header (the
  nanoGPT ``train.bin`` layout), memory-mapped. Its dtype comes from, in order: the `dtype`
  argument; a sidecar JSON next to it with the same stem (``train.bin`` -> ``train.json``,
  ``{"dtype": "uint16", "vocab_size": 50257}``, written by `write_token_file`); a dtype in the
  name (``train.uint32.bin``); else uint16, nanoGPT's convention.

Sampling (`BatchSampler`, meshplan.train.sampler; blends of several data sets: meshplan.train.blend): window ``w`` holds tokens ``[w*S, w*S + S + 1)`` (S = seq_len), the
input is its first S tokens and the labels its last S (next-token targets). The stream of
samples is epoch after epoch of a seeded permutation of all windows; sample ``k*B + j`` (B =
global batch) is row j of step k. Any step's batch is computed from (seed, step) alone, so a
resumed run reads exactly the batches an uninterrupted run would, and a data-parallel rank can
read only its own rows: rank r of dp gets the contiguous rows ``[r*B/dp, (r+1)*B/dp)``, the
same rows as `rank_slice` of the global batch. The permutation is a keyed Feistel network
evaluated per index, so it needs no memory proportional to the data set.

Batch-size ramp-up (`BatchRampup`, Megatron's ``--rampup-batch-size start increment samples``):
the global batch starts at `start` sequences and grows by `increment` each time another
``samples / ((final - start) / increment)`` samples have been consumed, reaching the final
(the plan's) global batch after `samples` samples. The sample stream is the same as without
ramp-up: step k reads the samples ``consumed(k) .. consumed(k) + batch_size(k)``, both pure
functions of k, so a run resumed in the middle of a ramp continues exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np

from meshplan.errors import ConfigError
from meshplan.train.jsonfile import read_json, write_json
from meshplan.ir.rampup import BatchRampup
from meshplan.train import tokenizer
from meshplan.train.sampler import (  # noqa: F401 - the sampler's home before it had its own module
    SAMPLER_STATE_VERSION,
    Batch,
    BatchSampler,
    _feistel,
    _rank_rows,
    _round_keys,
    rank_slice,
)
from meshplan.train.sources import JSONL_SUFFIXES, PARQUET_SUFFIXES

__all__ = [
    "TokenDataset", "Batch", "BatchSampler", "BatchRampup", "rank_slice", "write_token_file", "default_cache_dir",
    "TEXT_SUFFIXES", "TOKEN_DTYPES",
]

TEXT_SUFFIXES = (".txt", ".md", ".text")
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
TOKEN_FILE_FORMAT = "meshplan-tokens"
_CORPUS_PACKAGE = "meshplan.train.corpus"
_CORPUS_FILES = ("corpus.txt",)
_MAX_SCAN_CHUNK = 1 << 24      # tokens per chunk when scanning a memory-mapped file for its max id


def default_cache_dir() -> Path:
    """Where tokenised text directories are cached: ``$MESHPLAN_CACHE/tokens`` or ~/.cache/meshplan/tokens."""
    return Path(os.environ.get("MESHPLAN_CACHE", "~/.cache/meshplan")).expanduser() / "tokens"


# ---- the data set ------------------------------------------------------------------------
class TokenDataset:
    """A 1-D stream of token ids (in memory or memory-mapped) with the vocabulary it was made with.

    `vocab_size` is what the tokenizer or the token file's sidecar declares (None when unknown);
    `check_vocab(model_vocab)` is the check to run before training. `doc_starts` (prepared data
    only) holds the offset of each document's first token, sorted; None when the boundaries
    are unknown.
    """

    def __init__(self, tokens: np.ndarray, *, vocab_size: int | None, source: str,
                 doc_starts: np.ndarray | None = None):
        if tokens.ndim != 1 or tokens.dtype.kind != "u":
            raise ConfigError(f"{source}: tokens must be a 1-D array of unsigned integers, "
                              f"got shape {tokens.shape} dtype {tokens.dtype}")
        if len(tokens) < 2:
            raise ConfigError(f"{source}: holds {len(tokens)} token(s); training needs at least one "
                              "sequence plus its next token: give it more text")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or vocab_size < 1):
            raise ConfigError(f"{source}: vocab_size must be a positive whole number, got {vocab_size!r}")
        self.tokens = tokens
        self.vocab_size = vocab_size
        self.source = source
        self.doc_starts = doc_starts
        self._max_id: int | None = None

    def __repr__(self) -> str:
        return f"TokenDataset({self.source}, {len(self)} tokens, vocab {self.vocab_size})"

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_tokens(self) -> int:
        return len(self)

    # ---- constructors --------------------------------------------------------------------
    @classmethod
    def open(cls, source: str | os.PathLike | None = None, *, cache_dir: str | os.PathLike | None = None,
             dtype: str | None = None, vocab_size: int | None = None, tokenizer: str | None = None,
             text_field: str = "text") -> TokenDataset:
        """The data set named by `source`: None/"embedded", a prepared directory, a text dir or file,
        a JSON Lines or Parquet file (or a directory of them), or a ``.bin`` token file.

        `tokenizer` (a tokenizer directory; None: the byte tokenizer) tokenises text sources;
        JSONL, Parquet, and text read with a tokenizer other than the byte one, are prepared once
        into ``<cache_dir>/prepared-<key>`` (meshplan.train.prepare) and read from there.
        """
        from meshplan.train import prepare
        if source is None or str(source) == "embedded":
            if tokenizer is not None:
                raise ConfigError("the built-in corpus is byte-tokenised; with --tokenizer, give --data "
                                  "(text, JSONL or Parquet files, or a prepared directory)")
            return cls.embedded()
        path = Path(source).expanduser()
        if not path.exists():
            raise ConfigError(f"data path {str(path)!r} does not exist; give a directory of text files, "
                              f"a text file ({', '.join(TEXT_SUFFIXES)}), a JSON Lines or Parquet file, a "
                              "directory written by `meshplan data prepare`, a token file (.bin), "
                              "or 'embedded' for the built-in corpus")
        if prepare.is_prepared(path):
            return cls.from_prepared(path, tokenizer=tokenizer)
        structured = path.suffix in JSONL_SUFFIXES + PARQUET_SUFFIXES or (path.is_dir() and any(
            p.suffix in JSONL_SUFFIXES + PARQUET_SUFFIXES for p in path.rglob("*")))
        if tokenizer is not None or structured:
            return cls.from_sources(path, tokenizer=tokenizer, text_field=text_field, cache_dir=cache_dir)
        if path.is_dir() or path.suffix in TEXT_SUFFIXES:
            return cls.from_text(path, cache_dir=cache_dir)
        if path.suffix == ".bin":
            return cls.from_token_file(path, dtype=dtype, vocab_size=vocab_size)
        raise ConfigError(f"data file {str(path)!r} is neither text ({', '.join(TEXT_SUFFIXES)}) nor a "
                          "token file (.bin); rename it or pass its directory")

    @classmethod
    def from_prepared(cls, path: str | os.PathLike, *, tokenizer: str | None = None) -> TokenDataset:
        """A directory written by `meshplan data prepare` (shards memory-mapped, with document starts)."""
        from meshplan.train import prepare
        from meshplan.train import tokenizer as tokenizers
        tokens, starts, index = prepare.open_prepared(path)
        if tokenizer is not None and tokenizers.load(tokenizer).id != index["tokenizer"]:
            raise ConfigError(f"{path} was prepared with tokenizer {index.get('tokenizer_name')!r}, not with "
                              f"--tokenizer {tokenizer}; prepare it again with this tokenizer, or leave "
                              "--tokenizer out to train with the one it was prepared with")
        return cls(tokens, vocab_size=index["vocab_size"], source=str(path), doc_starts=starts)

    @classmethod
    def from_sources(cls, path: str | os.PathLike, *, tokenizer: str | None = None, text_field: str = "text",
                     cache_dir: str | os.PathLike | None = None) -> TokenDataset:
        """Text, JSONL or Parquet sources, prepared once into the cache (re-prepared when a file changes)."""
        from meshplan.train import prepare
        from meshplan.train import tokenizer as tokenizers
        tok = tokenizers.load(tokenizer)
        path = Path(path).expanduser().resolve()
        key = hashlib.sha256(json.dumps([tok.id, text_field, str(path)]).encode()).hexdigest()[:20]
        cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        # up to date (rank 0 prepared it, or an earlier run did): only read it; else prepare, which
        # tokenises only the files that changed
        if not prepare.up_to_date([path], cache / f"prepared-{key}", tokenizer=tok, text_field=text_field):
            prepare.prepare([path], cache / f"prepared-{key}", tokenizer=tok, text_field=text_field, progress=None)
        return cls.from_prepared(cache / f"prepared-{key}")

    @classmethod
    def embedded(cls) -> TokenDataset:
        """The built-in corpus (see meshplan/train/corpus/README.md), tokenised in memory."""
        root = resources.files(_CORPUS_PACKAGE)
        parts = [tokenizer.encode_array(root.joinpath(name).read_bytes(), eos=True) for name in _CORPUS_FILES]
        return cls(np.concatenate(parts), vocab_size=tokenizer.VOCAB_SIZE, source="embedded corpus")

    @classmethod
    def from_text(cls, path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> TokenDataset:
        """A directory of text files (or one file), byte-tokenised once and cached as uint16."""
        path = Path(path).expanduser().resolve()
        files = _text_files(path)
        listing = [(str(f.relative_to(path) if path.is_dir() else f.name), f.stat().st_size,
                    f.stat().st_mtime_ns) for f in files]
        if sum(size for _, size, _ in listing) == 0:
            raise ConfigError(f"the text files under {str(path)!r} are all empty; add some text")
        key = hashlib.sha256(json.dumps([tokenizer.TOKENIZER_ID, str(path), listing]).encode()).hexdigest()[:20]
        cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        bin_path, manifest_path = cache / f"{key}.bin", cache / f"{key}.json"
        manifest = read_json(manifest_path, strict=False)
        if not (manifest and manifest.get("files") == [list(x) for x in listing]
                and bin_path.exists() and bin_path.stat().st_size == 2 * manifest.get("num_tokens", -1)):
            _tokenize_to_cache(path, files, listing, bin_path, manifest_path)
        tokens = np.memmap(bin_path, dtype=TOKEN_DTYPES["uint16"], mode="r")
        return cls(tokens, vocab_size=tokenizer.VOCAB_SIZE, source=str(path))

    @classmethod
    def from_token_file(cls, path: str | os.PathLike, *, dtype: str | None = None,
                        vocab_size: int | None = None) -> TokenDataset:
        """A headerless ``.bin`` file of token ids, memory-mapped (dtype rules in the module doc)."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise ConfigError(f"token file {str(path)!r} does not exist or is not a file")
        sidecar = read_json(path.with_suffix(".json"))
        if sidecar is not None and sidecar.get("format", TOKEN_FILE_FORMAT) != TOKEN_FILE_FORMAT:
            sidecar = None          # some other tool's JSON with the same stem: not ours
        guessed = False
        if dtype is None:
            if sidecar is not None and "dtype" in sidecar:
                dtype = sidecar["dtype"]
            else:
                dtype = next((d for d in TOKEN_DTYPES if path.name.endswith(f".{d}.bin")), None)
                if dtype is None:
                    dtype, guessed = "uint16", True
        if dtype not in TOKEN_DTYPES:
            raise ConfigError(f"token file {path.name}: dtype {dtype!r} is not supported; "
                              f"use one of {', '.join(TOKEN_DTYPES)}")
        np_dtype = TOKEN_DTYPES[dtype]
        size = path.stat().st_size
        if size == 0:
            raise ConfigError(f"token file {str(path)!r} is empty")
        if size % np_dtype.itemsize:
            raise ConfigError(f"token file {path.name} has {size} bytes, not a multiple of {np_dtype.itemsize} "
                              f"({dtype}); it is not a {dtype} token file: pass the right dtype "
                              f"({', '.join(TOKEN_DTYPES)}) or write a sidecar {path.with_suffix('.json').name}")
        if vocab_size is None and sidecar is not None:
            vocab_size = sidecar.get("vocab_size")
        tokens = np.memmap(path, dtype=np_dtype, mode="r")
        if guessed:
            _refuse_uint32_as_uint16(tokens, path)
        return cls(tokens, vocab_size=vocab_size, source=str(path))

    # ---- checks --------------------------------------------------------------------------
    def max_token_id(self) -> int:
        """Largest token id in the stream (a full scan of a token file the first time)."""
        if self._max_id is None:
            t = self.tokens
            self._max_id = max(int(t[i:i + _MAX_SCAN_CHUNK].max()) for i in range(0, len(t), _MAX_SCAN_CHUNK))
        return self._max_id

    def check_vocab(self, vocab: int) -> None:
        """Raise ConfigError unless every token id fits a model with `vocab` embeddings."""
        if self.vocab_size is not None and self.vocab_size > vocab:
            raise ConfigError(f"the data ({self.source}) was tokenised with a vocabulary of {self.vocab_size}, "
                              f"but the model has only {vocab} embeddings; build the model with "
                              f"vocab>={self.vocab_size} or use data from a smaller tokenizer")
        top = self.max_token_id()
        if self.vocab_size is not None and top >= self.vocab_size:
            raise ConfigError(f"{self.source} holds token id {top}, but its declared vocabulary is "
                              f"{self.vocab_size}: the file's dtype is probably wrong (uint16 vs uint32)")
        if top >= vocab:
            raise ConfigError(f"{self.source} holds token id {top}, which does not fit the model's vocab "
                              f"of {vocab}; build the model with vocab>={top + 1}, or check the token "
                              "file's dtype (uint16 vs uint32)")

    def num_windows(self, seq_len: int) -> int:
        """How many non-overlapping training windows of seq_len (+1 label token) the stream holds."""
        return (len(self) - 1) // seq_len

    # ---- documents and splits ------------------------------------------------------------
    def document_of(self, positions: np.ndarray) -> np.ndarray:
        """Index of the document holding each token position (same shape, int64)."""
        if self.doc_starts is None:
            raise ConfigError(f"{self.source} records no document boundaries")
        return np.searchsorted(self.doc_starts, positions, side="right").astype(np.int64) - 1

    def slice(self, lo: int, hi: int, *, source: str | None = None) -> TokenDataset:
        """Tokens [lo, hi) as a data set of their own (a view; a document cut at lo starts there)."""
        if not 0 <= lo < hi <= len(self):
            raise ConfigError(f"token range {lo}..{hi} is outside {self.source}'s 0..{len(self)}")
        view = self.tokens.view(lo, hi) if hasattr(self.tokens, "view") and not isinstance(
            self.tokens, np.ndarray) else self.tokens[lo:hi]
        starts = None
        if self.doc_starts is not None:
            inside = self.doc_starts[(self.doc_starts > lo) & (self.doc_starts < hi)] - lo
            starts = np.concatenate([np.zeros(1, dtype=np.int64), inside.astype(np.int64)])
        return TokenDataset(view, vocab_size=self.vocab_size, source=source or f"{self.source}[{lo}:{hi}]",
                            doc_starts=starts)

    def split(self, fraction: float) -> tuple[TokenDataset, TokenDataset]:
        """(train, held-out): the last `fraction` of the tokens is held out for validation."""
        if not 0 < fraction < 1:
            raise ConfigError(f"the held-out fraction must lie strictly between 0 and 1, got {fraction!r}; "
                              "e.g. --eval-fraction 0.01")
        cut = len(self) - max(2, int(round(len(self) * fraction)))
        if cut < 2:
            raise ConfigError(f"{self.source} has {len(self)} tokens, too few to hold out {fraction:.1%} and "
                              "keep training data; use a smaller --eval-fraction or give --eval-data")
        return (self.slice(0, cut, source=f"{self.source} (train split)"),
                self.slice(cut, len(self), source=f"{self.source} (held out)"))

    # ---- sampling ------------------------------------------------------------------------
    def sampler(self, *, global_batch: int, seq_len: int, seed: int = 0, start_step: int = 0,
                rampup: BatchRampup | None = None, document_mask: bool = False) -> BatchSampler:
        return BatchSampler(self, global_batch=global_batch, seq_len=seq_len, seed=seed, start_step=start_step,
                            rampup=rampup, document_mask=document_mask)

    def batches(self, global_batch: int, seq_len: int, seed: int = 0, start_step: int = 0) -> BatchSampler:
        """Iterator of (input_ids, labels), each (global_batch, seq_len) int64, from step start_step on."""
        return self.sampler(global_batch=global_batch, seq_len=seq_len, seed=seed, start_step=start_step)


# ---- text files and token files ----------------------------------------------------------
def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise ConfigError(f"no text files ({', '.join('*' + s for s in TEXT_SUFFIXES)}) under {str(path)!r}; "
                          "put the training text there, or pass a token file (.bin)")
    return files


def _tokenize_to_cache(root: Path, files: list[Path], listing: list, bin_path: Path, manifest_path: Path) -> None:
    """Write the tokens then the manifest, each by atomic rename, so that ranks tokenising the same
    directory at once, or a crash half-way, never leave a cache that a later run would trust."""
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    fd, tmp = tempfile.mkstemp(dir=bin_path.parent, suffix=".bin.tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            for f in files:
                ids = tokenizer.encode_array(f.read_bytes(), eos=True)
                out.write(ids.astype(TOKEN_DTYPES["uint16"]).tobytes())
                count += len(ids)
        os.replace(tmp, bin_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    write_json(manifest_path, {"format": TOKEN_FILE_FORMAT, "source": str(root), "tokenizer": tokenizer.TOKENIZER_ID,
                                "dtype": "uint16", "vocab_size": tokenizer.VOCAB_SIZE, "num_tokens": count,
                                "files": [list(x) for x in listing]})


def write_token_file(path: str | os.PathLike, tokens: np.ndarray | list[int], *, vocab_size: int,
                     dtype: str | None = None) -> Path:
    """Write `tokens` as a headerless token file plus its sidecar JSON; returns the .bin path.

    dtype defaults to uint16 when vocab_size fits in 16 bits, else uint32.
    """
    path = Path(path)
    if path.suffix != ".bin":
        raise ConfigError(f"token files end in .bin, got {path.name!r}")
    dtype = dtype or ("uint16" if vocab_size <= 1 << 16 else "uint32")
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {', '.join(TOKEN_DTYPES)}")
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ConfigError(f"token ids must lie in 0..{vocab_size - 1}, got {int(arr.min())}..{int(arr.max())}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(arr.astype(TOKEN_DTYPES[dtype]).tobytes())
    write_json(path.with_suffix(".json"), {"format": TOKEN_FILE_FORMAT, "dtype": dtype,
                                            "vocab_size": vocab_size, "num_tokens": int(arr.size)})
    return path


def _refuse_uint32_as_uint16(tokens: np.ndarray, path: Path) -> None:
    """uint32 ids below 65536 read as uint16 show a zero in every odd slot; refuse that guess."""
    head = np.asarray(tokens[:4096])
    if len(head) >= 64 and not head[1::2].any() and head[0::2].any():
        raise ConfigError(f"token file {path.name} looks like uint32 data (every second uint16 is 0); "
                          f"pass dtype='uint32', rename it to {path.stem}.uint32.bin, or write a sidecar "
                          f"{path.with_suffix('.json').name}")
