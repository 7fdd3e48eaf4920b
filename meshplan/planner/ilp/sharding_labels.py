"""Dim labels of the sharding ILP: which dim of an activation holds tokens and which features,
propagated op by op from the block input (B, S, H) through the ops' shapes.

Op arguments (dims, permutations) are not in the IR, so each op's input dims are matched to its
output dims by shape (`alignments`); a label moves only where every candidate agrees (`follow`).
A shard follows the major dim of a split or merge (`reshape_map`); transposes move it; a label
summed away (`reduced`) turns a shard into partial sums.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

from meshplan.profiling.aten_ops import PERMUTE_OPS, SWAP_OPS, bare

__all__ = ["target_name", "is_pointwise", "is_float", "reshape_map", "alignments", "follow", "reduced"]

_SWAP = bare(SWAP_OPS)
_PERMUTE = bare(PERMUTE_OPS)


def target_name(target: str) -> str:
    """An IR target's op name without namespace and overload ("aten.mul.Tensor" -> "mul")."""
    if "getitem" in target:
        return "getitem"
    parts = target.split(".")
    return parts[1] if len(parts) >= 2 else target


@lru_cache(maxsize=None)
def is_pointwise(target: str) -> bool:
    parts = target.split(".")
    if len(parts) != 3:
        return False
    try:
        import torch   # lazy on purpose: planning imports this module, and it must not import torch
        op = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
        return torch.Tag.pointwise in op.tags
    except Exception:   # not resolvable here: the op is treated as opaque (R -> R only)
        return False


def is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def reshape_map(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int]:
    """src dim -> dst dim under a contiguous reshape: dims group by equal products, and the first
    non-1 dim of a group maps to the group's first non-1 dim (a shard on the major dim survives a
    split or merge; one on a minor dim does not)."""
    out: dict[int, int] = {}
    i = j = 0
    while True:
        while i < len(src) and src[i] == 1:
            i += 1
        while j < len(dst) and dst[j] == 1:
            j += 1
        if i >= len(src) or j >= len(dst):
            return out
        first_i, first_j, pi, pj = i, j, src[i], dst[j]
        while pi != pj:
            if pi < pj:
                i += 1
                if i >= len(src):
                    return out
                pi *= src[i]
            else:
                j += 1
                if j >= len(dst):
                    return out
                pj *= dst[j]
        out[first_i] = first_j
        i, j = i + 1, j + 1


def alignments(src: tuple[int, ...], dst: tuple[int, ...], base: str) -> list[dict[int, int]]:
    """Candidate maps src dim -> dst dim consistent with the shapes (absent dims are dropped).
    Op arguments are not in the IR, so equal sizes can leave several candidates."""
    n, m = len(src), len(dst)
    if base in _SWAP and n == m:      # exactly two dims trade places
        swaps = []
        for i, j in itertools.combinations(range(n), 2):
            perm = list(range(n))
            perm[i], perm[j] = j, i
            if all(src[a] == dst[b] for a, b in enumerate(perm)):
                swaps.append(dict(enumerate(perm)))
        return swaps
    if base in _PERMUTE and n == m:
        return [dict(enumerate(p)) for p in itertools.permutations(range(n))
                if all(src[a] == dst[b] for a, b in enumerate(p))]
    if math.prod(src) == math.prod(dst) and src != dst:
        return [reshape_map(src, dst)]
    if n == m:
        return [{d: d for d in range(n)}]
    cands = []
    if n < m:         # broadcast (right-aligned) or inserted dims (stack, unsqueeze + expand)
        if all(src[d] in (1, dst[d + m - n]) for d in range(n)):
            cands.append({d: d + m - n for d in range(n)})
        cands += [dict(enumerate(pos)) for pos in itertools.combinations(range(m), n)
                  if all(src[d] == dst[p] for d, p in enumerate(pos))]
    else:             # removed dims (select, reductions without keepdim)
        cands += [{d: e for e, d in enumerate(kept)} for kept in itertools.combinations(range(n), m)
                  if all(src[d] == dst[e] for e, d in enumerate(kept))]
    return cands


def follow(dim: int | None, src: tuple[int, ...], dst: tuple[int, ...],
            cands: list[dict[int, int]]) -> int | None:
    """Where a label on src dim `dim` lands in dst: only if every candidate agrees and the dim
    keeps its size (or, through a reshape, heads its group)."""
    if dim is None or not cands:
        return None
    targets = {c.get(dim) for c in cands}
    if len(targets) != 1 or None in targets:
        return None
    e = targets.pop()
    reshaped = math.prod(src) == math.prod(dst) and len(cands) == 1 and src != dst
    return e if (reshaped or src[dim] == dst[e]) else None


def reduced(dim: int | None, dst: tuple[int, ...], cands: list[dict[int, int]]) -> bool:
    """A label summed away: every candidate drops the dim or maps it to a size-1 dim."""
    return dim is not None and bool(cands) and all(c.get(dim) is None or dst[c[dim]] == 1 for c in cands)
