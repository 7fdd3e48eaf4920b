"""Pipeline stage boundaries: which contiguous layers each of the pp x vp virtual stages runs.

Virtual stage s (s = 0 .. S-1, S = pp*vp) runs on pipeline rank s mod pp (Megatron's interleaved
placement; vp = 1 is plain pipelining). The embedding lives on virtual stage 0 (rank 0), the
final norm, output layer and loss on stage S-1 (rank pp-1). Because those extras make the end
ranks slower and fuller, the best split is often uneven - what Megatron users set by hand with
`--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`.

The ILP
-------
Data: L layers with time t_l (one micro-batch, forward + backward), activation memory a_l (one
micro-batch) and static memory w_l (weights, gradients, optimizer state); per rank r a multiplier
f_r on activations (micro-batches in flight under the schedule) and extras e^T_r, e^M_r (the
embedding on rank 0, the output layer + loss on rank pp-1); a memory cap C; at least n_min
layers per stage (n_min = 1 by default).

Runs. Consecutive identical layers (same t, a, w) form a run k of n_k layers with values
(t_k, a_k, w_k); a Llama is 1 run, DeepSeek-V3 2 (3 dense, 58 MoE). The model counts layers per
run instead of placing each layer, so its size is O(S x runs), not O(L x S^2): a 126-layer Llama on
32 virtual stages has 31 + 8 general integers and no binary. Layers of one kind that are not
adjacent (a model alternating dense and MoE layers) share their rank-count variables.

Variables
  q_sk in {0..n_k}  layers of run k before boundary s (s = 1 .. S-1; q_0k = 0, q_Sk = n_k);
                    boundary b_s = sum_k q_sk and stage s runs layers [b_s, b_{s+1})
  z_sk in {0, 1}    run k lies wholly before boundary s (only where b_s may fall in run k or k+1;
                    for a one-layer run z_sk is q_sk itself)
  c_rj in {0..N_j}  layers of kind j (identical t, a, w; N_j of them) on rank r; for a kind of
                    one layer the expression below is used directly
  T                 the slowest rank's time (the epigraph variable)
  The prefix sums are linear: time of stage s = sum_k t_k (q_{s+1,k} - q_sk), likewise memory.

Objective
  minimise T

Constraint families (one method each in `_StageModel`)
  assignment  q_sk >= n_k z_sk and q_{s,k+1} <= n_{k+1} z_sk: a boundary takes layers of run k+1
              only after all of run k, so q_s. describes one position and every layer belongs to
              exactly one stage
  order       q_{s+1,k} >= q_sk (stages are contiguous and in order) and
              b_{s+1} - b_s >= n_min (no stage is empty)
  count       c_rj = sum_{runs k of kind j} sum_{s on r} (q_{s+1,k} - q_sk)
  memory      for every rank r: sum_j (w_j + f_r a_j) c_rj + e^M_r <= C
  epigraph    for every rank r: sum_j t_j c_rj + e^T_r <= T
  incumbent   T <= T_h: the slowest rank of a heuristic split, see below

Each q_sk's range is pruned beforehand from b_s in [s n_min, L - (S - s) n_min].

Methods. With vp = 1 a stage is a rank, and the problem is the classic min-max linear partition
with per-part limits: a dynamic program over boundaries solves it exactly in about L^2 steps
(best[j] = min over i of max(best over the first i layers, time of [i, j)), memory checked per
stage), so `method="auto"` uses it there and keeps the ILP for vp > 1, where a rank's chunks are
not contiguous and no such recursion exists. `method="ilp"` runs the ILP for any vp (tests check
both against brute force).

Incumbent (vp > 1). Branch and bound proves min-max splits slowly when layers differ one by one
(the LP bound spreads time perfectly), so a split found without a solver bounds the search (the
incumbent family) and is the answer if the solver stops at its time limit without beating it:
the same dynamic program balancing virtual stages (each holding a 1/vp share of its rank's memory
room), improved by moving single boundaries. CBC also starts from it (HiGHS through pulp cannot).

Tie-break. Many splits share the optimal T. A second solve (or dynamic program) keeps T <= T* and
minimises the slowest virtual stage (vp > 1: the interleaved schedule fills and drains the
pipeline chunk by chunk) or the peak rank memory (vp = 1). It gets a quarter of the time limit.

Infeasibility. When the memory family admits no split, the same variables (or the dynamic
program) minimise the peak rank memory instead; that optimum names the rank and what on it
cannot fit, in GB.

Zero-layer stages: n_min = 0 is allowed for callers that want the embedding or the output layer
to be a stage of its own (Megatron's account-for-embedding / account-for-loss splits); it is
not the default because torch.distributed.pipelining needs a module on every stage.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import pulp

from meshplan.ir.layout import split_layers
from meshplan.errors import ConfigError, DoesNotFitError, LayoutError
from meshplan.planner.solver import has_solution, proved_optimal, resolve_solver, solve

__all__ = ["StageAssignment", "assign_stages", "even_split", "evaluate_split"]

# Memory may exceed the cap by this much (relative and absolute GB) after the solve: the solvers'
# feasibility tolerance (1e-6 to 1e-7 absolute, HiGHS / CBC defaults) on GB-sized numbers.
_MEMORY_TOL = 1e-6
# Two splits whose slowest ranks differ by less than this (relative, absolute seconds) are equally
# fast: float noise in sums of per-layer seconds.
_TIME_REL = 1e-9
_TIME_ABS = 1e-12
# Single-boundary moves the vp > 1 heuristic tries, per boundary (bounds its cost to a few ms).
_LOCAL_SEARCH_PASSES = 40


@dataclass(frozen=True, kw_only=True)
class StageAssignment:
    """Layers per virtual stage and what each pipeline rank then costs."""

    stage_layers: tuple[int, ...]      # layers per virtual stage, len = pp*vp; stage s runs on rank s % pp
    rank_time_s: tuple[float, ...]     # per pipeline rank: one micro-batch fwd+bwd over its chunks (incl. extras)
    rank_memory_gb: tuple[float, ...]  # per pipeline rank: static + in-flight activations + extras
    slowest_s: float                   # max(rank_time_s), the ILP's objective
    solver: str                        # "highs" / "cbc", + " (time limit)" when optimality is not proved; "evaluated"
    solve_time_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.stage_layers or min(self.stage_layers) < 0:
            raise ConfigError(f"stage_layers {self.stage_layers}: needs one non-negative count per virtual stage")
        if (not self.rank_time_s or len(self.rank_time_s) != len(self.rank_memory_gb)
                or len(self.stage_layers) % len(self.rank_time_s)):
            raise ConfigError(f"{len(self.stage_layers)} virtual stages do not spread over "
                              f"{len(self.rank_time_s)} pipeline ranks")
        if not math.isclose(self.slowest_s, max(self.rank_time_s), rel_tol=1e-9, abs_tol=1e-15):
            raise ConfigError(f"slowest_s={self.slowest_s} is not the largest rank time {max(self.rank_time_s)}")

    @property
    def pp(self) -> int:
        return len(self.rank_time_s)

    @property
    def vp(self) -> int:
        return len(self.stage_layers) // self.pp

    def rank_layers(self, rank: int) -> list[int]:
        """Layer indices pipeline rank `rank` runs, in execution order."""
        return _rank_layer_indices(self.stage_layers, self.pp, rank)


def _rank_layer_indices(stage_layers: Sequence[int], pp: int, rank: int) -> list[int]:
    out, start = [], 0
    for s, n in enumerate(stage_layers):
        if s % pp == rank:
            out.extend(range(start, start + n))
        start += n
    return out


# ---- inputs ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class _Inputs:
    time: tuple[float, ...]
    act: tuple[float, ...]
    static: tuple[float, ...]
    pp: int
    vp: int
    in_flight: tuple[float, ...]
    extra_time: tuple[float, ...]     # per rank
    extra_mem: tuple[float, ...]      # per rank
    first_extra_time_s: float
    last_extra_time_s: float
    first_extra_memory_gb: float
    last_extra_memory_gb: float

    @property
    def L(self) -> int:
        return len(self.time)

    @property
    def S(self) -> int:
        return self.pp * self.vp

    def stage_extra_time(self, s: int) -> float:
        return (self.first_extra_time_s if s == 0 else 0.0) + (self.last_extra_time_s if s == self.S - 1 else 0.0)

    def rank_costs(self, stage_layers: Sequence[int]) -> tuple[list[float], list[float]]:
        """Exact (fsum) rank times and memory of a split."""
        t = list(self.extra_time)
        w = [0.0] * self.pp
        a = [0.0] * self.pp
        start = 0
        for s, n in enumerate(stage_layers):
            r = s % self.pp
            t[r] += math.fsum(self.time[start:start + n])
            w[r] += math.fsum(self.static[start:start + n])
            a[r] += math.fsum(self.act[start:start + n])
            start += n
        mem = [w[r] + self.in_flight[r] * a[r] + self.extra_mem[r] for r in range(self.pp)]
        return t, mem


def _floats(name: str, values, n: int | None) -> tuple[float, ...]:
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        if n is None:
            raise ConfigError(f"{name} must be a sequence")
        values = [values] * n
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a sequence of numbers, got {values!r}") from None
    if n is not None and len(out) != n:
        raise ConfigError(f"{name} has {len(out)} entries, expected {n}")
    bad = [v for v in out if not math.isfinite(v) or v < 0]
    if bad:
        raise ConfigError(f"{name} must be finite and non-negative, got {bad[0]!r}")
    return out


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{name}={v!r}: must be a positive integer")
    return v


def _inputs(layer_time_s, layer_memory_gb, *, pp, vp, static_memory_gb, in_flight, first_extra_time_s,
            last_extra_time_s, first_extra_memory_gb, last_extra_memory_gb) -> _Inputs:
    pp, vp = _positive_int("pp", pp), _positive_int("vp", vp)
    t = _floats("layer_time_s", layer_time_s, None)
    if not t:
        raise ConfigError("layer_time_s is empty: a model needs at least one layer")
    a = _floats("layer_memory_gb", layer_memory_gb, len(t))
    w = _floats("static_memory_gb", static_memory_gb, len(t))
    f = _floats("in_flight", [1.0] * pp if in_flight is None else in_flight, pp)
    ft, lt, fm, lm = _floats("first/last extras", (first_extra_time_s, last_extra_time_s, first_extra_memory_gb,
                                                    last_extra_memory_gb), 4)
    et, em = [0.0] * pp, [0.0] * pp
    et[0] += ft
    et[pp - 1] += lt
    em[0] += fm
    em[pp - 1] += lm
    return _Inputs(time=t, act=a, static=w, pp=pp, vp=vp, in_flight=f, extra_time=tuple(et), extra_mem=tuple(em),
                   first_extra_time_s=ft, last_extra_time_s=lt, first_extra_memory_gb=fm, last_extra_memory_gb=lm)


def _fits(mem: Sequence[float], cap: float) -> bool:
    return max(mem) <= cap * (1 + _MEMORY_TOL) + _MEMORY_TOL


def _no_slower(t: float, ref: float) -> bool:
    return t <= ref * (1 + _TIME_REL) + _TIME_ABS


# ---- baselines ------------------------------------------------------------------------------------
def even_split(num_layers: int, stages: int) -> tuple[int, ...]:
    """The split without an ILP: equal counts, the remainder on the middle stages (the layout's default)."""
    _positive_int("num_layers", num_layers)
    _positive_int("stages", stages)
    if stages > num_layers:
        raise LayoutError(f"{stages} virtual stages but only {num_layers} layers; use pp*vp <= {num_layers}")
    return split_layers(num_layers, stages)


def evaluate_split(stage_layers: Sequence[int], layer_time_s: Sequence[float], layer_memory_gb: Sequence[float], *,
                   pp: int, vp: int = 1, static_memory_gb: Sequence[float] | float = 0.0,
                   in_flight: Sequence[float] | None = None, first_extra_time_s: float = 0.0,
                   last_extra_time_s: float = 0.0, first_extra_memory_gb: float = 0.0,
                   last_extra_memory_gb: float = 0.0) -> StageAssignment:
    """Rank times and memory of a given split, on the ILP's own terms (no cap is checked)."""
    d = _inputs(layer_time_s, layer_memory_gb, pp=pp, vp=vp, static_memory_gb=static_memory_gb, in_flight=in_flight,
                first_extra_time_s=first_extra_time_s, last_extra_time_s=last_extra_time_s,
                first_extra_memory_gb=first_extra_memory_gb, last_extra_memory_gb=last_extra_memory_gb)
    sl = tuple(int(n) for n in stage_layers)
    if len(sl) != d.S or min(sl) < 0 or sum(sl) != d.L:
        raise ConfigError(f"stage_layers {sl}: needs pp*vp = {d.S} non-negative counts summing to {d.L} layers")
    t, m = d.rank_costs(sl)
    return StageAssignment(stage_layers=sl, rank_time_s=tuple(t), rank_memory_gb=tuple(m), slowest_s=max(t),
                           solver="evaluated")


# ---- incumbent heuristics -------------------------------------------------------------------------
def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _dp(d: _Inputs, nmin: int, *, minimise: str, memory_room: Sequence[float],
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
        room = memory_room[s] * (1 + _MEMORY_TOL) + _MEMORY_TOL
        tcap = time_cap * (1 + _TIME_REL) + _TIME_ABS
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


def _stage_room(d: _Inputs, cap: float) -> list[float]:
    """Memory room of each virtual stage's layers: its rank's cap less the rank's extras, shared
    equally by the rank's vp chunks (exact for vp = 1, a safe share for vp > 1)."""
    return [(cap - d.extra_mem[s % d.pp]) / d.vp for s in range(d.S)]


def _local_search(d: _Inputs, cap: float, nmin: int, split: tuple[int, ...]) -> tuple[int, ...]:
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
                if better and _fits(m, cap):
                    b, cur, moved = trial, k, True
        if not moved:
            break
    return tuple(b[s + 1] - b[s] for s in range(S))


def _incumbent(d: _Inputs, cap: float, nmin: int) -> tuple[int, ...] | None:
    """A split that fits, found without a solver (vp > 1), or None."""
    split = _dp(d, nmin, minimise="time", memory_room=_stage_room(d, cap))
    if split is None and d.L >= d.S * max(nmin, 1):
        even = even_split(d.L, d.S)
        if min(even) >= nmin and _fits(d.rank_costs(even)[1], cap):
            split = even
    return None if split is None else _local_search(d, cap, nmin, split)


# ---- the ILP --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Run:
    start: int
    length: int
    time: float
    act: float
    static: float


def _runs(d: _Inputs) -> list[_Run]:
    runs: list[_Run] = []
    for i in range(d.L):
        key = (d.time[i], d.act[i], d.static[i])
        if runs and (runs[-1].time, runs[-1].act, runs[-1].static) == key:
            r = runs[-1]
            runs[-1] = _Run(r.start, r.length + 1, r.time, r.act, r.static)
        else:
            runs.append(_Run(i, 1, *key))
    return runs


class _StageModel:
    """The variables of the formulation and one method per constraint family."""

    def __init__(self, d: _Inputs, cap: float, min_layers: int, name: str):
        self.d, self.cap, self.nmin = d, cap, min_layers
        self.prob = pulp.LpProblem(name, pulp.LpMinimize)
        self.runs = _runs(d)
        self._q: dict[tuple[int, int], object] = {}
        self.z: dict[tuple[int, int], object] = {}
        self.c: dict[tuple[int, int], object] = {}
        self._count_expr: dict[tuple[int, int], object] = {}
        self._boundary_variables()
        self._rank_count_variables()

    def _boundary_variables(self) -> None:
        # b_s lies in [s*nmin, L-(S-s)*nmin], which bounds how much of each run can precede it
        d, S = self.d, self.d.S
        for s in range(1, S):
            lo_s, hi_s = s * self.nmin, d.L - (S - s) * self.nmin
            for k, run in enumerate(self.runs):
                lo = min(max(lo_s - run.start, 0), run.length)
                hi = min(max(hi_s - run.start, 0), run.length)
                self._q[s, k] = lo if lo == hi else pulp.LpVariable(
                    f"q_{s}_{k}", lo, hi, cat="Binary" if (lo, hi) == (0, 1) else "Integer")
            for k in range(len(self.runs) - 1):
                if not isinstance(self._q[s, k], pulp.LpVariable) or not isinstance(self._q[s, k + 1], pulp.LpVariable):
                    continue   # run k is surely complete, or run k+1 surely untouched: no link needed
                if self.runs[k].length == 1:
                    self.z[s, k] = self._q[s, k]   # a one-layer run is complete exactly when it is started
                else:
                    self.z[s, k] = pulp.LpVariable(f"z_{s}_{k}", cat="Binary")

    def _rank_count_variables(self) -> None:
        # A rank's layer count per kind (identical layers, wherever they sit: a Llama has 1 kind, a
        # model alternating dense and MoE layers 2) gets an integer variable of its own: branching on
        # it closes the gap between the LP bound and the integer optimum far faster than branching on
        # boundaries (measured: CBC went from its 10 s limit to 20 ms on a DeepSeek-V3-like pp=8,
        # vp=2 instance).
        kinds: dict[tuple[float, float, float], list[int]] = {}
        for k, run in enumerate(self.runs):
            kinds.setdefault((run.time, run.act, run.static), []).append(k)
        self.kinds = list(kinds.items())
        for r in range(self.d.pp):
            for j, (_, ks) in enumerate(self.kinds):
                expr = pulp.lpSum(self.q(s + 1, k) - self.q(s, k) for k in ks for s in range(r, self.d.S, self.d.pp))
                total = sum(self.runs[k].length for k in ks)
                if total > 1:
                    self.c[r, j] = pulp.LpVariable(f"c_{r}_{j}", 0, total, cat="Integer")
                    self._count_expr[r, j] = expr
                else:
                    self.c[r, j] = expr

    def q(self, s: int, k: int):
        """q_sk: how many layers of run k lie before boundary s."""
        if s == 0:
            return 0
        if s == self.d.S:
            return self.runs[k].length
        return self._q[s, k]

    def boundary(self, s: int):
        return pulp.lpSum(self.q(s, k) for k in range(len(self.runs)))

    def rank_time(self, r: int):
        return pulp.lpSum(t * self.c[r, j] for j, ((t, _, _), _) in enumerate(self.kinds)) + self.d.extra_time[r]

    def rank_memory(self, r: int):
        f = self.d.in_flight[r]
        return (pulp.lpSum((w + f * a) * self.c[r, j] for j, ((_, a, w), _) in enumerate(self.kinds))
                + self.d.extra_mem[r])

    def stage_time(self, s: int):
        return (pulp.lpSum(run.time * (self.q(s + 1, k) - self.q(s, k)) for k, run in enumerate(self.runs))
                + self.d.stage_extra_time(s))

    # ---- constraint families ----
    def add_assignment(self) -> None:
        for (s, k), z in self.z.items():
            if z is not self._q[s, k]:
                self.prob += self._q[s, k] >= self.runs[k].length * z, f"complete_{s}_{k}"
            self.prob += self._q[s, k + 1] <= self.runs[k + 1].length * z, f"started_{s}_{k + 1}"

    def add_order(self) -> None:
        for s in range(self.d.S):
            for k in range(len(self.runs)):
                if isinstance(self.q(s, k), pulp.LpVariable) or isinstance(self.q(s + 1, k), pulp.LpVariable):
                    self.prob += self.q(s + 1, k) >= self.q(s, k), f"order_{s}_{k}"
            if self.nmin > 0:
                self.prob += self.boundary(s + 1) - self.boundary(s) >= self.nmin, f"nonempty_{s}"

    def add_count(self) -> None:
        for (r, j), expr in self._count_expr.items():
            self.prob += self.c[r, j] == expr, f"count_{r}_{j}"

    def add_memory(self) -> None:
        for r in range(self.d.pp):
            self.prob += self.rank_memory(r) <= self.cap, f"memory_rank_{r}"

    def add_epigraph(self, T: pulp.LpVariable) -> None:
        for r in range(self.d.pp):
            self.prob += self.rank_time(r) <= T, f"slowest_rank_{r}"

    def add_incumbent(self, T: pulp.LpVariable, upper: float) -> None:
        self.prob += T <= upper * (1 + _TIME_REL) + _TIME_ABS, "incumbent_upper"

    def add_tie_break(self, slowest: float, Z: pulp.LpVariable) -> None:
        """Keep every rank within the optimal slowest time; Z bounds the slowest virtual stage (vp > 1)
        or the peak memory (vp = 1)."""
        for r in range(self.d.pp):
            self.prob += self.rank_time(r) <= slowest * (1 + _TIME_REL) + _TIME_ABS, f"keep_slowest_{r}"
        if self.d.vp > 1:
            for s in range(self.d.S):
                self.prob += self.stage_time(s) <= Z, f"slowest_stage_{s}"
        else:
            self.add_peak_memory(Z)

    def add_peak_memory(self, M: pulp.LpVariable) -> None:
        """M bounds every rank's memory (the infeasibility diagnosis and the vp = 1 tie-break)."""
        for r in range(self.d.pp):
            self.prob += self.rank_memory(r) <= M, f"peak_memory_rank_{r}"

    def start_from(self, split: Sequence[int]) -> None:
        """Initial values for CBC's warm start."""
        b = [0]
        for n in split:
            b.append(b[-1] + n)
        for (s, k), v in self._q.items():
            run = self.runs[k]
            if isinstance(v, pulp.LpVariable):
                v.setInitialValue(min(max(b[s] - run.start, 0), run.length))
        for (s, k), z in self.z.items():
            if z is not self._q[s, k]:
                z.setInitialValue(1 if b[s] >= self.runs[k].start + self.runs[k].length else 0)
        for (r, j), c in self.c.items():
            if isinstance(c, pulp.LpVariable):
                c.setInitialValue(sum(len(range(max(b[s], self.runs[k].start),
                                                min(b[s + 1], self.runs[k].start + self.runs[k].length)))
                                      for k in self.kinds[j][1] for s in range(r, self.d.S, self.d.pp)))

    def stage_layers(self) -> tuple[int, ...]:
        b = [0] + [int(round(pulp.value(self.boundary(s)))) for s in range(1, self.d.S)] + [self.d.L]
        return tuple(b[s + 1] - b[s] for s in range(self.d.S))

    def build(self, objective_name: str) -> pulp.LpVariable:
        """The objective variable, and the families every variant shares."""
        v = pulp.LpVariable(objective_name, lowBound=0)
        self.prob += v
        self.add_assignment()
        self.add_order()
        self.add_count()
        return v


def assign_stages(layer_time_s: Sequence[float], layer_memory_gb: Sequence[float], *, pp: int, vp: int = 1,
                  static_memory_gb: Sequence[float] | float = 0.0, in_flight: Sequence[float] | None = None,
                  first_extra_time_s: float = 0.0, last_extra_time_s: float = 0.0,
                  first_extra_memory_gb: float = 0.0, last_extra_memory_gb: float = 0.0,
                  memory_cap_gb: float, time_limit_s: float = 10.0, solver: str = "auto",
                  min_stage_layers: int = 1, tie_break: bool = True, method: str = "auto") -> StageAssignment:
    """Split the layers over pp*vp virtual stages so the slowest pipeline rank is as fast as possible
    while every rank fits in `memory_cap_gb`.

    layer_time_s: per layer, one micro-batch forward + backward (+ recompute) seconds.
    layer_memory_gb: per layer, activations of one micro-batch; multiplied by in_flight[rank]
        (micro-batches the schedule keeps alive on that rank; default 1).
    static_memory_gb: per layer (or one value for all), memory that does not scale with micro-batches.
    first/last_extra_*: the embedding (rank 0) and the output layer + loss (rank pp-1), as totals
        (scale their activations by in-flight micro-batches before passing them).
    tie_break: among the splits with the optimal slowest rank, pick the one with the fastest slowest
        virtual stage (vp > 1) or the least peak memory (vp = 1).
    method: "auto" (the exact dynamic program for vp = 1, the ILP bounded by a heuristic split for
        vp > 1), "ilp" (the ILP alone, no heuristic) or "dp" (vp = 1 only).
    time_limit_s: for the whole call; solver: "auto", "highs" or "cbc".
    Raises LayoutError when there are fewer layers than stages, DoesNotFitError when no split fits.
    """
    d = _inputs(layer_time_s, layer_memory_gb, pp=pp, vp=vp, static_memory_gb=static_memory_gb, in_flight=in_flight,
                first_extra_time_s=first_extra_time_s, last_extra_time_s=last_extra_time_s,
                first_extra_memory_gb=first_extra_memory_gb, last_extra_memory_gb=last_extra_memory_gb)
    if isinstance(min_stage_layers, bool) or not isinstance(min_stage_layers, int) or min_stage_layers < 0:
        raise ConfigError(f"min_stage_layers={min_stage_layers!r}: must be 0 or a positive integer")
    if isinstance(memory_cap_gb, bool) or not (isinstance(memory_cap_gb, (int, float))
                                               and math.isfinite(memory_cap_gb) and memory_cap_gb > 0):
        raise ConfigError(f"memory_cap_gb={memory_cap_gb!r}: must be a positive number of GB")
    if isinstance(time_limit_s, bool) or not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0):
        raise ConfigError(f"time_limit_s={time_limit_s!r}: must be a positive number of seconds")
    if method not in ("auto", "ilp", "dp"):
        raise ConfigError(f"method={method!r}: use 'auto', 'ilp' or 'dp'")
    if method == "dp" and d.vp > 1:
        raise ConfigError(f"method='dp' is exact only for vp=1 (a rank's {d.vp} chunks are not contiguous); "
                          "use method='auto' or 'ilp'")
    if d.S * min_stage_layers > d.L:
        raise LayoutError(f"pp*vp = {d.pp}*{d.vp} = {d.S} virtual stages need at least {d.S * min_stage_layers} "
                          f"layers ({min_stage_layers} each) but the model has {d.L}; use pp*vp <= "
                          f"{d.L // max(1, min_stage_layers)}")
    cap, nmin = float(memory_cap_gb), min_stage_layers
    t0 = time.perf_counter()
    if method == "dp" or (method == "auto" and d.vp == 1):
        best, label = _solve_dp(d, cap, nmin, tie_break), "dp"
    else:
        best, label = _solve_ilp(d, cap, nmin, tie_break, time_limit_s, resolve_solver(solver),
                                 with_incumbent=method == "auto")
    t, m = d.rank_costs(best)
    return StageAssignment(stage_layers=best, rank_time_s=tuple(t), rank_memory_gb=tuple(m), slowest_s=max(t),
                           solver=label, solve_time_s=time.perf_counter() - t0)


def _solve_dp(d: _Inputs, cap: float, nmin: int, tie_break: bool) -> tuple[int, ...]:
    room = _stage_room(d, cap)
    best = _dp(d, nmin, minimise="time", memory_room=room)
    if best is None:
        least = _dp(d, nmin, minimise="memory", memory_room=[math.inf] * d.S)
        _raise_does_not_fit(d, cap, least)
    if tie_break:
        slowest = max(d.rank_costs(best)[0])
        again = _dp(d, nmin, minimise="memory", memory_room=room, time_cap=slowest)
        if again is not None and _no_slower(max(d.rank_costs(again)[0]), slowest):
            best = again
    return best


def _solve_ilp(d: _Inputs, cap: float, nmin: int, tie_break: bool, time_limit_s: float, name: str, *,
               with_incumbent: bool) -> tuple[tuple[int, ...], str]:
    t0 = time.perf_counter()
    start = _incumbent(d, cap, nmin) if with_incumbent else None
    model = _StageModel(d, cap, nmin, "stages")
    T = model.build("slowest_rank_s")
    model.add_memory()
    model.add_epigraph(T)
    if start is not None:
        model.add_incumbent(T, max(d.rank_costs(start)[0]))
        model.start_from(start)
    # a quarter of the time limit is kept for the tie-break: it refines, it must not double the cost
    first_limit = time_limit_s * (0.75 if tie_break and d.S > 1 else 1.0)
    status = solve(model.prob, time_limit_s=first_limit, solver=name, warm_start=start is not None)
    found = [start] if start is not None else []
    if has_solution(model.prob):
        sl = model.stage_layers()
        if min(sl) >= nmin and _fits(d.rank_costs(sl)[1], cap):   # never trust a tolerance slip
            found.append(sl)
    if not found:
        _raise_does_not_fit(d, cap, _least_memory_ilp(d, nmin, name, time_limit_s), status)
    best = min(found, key=lambda sl: (max(d.rank_costs(sl)[0]), max(d.rank_costs(sl)[1])))
    label = name if proved_optimal(model.prob) else f"{name} (time limit)"
    left = time_limit_s - (time.perf_counter() - t0)
    if tie_break and d.S > 1 and left > 0:
        best = _tie_break(d, cap, nmin, name, left, best)
    return best, label


def _tie_break(d: _Inputs, cap: float, nmin: int, solver: str, time_limit_s: float,
               first: tuple[int, ...]) -> tuple[int, ...]:
    t, m = d.rank_costs(first)
    slowest = max(t)
    model = _StageModel(d, cap, nmin, "stages_tie_break")
    Z = model.build("tie_break")
    model.add_memory()
    model.add_tie_break(slowest, Z)
    model.start_from(first)
    solve(model.prob, time_limit_s=time_limit_s, solver=solver, warm_start=True)
    if not has_solution(model.prob):
        return first
    sl = model.stage_layers()
    t2, m2 = d.rank_costs(sl)
    # keep the second split only if it is truly no slower and fits (solver tolerances are not ours)
    if min(sl) >= nmin and _no_slower(max(t2), slowest) and _fits(m2, cap):
        return sl
    return first


def _least_memory_ilp(d: _Inputs, nmin: int, solver: str, time_limit_s: float) -> tuple[int, ...] | None:
    model = _StageModel(d, math.inf, nmin, "stages_min_memory")
    M = model.build("peak_memory_gb")
    model.add_peak_memory(M)
    solve(model.prob, time_limit_s=time_limit_s, solver=solver)
    return model.stage_layers() if has_solution(model.prob) else None


def _raise_does_not_fit(d: _Inputs, cap: float, least: tuple[int, ...] | None, status: str = "Infeasible"):
    """Say which rank of the split with the least peak memory cannot fit, and what on it."""
    if least is None:
        raise DoesNotFitError(f"no split of {d.L} layers over pp*vp = {d.S} stages was found within the time "
                              f"limit (solver status {status!r}); raise time_limit_s")
    _, mem = d.rank_costs(least)
    r = max(range(d.pp), key=lambda i: mem[i])
    if _fits(mem, cap):
        raise DoesNotFitError(f"the stage-split ILP stopped without a split that fits in {cap:.1f} GB "
                              f"(solver status {status!r}) although one exists; raise time_limit_s")
    layers = _rank_layer_indices(least, d.pp, r)
    static = math.fsum(d.static[i] for i in layers)
    act = d.in_flight[r] * math.fsum(d.act[i] for i in layers)
    parts = [f"{len(layers)} layer{'s' if len(layers) != 1 else ''} "
             f"({static:.1f} GB weights/gradients/optimizer + {act:.1f} GB activations of "
             f"{d.in_flight[r]:g} micro-batch{'es' if d.in_flight[r] != 1 else ''} in flight)"]
    if r == 0 and d.first_extra_memory_gb:
        parts.append(f"embedding ({d.first_extra_memory_gb:.1f} GB)")
    if r == d.pp - 1 and d.last_extra_memory_gb:
        parts.append(f"output layer + loss ({d.last_extra_memory_gb:.1f} GB)")
    lead = "even with the split that needs the least memory, " if d.S > 1 else ""
    raise DoesNotFitError(f"{lead}pipeline stage {r} needs {mem[r]:.1f} GB for its {' + '.join(parts)}, more than "
                          f"the {cap:.1f} GB available: use more pipeline stages, recompute or a larger tp")
