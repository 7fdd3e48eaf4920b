"""Splits found without a solver: the min-max dynamic program over virtual stages (`dp_split`,
exact for vp = 1), and for vp > 1 the heuristic split that bounds the ILP (`incumbent_split`:
the dynamic program with each stage holding its share of its rank's memory room, improved by
moving single boundaries).
"""

from __future__ import annotations

import math
from typing import Sequence

from meshplan.planner.ilp.stage_costs import MEMORY_TOL, TIME_ABS, TIME_REL, StageInputs, even_split, fits

__all__ = ["dp_split", "stage_room", "incumbent_split"]

# Single-boundary moves the vp > 1 heuristic tries, per boundary (bounds its cost to a few ms).
_LOCAL_SEARCH_PASSES = 40


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def dp_split(d: StageInputs, nmin: int, *, minimise: str, memory_room: Sequence[float],
             time_cap: float = math.inf) -> tuple[int, ...] | None:
    """Min-max split over virtual stages by dynamic programming; None when none is allowed.

    minimise "time": the slowest stage; "memory": the largest stage memory (static + in-flight
    activations + the rank's extras). Stage s must fit memory_room[s] (GB for its layers) and
    take at most time_cap seconds. For vp = 1 a stage is a rank, so with memory_room = C - e^M_r
    this is the exact optimum of the ILP. Both stage time and memory grow as a stage reaches
    further back, so the scan over a stage's first layer stops at the first one that breaks a
    limit or cannot beat the best found: about L^2 steps in all, usually far fewer.
    """
    L, S = d.L, d.S
    PT, PA, PW = _prefix(d.time), _prefix(d.act), _prefix(d.static)
    inf = math.inf
    best = [0.0] + [inf] * L            # best[j]: min-max value with the first j layers placed
    choice: list[list[int]] = []
    for s in range(S):
        r = s % d.pp
        room = memory_room[s] * (1 + MEMORY_TOL) + MEMORY_TOL
        tcap = time_cap * (1 + TIME_REL) + TIME_ABS
        ext_t, ext_m, f = d.stage_extra_time(s), d.extra_mem[r], d.in_flight[r]
        new, arg = [inf] * (L + 1), [-1] * (L + 1)
        for j in range((s + 1) * nmin, L - (S - s - 1) * nmin + 1):
            b = inf
            for i in range(j - nmin, s * nmin - 1, -1):
                mem = PW[j] - PW[i] + f * (PA[j] - PA[i])
                t = PT[j] - PT[i] + ext_t
                if mem > room or t > tcap:
                    break
                v = t if minimise == "time" else mem + ext_m
                if v >= b:
                    break
                if best[i] > v:
                    v = best[i]
                if v < b:
                    b, arg[j] = v, i
            new[j] = b
        best = new
        choice.append(arg)
    if best[L] == inf:
        return None
    bounds = [L]
    for s in range(S - 1, -1, -1):
        bounds.append(choice[s][bounds[-1]])
    bounds.reverse()
    return tuple(bounds[s + 1] - bounds[s] for s in range(S))


def stage_room(d: StageInputs, cap: float) -> list[float]:
    """Memory room of each virtual stage's layers: its rank's cap less the rank's extras, shared
    equally by the rank's vp chunks (exact for vp = 1, a safe share for vp > 1)."""
    return [(cap - d.extra_mem[s % d.pp]) / d.vp for s in range(d.S)]


def _local_search(d: StageInputs, cap: float, nmin: int, split: tuple[int, ...]) -> tuple[int, ...]:
    """Move single boundaries by one layer while that lowers (slowest rank, sum of squared rank
    times) and every rank still fits."""
    S, pp = d.S, d.pp
    PT, PA, PW = _prefix(d.time), _prefix(d.act), _prefix(d.static)
    b = [0]
    for n in split:
        b.append(b[-1] + n)

    def costs(bb):
        t, w, a = list(d.extra_time), [0.0] * pp, [0.0] * pp
        for s in range(S):
            r = s % pp
            t[r] += PT[bb[s + 1]] - PT[bb[s]]
            w[r] += PW[bb[s + 1]] - PW[bb[s]]
            a[r] += PA[bb[s + 1]] - PA[bb[s]]
        return t, [w[r] + d.in_flight[r] * a[r] + d.extra_mem[r] for r in range(pp)]

    def key(t):
        return (max(t), sum(x * x for x in t))

    cur = key(costs(b)[0])
    for _ in range(_LOCAL_SEARCH_PASSES):
        moved = False
        for s in range(1, S):
            for step in (-1, 1):
                nb = b[s] + step
                if nb - b[s - 1] < nmin or b[s + 1] - nb < nmin:
                    continue
                trial = b[:s] + [nb] + b[s + 1:]
                t, m = costs(trial)
                k = key(t)
                better = k[0] < cur[0] or (k[0] <= cur[0] and k[1] < cur[1] * (1 - 1e-12))
                if better and fits(m, cap):
                    b, cur, moved = trial, k, True
        if not moved:
            break
    return tuple(b[s + 1] - b[s] for s in range(S))


def incumbent_split(d: StageInputs, cap: float, nmin: int) -> tuple[int, ...] | None:
    """A split that fits, found without a solver (vp > 1), or None."""
    split = dp_split(d, nmin, minimise="time", memory_room=stage_room(d, cap))
    if split is None and d.L >= d.S * max(nmin, 1):
        even = even_split(d.L, d.S)
        if min(even) >= nmin and fits(d.rank_costs(even)[1], cap):
            split = even
    return None if split is None else _local_search(d, cap, nmin, split)
