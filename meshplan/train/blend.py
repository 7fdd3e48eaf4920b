"""Weighted blends of several data sets: `--data A:0.7,B:0.3`.

`parse_data_spec` reads the syntax: comma-separated sources, each optionally followed by
``:WEIGHT`` (a positive number; weights are normalised, a source without one weighs 1). A
single source without a weight is plain data, not a blend.

`BlendedSampler` draws each global sample from one component, deterministically per (seed,
sample number), so every step's batch is a pure function of (seed, step) as with one data set
and exact resume holds. Samples are dealt in blocks of `BLOCK` = 4096: block b gives component i
exactly n_i samples (the weights times 4096, rounded by largest remainder), in an order shuffled
by (seed, b). Component i's j-th sample is then the j-th sample of its own `BatchSampler` (its
own seeded permutation, epoch after epoch), so each component is read without repetition within
its epochs, and the proportions are exact over every block of 4096 samples.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from meshplan.errors import ConfigError
from meshplan.ir.rampup import BatchRampup
from meshplan.train.sampler import Batch, BatchSampler, SamplerBase

__all__ = ["BLOCK", "BlendedSampler", "parse_data_spec"]

BLOCK = 4096


def parse_data_spec(spec: str | None) -> list[tuple[str, float]] | None:
    """[(source, weight), ...] of a blend, or None for a single source (or None)."""
    if spec is None:
        return None
    items = [s.strip() for s in str(spec).split(",") if s.strip()]
    parts: list[tuple[str, float]] = []
    weighted = False
    for item in items:
        source, _, tail = item.rpartition(":")
        try:
            weight = float(tail) if source else None
        except ValueError:
            weight = None                     # a colon inside the path, not a weight
        if weight is None:
            parts.append((item, 1.0))
            continue
        if not weight > 0 or weight != weight or weight == float("inf"):
            raise ConfigError(f"--data {spec!r}: weight {tail!r} of {source!r} must be a positive number")
        parts.append((source, weight))
        weighted = True
    if not parts:
        raise ConfigError(f"--data {spec!r} names no source")
    if len(parts) == 1 and not weighted:
        return None
    names = [s for s, _ in parts]
    if len(set(names)) != len(names):
        raise ConfigError(f"--data {spec!r} names a source twice; give each once with its total weight")
    return parts


def block_counts(weights: list[float]) -> np.ndarray:
    """Samples per component in a block of BLOCK (largest-remainder rounding of the weights)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * BLOCK
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:BLOCK - counts.sum()]] += 1
    if (counts == 0).any():
        i = int(np.argmin(counts))
        raise ConfigError(f"data weight {weights[i]} is too small to draw from (less than 1 in {BLOCK} samples); "
                          "raise it or leave that source out")
    return counts


class BlendedSampler(SamplerBase):
    """Batches drawn from several data sets in fixed proportions (see the module docstring)."""

    def __init__(self, datasets: list, weights: list[float], *, global_batch: int, seq_len: int, seed: int = 0,
                 start_step: int = 0, rampup: BatchRampup | None = None, document_mask: bool = False):
        super().__init__(global_batch=global_batch, seq_len=seq_len, seed=seed, start_step=start_step,
                         rampup=rampup)
        if len(datasets) != len(weights) or len(datasets) < 1:
            raise ConfigError("a blend needs one weight per data set")
        self.weights = [float(w) for w in weights]
        self.counts = block_counts(self.weights)
        # each component its own permutation: seeds derived from (seed, component), never equal
        self.components = [BatchSampler(ds, global_batch=global_batch, seq_len=seq_len,
                                        seed=int(np.random.default_rng((seed, i, 0xB1E)).integers(2**62)),
                                        document_mask=document_mask)
                           for i, ds in enumerate(datasets)]
        self.document_mask = bool(document_mask)
        self._block_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def datasets(self) -> list:
        return [c.dataset for c in self.components]

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(component, rank of the sample among its component's in this block) for block b's samples."""
        if b not in self._block_cache:
            order = np.random.default_rng((self.seed, b, 0xB1E)).permutation(
                np.repeat(np.arange(len(self.counts)), self.counts))               # (BLOCK,)
            rank = np.empty(BLOCK, dtype=np.int64)
            for c in range(len(self.counts)):
                m = order == c
                rank[m] = np.arange(int(m.sum()))
            if len(self._block_cache) > 4:
                self._block_cache.clear()
            self._block_cache[b] = (order, rank)
        return self._block_cache[b]

    def assign(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(component, that component's own sample number) for each global sample number."""
        block, offset = np.divmod(samples, BLOCK)
        comp = np.empty_like(samples)
        index = np.empty_like(samples)
        for b in np.unique(block):
            m = block == b
            order, rank = self._block(int(b))
            comp[m] = order[offset[m]]
            index[m] = int(b) * self.counts[comp[m]] + rank[offset[m]]
        return comp, index

    def _rows(self, samples: np.ndarray) -> Batch:
        comp, index = self.assign(samples)
        x = torch.empty(len(samples), self.seq_len, dtype=torch.int64)
        y = torch.empty_like(x)
        d = torch.empty_like(x) if self.document_mask else None
        for c in np.unique(comp):
            m = comp == c
            sub = self.components[c]
            part = sub.read_windows(sub.windows_of(index[m]))
            rows = torch.from_numpy(np.nonzero(m)[0])
            x[rows], y[rows] = part.input_ids, part.labels
            if d is not None:
                # document ids only compare within a row; offset them per component for readability
                d[rows] = part.document_ids + (int(c) << 40)
        return Batch(x, y, d)

    def _order_state(self) -> dict[str, Any]:
        return {"blend": [{"source": c.dataset.source, "weight": w, "num_windows": c.num_windows}
                          for c, w in zip(self.components, self.weights)],
                **({"document_mask": True} if self.document_mask else {})}
