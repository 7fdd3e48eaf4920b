"""What-if capacity planning: plan one model on many (GPU type, GPU count) clusters and compare
time to train, cost and what limits scaling.

    w = meshplan.whatif("llama3-405b", tokens="15T", seq_len=8192, global_batch=2048,
                        gpus=("h100-sxm", "h200", "b200"), counts=(1024, 4096, 16384),
                        deadline_days=90, budget_usd="20M")
    print(w.to_table()); w.to_html()

For every point the best layout comes from `meshplan.plan` on a cluster built from the GPU's
node preset (or from a cluster JSON file, e.g. a calibrated profile, used as the node type). The
model is profiled once and the profile reused, so a sweep costs one trace plus one search per
point. Derived columns:

    tokens/s   = tokens/s/GPU x GPUs                       time = tokens / (tokens/s)
    ramp-up    (`rampup=(start, increment, samples)`, Megatron's --rampup-batch-size): the
               runtime keeps the layout and runs fewer micro-batches per step, so a step of b
               sequences takes fixed + (step - fixed) x b / B, fixed = the per-step costs that
               do not shrink with the batch (pipeline bubble, exposed DP communication, the
               optimizer step, the fixed step overhead); the
               ramp's steps are summed phase by phase, the remaining tokens run at full speed
    GPU-hours  = GPUs x time                               cost = GPU-hours x price per GPU-hour
    headroom   = usable memory - predicted peak per GPU
    limited by = the largest of: bubble, exposed DP comm, exposed TP comm, other exposed comm
                 (CP + EP + PP p2p), and memory (seconds spent recomputing activations because
                 they did not fit) — "compute" when none reaches COMPUTE_BOUND_SHARE of the step.

Marks: the cheapest option that meets the deadline, the fastest within the budget, and the
time-cost Pareto front. A request nothing satisfies is said so, with the nearest options.

This module owns the sweep, its rows and marks and the ramp-up arithmetic; the parsing of the
request ('15T', '90d', '20M', GPU counts, prices) and the GPU options with their price sources
live in meshplan/reports/whatif_inputs.py (re-exported here).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Sequence, TextIO

import meshplan.api as api
from meshplan.errors import ConfigError, DoesNotFitError, MeshplanError
from meshplan.ir.precision import AUTO, PRICED, Precision, parse_precision
from meshplan.ir.rampup import BatchRampup
from meshplan.reports.html import whatif_html
from meshplan.reports.render import to_markdown, to_table, verdicts
from meshplan.reports.whatif_pool import run_points
from meshplan.reports.whatif_inputs import (
    DEFAULT_COUNTS, DEFAULT_GPUS, PriceSource, _Option, _options, _price_sources, parse_counts,
    parse_duration_days, parse_money, parse_prices, parse_tokens,
)

__all__ = [
    "WhatIf", "WhatIfRow", "PriceSource", "whatif", "compute_marks", "scaling_limits",
    "parse_tokens", "parse_duration_days", "parse_money", "parse_counts", "parse_prices",
    "DEFAULT_GPUS", "DEFAULT_COUNTS", "WHATIF_VERSION", "LIMITERS",
]

WHATIF_VERSION = 1
# The same threshold Estimate.bottleneck uses (cost_models/estimate.py): below 5% of the step no
# overhead is worth naming and the point is compute-bound.
COMPUTE_BOUND_SHARE = 0.05
LIMITERS = ("bubble", "DP comm", "TP comm", "other comm", "memory")
STATUSES = ("ok", "does not fit", "no plan")
_SECONDS_PER_DAY = 86400.0


# ---- results --------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class WhatIfRow:
    """One (GPU type, GPU count) point. Numeric fields are None unless status == 'ok'."""

    gpu: str                          # option label: GPU id or the cluster file's stem
    gpu_id: str
    num_gpus: int
    nodes: int
    gpus_per_node: int
    status: str                       # "ok" | "does not fit" | "no plan"
    reason: str = ""                  # why there is no plan
    layout: str = ""                  # Layout.short() of the best plan
    precision: str = ""
    step_time_s: float | None = None
    tokens_per_s: float | None = None          # whole cluster
    mfu: float | None = None
    days: float | None = None                  # to train the token budget
    gpu_hours: float | None = None
    price_usd_per_gpu_hour: float | None = None
    cost_usd: float | None = None              # None when the GPU has no price
    peak_memory_gb: float | None = None
    capacity_gb: float | None = None           # usable memory per GPU
    headroom_gb: float | None = None
    limiter: str = ""                          # one of LIMITERS or "compute"
    limiter_share: float | None = None         # its share of the step time
    limits_s: dict[str, float] = field(default_factory=dict)   # seconds per step, per LIMITERS entry
    estimate: dict[str, Any] | None = None     # Estimate.to_dict() of the best plan
    plan_seconds: float = 0.0                  # time the planner took for this point

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ConfigError(f"row status {self.status!r}: use one of {STATUSES}")
        if isinstance(self.num_gpus, bool) or not isinstance(self.num_gpus, int) or self.num_gpus < 1:
            raise ConfigError(f"row num_gpus must be a positive whole number, got {self.num_gpus!r}")
        if self.status == "ok":
            missing = [f for f in ("step_time_s", "tokens_per_s", "mfu", "days", "gpu_hours", "peak_memory_gb",
                                   "capacity_gb", "headroom_gb") if getattr(self, f) is None]
            if missing:
                raise ConfigError(f"row {self.key}: a planned row needs {missing}")
        elif not self.reason:
            raise ConfigError(f"row {self.key}: status {self.status!r} needs a reason")

    @property
    def key(self) -> str:
        return f"{self.gpu}@{self.num_gpus}"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True, kw_only=True)
class WhatIf:
    """A what-if sweep: rows, marks, price sources and the messages a reader must see."""

    version: int = WHATIF_VERSION
    model: str
    tokens: float
    seq_len: int
    global_batch: int
    precision: str
    deadline_days: float | None = None
    budget_usd: float | None = None
    rampup: tuple[int, int, int] | None = None   # (start, increment, samples) batch-size ramp-up
    rows: tuple[WhatIfRow, ...]
    prices: tuple[PriceSource, ...]
    cheapest: str | None = None            # cheapest row meeting the deadline (cheapest overall if none given)
    fastest: str | None = None             # fastest row within the budget (fastest overall if none given)
    pareto: tuple[str, ...] = ()           # time-cost Pareto front, cheapest first
    fastest_overall: str | None = None
    cheapest_overall: str | None = None
    chosen: str | None = None              # the row detailed in reports
    chosen_plan: dict[str, Any] | None = None   # Plan.to_dict() of the chosen row
    messages: tuple[str, ...] = ()
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.version != WHATIF_VERSION:
            raise ConfigError(f"what-if version {self.version} is not supported (expects {WHATIF_VERSION})")
        keys = [r.key for r in self.rows]
        if len(set(keys)) != len(keys):
            raise ConfigError(f"what-if rows repeat a (gpu, count) point: {keys}")
        for name in ("cheapest", "fastest", "fastest_overall", "cheapest_overall", "chosen"):
            k = getattr(self, name)
            if k is not None and k not in keys:
                raise ConfigError(f"what-if {name}={k!r} names no row; rows: {keys}")
        bad = [k for k in self.pareto if k not in keys]
        if bad:
            raise ConfigError(f"what-if pareto names unknown rows {bad}")

    # ---- access ----
    def row(self, key: str) -> WhatIfRow:
        for r in self.rows:
            if r.key == key:
                return r
        raise KeyError(key)

    def marks_of(self, key: str) -> tuple[str, ...]:
        """'cheapest', 'fastest', 'pareto' for the row `key`."""
        out = []
        if key == self.cheapest:
            out.append("cheapest")
        if key == self.fastest:
            out.append("fastest")
        if key in self.pareto:
            out.append("pareto")
        return tuple(out)

    @property
    def plan(self):
        """The chosen row's `Plan`, or None."""
        if self.chosen_plan is None:
            return None
        return api.Plan.from_dict(self.chosen_plan)

    # ---- serialisation and renderings ----
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["rows"] = [asdict(r) for r in self.rows]
        d["prices"] = [asdict(p) for p in self.prices]
        d["pareto"] = list(self.pareto)
        d["messages"] = list(self.messages)
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WhatIf:
        if not isinstance(data, dict) or "rows" not in data:
            raise ConfigError("not a meshplan what-if report: expected an object with 'rows'")
        d = dict(data)
        try:
            d["rows"] = tuple(WhatIfRow(**r) for r in d["rows"])
            d["prices"] = tuple(PriceSource(**p) for p in d.get("prices", ()))
            d["pareto"] = tuple(d.get("pareto", ()))
            d["messages"] = tuple(d.get("messages", ()))
            if d.get("rampup") is not None:
                d["rampup"] = tuple(d["rampup"])
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"malformed what-if JSON: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> WhatIf:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise ConfigError(f"what-if report is not valid JSON: {e}") from None

    def to_table(self) -> str:
        return to_table(self)

    def to_markdown(self) -> str:
        return to_markdown(self)

    def to_html(self) -> str:
        return whatif_html(self)


# ---- derived quantities ---------------------------------------------------------------------
def scaling_limits(est) -> dict[str, float]:
    """Seconds per step that each scaling limiter costs, from an Estimate's components.

    memory = the recomputation the layout needs because activations did not fit: the share of
    compute time spent on FLOPs beyond the model's, (hardware - model FLOPs) / hardware FLOPs.
    """
    t = est.time_s
    recompute = t.get("compute", 0.0) * (1.0 - est.mfu / est.hfu) if est.hfu > 0 else 0.0
    return {"bubble": t.get("bubble", 0.0), "DP comm": t.get("dp", 0.0), "TP comm": t.get("tp", 0.0),
            "other comm": t.get("cp", 0.0) + t.get("ep", 0.0) + t.get("pp", 0.0),
            "memory": max(0.0, recompute)}


def _limiter(limits: Mapping[str, float], step_s: float) -> tuple[str, float]:
    name = max(LIMITERS, key=lambda k: limits.get(k, 0.0))
    share = limits.get(name, 0.0) / step_s if step_s > 0 else 0.0
    return ("compute", share) if share < COMPUTE_BOUND_SHARE else (name, share)


def by_time(r: WhatIfRow):
    """Sort key: fastest first; ties go to the cheaper, then the smaller option."""
    return (r.days, math.inf if r.cost_usd is None else r.cost_usd, r.num_gpus, r.key)


def by_cost(r: WhatIfRow):
    """Sort key for priced rows: cheapest first; ties go to the faster, then the smaller option."""
    return (r.cost_usd, r.days, r.num_gpus, r.key)


def compute_marks(rows: Sequence[WhatIfRow], *, deadline_days: float | None = None,
                  budget_usd: float | None = None) -> dict[str, Any]:
    """Which rows are the cheapest meeting the deadline, the fastest within the budget, and on
    the time-cost Pareto front (no other row is at least as fast and as cheap, and better in one).
    Rows with no plan never count; rows with no price only count where cost does not matter."""
    ok = [r for r in rows if r.ok]
    priced = [r for r in ok if r.cost_usd is not None]
    meets = [r for r in priced if deadline_days is None or r.days <= deadline_days]
    within = ok if budget_usd is None else [r for r in priced if r.cost_usd <= budget_usd]
    front = [r for r in priced
             if not any(s.days <= r.days and s.cost_usd <= r.cost_usd and (s.days < r.days or s.cost_usd < r.cost_usd)
                        for s in priced)]
    return dict(
        cheapest=min(meets, key=by_cost).key if meets else None,
        fastest=min(within, key=by_time).key if within else None,
        pareto=tuple(r.key for r in sorted(front, key=by_cost)),
        fastest_overall=min(ok, key=by_time).key if ok else None,
        cheapest_overall=min(priced, key=by_cost).key if priced else None,
    )


# ---- progress -------------------------------------------------------------------------------
class _Progress:
    """One stderr line rewritten with carriage returns: [#####-----] 7/15 h200 x 4096 12 s."""

    WIDTH = 24

    def __init__(self, total: int, stream: TextIO | None):
        self.total, self.stream, self.t0, self.last = total, stream, time.perf_counter(), 0

    def update(self, done: int, label: str) -> None:
        if self.stream is None:
            return
        n = round(self.WIDTH * done / max(1, self.total))
        line = (f"whatif [{'#' * n}{'-' * (self.WIDTH - n)}] {done}/{self.total} {label} "
                f"{time.perf_counter() - self.t0:.0f} s")
        self.stream.write("\r" + line + " " * max(0, self.last - len(line)))
        self.stream.flush()
        self.last = len(line)

    def close(self) -> None:
        if self.stream is not None:
            self.update(self.total, "done")
            self.stream.write("\n")
            self.stream.flush()


# ---- the sweep ------------------------------------------------------------------------------
def rampup_seconds(est, *, global_batch: int, seq_len: int, rampup: tuple[int, int, int] | None,
                   tokens: float) -> tuple[float, float]:
    """(seconds the ramp-up's steps take, tokens they train) for a plan's Estimate; (0, 0)
    without a ramp-up. See the module docstring; the ramp is cut short at `tokens`."""
    if rampup is None:
        return 0.0, 0.0
    ramp = BatchRampup(*rampup, final=global_batch)
    limits = scaling_limits(est)
    per_step = limits["bubble"] + limits["DP comm"] + est.time_s.get("optimizer", 0.0) + est.time_s.get("overhead", 0.0)
    fixed = min(per_step, est.step_time_s)
    seconds = done = 0.0
    for (first, _, size), (nxt, _, _) in zip(ramp.phases, ramp.phases[1:]):
        steps = nxt - first
        if steps <= 0:
            continue
        steps = min(steps, math.ceil(max(tokens - done, 0.0) / (size * seq_len)))
        seconds += steps * (fixed + (est.step_time_s - fixed) * size / global_batch)
        done += steps * size * seq_len
    return seconds, done


def _planned_row(opt: _Option, cl, plan, price: float | None, tokens: float, seconds: float,
                 rampup: tuple[int, int, int] | None = None) -> WhatIfRow:
    est = plan.estimate
    n = cl.num_gpus
    tps = est.tokens_per_s_per_gpu * n
    ramp_s, ramp_tokens = rampup_seconds(est, global_batch=plan.global_batch, seq_len=plan.seq_len,
                                         rampup=rampup, tokens=tokens)
    train_s = ramp_s + max(tokens - ramp_tokens, 0.0) / tps
    gpu_hours = n * train_s / 3600.0
    limits = scaling_limits(est)
    name, share = _limiter(limits, est.step_time_s)
    return WhatIfRow(
        gpu=opt.label, gpu_id=opt.spec.id, num_gpus=n, nodes=cl.nodes, gpus_per_node=cl.gpus_per_node,
        status="ok", layout=plan.layout.short(), precision=plan.precision,
        step_time_s=est.step_time_s, tokens_per_s=tps, mfu=est.mfu, days=train_s / _SECONDS_PER_DAY,
        gpu_hours=gpu_hours, price_usd_per_gpu_hour=price,
        cost_usd=None if price is None else gpu_hours * price,
        peak_memory_gb=est.peak_memory_gb, capacity_gb=est.capacity_gb,
        headroom_gb=est.capacity_gb - est.peak_memory_gb, limiter=name, limiter_share=share,
        limits_s=limits, estimate=json.loads(json.dumps(est.to_dict())), plan_seconds=seconds)


# a sweep this large is planned by several processes (when the machine has the cores): below it,
# starting them (a few seconds each, importing torch) costs more than it saves
PARALLEL_MIN_POINTS = 8


def _jobs(jobs: int | None, points: int) -> int:
    if jobs is not None:
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise ConfigError(f"jobs must be a whole number >= 1 (1: plan in this process), got {jobs!r}")
        return min(jobs, max(points, 1))
    if points < PARALLEL_MIN_POINTS:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:                      # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, points))


def _plan_point(prof, opt: _Option, price: PriceSource, cl, *, seq_len: int, global_batch: int, precision: str,
                tokens: float, rampup) -> tuple[WhatIfRow, str | None]:
    """One point of the sweep: its row, and its plan's JSON where one was found."""
    t1 = time.perf_counter()
    base = dict(gpu=opt.label, gpu_id=opt.spec.id, num_gpus=cl.num_gpus, nodes=cl.nodes,
                gpus_per_node=cl.gpus_per_node, capacity_gb=cl.usable_memory_gb,
                price_usd_per_gpu_hour=price.usd_per_gpu_hour)
    try:
        plan = api.plan(prof, cl, seq_len=seq_len, global_batch=global_batch, precision=precision, top_k=3)
    except DoesNotFitError as e:
        return WhatIfRow(**base, status="does not fit", reason=str(e), plan_seconds=time.perf_counter() - t1), None
    except MeshplanError as e:   # e.g. no mesh divides the batch on this count
        return WhatIfRow(**base, status="no plan", reason=str(e), plan_seconds=time.perf_counter() - t1), None
    row = _planned_row(opt, cl, plan, price.usd_per_gpu_hour, tokens, time.perf_counter() - t1, rampup)
    return row, plan.to_json()


def _point_task(shared: tuple, opt: _Option, price: PriceSource, cl) -> tuple[WhatIfRow, str | None]:
    prof, args = shared
    return _plan_point(prof, opt, price, cl, **args)


def _sweep(prof, points: list, args: dict, jobs: int, bar: "_Progress") -> list[tuple[WhatIfRow, str | None]]:
    """Plan every point, in `jobs` processes (whatif_pool); results in the order of `points`."""
    if jobs > 1:
        return run_points(_point_task, (prof, args), points, jobs,
                          on_done=lambda done, i: bar.update(done, f"{points[i][0].label} x {points[i][2].num_gpus}"))
    results = []
    for i, (opt, price, cl) in enumerate(points):
        bar.update(i, f"{opt.label} x {cl.num_gpus}")
        results.append(_plan_point(prof, opt, price, cl, **args))
    return results


def whatif(model: Any, *, tokens: str | float, seq_len: int, global_batch: int,
           gpus: Any = DEFAULT_GPUS, counts: Any = DEFAULT_COUNTS, deadline_days: str | float | None = None,
           budget_usd: str | float | None = None, prices: Any = None, precision: Precision | str = Precision.BF16,
           progress: bool | TextIO = True, rampup: tuple[int, int, int] | None = None,
           jobs: int | None = None) -> WhatIf:
    """Plan `model` on every (GPU type, count) and compare time to train `tokens`, cost and limits.

    model: preset name, nn.Module, config mapping or ModelProfile (profiled once for the sweep).
    gpus: GPU ids, cluster JSON paths (a calibrated profile used as the node type), GPUSpecs or
    Clusters. counts: GPU counts (multiples of each node size). tokens / deadline_days /
    budget_usd / prices accept numbers or strings such as '15T', '90d', '20M', {'b200': 3.5}.
    progress: True prints a progress line to stderr, False nothing, or a stream to write it to.
    rampup: (start, increment, samples) batch-size ramp-up; time to train includes its slower steps.
    jobs: processes planning points in parallel (reports/whatif_pool.py); None: one per available
    core from PARALLEL_MIN_POINTS points on (each starts in a few seconds), 1: this process only.
    """
    t0 = time.perf_counter()
    tok = parse_tokens(tokens)
    deadline = None if deadline_days is None else parse_duration_days(deadline_days)
    budget = None if budget_usd is None else parse_money(budget_usd)
    for name, v in (("seq_len", seq_len), ("global_batch", global_batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be a positive whole number, got {v!r}")
    # fp32 is left out: a what-if prices GPU time, and the cost model has no fp32 rates
    parse_precision(precision, allowed=(*(p.value for p in PRICED), AUTO))
    if rampup is not None:
        rampup = tuple(rampup)
        BatchRampup(*rampup, final=global_batch)            # refuse a bad ramp before planning
    options = _options(gpus)
    count_list = parse_counts(counts)
    if precision == Precision.FP8:
        no_fp8 = [o.label for o in options if not o.spec.fp8_tflops]
        if no_fp8:
            raise ConfigError(f"{no_fp8} have no FP8 matrix units; use precision 'bf16' or 'auto'")
    price_list = _price_sources(options, parse_prices(prices))
    # build every cluster before planning anything, so a bad count fails at once
    points = [(o, p, o.cluster(n)) for o, p in zip(options, price_list) for n in count_list]
    prof = api.profile(model, seq_len=seq_len)
    stream = (sys.stderr if progress is True else None) if isinstance(progress, bool) else progress
    bar = _Progress(len(points), stream)
    args = dict(seq_len=seq_len, global_batch=global_batch, precision=precision, tokens=tok, rampup=rampup)
    results = _sweep(prof, points, args, _jobs(jobs, len(points)), bar)
    bar.close()
    rows: list[WhatIfRow] = [row for row, _ in results]
    plans = {row.key: plan for row, plan in results if plan is not None}
    marks = compute_marks(rows, deadline_days=deadline, budget_usd=budget)
    chosen = marks["cheapest"] or marks["fastest"] or marks["fastest_overall"]
    msgs = verdicts(rows, marks, model=prof.name, tokens=tok, deadline_days=deadline, budget_usd=budget,
                     prices=price_list)
    return WhatIf(model=prof.name, tokens=tok, seq_len=seq_len, global_batch=global_batch, precision=precision,
                  deadline_days=deadline, budget_usd=budget, rampup=rampup, rows=tuple(rows), prices=tuple(price_list),
                  chosen=chosen, chosen_plan=json.loads(plans[chosen]) if chosen else None,
                  messages=tuple(msgs), seconds=time.perf_counter() - t0, **marks)
