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

Runs. Consecutive identical layers (same t, a, w) form a run k = [s_k, s_k + n_k); DeepSeek-V3
is 2 runs (3 dense, 58 MoE), a Llama is 1. Inside a run the prefix sums
P^T(b) = sum_{l<b} t_l (and P^A, P^W) are linear in the boundary b, so a boundary needs one
binary per run it can fall in rather than one per layer: the model is O(S x runs), not
O(L x S^2), and a 126-layer Llama on 32 virtual stages has 31 general integers and no binary.

Variables
  b_s  boundary between stages s-1 and s, s = 1 .. S-1 (b_0 = 0, b_S = L); stage s runs
       layers [b_s, b_{s+1}). Encoded per run k the boundary may fall in:
  u_sk in {0, 1}   b_s lies in run k                          (omitted when only one run fits)
  o_sk in Z_{>=0}  offset of b_s from the first position lo_sk that run k allows for it
  so  b_s = sum_k (lo_sk u_sk + o_sk),   P^X(b_s) = sum_k (P^X(lo_sk) u_sk + x_k o_sk), X in {T, A, W}
  T    the slowest rank's time (the epigraph variable)

Objective
  minimise T

Constraint families (one method each below)
  assignment    sum_k u_sk = 1 and o_sk <= (hi_sk - lo_sk) u_sk: each boundary sits in exactly one
                run, so every layer belongs to exactly one stage
  order         b_{s+1} - b_s >= n_min (stages are contiguous, in order, and non-empty), and
                sum_{k'<=k} u_{s+1,k'} <= sum_{k'<=k} u_{s,k'} (a later boundary never falls in an
                earlier run; implied by the first, added because it tightens the LP relaxation)
  memory        for every rank r: sum_{s on r} [P^W(b_{s+1}) - P^W(b_s)]
                                  + f_r sum_{s on r} [P^A(b_{s+1}) - P^A(b_s)] + e^M_r <= C
  epigraph      for every rank r: sum_{s on r} [P^T(b_{s+1}) - P^T(b_s)] + e^T_r <= T

Each boundary's range is pruned beforehand to [s n_min, L - (S - s) n_min]. When the memory
family makes the problem infeasible, a second ILP with the same variables minimises the peak
rank memory instead; its optimum names the rank and the parts that cannot fit, in GB.

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

from meshplan.cost_models.layout import split_layers
from meshplan.errors import ConfigError, DoesNotFitError, LayoutError
from meshplan.planner.solver import has_solution, proved_optimal, resolve_solver, solve

__all__ = ["StageAssignment", "assign_stages", "even_split", "evaluate_split"]

# Memory may exceed the cap by this relative amount after the solve: the solvers' feasibility
# tolerance (1e-6 to 1e-7 absolute, HiGHS / CBC defaults) on GB-sized numbers.
_MEMORY_TOL = 1e-6
# The tie-break solve may not make the slowest rank slower than the first solve's optimum by more
# than this (relative, absolute seconds): float noise only.
_TIE_REL = 1e-9
_TIE_ABS = 1e-12


@dataclass(frozen=True, kw_only=True)
class StageAssignment:
    """Layers per virtual stage and what each pipeline rank then costs."""

    stage_layers: tuple[int, ...]      # layers per virtual stage, len = pp*vp; stage s runs on rank s % pp
    rank_time_s: tuple[float, ...]     # per pipeline rank: one micro-batch fwd+bwd over its chunks (incl. extras)
    rank_memory_gb: tuple[float, ...]  # per pipeline rank: static + in-flight activations + extras
    slowest_s: float                   # max(rank_time_s), the ILP's objective
    solver: str                        # "highs" / "cbc" (+ " (time limit)" when optimality was not proved), "evaluated"
    solve_time_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.stage_layers or min(self.stage_layers) < 0:
            raise ConfigError(f"stage_layers {self.stage_layers}: needs one non-negative count per virtual stage")
        if len(self.rank_time_s) != len(self.rank_memory_gb) or len(self.stage_layers) % len(self.rank_time_s):
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
    first_extra_memory_gb: float
    last_extra_memory_gb: float

    @property
    def L(self) -> int:
        return len(self.time)

    @property
    def S(self) -> int:
        return self.pp * self.vp

    def rank_costs(self, stage_layers: Sequence[int]) -> tuple[list[float], list[float]]:
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
    ex = _floats("extras", (first_extra_time_s, last_extra_time_s, first_extra_memory_gb, last_extra_memory_gb), 4)
    et, em = [0.0] * pp, [0.0] * pp
    et[0] += ex[0]
    et[pp - 1] += ex[1]
    em[0] += ex[2]
    em[pp - 1] += ex[3]
    return _Inputs(time=t, act=a, static=w, pp=pp, vp=vp, in_flight=f, extra_time=tuple(et), extra_mem=tuple(em),
                   first_extra_memory_gb=ex[2], last_extra_memory_gb=ex[3])


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

    # boundary s may take positions [s*nmin, L-(S-s)*nmin], which bounds how much of each run lies before it
    def _boundary_variables(self) -> None:
        d, S = self.d, self.d.S
        for s in range(1, S):
            lo_s, hi_s = s * self.nmin, d.L - (S - s) * self.nmin
            for k, run in enumerate(self.runs):
                lo = min(max(lo_s - run.start, 0), run.length)
                hi = min(max(hi_s - run.start, 0), run.length)
                self._q[s, k] = lo if lo == hi else pulp.LpVariable(
                    f"q_{s}_{k}", lo, hi, cat="Binary" if (lo, hi) == (0, 1) else "Integer")
            for k in range(len(self.runs) - 1):
                full = self.runs[k].length
                if not isinstance(self._q[s, k], pulp.LpVariable) or not isinstance(self._q[s, k + 1], pulp.LpVariable):
                    continue   # run k is surely complete, or run k+1 surely untouched: no link needed
                if full == 1:
                    self.z[s, k] = self._q[s, k]   # a one-layer run is complete exactly when it is started
                else:
                    self.z[s, k] = pulp.LpVariable(f"z_{s}_{k}", cat="Binary")

    def _rank_count_variables(self) -> None:
        # c_rk for runs longer than one layer are integer variables of their own (tied to the
        # boundaries by the count family): branching on a rank's layer count closes the gap between
        # the LP bound and the integer optimum far faster than branching on boundaries (measured:
        # CBC went from the 10 s time limit to 20 ms on a DeepSeek-V3-like pp=8, vp=2 instance).
        d = self.d
        for r in range(d.pp):
            for k, run in enumerate(self.runs):
                expr = self._stages_sum(r, k)
                if run.length > 1:
                    self.c[r, k] = pulp.LpVariable(f"c_{r}_{k}", 0, run.length, cat="Integer")
                    self._count_expr[r, k] = expr
                else:
                    self.c[r, k] = expr

    def q(self, s: int, k: int):
        """q_sk: how many layers of run k lie before boundary s."""
        if s == 0:
            return 0
        if s == self.d.S:
            return self.runs[k].length
        return self._q[s, k]

    def boundary(self, s: int):
        """b_s = sum_k q_sk."""
        return pulp.lpSum(self.q(s, k) for k in range(len(self.runs)))

    def _stages_sum(self, r: int, k: int):
        return pulp.lpSum(self.q(s + 1, k) - self.q(s, k) for s in range(r, self.d.S, self.d.pp))

    @staticmethod
    def _value(run: _Run, X: str) -> float:
        return {"T": run.time, "A": run.act, "W": run.static}[X]

    def rank_sum(self, X: str, r: int):
        """Time / activation / static memory of the layers rank r runs."""
        return pulp.lpSum(self._value(run, X) * self.c[r, k] for k, run in enumerate(self.runs))

    def stage_time(self, s: int):
        extra = (self.d.extra_time[0] if s == 0 else 0.0) + \
            (self.d.extra_time[self.d.pp - 1] if s == self.d.S - 1 else 0.0)
        return pulp.lpSum(run.time * (self.q(s + 1, k) - self.q(s, k)) for k, run in enumerate(self.runs)) + extra

    def rank_memory(self, r: int):
        return self.rank_sum("W", r) + self.d.in_flight[r] * self.rank_sum("A", r) + self.d.extra_mem[r]

    # ---- constraint families ----
    def add_assignment(self) -> None:
        for (s, k), z in self.z.items():
            if z is not self._q[s, k]:
                self.prob += self._q[s, k] >= self.runs[k].length * z, f"complete_{s}_{k}"
            self.prob += self._q[s, k + 1] <= self.runs[k + 1].length * z, f"started_{s}_{k + 1}"

    def add_order(self) -> None:
        d = self.d
        for s in range(d.S):
            for k in range(len(self.runs)):
                if isinstance(self.q(s, k), pulp.LpVariable) or isinstance(self.q(s + 1, k), pulp.LpVariable):
                    self.prob += self.q(s + 1, k) >= self.q(s, k), f"order_{s}_{k}"
            if self.nmin > 0:
                self.prob += self.boundary(s + 1) - self.boundary(s) >= self.nmin, f"nonempty_{s}"

    def add_count(self) -> None:
        for (r, k), expr in getattr(self, "_count_expr", {}).items():
            self.prob += self.c[r, k] == expr, f"count_{r}_{k}"

    def add_memory(self) -> None:
        for r in range(self.d.pp):
            self.prob += self.rank_memory(r) <= self.cap, f"memory_rank_{r}"

    def add_epigraph(self, T: pulp.LpVariable) -> None:
        for r in range(self.d.pp):
            self.prob += self.rank_sum("T", r) + self.d.extra_time[r] <= T, f"slowest_rank_{r}"

    def add_tie_break(self, slowest: float, Z: pulp.LpVariable) -> None:
        """Second solve: keep the optimal slowest rank, then minimise the slowest virtual stage
        (vp > 1: the interleaved schedule's fill and drain run chunk by chunk) or the peak memory (vp = 1)."""
        bound = slowest * (1 + _TIE_REL) + _TIE_ABS
        for r in range(self.d.pp):
            self.prob += self.rank_sum("T", r) + self.d.extra_time[r] <= bound, f"keep_slowest_{r}"
        if self.d.vp > 1:
            for s in range(self.d.S):
                self.prob += self.stage_time(s) <= Z, f"slowest_stage_{s}"
        else:
            self.add_peak_memory(Z)

    def add_peak_memory(self, M: pulp.LpVariable) -> None:
        """M bounds every rank's memory (the diagnosis and the vp = 1 tie-break)."""
        for r in range(self.d.pp):
            self.prob += self.rank_memory(r) <= M, f"peak_memory_rank_{r}"

    def stage_layers(self) -> tuple[int, ...]:
        b = [0] + [int(round(pulp.value(self.boundary(s)))) for s in range(1, self.d.S)] + [self.d.L]
        return tuple(b[s + 1] - b[s] for s in range(self.d.S))


def assign_stages(layer_time_s: Sequence[float], layer_memory_gb: Sequence[float], *, pp: int, vp: int = 1,
                  static_memory_gb: Sequence[float] | float = 0.0, in_flight: Sequence[float] | None = None,
                  first_extra_time_s: float = 0.0, last_extra_time_s: float = 0.0,
                  first_extra_memory_gb: float = 0.0, last_extra_memory_gb: float = 0.0,
                  memory_cap_gb: float, time_limit_s: float = 10.0, solver: str = "auto",
                  min_stage_layers: int = 1, tie_break: bool = True) -> StageAssignment:
    """Split the layers over pp*vp virtual stages so the slowest pipeline rank is as fast as possible
    while every rank fits in `memory_cap_gb`.

    layer_time_s: per layer, one micro-batch forward + backward (+ recompute) seconds.
    layer_memory_gb: per layer, activations of one micro-batch; multiplied by in_flight[rank]
        (micro-batches the schedule keeps alive on that rank; default 1).
    static_memory_gb: per layer (or one value for all), memory that does not scale with micro-batches.
    first/last_extra_*: the embedding (rank 0) and the output layer + loss (rank pp-1), as totals.
    tie_break: among the splits with the optimal slowest rank, pick the one with the fastest slowest
        virtual stage (vp > 1) or the least peak memory (vp = 1) - a second solve.
    time_limit_s: for the whole call (both solves).
    Raises LayoutError when there are fewer layers than stages, DoesNotFitError when no split fits.
    """
    d = _inputs(layer_time_s, layer_memory_gb, pp=pp, vp=vp, static_memory_gb=static_memory_gb, in_flight=in_flight,
                first_extra_time_s=first_extra_time_s, last_extra_time_s=last_extra_time_s,
                first_extra_memory_gb=first_extra_memory_gb, last_extra_memory_gb=last_extra_memory_gb)
    if isinstance(min_stage_layers, bool) or not isinstance(min_stage_layers, int) or min_stage_layers < 0:
        raise ConfigError(f"min_stage_layers={min_stage_layers!r}: must be 0 or a positive integer")
    if not (isinstance(memory_cap_gb, (int, float)) and math.isfinite(memory_cap_gb) and memory_cap_gb > 0):
        raise ConfigError(f"memory_cap_gb={memory_cap_gb!r}: must be a positive number of GB")
    if not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0):
        raise ConfigError(f"time_limit_s={time_limit_s!r}: must be a positive number of seconds")
    if d.S * min_stage_layers > d.L:
        raise LayoutError(f"pp*vp = {d.pp}*{d.vp} = {d.S} virtual stages need at least {d.S * min_stage_layers} "
                          f"layers ({min_stage_layers} each) but the model has {d.L}; use pp*vp <= "
                          f"{d.L // max(1, min_stage_layers)}")
    cap = float(memory_cap_gb)
    name = resolve_solver(solver)
    t0 = time.perf_counter()
    model = _StageModel(d, cap, min_stage_layers, "stages")
    T = pulp.LpVariable("slowest_rank_s", lowBound=0)
    model.prob += T
    model.add_assignment()
    model.add_order()
    model.add_count()
    model.add_memory()
    model.add_epigraph(T)
    status = solve(model.prob, time_limit_s=time_limit_s, solver=name)
    if status == "Infeasible" or not has_solution(model.prob):
        _explain_infeasible(d, cap, min_stage_layers, name, time_limit_s, status)
    best = model.stage_layers()
    optimal = proved_optimal(model.prob)
    t, m = d.rank_costs(best)
    if max(m) > cap * (1 + _MEMORY_TOL) + _MEMORY_TOL:   # a solver tolerance slip
        _explain_infeasible(d, cap, min_stage_layers, name, time_limit_s, status)
    left = time_limit_s - (time.perf_counter() - t0)
    if tie_break and d.S > 1 and left > 0:
        best, t, m = _tie_break(d, cap, min_stage_layers, name, left, best, max(t))
    label = name if optimal else f"{name} (time limit)"
    return StageAssignment(stage_layers=best, rank_time_s=tuple(t), rank_memory_gb=tuple(m), slowest_s=max(t),
                           solver=label, solve_time_s=time.perf_counter() - t0)


def _tie_break(d: _Inputs, cap: float, nmin: int, solver: str, time_limit_s: float,
               first: tuple[int, ...], slowest: float):
    model = _StageModel(d, cap, nmin, "stages_tie_break")
    Z = pulp.LpVariable("tie_break", lowBound=0)
    model.prob += Z
    model.add_assignment()
    model.add_order()
    model.add_count()
    model.add_memory()
    model.add_tie_break(slowest, Z)
    solve(model.prob, time_limit_s=time_limit_s, solver=solver)
    t, m = d.rank_costs(first)
    if not has_solution(model.prob):
        return first, t, m
    sl = model.stage_layers()
    t2, m2 = d.rank_costs(sl)
    # keep the second split only if it is truly no slower and fits (solver tolerances are not ours)
    if max(t2) <= slowest * (1 + _TIE_REL) + _TIE_ABS and max(m2) <= cap * (1 + _MEMORY_TOL) + _MEMORY_TOL:
        return sl, t2, m2
    return first, t, m


def _explain_infeasible(d: _Inputs, cap: float, nmin: int, solver: str, time_limit_s: float, status: str):
    """Find the split with the least peak memory and say which rank, and what on it, cannot fit."""
    model = _StageModel(d, cap, nmin, "stages_min_memory")
    M = pulp.LpVariable("peak_memory_gb", lowBound=0)
    model.prob += M
    model.add_assignment()
    model.add_order()
    model.add_count()
    model.add_peak_memory(M)
    solve(model.prob, time_limit_s=time_limit_s, solver=solver)
    if not has_solution(model.prob):
        raise DoesNotFitError(f"the stage-split ILP found no split of {d.L} layers over pp*vp = {d.S} stages "
                              f"within time_limit_s={time_limit_s} (solver status {status!r}); raise time_limit_s")
    sl = model.stage_layers()
    _, mem = d.rank_costs(sl)
    r = max(range(d.pp), key=lambda i: mem[i])
    if mem[r] <= cap * (1 + _MEMORY_TOL) + _MEMORY_TOL:
        raise DoesNotFitError(f"the stage-split ILP stopped without a split that fits in {cap:.1f} GB "
                              f"(solver status {status!r}) although one exists; raise time_limit_s")
    layers = _rank_layer_indices(sl, d.pp, r)
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


def _rank_layer_indices(stage_layers: Sequence[int], pp: int, rank: int) -> list[int]:
    out, start = [], 0
    for s, n in enumerate(stage_layers):
        if s % pp == rank:
            out.extend(range(start, start + n))
        start += n
    return out
