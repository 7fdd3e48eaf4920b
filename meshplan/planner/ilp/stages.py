"""Pipeline stage boundaries: which contiguous layers each of the pp x vp virtual stages runs.

Virtual stage s (s = 0 .. S-1, S = pp*vp) runs on pipeline rank s mod pp (Megatron's interleaved
placement; vp = 1 is plain pipelining). The embedding lives on virtual stage 0 (rank 0), the
final norm, output layer and loss on stage S-1 (rank pp-1). Because those extras make the end
ranks slower and fuller, the best split is often uneven - what Megatron users set by hand with
`--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`.

The parts: `stage_costs` holds the problem's data and prices a split; `stage_dp` the dynamic
program and the heuristic split; `stage_model` the ILP (its docstring has the formulation). This
module chooses between them, breaks ties and explains a split that cannot fit.

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
from typing import Sequence

from meshplan.errors import ConfigError, DoesNotFitError, LayoutError
from meshplan.planner.ilp.solver import has_solution, proved_optimal, resolve_solver, solve
from meshplan.planner.ilp.stage_costs import (
    StageAssignment,
    StageInputs,
    even_split,
    evaluate_split,
    fits,
    no_slower,
    rank_layer_indices,
    stage_inputs,
)
from meshplan.planner.ilp.stage_dp import dp_split, incumbent_split, stage_room
from meshplan.planner.ilp.stage_model import StageModel

__all__ = ["StageAssignment", "assign_stages", "even_split", "evaluate_split"]


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
    d = stage_inputs(layer_time_s, layer_memory_gb, pp=pp, vp=vp, static_memory_gb=static_memory_gb,
                     in_flight=in_flight, first_extra_time_s=first_extra_time_s,
                     last_extra_time_s=last_extra_time_s, first_extra_memory_gb=first_extra_memory_gb,
                     last_extra_memory_gb=last_extra_memory_gb)
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


def _solve_dp(d: StageInputs, cap: float, nmin: int, tie_break: bool) -> tuple[int, ...]:
    room = stage_room(d, cap)
    best = dp_split(d, nmin, minimise="time", memory_room=room)
    if best is None:
        least = dp_split(d, nmin, minimise="memory", memory_room=[math.inf] * d.S)
        _raise_does_not_fit(d, cap, least)
    if tie_break:
        slowest = max(d.rank_costs(best)[0])
        again = dp_split(d, nmin, minimise="memory", memory_room=room, time_cap=slowest)
        if again is not None and no_slower(max(d.rank_costs(again)[0]), slowest):
            best = again
    return best


# The share of the time limit the interleaved tie-break may take. It refines among splits that are
# equally fast by their slowest rank, and HiGHS finds its best such split early, then spends the rest
# proving it: on the splits a what-if sweep of Llama 3 70B refines (80 layers over 16-40 virtual
# stages), the slowest stage after 0.1 s equalled the one after 1 s in every case, where five of 21
# calls ran the full second to the limit.
TIE_BREAK_SHARE = 0.1


def _solve_ilp(d: StageInputs, cap: float, nmin: int, tie_break: bool, time_limit_s: float, name: str, *,
               with_incumbent: bool) -> tuple[tuple[int, ...], str]:
    t0 = time.perf_counter()
    start = incumbent_split(d, cap, nmin) if with_incumbent else None
    model = StageModel(d, cap, nmin, "stages")
    T = model.build("slowest_rank_s")
    model.add_memory()
    model.add_epigraph(T)
    if start is not None:
        model.add_incumbent(T, max(d.rank_costs(start)[0]))
        model.start_from(start)
    # the tie-break's share of the time limit is kept for it: it refines, it must not double the cost
    first_limit = time_limit_s * (1.0 - TIE_BREAK_SHARE if tie_break and d.S > 1 else 1.0)
    status = solve(model.prob, time_limit_s=first_limit, solver=name, warm_start=start is not None)
    found = [start] if start is not None else []
    if has_solution(model.prob):
        sl = model.stage_layers()
        if min(sl) >= nmin and fits(d.rank_costs(sl)[1], cap):   # never trust a tolerance slip
            found.append(sl)
    if not found:
        _raise_does_not_fit(d, cap, _least_memory_ilp(d, nmin, name, time_limit_s), status)
    best = min(found, key=lambda sl: (max(d.rank_costs(sl)[0]), max(d.rank_costs(sl)[1])))
    label = name if proved_optimal(model.prob) else f"{name} (time limit)"
    left = min(time_limit_s - (time.perf_counter() - t0), TIE_BREAK_SHARE * time_limit_s)
    if tie_break and d.S > 1 and left > 0:
        best = _tie_break(d, cap, nmin, name, left, best)
    return best, label


def _tie_break(d: StageInputs, cap: float, nmin: int, solver: str, time_limit_s: float,
               first: tuple[int, ...]) -> tuple[int, ...]:
    t, m = d.rank_costs(first)
    slowest = max(t)
    model = StageModel(d, cap, nmin, "stages_tie_break")
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
    if min(sl) >= nmin and no_slower(max(t2), slowest) and fits(m2, cap):
        return sl
    return first


def _least_memory_ilp(d: StageInputs, nmin: int, solver: str, time_limit_s: float) -> tuple[int, ...] | None:
    model = StageModel(d, math.inf, nmin, "stages_min_memory")
    M = model.build("peak_memory_gb")
    model.add_peak_memory(M)
    solve(model.prob, time_limit_s=time_limit_s, solver=solver)
    return model.stage_layers() if has_solution(model.prob) else None


def _raise_does_not_fit(d: StageInputs, cap: float, least: tuple[int, ...] | None, status: str = "Infeasible"):
    """Say which rank of the split with the least peak memory cannot fit, and what on it."""
    if least is None:
        raise DoesNotFitError(f"no split of {d.L} layers over pp*vp = {d.S} stages was found within the time "
                              f"limit (solver status {status!r}); raise time_limit_s")
    _, mem = d.rank_costs(least)
    r = max(range(d.pp), key=lambda i: mem[i])
    if fits(mem, cap):
        raise DoesNotFitError(f"the stage-split ILP stopped without a split that fits in {cap:.1f} GB "
                              f"(solver status {status!r}) although one exists; raise time_limit_s")
    layers = rank_layer_indices(least, d.pp, r)
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
