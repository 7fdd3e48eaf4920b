"""Self-contained HTML reports (inline CSS and SVG, no external assets).

`write_plan_report(plan, path)`: one plan — its layout, per-GPU memory by category and pipeline
stage against capacity, the step time split into compute, exposed communication per dimension
and bubble, and `plan.explain()`.
`write_whatif_report(w, path)` / `whatif_html(w)`: a what-if sweep — verdicts, the table,
throughput and MFU against GPU count per GPU type, time to train against cost with the Pareto
front, then the chosen option's plan section.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from meshplan.reports import svg
from meshplan.reports.render import COLUMNS, compact_layout, fmt_days, fmt_money, fmt_pct, fmt_si

if TYPE_CHECKING:  # pragma: no cover
    from meshplan.ir.plan import Plan
    from meshplan.reports.whatif import WhatIf

__all__ = ["write_plan_report", "plan_report_html", "plan_section_html", "whatif_html", "write_whatif_report",
           "memory_svg", "step_time_svg"]

# Estimate.time_s keys, in the order a reader scans a step: work, then what is exposed, then idle.
STEP_PARTS = (("compute", "compute"), ("tp", "TP comm (exposed)"), ("cp", "CP comm (exposed)"),
              ("ep", "EP all-to-all (exposed)"), ("pp", "PP p2p (exposed)"), ("dp", "DP comm (exposed)"),
              ("bubble", "pipeline bubble"), ("optimizer", "optimizer step"), ("overhead", "fixed overhead"))
MEMORY_ORDER = ("weights", "gradients", "optimizer", "fp8_cache", "activations")
# A log axis reads better than a linear one once values span more than this factor.
LOG_SPAN = 5.0

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;color:#1a1a1a;
 max-width:1080px;margin:24px auto;padding:0 16px;line-height:1.45}
h1{font-size:1.5em;margin-bottom:.2em} h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
.sub{color:#555;margin-top:0} .verdict{background:#f3f7fb;border-left:4px solid #0072B2;padding:8px 12px;margin:6px 0}
.verdict.warn{background:#fdf4ec;border-left-color:#D55E00}
table{border-collapse:collapse;font-size:.88em;margin:8px 0} th,td{padding:4px 8px;border-bottom:1px solid #e5e5e5;white-space:nowrap}
.reason{display:inline-block;max-width:320px;white-space:normal}
th{background:#f5f5f5;text-align:left} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.nofit td{color:#888} tr.chosen td{background:#fffbe6}
.badge{display:inline-block;border-radius:3px;padding:0 5px;margin-right:3px;font-size:.85em;color:#fff}
.b-cheapest{background:#D55E00}.b-fastest{background:#009E73}.b-pareto{background:#555}
.plot{margin:14px 0} svg.mp-plot{max-width:100%;height:auto;border:1px solid #eee}
pre{background:#f7f7f7;padding:10px;overflow-x:auto;font-size:.82em} .small{font-size:.85em;color:#555}
"""


def _page(title: str, body: Sequence[str]) -> str:
    return "\n".join(["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
                      '<meta name="viewport" content="width=device-width, initial-scale=1">',
                      f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>", *body, "</body></html>\n"])


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[bool] | None = None,
           row_class: Sequence[str] | None = None, raw: bool = False) -> str:
    numeric = numeric or [False] * len(head)
    out = ["<table><thead><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr></thead><tbody>"]
    for i, r in enumerate(rows):
        cls = f' class="{row_class[i]}"' if row_class and row_class[i] else ""
        cells = "".join(f'<td{" class=num" if numeric[j] else ""}>{c if raw else escape(c)}</td>'
                        for j, c in enumerate(r))
        out.append(f"<tr{cls}>{cells}</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


# ---- one plan ---------------------------------------------------------------------------------
def memory_svg(est, *, hbm_gb: float | None = None, title: str | None = None) -> str:
    """Per-GPU memory by category for each pipeline stage, against usable capacity."""
    stages = est.memory_by_stage
    bars = [(f"{i}", dict(s)) for i, s in enumerate(stages)]
    cap = f"usable {est.capacity_gb:.1f} GB" + (f" of {hbm_gb:g} GB" if hbm_gb else "")
    return svg.stacked_bars(
        bars, title=title or f"Memory per GPU by pipeline stage (peak {est.peak_memory_gb:.1f} GB on stage {est.peak_stage})",
        x_label="pipeline stage (rank)" if len(stages) > 1 else "all GPUs (pp = 1)",
        y_label="memory per GPU (GB)", categories=MEMORY_ORDER, limit=(est.capacity_gb, cap),
        y_fmt=lambda v: f"{v:g}")


def step_time_svg(est, *, title: str | None = None) -> str:
    """The step time split into compute, exposed communication per dimension and bubble."""
    parts = {label: est.time_s.get(k, 0.0) for k, label in STEP_PARTS}
    return svg.hbar_stacked(parts, title=title or f"Step time split ({_dur(est.step_time_s)} per step)",
                            fmt=_dur, x_label="time per training step")


def _dur(seconds: float) -> str:
    if seconds == 0:
        return "0"
    if seconds >= 0.1:
        return f"{seconds:.3g} s"
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.3g} µs"


def _layout_rows(plan: Plan) -> list[tuple[str, str]]:
    est = plan.estimate
    lay = plan.layout
    rows = [("GPUs", f"{est.num_gpus} x {plan.cluster.get('gpu', {}).get('id', '?')} ({plan.cluster.get('name')})"),
            ("mesh", " x ".join(f"{k}={v}" for k, v in plan.mesh.items())),
            ("degrees", " ".join(f"{k}={getattr(lay, k)}" for k in ("tp", "cp", "pp", "vp", "dp", "ep", "etp"))),
            ("ZeRO stage", str(lay.zero)), ("sequence parallel", str(lay.sp)),
            ("schedule", str(plan.schedule)), ("recompute", str(plan.recompute)),
            ("micro-batch", f"{plan.micro_batch_size} sequence{'s' if plan.micro_batch_size != 1 else ''}, "
                            f"{plan.num_microbatches} per step per DP rank"),
            ("precision", plan.precision),
             ("FP8 linears", str(len(plan.fp8_modules))),
             ("step time", f"{est.step_time_s:.3f} s"),
             ("tokens/s per GPU", f"{est.tokens_per_s_per_gpu:,.0f}"),
             ("MFU", fmt_pct(est.mfu)),
             ("peak memory", f"{est.peak_memory_gb:.1f} GB of {est.capacity_gb:.1f} GB usable")]
    return rows


def plan_section_html(plan: Plan, heading: str | None = None) -> str:
    est = plan.estimate
    hbm = plan.cluster.get("gpu", {}).get("hbm_gb")
    gpu = plan.cluster.get("gpu", {}).get("id", "?")
    out = [f"<h2>{escape(heading or f'Plan: {plan.model} on {est.num_gpus} x {gpu}')}</h2>",
           f'<p class="sub">{escape(compact_layout(plan.layout.short()))} — bottleneck: {escape(est.bottleneck)}</p>',
           _table(["setting", "value"], _layout_rows(plan)),
           f'<div class="plot">{memory_svg(est, hbm_gb=hbm)}</div>',
           f'<div class="plot">{step_time_svg(est)}</div>',
           "<h3>Explanation</h3>", f"<pre>{escape(plan.explain())}</pre>"]
    return "\n".join(out)


def plan_report_html(plan: Plan) -> str:
    est = plan.estimate
    gpu = plan.cluster.get("gpu", {}).get("id", "?")
    title = f"meshplan plan: {plan.model} on {est.num_gpus} x {gpu}"
    body = [f"<h1>{escape(title)}</h1>",
            f'<p class="sub">seq {plan.seq_len}, global batch {plan.global_batch} sequences, {plan.precision}</p>',
            plan_section_html(plan, "Layout, memory and step time")]
    return _page(title, body)


def write_plan_report(plan: Plan, path: str | Path) -> None:
    """Write the single-plan HTML report (called by `meshplan plan --report`)."""
    Path(path).write_text(plan_report_html(plan), encoding="utf-8")


# ---- a what-if sweep ------------------------------------------------------------------------------
def _log_if_wide(values: Sequence[float]) -> bool:
    vals = [v for v in values if v and v > 0]
    return bool(vals) and max(vals) / min(vals) > LOG_SPAN


def throughput_svg(w: WhatIf) -> str:
    series = _series(w, lambda r: r.tokens_per_s)
    counts = sorted({r.num_gpus for r in w.rows})
    return svg.line_plot(series, title="Training throughput against GPU count", x_label="GPUs (log scale)",
                         y_label="throughput (tokens/s)", log_x=True, log_y=True, x_ticks=counts,
                         x_fmt=lambda v: f"{v:g}", y_fmt=fmt_si)


def mfu_svg(w: WhatIf) -> str:
    series = _series(w, lambda r: r.mfu * 100)
    counts = sorted({r.num_gpus for r in w.rows})
    return svg.line_plot(series, title="Model FLOPs utilisation against GPU count", x_label="GPUs (log scale)",
                         y_label="MFU (% of dense BF16 peak)", log_x=True, x_ticks=counts, y_zero=True,
                         x_fmt=lambda v: f"{v:g}", y_fmt=lambda v: f"{v:g}%")


def _series(w: WhatIf, value) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for r in w.rows:
        if r.ok:
            out.setdefault(r.gpu, []).append((float(r.num_gpus), float(value(r))))
    return out


def time_cost_svg(w: WhatIf) -> str:
    groups: dict[str, list[tuple[float, float, str]]] = {}
    priced = [r for r in w.rows if r.ok and r.cost_usd is not None]
    for r in priced:
        groups.setdefault(r.gpu, []).append((r.cost_usd, r.days, f"{r.num_gpus}"))
    front = [(w.row(k).cost_usd, w.row(k).days) for k in w.pareto]
    highlights = []
    if w.cheapest:
        r = w.row(w.cheapest)
        dl = f" ≤ {fmt_days(w.deadline_days)}" if w.deadline_days is not None else ""
        highlights.append((r.cost_usd, r.days, f"cheapest{dl}"))
    if w.fastest and w.row(w.fastest).cost_usd is not None:
        r = w.row(w.fastest)
        bu = f" ≤ {fmt_money(w.budget_usd)}" if w.budget_usd is not None else ""
        highlights.append((r.cost_usd, r.days, f"fastest{bu}"))
    h_guides = [(w.deadline_days, f"deadline {fmt_days(w.deadline_days)}")] if w.deadline_days is not None else []
    v_guides = [(w.budget_usd, f"budget {fmt_money(w.budget_usd)}")] if w.budget_usd is not None else []
    costs = [r.cost_usd for r in priced] + [v for v, _ in v_guides]
    days = [r.days for r in priced] + [v for v, _ in h_guides]
    return svg.scatter_plot(groups, title="Time to train against cost (labels: GPU count)",
                            x_label="cost (USD, on-demand)" + (" (log scale)" if _log_if_wide(costs) else ""),
                            y_label="time to train (days)" + (" (log scale)" if _log_if_wide(days) else ""),
                            front=front, highlights=highlights, h_guides=h_guides, v_guides=v_guides,
                            log_x=_log_if_wide(costs), log_y=_log_if_wide(days), x_fmt=fmt_money,
                            y_fmt=lambda v: f"{v:g}")


def _badges(w: WhatIf, key: str) -> str:
    names = {"cheapest": "cheapest" + (f" ≤ {fmt_days(w.deadline_days)}" if w.deadline_days is not None else ""),
             "fastest": "fastest" + (f" ≤ {fmt_money(w.budget_usd)}" if w.budget_usd is not None else ""),
             "pareto": "Pareto"}
    return "".join(f'<span class="badge b-{m}">{escape(names[m])}</span>' for m in w.marks_of(key))


def _sweep_table(w: WhatIf) -> str:
    head = [h for h, _ in COLUMNS] + ["marks"]
    numeric = [h in ("GPUs", "tokens/s", "MFU", "days", "GPU-hours", "cost", "headroom") for h in head]
    rows, classes = [], []
    for r in w.rows:
        if r.ok:
            lim = r.limiter if r.limiter == "compute" else f"{r.limiter} {r.limiter_share * 100:.0f}%"
            cells = [r.gpu, str(r.num_gpus), compact_layout(r.layout), fmt_si(r.tokens_per_s), fmt_pct(r.mfu), f"{r.days:.1f}",
                     fmt_si(r.gpu_hours), fmt_money(r.cost_usd), f"{r.headroom_gb:.1f} GB", lim]
            rows.append([escape(c) for c in cells] + [_badges(w, r.key)])
        else:
            rows.append([escape(r.gpu), str(r.num_gpus), f"<b>{escape(r.status)}</b>",
                         *[""] * 6, f'<span class="small reason">{escape(_short_reason(r.reason))}</span>', ""])
        classes.append("chosen" if r.key == w.chosen else ("" if r.ok else "nofit"))
    return _table(head, rows, numeric, classes, raw=True)


def _short_reason(reason: str) -> str:
    """The first clause of a planner message (the full text is listed under the table)."""
    cut = reason.split(";")[0]
    return cut if len(cut) <= 140 else cut[:137] + "..."


def whatif_html(w: WhatIf) -> str:
    title = f"meshplan what-if: {w.model}, {fmt_si(w.tokens)} tokens"
    sub = f"seq {w.seq_len}, global batch {w.global_batch} sequences, {w.precision}"
    if w.deadline_days is not None:
        sub += f", deadline {fmt_days(w.deadline_days)}"
    if w.budget_usd is not None:
        sub += f", budget {fmt_money(w.budget_usd)}"
    body = [f"<h1>{escape(title)}</h1>", f'<p class="sub">{escape(sub)}</p>']
    for m in w.messages:
        warn = m.startswith(("No option", "No price")) or "fits on none" in m
        body.append(f'<div class="verdict{" warn" if warn else ""}">{escape(m)}</div>')
    body += ["<h2>Options</h2>", _sweep_table(w)]
    failed = [r for r in w.rows if not r.ok]
    if failed:
        body.append("<details><summary>Why some options have no plan</summary><ul>"
                    + "".join(f"<li>{r.num_gpus} x {escape(r.gpu)}: {escape(r.reason)}</li>" for r in failed)
                    + "</ul></details>")
    body.append('<p class="small">' + "<br>".join(f"<b>{escape(h)}</b>: {escape(m)}" for h, m in COLUMNS) + "</p>")
    if any(r.ok for r in w.rows):
        body += ["<h2>Scaling</h2>", f'<div class="plot">{throughput_svg(w)}</div>', f'<div class="plot">{mfu_svg(w)}</div>']
        body.append("<h2>Time and cost</h2>")
        if any(r.ok and r.cost_usd is not None for r in w.rows):
            body.append(f'<div class="plot">{time_cost_svg(w)}</div>')
        else:
            body.append("<p>No option has a price, so there is no time–cost plot; give prices with --price.</p>")
    prices = [[p.gpu, f"${p.usd_per_gpu_hour:.2f}" if p.usd_per_gpu_hour is not None else "none",
               p.source + (" (override)" if p.overridden else "")] for p in w.prices]
    body += ["<h2>Prices</h2>", _table(["GPU", "USD per GPU-hour", "source"], prices, [False, True, False])]
    plan = w.plan
    if plan is not None:
        r = w.row(w.chosen)
        why = ", ".join(w.marks_of(w.chosen)) or "fastest overall (nearest to the deadline)"
        body.append(plan_section_html(plan, f"Chosen option: {r.num_gpus} x {r.gpu} ({why})"))
    body.append(f'<p class="small">Swept {len(w.rows)} options in {w.seconds:.1f} s. Generated by meshplan.</p>')
    return _page(title, body)


def write_whatif_report(w: WhatIf, path: str | Path) -> None:
    Path(path).write_text(whatif_html(w), encoding="utf-8")
