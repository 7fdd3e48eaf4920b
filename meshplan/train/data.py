"""Training data: a flat stream of token ids cut into fixed-length windows, shuffled by seed.

Three sources, all opened with `TokenDataset.open(source)`:

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

Sampling (`BatchSampler`): window ``w`` holds tokens ``[w*S, w*S + S + 1)`` (S = seq_len), the
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
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshplan.errors import ConfigError
from meshplan.ir.rampup import BatchRampup
from meshplan.train import tokenizer

__all__ = [
    "TokenDataset", "BatchSampler", "BatchRampup", "rank_slice", "write_token_file", "default_cache_dir",
    "TEXT_SUFFIXES", "TOKEN_DTYPES",
]

TEXT_SUFFIXES = (".txt", ".md", ".text")
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
TOKEN_FILE_FORMAT = "meshplan-tokens"
SAMPLER_STATE_VERSION = 1
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
    `check_vocab(model_vocab)` is the check to run before training.
    """

    def __init__(self, tokens: np.ndarray, *, vocab_size: int | None, source: str):
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
             dtype: str | None = None, vocab_size: int | None = None) -> TokenDataset:
        """The data set named by `source`: None/"embedded", a text dir or file, or a ``.bin`` token file."""
        if source is None or str(source) == "embedded":
            return cls.embedded()
        path = Path(source).expanduser()
        if not path.exists():
            raise ConfigError(f"data path {str(path)!r} does not exist; give a directory of text files, "
                              f"a text file ({', '.join(TEXT_SUFFIXES)}), a token file (.bin), "
                              "or 'embedded' for the built-in corpus")
        if path.is_dir() or path.suffix in TEXT_SUFFIXES:
            return cls.from_text(path, cache_dir=cache_dir)
        if path.suffix == ".bin":
            return cls.from_token_file(path, dtype=dtype, vocab_size=vocab_size)
        raise ConfigError(f"data file {str(path)!r} is neither text ({', '.join(TEXT_SUFFIXES)}) nor a "
                          "token file (.bin); rename it or pass its directory")

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
        manifest = _read_json(manifest_path, strict=False)
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
        sidecar = _read_json(path.with_suffix(".json"))
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

    # ---- sampling ------------------------------------------------------------------------
    def sampler(self, *, global_batch: int, seq_len: int, seed: int = 0, start_step: int = 0,
                rampup: BatchRampup | None = None) -> BatchSampler:
        return BatchSampler(self, global_batch=global_batch, seq_len=seq_len, seed=seed, start_step=start_step,
                            rampup=rampup)

    def batches(self, global_batch: int, seq_len: int, seed: int = 0, start_step: int = 0) -> BatchSampler:
        """Iterator of (input_ids, labels), each (global_batch, seq_len) int64, from step start_step on."""
        return self.sampler(global_batch=global_batch, seq_len=seq_len, seed=seed, start_step=start_step)


# ---- ramp-up -----------------------------------------------------------------------------
# ---- sampler -----------------------------------------------------------------------------
class BatchSampler:
    """Deterministic, resumable batches over a `TokenDataset` (see the module docstring).

    Iterating yields the full global batch of `step` and advances it; `batch(k)` and
    `rank_batch(k, dp_rank, dp)` read any step without moving the position.
    """

    def __init__(self, dataset: TokenDataset, *, global_batch: int, seq_len: int, seed: int = 0,
                 start_step: int = 0, rampup: BatchRampup | None = None):
        for name, value, low in (("global_batch", global_batch, 1), ("seq_len", seq_len, 1),
                                 ("seed", seed, 0), ("start_step", start_step, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be a whole number >= {low}, got {value!r}")
        windows = dataset.num_windows(seq_len)
        if windows < 1:
            raise ConfigError(f"{dataset.source} has {len(dataset)} tokens, fewer than one sequence of "
                              f"seq_len={seq_len} plus its next token; use a shorter seq_len "
                              f"(at most {len(dataset) - 1}) or more data")
        self.dataset = dataset
        self.global_batch = global_batch
        self.seq_len = seq_len
        self.seed = seed
        self.step = start_step
        self.num_windows = windows
        if rampup is not None and rampup.final != global_batch:
            raise ConfigError(f"the ramp-up ends at a global batch of {rampup.final}, the sampler's is {global_batch}")
        self.rampup = rampup
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)        # (S+1,)

    @property
    def epoch(self) -> int:
        """The epoch (pass over all windows) the next batch starts in."""
        return self.consumed(self.step) // self.num_windows

    def batch_size(self, step: int) -> int:
        """Sequences in step `step`'s global batch (smaller during a ramp-up)."""
        return self.rampup.batch_size(step) if self.rampup is not None else self.global_batch

    def consumed(self, step: int) -> int:
        """Samples read by the steps before `step`."""
        return self.rampup.consumed(step) if self.rampup is not None else step * self.global_batch

    @property
    def steps_per_epoch(self) -> float:
        return self.num_windows / self.global_batch

    def window_indices(self, step: int, rows: slice | None = None) -> np.ndarray:
        """Window index of each row of step `step` (only `rows` of them when given)."""
        rows = rows or slice(0, self.batch_size(step))
        sample = self.consumed(step) + np.arange(rows.start, rows.stop, dtype=np.int64)   # (rows,)
        epoch, pos = np.divmod(sample, self.num_windows)
        out = np.empty_like(sample)
        for e in np.unique(epoch):          # a batch spans two epochs at most unless it is bigger than one
            m = epoch == e
            out[m] = _feistel(pos[m], self.num_windows, _round_keys(self.seed, int(e)))
        return out

    def batch(self, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) of step `step` (default: the current one), each (global_batch, seq_len) int64."""
        step = self.step if step is None else step
        return self._read(step, slice(0, self.batch_size(step)))

    def rank_batch(self, dp_rank: int, dp: int, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Only data-parallel rank `dp_rank`'s rows of `batch(step)`: (global_batch/dp, seq_len) each."""
        step = self.step if step is None else step
        lo, hi = _rank_rows(self.batch_size(step), dp_rank, dp)
        return self._read(step, slice(lo, hi))

    def _read(self, step: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        if step < 0:
            raise ConfigError(f"step must be >= 0, got {step}")
        starts = self.window_indices(step, rows) * self.seq_len                  # (rows,)
        window = np.asarray(self.dataset.tokens[starts[:, None] + self._offsets], dtype=np.int64)  # (rows, S+1)
        window_t = torch.from_numpy(window)
        return window_t[:, :-1].contiguous(), window_t[:, 1:].contiguous()      # (rows, S) each

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    # ---- resume --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Position to save in a checkpoint: the next step to read, plus what fixes the order."""
        return {"version": SAMPLER_STATE_VERSION, "step": self.step, "epoch": self.epoch, "seed": self.seed,
                "global_batch": self.global_batch, "seq_len": self.seq_len, "num_windows": self.num_windows,
                "rampup": self.rampup.state() if self.rampup is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuse one whose batches would differ from this sampler's."""
        if state.get("version") != SAMPLER_STATE_VERSION:
            raise ConfigError(f"data position version {state.get('version')!r} is not supported "
                              f"(expects {SAMPLER_STATE_VERSION})")
        for key, label in (("seed", "seed"), ("global_batch", "global batch"), ("seq_len", "seq_len"),
                           ("num_windows", "number of data windows"), ("rampup", "batch-size ramp-up")):
            mine = self.rampup.state() if key == "rampup" and self.rampup is not None else getattr(self, key, None)
            if state.get(key) != mine:
                hint = ("the data changed since the checkpoint" if key == "num_windows"
                        else f"resume with {key}={state.get(key)}")
                raise ConfigError(f"the checkpoint's data position was saved with {label} {state.get(key)}, "
                                  f"this run has {mine}; batches would not continue the same "
                                  f"order: {hint}, or start a fresh run")
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"data position step must be a whole number >= 0, got {step!r}")
        self.step = step


def rank_slice(batch: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    """Rows of a global batch that data-parallel rank `dp_rank` of `dp` trains on (a contiguous block)."""
    lo, hi = _rank_rows(batch.shape[0], dp_rank, dp)
    return batch[lo:hi]


def _rank_rows(global_batch: int, dp_rank: int, dp: int) -> tuple[int, int]:
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ConfigError(f"dp must be a positive whole number, got {dp!r}")
    if not 0 <= dp_rank < dp:
        raise ConfigError(f"dp_rank {dp_rank} is outside 0..{dp - 1}")
    if global_batch % dp:
        raise ConfigError(f"global batch {global_batch} does not split over dp={dp} data-parallel ranks; "
                          f"use a global batch that is a multiple of {dp}")
    n = global_batch // dp
    return dp_rank * n, (dp_rank + 1) * n


# ---- keyed permutation -------------------------------------------------------------------
_FEISTEL_ROUNDS = 4      # 4 rounds make a Feistel network a pseudorandom permutation (Luby-Rackoff)
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _round_keys(seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng((seed, epoch)).integers(0, 2**63, size=_FEISTEL_ROUNDS, dtype=np.uint64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (public-domain constants by S. Vigna): a fast 64-bit avalanche hash."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _feistel(pos: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """Image of each index in 0..n-1 under a keyed bijection of 0..n-1 (cycle-walking Feistel)."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)     # domain 4**half >= n, < 4n: <4 walks expected
    mask = np.uint64((1 << half) - 1)
    x = pos.astype(np.uint64)
    todo = np.ones(x.shape, dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():
            left, right = x[todo] >> np.uint64(half), x[todo] & mask
            for k in keys:
                left, right = right, left ^ (_mix(right ^ k) & mask)
            x[todo] = (left << np.uint64(half)) | right
            todo &= x >= np.uint64(n)
    return x.astype(np.int64)


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
    _write_json(manifest_path, {"format": TOKEN_FILE_FORMAT, "source": str(root), "tokenizer": tokenizer.TOKENIZER_ID,
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
    _write_json(path.with_suffix(".json"), {"format": TOKEN_FILE_FORMAT, "dtype": dtype,
                                            "vocab_size": vocab_size, "num_tokens": int(arr.size)})
    return path


def _refuse_uint32_as_uint16(tokens: np.ndarray, path: Path) -> None:
    """uint32 ids below 65536 read as uint16 show a zero in every odd slot; refuse that guess."""
    head = np.asarray(tokens[:4096])
    if len(head) >= 64 and not head[1::2].any() and head[0::2].any():
        raise ConfigError(f"token file {path.name} looks like uint32 data (every second uint16 is 0); "
                          f"pass dtype='uint32', rename it to {path.stem}.uint32.bin, or write a sidecar "
                          f"{path.with_suffix('.json').name}")


def _read_json(path: Path, *, strict: bool = True) -> dict | None:
    """The JSON object in `path`; None when absent (or unreadable and not strict: a cache to rebuild)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        if not strict:
            return None
        raise ConfigError(f"{str(path)!r} is not readable JSON ({e}); fix or delete it") from None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json.tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
