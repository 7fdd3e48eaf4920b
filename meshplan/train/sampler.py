"""Deterministic, resumable batches over token data sets (the rules are in meshplan.train.data's
module docstring): `BatchSampler` over one data set, and the shared step bookkeeping that
`meshplan.train.blend.BlendedSampler` reuses over several.

With `document_mask=True` (data sets that know their document boundaries: prepared data), each
batch also carries `document_ids` (rows, seq_len): the document each input token belongs to, so
the model's attention stays inside documents and its positions restart at each one, and every
label whose target token starts another document is set to the loss's ignore index (-100): a
document's last token is not trained to predict the next, unrelated document. A document cut by
a window's start is, inside that window, a document starting there (positions restart at 0).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from meshplan.errors import ConfigError
from meshplan.ir.rampup import BatchRampup

__all__ = ["IGNORE_INDEX", "Batch", "BatchSampler", "rank_slice"]

SAMPLER_STATE_VERSION = 1
IGNORE_INDEX = -100          # the loss's ignore index (meshplan.models.transformer.IGNORE_INDEX)


@dataclass(frozen=True)
class Batch:
    """One step's rows: input_ids and labels (rows, seq_len) int64, and with document masking the
    document id of every input token (rows, seq_len) int64 (only equality within a row matters)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor | None = None


class SamplerBase:
    """Step bookkeeping shared by the samplers: the batch size and consumed samples of each step
    (batch-size ramp-up), iteration, the data-parallel row split. Subclasses read rows with
    `_rows(samples)` (global sample numbers -> Batch) and describe their order in `_order_state`."""

    def __init__(self, *, global_batch: int, seq_len: int, seed: int = 0, start_step: int = 0,
                 rampup: BatchRampup | None = None):
        for name, value, low in (("global_batch", global_batch, 1), ("seq_len", seq_len, 1),
                                 ("seed", seed, 0), ("start_step", start_step, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be a whole number >= {low}, got {value!r}")
        if rampup is not None and rampup.final != global_batch:
            raise ConfigError(f"the ramp-up ends at a global batch of {rampup.final}, the sampler's is {global_batch}")
        self.global_batch = global_batch
        self.seq_len = seq_len
        self.seed = seed
        self.step = start_step
        self.rampup = rampup

    def batch_size(self, step: int) -> int:
        """Sequences in step `step`'s global batch (smaller during a ramp-up)."""
        return self.rampup.batch_size(step) if self.rampup is not None else self.global_batch

    def consumed(self, step: int) -> int:
        """Samples read by the steps before `step`."""
        return self.rampup.consumed(step) if self.rampup is not None else step * self.global_batch

    def _samples(self, step: int, rows: slice) -> np.ndarray:
        if step < 0:
            raise ConfigError(f"step must be >= 0, got {step}")
        return self.consumed(step) + np.arange(rows.start, rows.stop, dtype=np.int64)   # (rows,)

    def sample(self, step: int | None = None) -> Batch:
        """Step `step`'s whole global batch (default: the current step) as a `Batch`."""
        step = self.step if step is None else step
        return self._rows(self._samples(step, slice(0, self.batch_size(step))))

    def rank_sample(self, dp_rank: int, dp: int, step: int | None = None) -> Batch:
        """Only data-parallel rank `dp_rank`'s rows of `sample(step)`."""
        step = self.step if step is None else step
        lo, hi = _rank_rows(self.batch_size(step), dp_rank, dp)
        return self._rows(self._samples(step, slice(lo, hi)))

    def batch(self, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) of step `step` (default: the current one), each (global_batch, seq_len) int64."""
        b = self.sample(step)
        return b.input_ids, b.labels

    def rank_batch(self, dp_rank: int, dp: int, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Only data-parallel rank `dp_rank`'s rows of `batch(step)`: (global_batch/dp, seq_len) each."""
        b = self.rank_sample(dp_rank, dp, step)
        return b.input_ids, b.labels

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def _rows(self, samples: np.ndarray) -> Batch:
        raise NotImplementedError

    # ---- resume --------------------------------------------------------------------------
    def _order_state(self) -> dict[str, Any]:
        """What, besides seed, batch, seq_len and ramp-up, fixes the order of the samples."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Position to save in a checkpoint: the next step to read, plus what fixes the order."""
        return {"version": SAMPLER_STATE_VERSION, "step": self.step, "seed": self.seed,
                "global_batch": self.global_batch, "seq_len": self.seq_len,
                "rampup": self.rampup.state() if self.rampup is not None else None, **self._order_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuse one whose batches would differ from this sampler's."""
        if state.get("version") != SAMPLER_STATE_VERSION:
            raise ConfigError(f"data position version {state.get('version')!r} is not supported "
                              f"(expects {SAMPLER_STATE_VERSION})")
        mine = self.state_dict()
        labels = {"seed": "seed", "global_batch": "global batch", "seq_len": "seq_len", "rampup": "batch-size ramp-up",
                  "num_windows": "number of data windows", "blend": "data blend", "document_mask": "document masking"}
        for key, label in labels.items():
            if key not in mine and key not in state:
                continue
            # a checkpoint written before document masking existed trained without it
            saved = state.get(key, False if key == "document_mask" else None)
            if saved != mine.get(key, False if key == "document_mask" else None):
                hint = {"num_windows": "the data changed since the checkpoint",
                        "blend": "resume with the same --data sources and weights"}.get(key, f"resume with {key}={saved}")
                raise ConfigError(f"the checkpoint's data position was saved with {label} {saved}, "
                                  f"this run has {mine.get(key)}; batches would not continue the same "
                                  f"order: {hint}, or start a fresh run")
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"data position step must be a whole number >= 0, got {step!r}")
        self.step = step


class BatchSampler(SamplerBase):
    """Deterministic, resumable batches over one `TokenDataset` (see meshplan.train.data).

    Iterating yields the full global batch of `step` and advances it; `batch(k)` and
    `rank_batch(k, dp_rank, dp)` read any step without moving the position; `sample(k)` and
    `rank_sample(...)` return a `Batch` (with document ids under document masking).
    """

    def __init__(self, dataset, *, global_batch: int, seq_len: int, seed: int = 0, start_step: int = 0,
                 rampup: BatchRampup | None = None, document_mask: bool = False):
        super().__init__(global_batch=global_batch, seq_len=seq_len, seed=seed, start_step=start_step,
                         rampup=rampup)
        windows = dataset.num_windows(seq_len)
        if windows < 1:
            raise ConfigError(f"{dataset.source} has {len(dataset)} tokens, fewer than one sequence of "
                              f"seq_len={seq_len} plus its next token; use a shorter seq_len "
                              f"(at most {len(dataset) - 1}) or more data")
        if document_mask and dataset.doc_starts is None:
            raise ConfigError(f"document masking needs document boundaries, which {dataset.source} does not "
                              "record; prepare the data with `meshplan data prepare`, or train without "
                              "--document-mask")
        self.dataset = dataset
        self.num_windows = windows
        self.document_mask = bool(document_mask)
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)        # (S+1,)

    @property
    def epoch(self) -> int:
        """The epoch (pass over all windows) the next batch starts in."""
        return self.consumed(self.step) // self.num_windows

    @property
    def steps_per_epoch(self) -> float:
        return self.num_windows / self.global_batch

    def window_indices(self, step: int, rows: slice | None = None) -> np.ndarray:
        """Window index of each row of step `step` (only `rows` of them when given)."""
        rows = rows or slice(0, self.batch_size(step))
        return self.windows_of(self.consumed(step) + np.arange(rows.start, rows.stop, dtype=np.int64))

    def windows_of(self, sample: np.ndarray) -> np.ndarray:
        """Window index of each global sample number: epoch after epoch of a seeded permutation."""
        epoch, pos = np.divmod(sample, self.num_windows)
        out = np.empty_like(sample)
        for e in np.unique(epoch):          # a batch spans two epochs at most unless it is bigger than one
            m = epoch == e
            out[m] = _feistel(pos[m], self.num_windows, _round_keys(self.seed, int(e)))
        return out

    def _rows(self, samples: np.ndarray) -> Batch:
        return self.read_windows(self.windows_of(samples))

    def read_windows(self, windows: np.ndarray) -> Batch:
        """The rows of the given windows (inputs, next-token labels, document ids)."""
        positions = windows[:, None] * self.seq_len + self._offsets                       # (rows, S+1)
        window_t = torch.from_numpy(np.asarray(self.dataset.tokens[positions], dtype=np.int64))
        x, y = window_t[:, :-1].contiguous(), window_t[:, 1:].contiguous()      # (rows, S) each
        if not self.document_mask:
            return Batch(x, y)
        docs = torch.from_numpy(self.dataset.document_of(positions))             # (rows, S+1)
        y[docs[:, 1:] != docs[:, :-1]] = IGNORE_INDEX       # targets in the next document: not learned
        return Batch(x, y, docs[:, :-1].contiguous())

    def _order_state(self) -> dict[str, Any]:
        # document_mask only when on, so that positions saved before it existed still load
        return {"epoch": self.epoch, "num_windows": self.num_windows,
                **({"document_mask": True} if self.document_mask else {})}


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


def _round_keys(seed: int | tuple, epoch: int) -> np.ndarray:
    seed = seed if isinstance(seed, tuple) else (seed,)
    return np.random.default_rng((*seed, epoch)).integers(0, 2**63, size=_FEISTEL_ROUNDS, dtype=np.uint64)


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
