#!/usr/bin/env python
"""Validate meshplan's cost model against measured training runs.

    python benchmarks/validate_published.py            # every expressible row, traced models
    python benchmarks/validate_published.py --quick    # a few rows per source (CI)
    python benchmarks/validate_published.py --fit      # re-fit the "fitted" constants on the fit split
    python benchmarks/validate_published.py --no-loso  # skip the leave-one-source-out refits

Leave-one-source-out (LOSO): for each source, the fitted constants are re-fitted on every row of
all OTHER modelled sources and the held-out source is predicted with them; the constants are then
restored. A random row split lets a source's conventions (FLOP counting, stack defaults) leak into
the fit through its own fit rows; LOSO does not, so it is the error to expect on a new source.

Prints predicted vs measured per row (in the row's own metric and FLOP convention), the absolute
percentage error, the mean by source and overall, separately for the rows used to fit the
constants and the held-out rows, every published layout meshplan predicts would NOT fit in
memory (each such row is a memory-model bug: the run happened), and, for scaling series (rows of one
source that differ only in dp), the pipeline fill/drain overhead the measurements imply next to the
predicted one.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit  # noqa: E402

from meshplan.cost_models import constants as K  # noqa: E402
from meshplan.cost_models import validation as V  # noqa: E402
from meshplan.cost_models.uncertainty import band_coverage, regime_generation  # noqa: E402
from meshplan.cost_models.validation import DEFAULT_CSV, NOT_FITTED, load_rows, split_of  # noqa: E402
from meshplan.ir.layout import PER_TENSOR_FP8_RECIPES  # noqa: E402

# Constants re-fitted by --fit (the fields of constants.Fitted), with the bounds they may take
# (physical ranges, not free knobs).
FITTED = {"training_gemm_eff": (0.5, 1.0), "dp_overlap_eff": (0.1, 0.95), "fsdp_overlap_eff": (0.1, 0.95),
          "tp_overlap_hidden": (0.3, 0.95), "layer_overhead_s": (0.0, 2e-4)}
# (The attention kernels' rates are measured, not fitted: constants.ATTN_FWD_EFF / ATTN_BWD_EFF and
# ATTN_KERNEL_RATE, from benchmarks/gpu_rates.py on an H200.)


def model_profile(cfg, *, traced: bool = True):
    """Profile of a row's architecture: meshplan's model built on the meta device and traced (the
    real path), or the analytic builder (fast, for what-if sweeps).

    The published runs used their framework's fused kernels (Megatron/TE norm, SwiGLU, rotary; an
    unfused loss), not meshplan's runtime swaps: the validation prices each row's profile for its
    stack (cost_models.context.for_stack), which clears the traced `fusions`."""
    if traced:
        from meshplan import models
        from meshplan.api import profile
        kw = {k: v for k, v in cfg.items() if k != "family"}
        return profile(models.build(cfg["family"], device="meta", **kw))
    from meshplan.profiling.analytic import profile_from_config
    return profile_from_config(cfg)


def model_config(row):
    """The row's model config, with fields the row leaves empty filled from meshplan's presets."""
    from meshplan.models import config as preset
    return V.model_config(row, preset)


def run_row(row, *, traced: bool = True, profiles: dict | None = None, fitted=None):
    """meshplan.cost_models.validation.run_row with meshplan's model builders and presets."""
    from meshplan.models import config as preset
    return V.run_row(row, lambda cfg: model_profile(cfg, traced=traced), preset=preset, profiles=profiles,
                     fitted=fitted)


def evaluate(rows, traced, profiles, fitted=None):
    return [run_row(r, traced=traced, profiles=profiles, fitted=fitted) for r in rows]


def mape(results):
    errs = [abs(x.error) for x in results if x.error is not None]
    return statistics.mean(errs) if errs else float("nan")


# The folds' search: multiplicative steps, each round's the square roots of the last's, until the
# steps are within 1% (FIT_TOL): the number of rounds that takes for a set of factors.
FIT_FACTORS = (0.6, 0.8, 0.9, 1.1, 1.25, 1.6)
QUICK_FACTORS = (0.8, 1.25)
FIT_TOL = 0.01


def rounds_to_converge(factors, tol: float = FIT_TOL) -> int:
    """Rounds of `fit` until its largest step is within `tol`."""
    widest = max(abs(math.log(f)) for f in factors)
    return max(1, math.ceil(math.log2(widest / math.log1p(tol))) + 1)


def fit(rows, traced, profiles, *, fit_rows=None, rounds: int | None = None, factors=FIT_FACTORS,
        verbose: bool = True, start: K.Fitted = K.FITTED) -> K.Fitted:
    """Coordinate descent on the fitted constants over the fit split only (or `fit_rows`), each
    constant kept inside its physical bounds, from `start`; returns the new constants.Fitted (the
    cost model is priced with it; nothing global changes). A pattern search: each constant keeps
    stepping by the round's factors while the loss falls, and each round's steps are the square roots
    of the previous round's (x1.25, then x1.12, then x1.06, ...), so a constant travels as far as the
    loss asks and settles between the coarse steps' points (a few fixed multiplicative steps from the
    neutral start reach only a few values: the GEMM rate 0.707 x 1.1 or x 1.25, 0.778 or 0.884, which
    moves every row of a fold by ~6%). The loss weights every source equally (the mean over sources
    of each source's mean |error|), so the source with the most rows does not set the constants."""
    if fit_rows is None:
        fit_rows = [r for r in rows if split_of(r.id, r.family) == "fit"]

    def loss(f: K.Fitted) -> float:
        per_src = defaultdict(list)
        for x in evaluate(fit_rows, traced, profiles, f):
            if x.error is not None:
                per_src[x.row.family].append(abs(x.error))
        return statistics.mean(statistics.mean(v) for v in per_src.values())

    best_f, best = start, loss(start)
    for r in range(rounds or rounds_to_converge(factors)):
        steps = [fac ** (0.5 ** r) for fac in factors]
        for name, (lo, hi) in FITTED.items():
            moved = True
            while moved:
                moved = False
                base = getattr(best_f, name)
                for fac in steps:
                    cand = dataclasses.replace(best_f, **{name: min(hi, max(lo, base * fac))})
                    cur = loss(cand)
                    if cur < best - 1e-4:
                        best, best_f, moved = cur, cand, True
            if verbose:
                print(f"  {name:20s} = {getattr(best_f, name):.4g}   loss {best:.4f}", flush=True)
    return best_f


def leave_out(rows, traced, profiles, groups: dict, *, rounds: int | None = None, factors=FIT_FACTORS):
    """For each named group of rows (`groups`: name -> predicate on a Row): re-fit the FITTED
    constants on every modelled row outside the group, predict the group's rows with them. Each
    fold starts from the same neutral point (the geometric middle of each constant's bounds), not
    from the shipped values, which the held-out rows helped fit. Rows of NOT_FITTED sources never
    fit; a group of only such rows is predicted from all modelled rows.
    Returns {group: [RowResult]} and {group: constants.Fitted}."""
    expressible = [x.row for x in evaluate(rows, traced, profiles) if x.predicted is not None]
    neutral = K.Fitted(**{n: (lo * hi) ** 0.5 if lo > 0 else hi / 2 for n, (lo, hi) in FITTED.items()})
    out, consts = {}, {}
    for name, inside in groups.items():
        held = [r for r in expressible if inside(r)]
        if not held:
            continue
        train = [r for r in expressible if not inside(r) and r.family not in NOT_FITTED]
        consts[name] = fit(rows, traced, profiles, fit_rows=train, rounds=rounds, factors=factors, verbose=False,
                           start=neutral)
        out[name] = evaluate(held, traced, profiles, consts[name])
    return out, consts


def leave_one_source_out(rows, traced, profiles, *, rounds: int | None = None, factors=FIT_FACTORS):
    """leave_out over the sources (row families)."""
    sources = sorted({r.family for r in rows})
    return leave_out(rows, traced, profiles, {s: (lambda r, s=s: r.family == s) for s in sources},
                     rounds=rounds, factors=factors)


def _gen(row) -> str:
    return regime_generation(V._gpu(row) or "")


def _fp8_recipe(row) -> str:
    prec = row.get("precision").lower()
    if "fp8" not in prec and "float8" not in prec:
        return ""
    return V.stack_options(row).get("fp8_recipe", "tensorwise")


def _ep_cross_node(row) -> bool:
    return (row.num("ep") or 1) * (row.num("etp") or 1) > 8


# Regimes the table covers unevenly: each is held out whole (a stack, a GPU generation, an FP8 recipe
# family, expert parallelism across nodes, long context, MoE), to see what a new regime costs
REGIMES = {
    **{f"stack {st}": (lambda r, st=st: V.stack_of(r).name == st)
       for st in ("megatron-2021", "megatron-deepspeed", "megatron-core", "torchtitan", "llm-foundry")},
    **{f"gpu {g}": (lambda r, g=g: _gen(r) == g) for g in ("ampere", "hopper", "blackwell")},
    "fp8 per-tensor scales": lambda r: _fp8_recipe(r) in PER_TENSOR_FP8_RECIPES,
    "fp8 block/row/mx recipes": lambda r: _fp8_recipe(r) not in ("", *PER_TENSOR_FP8_RECIPES),
    "ep across nodes": _ep_cross_node,
    "context >= 64k": lambda r: (r.num("seq") or 0) >= 65536,
    "moe": lambda r: bool(r.num("moe_experts")) or "qwen3" in r.get("model").lower()
    or "deepseek" in r.get("model").lower() or "gpt oss" in r.get("model").lower(),
}
LORO_TARGET_MEAN = 0.15


def loro_report(p, rows, traced, profiles, *, quick: bool) -> dict:
    """Leave-one-regime-out: each regime of REGIMES held out whole; its rows' error, then the mean
    over regimes (the error to expect where the table has no rows like the plan's)."""
    t0 = time.time()
    factors = QUICK_FACTORS if quick else FIT_FACTORS
    rounds = rounds_to_converge(factors)
    modelled = [r for r in rows if r.family not in NOT_FITTED]
    res, consts = leave_out(modelled, traced, profiles, REGIMES, rounds=rounds, factors=factors)
    p("leave-one-regime-out (fit the constants on every row outside the regime, predict the regime):")
    p(f"{'regime':26s} {'n':>3s} {'LORO MAPE':>9s} {'max':>7s}  {'signed mean':>11s}  constants fitted without it")
    means = {}
    for name in REGIMES:
        xs = [x for x in res.get(name, []) if x.error is not None]
        if not xs:
            continue
        means[name] = mape(xs)
        signed = statistics.mean(x.error for x in xs)
        fitted = ", ".join(f"{k}={getattr(consts[name], k):.3g}" for k in FITTED) if name in consts else ""
        p(f"{name:26s} {len(xs):3d} {means[name] * 100:8.1f}% {max(abs(x.error) for x in xs) * 100:6.1f}%  "
          f"{signed * 100:+10.1f}%  {fitted}")
    overall = statistics.mean(means.values()) if means else float("nan")
    p(f"{'LORO mean over regimes':26s} {'':3s} {overall * 100:8.1f}%   target <= {LORO_TARGET_MEAN * 100:.0f}%: "
      f"{'MET' if overall <= LORO_TARGET_MEAN else 'NOT MET'}")
    p(f"(LORO: {len(res)} refits, {rounds} round(s) of pattern search each, to {FIT_TOL:.0%} steps, {time.time() - t0:.1f} s)")
    return {"overall": overall, "regimes": means}


def mechanism_tags(x) -> list[str]:
    """The mechanisms a validated row's prediction leans on (for the per-mechanism error table that
    meshplan.cost_models.uncertainty's constants come from)."""
    lay, row = x.layout, x.row
    tags = []
    if x.estimate.precision == "fp8":
        tags.append("fp8")
    if lay.get("ep", 1) > 1 or row.get("moe_experts"):
        tags.append("moe_ep")
    if lay.get("cp", 1) > 1:
        tags.append("cp")
    if lay.get("zero") == 3:
        tags.append("fsdp")
    if lay.get("pp", 1) > 1:
        tags.append("pp")
    if not tags or tags == ["pp"]:
        tags.append("dense")
    return tags


def measured_step_s(x) -> float:
    """The row's measured step time: every throughput metric is inversely proportional to the step
    time of that row's own batch and GPU count, so measured/predicted converts one into the other."""
    if x.metric == "step_time_s":
        return x.measured
    return x.estimate.step_time_s * x.predicted / x.measured


def pipeline_series(results):
    """Scaling series: rows of one source that differ only in the data-parallel degree (same model,
    tp, pp, vp, micro-batch, global batch, sequence). For each, fit step = c * (m + k) over the rows
    (m = micro-batches per pipeline) and compare the measured pipeline overhead k, in micro-batch
    slots, with the predicted one and with the schedule's own (pp-1)/vp. A measured k far above
    (pp-1)/vp is a per-step cost the schedule alone does not explain."""
    groups = defaultdict(list)
    for x in results:
        if x.predicted is None or x.layout.get("pp", 1) < 2:
            continue
        lay = x.layout
        key = (x.row.family, x.row.get("model"), lay["tp"], lay["pp"], lay["vp"], lay["mbs"],
               x.estimate.global_batch, x.estimate.seq_len)
        groups[key].append(x)
    out = []
    for key, xs in groups.items():
        if len({x.layout["dp"] for x in xs}) < 3:
            continue
        ms = [x.estimate.num_microbatches for x in xs]

        def overhead(ts):
            mm, mt = statistics.mean(ms), statistics.mean(ts)
            c = sum((a - mm) * (b - mt) for a, b in zip(ms, ts)) / sum((a - mm) ** 2 for a in ms)
            return (mt - c * mm) / c
        k_meas = overhead([measured_step_s(x) for x in xs])
        k_pred = overhead([x.estimate.step_time_s for x in xs])
        out.append((key, sorted(ms, reverse=True), k_meas, k_pred, (key[3] - 1) / key[4]))
    return out


# LOSO targets: mean over held-out rows of modelled sources, and the worst source mean
LOSO_TARGET_MEAN = 0.08
LOSO_TARGET_SOURCE = 0.15


def loso_report(p, rows, traced, profiles, by_src, *, quick: bool) -> dict:
    """Leave-one-source-out error per source and overall, next to today's split's held-out error,
    then the same errors grouped by the mechanisms the rows lean on."""
    t0 = time.time()
    factors = QUICK_FACTORS if quick else FIT_FACTORS
    rounds = rounds_to_converge(factors)
    shipped = K.FITTED
    loso, consts = leave_one_source_out(rows, traced, profiles, rounds=rounds, factors=factors)
    p("leave-one-source-out (fit the constants on every other modelled source, predict this one):")
    p(f"{'source':16s} {'n':>3s} {'split test':>10s} {'LOSO MAPE':>9s} {'LOSO max':>8s}  constants refitted without it (where >5% from shipped)")
    all_rows, src_means = [], []
    for src in sorted(loso):
        xs = [x for x in loso[src] if x.error is not None]
        if not xs:
            continue
        m = mape(xs)
        worst = max(xs, key=lambda x: abs(x.error))
        test = by_src.get(src, {}).get("test", [])
        moved = ", ".join(f"{k}={getattr(consts[src], k):.3g}" for k in FITTED
                          if abs(getattr(consts[src], k) / getattr(shipped, k) - 1) > 0.05)
        p(f"{src:16s} {len(xs):3d} {mape(test) * 100:9.1f}% {m * 100:8.1f}% {abs(worst.error) * 100:7.1f}%  "
          f"{moved or '(as shipped)'}" + ("   [not modelled: never fits]" if src in NOT_FITTED else ""))
        if src not in NOT_FITTED:
            all_rows += xs
            src_means.append((m, src))
    overall = mape(all_rows)
    worst_src = max(src_means) if src_means else (float("nan"), "")
    ok = overall <= LOSO_TARGET_MEAN and worst_src[0] <= LOSO_TARGET_SOURCE
    p(f"{'LOSO MODELLED':16s} {len(all_rows):3d} {'':10s} {overall * 100:8.1f}%           mean over rows; "
      f"mean over sources {statistics.mean(m for m, _ in src_means) * 100:.1f}%; worst source {worst_src[1]} "
      f"{worst_src[0] * 100:.1f}%")
    p(f"targets: LOSO mean <= {LOSO_TARGET_MEAN * 100:.0f}%, no source > {LOSO_TARGET_SOURCE * 100:.0f}%: "
      f"{'MET' if ok else 'NOT MET'}")
    bad = sorted((x for x in all_rows if abs(x.error) > 0.15), key=lambda x: -abs(x.error))
    p(f"LOSO rows worse than 15%: {len(bad)} of {len(all_rows)}; worse than 25%: "
      f"{sum(abs(x.error) > 0.25 for x in all_rows)}" + (": " + ", ".join(
          f"{x.row.id} ({x.error * 100:+.0f}%)" for x in bad) if bad else ""))
    # the estimates' own bands against their held-out errors: is a confident estimate right?
    within, within2 = band_coverage((x.error, x.estimate.uncertainty) for x in all_rows)
    beyond = sorted((x for x in all_rows if abs(x.error) > 2 * x.estimate.uncertainty),
                    key=lambda x: -abs(x.error) / x.estimate.uncertainty)
    p(f"LOSO error against each estimate's own band: within it {within * 100:.0f}% of rows, within twice it "
      f"{within2 * 100:.0f}%" + (": beyond twice: " + ", ".join(
          f"{x.row.id} ({x.error * 100:+.0f}% vs +/-{x.estimate.uncertainty * 100:.0f}%)" for x in beyond) if beyond else ""))
    # by mechanism: the held-out error of rows leaning on each mechanism (uncertainty.py cites these)
    by_tag = defaultdict(list)
    for src, xs in loso.items():
        if src in NOT_FITTED:
            continue
        for x in xs:
            if x.error is not None:
                for tag in mechanism_tags(x):
                    by_tag[tag].append(x)
    p("LOSO error by mechanism the row leans on (rows may count under several):")
    for tag, xs in sorted(by_tag.items()):
        comp = {"cp": "cp", "moe_ep": "ep", "pp": "bubble", "fsdp": "dp"}.get(tag)
        share = statistics.mean(x.estimate.time_s.get(comp, 0.0) / x.estimate.step_time_s for x in xs) if comp else 0
        p(f"  {tag:8s} n={len(xs):3d}  MAPE {mape(xs) * 100:5.1f}%  max {max(abs(x.error) for x in xs) * 100:5.1f}%"
          + (f"  mean share of step in '{comp}' {share * 100:4.1f}%" if comp else ""))
    p(f"(LOSO: {len(loso)} refits, {rounds} round(s) of pattern search each, to {FIT_TOL:.0%} steps, {time.time() - t0:.1f} s)")
    return {"overall": overall, "sources": {s: m for m, s in src_means}, "met": ok}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", default=str(DEFAULT_CSV))
    ap.add_argument("--quick", action="store_true", help="two rows per source")
    ap.add_argument("--analytic", action="store_true", help="analytic profiles instead of traced models")
    ap.add_argument("--fit", action="store_true", help="re-fit the fitted constants on the fit split")
    ap.add_argument("--no-loso", action="store_true", help="skip the leave-one-source-out refits")
    ap.add_argument("--out", help="also write the report to this file")
    args = ap.parse_args(argv)
    if not Path(args.csv).exists():
        print(f"published runs not found at {args.csv}; pass --csv PATH", file=sys.stderr)
        return 2
    rows = load_rows(args.csv)
    if args.quick:
        seen = defaultdict(int)
        keep = []
        for r in rows:
            if seen[r.family] < 2 and r.get("tp") + r.get("zero") != "":
                keep.append(r)
                seen[r.family] += 1
        rows = keep
    traced = not args.analytic
    profiles: dict = {}
    t0 = time.time()
    fitted = K.FITTED
    if args.fit:
        print("fitting on the fit split ...")
        fitted = fit(rows, traced, profiles)
        print("fitted (write into meshplan/cost_models/constants.py to ship):",
              ", ".join(f"{k}={getattr(fitted, k):.4g}" for k in FITTED))
    results = evaluate(rows, traced, profiles, fitted)
    lines = []
    p = lines.append
    p(f"# meshplan cost model vs published runs ({len(rows)} rows, {'traced' if traced else 'analytic'} profiles)")
    p("")
    p(f"{'row':44s} {'split':5s} {'metric':22s} {'measured':>9s} {'predicted':>9s} {'err%':>7s}  layout")
    by_src: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    skipped, not_fit = [], []
    for x in results:
        if x.predicted is None:
            skipped.append(x)
            continue
        sp = split_of(x.row.id, x.row.family)
        by_src[x.row.family][sp].append(x)
        if not x.fits:
            not_fit.append(x)
        lay = x.layout
        desc = f"tp{lay['tp']} pp{lay['pp']} vp{lay['vp']} cp{lay['cp']} dp{lay['dp']} z{lay['zero']} " \
               f"mbs{lay['mbs']} rc={lay.get('recompute')}" + (f" ep{lay['ep']}" if lay.get('ep', 1) > 1 else "") + \
               "".join(f" {lay[k]}" for k in ("moe_dispatcher", "fsdp_impl") if k in lay) + \
               (f" {lay['attn_kernel']}-attn" if "attn_kernel" in lay else "") + \
               (f" grads-{lay['grad_dtype']}" if "grad_dtype" in lay else "")
        p(f"{x.row.id[:44]:44s} {sp:5s} {x.metric:22s} {x.measured:9.2f} {x.predicted:9.2f} "
          f"{x.error * 100:+7.1f}  {desc}{'' if x.fits else '  [DOES NOT FIT: %.1f GB]' % x.estimate.peak_memory_gb}")
    p("")
    p(f"{'source':16s} {'fit n':>5s} {'fit MAPE':>9s} {'test n':>6s} {'test MAPE':>9s} {'max |err|':>9s}")
    all_fit, all_test = [], []
    for src, d in sorted(by_src.items()):
        f, t = d["fit"], d["test"]
        all_fit += f
        all_test += t
        mx = max(abs(x.error) for x in f + t)
        p(f"{src:16s} {len(f):5d} {mape(f) * 100:8.1f}% {len(t):6d} {mape(t) * 100:8.1f}% {mx * 100:8.1f}%")
    every = all_fit + all_test
    worst = max(every, key=lambda x: abs(x.error))
    p(f"{'OVERALL':16s} {len(all_fit):5d} {mape(all_fit) * 100:8.1f}% {len(all_test):6d} {mape(all_test) * 100:8.1f}% "
      f"{abs(worst.error) * 100:8.1f}%   (worst: {worst.row.id})")
    modelled = [x for x in every if x.row.family not in NOT_FITTED]
    mt = [x for x in all_test if x.row.family not in NOT_FITTED]
    worst_m = max(modelled, key=lambda x: abs(x.error))
    p(f"{'MODELLED':16s} {len(all_fit):5d} {mape(all_fit) * 100:8.1f}% {len(mt):6d} {mape(mt) * 100:8.1f}% "
      f"{abs(worst_m.error) * 100:8.1f}%   (worst: {worst_m.row.id}; excludes {', '.join(NOT_FITTED)})")
    over = [x for x in mt if abs(x.error) > 0.25]
    p(f"held-out modelled rows worse than 25%: {len(over)} of {len(mt)}"
      + (": " + ", ".join(f"{x.row.id} ({x.error * 100:+.0f}%)" for x in over) if over else ""))
    over_all = [x for x in all_test if abs(x.error) > 0.25 and x.row.family in NOT_FITTED]
    p(f"held-out rows of unmodelled stacks worse than 25%: {len(over_all)} of "
      f"{sum(1 for x in all_test if x.row.family in NOT_FITTED)}"
      + (": " + ", ".join(f"{x.row.id} ({x.error * 100:+.0f}%)" for x in over_all) if over_all else ""))
    series = pipeline_series(results)
    if series:
        p("")
        p("pipeline scaling series (same model and layout, dp varied; fit step = c*(m + k)):")
        for key, ms, k_meas, k_pred, k_sched in series:
            p(f"  {key[0]:14s} {key[1][:28]:28s} tp{key[2]} pp{key[3]} vp{key[4]} mbs{key[5]} m={ms}: "
              f"overhead k measured {k_meas:6.1f}, predicted {k_pred:6.1f} micro-batch slots "
              f"(schedule alone: (pp-1)/vp = {k_sched:.1f})")
    if not args.no_loso:
        p("")
        loso_report(p, rows, traced, profiles, by_src, quick=args.quick)
        p("")
        loro_report(p, rows, traced, profiles, quick=args.quick)
    p("")
    p(f"published layouts predicted NOT to fit in memory: {len(not_fit)}")
    for x in not_fit:
        p(f"  {x.row.id}: {x.estimate.peak_memory_gb:.1f} GB > {x.estimate.capacity_gb:.1f} GB")
    p(f"rows skipped (not expressible): {len(skipped)}")
    for x in skipped:
        p(f"  {x.row.id}: {x.skipped}")
    p(f"\n({time.time() - t0:.1f} s)")
    return emit(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
