"""The stage-split problem's data and the price of a split: what `stages` solves over.

- `StageAssignment`: layers per virtual stage and each pipeline rank's time and memory.
- `StageInputs` (built and checked by `stage_inputs`): per-layer time, activation and static
  memory, per-rank in-flight micro-batches and extras; `rank_costs` prices a split exactly.
- `fits` / `no_slower`: the memory and time comparisons every method shares, with the solvers'
  tolerances.
- `even_split` / `evaluate_split`: the split without an ILP, and any split priced on the ILP's terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from meshplan.errors import ConfigError, LayoutError
from meshplan.ir.layout import split_layers

__all__ = ["StageAssignment", "StageInputs", "stage_inputs", "rank_layer_indices", "fits", "no_slower",
           "even_split", "evaluate_split", "MEMORY_TOL", "TIME_REL", "TIME_ABS"]

# Memory may exceed the cap by this much (relative and absolute GB) after the solve: the solvers'
# feasibility tolerance (1e-6 to 1e-7 absolute, HiGHS / CBC defaults) on GB-sized numbers.
MEMORY_TOL = 1e-6
# Two splits whose slowest ranks differ by less than this (relative, absolute seconds) are equally
# fast: float noise in sums of per-layer seconds.
TIME_REL = 1e-9
TIME_ABS = 1e-12


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
        return rank_layer_indices(self.stage_layers, self.pp, rank)


def rank_layer_indices(stage_layers: Sequence[int], pp: int, rank: int) -> list[int]:
    out, start = [], 0
    for s, n in enumerate(stage_layers):
        if s % pp == rank:
            out.extend(range(start, start + n))
        start += n
    return out


# ---- inputs ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StageInputs:
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


def stage_inputs(layer_time_s, layer_memory_gb, *, pp, vp, static_memory_gb, in_flight,
                 first_extra_time_s, last_extra_time_s, first_extra_memory_gb,
                 last_extra_memory_gb) -> StageInputs:
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
    return StageInputs(time=t, act=a, static=w, pp=pp, vp=vp, in_flight=f, extra_time=tuple(et), extra_mem=tuple(em),
                   first_extra_time_s=ft, last_extra_time_s=lt, first_extra_memory_gb=fm, last_extra_memory_gb=lm)


def fits(mem: Sequence[float], cap: float) -> bool:
    return max(mem) <= cap * (1 + MEMORY_TOL) + MEMORY_TOL


def no_slower(t: float, ref: float) -> bool:
    return t <= ref * (1 + TIME_REL) + TIME_ABS


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
    d = stage_inputs(layer_time_s, layer_memory_gb, pp=pp, vp=vp, static_memory_gb=static_memory_gb,
                     in_flight=in_flight, first_extra_time_s=first_extra_time_s,
                     last_extra_time_s=last_extra_time_s, first_extra_memory_gb=first_extra_memory_gb,
                     last_extra_memory_gb=last_extra_memory_gb)
    sl = tuple(int(n) for n in stage_layers)
    if len(sl) != d.S or min(sl) < 0 or sum(sl) != d.L:
        raise ConfigError(f"stage_layers {sl}: needs pp*vp = {d.S} non-negative counts summing to {d.L} layers")
    t, m = d.rank_costs(sl)
    return StageAssignment(stage_layers=sl, rank_time_s=tuple(t), rank_memory_gb=tuple(m), slowest_s=max(t),
                           solver="evaluated")
