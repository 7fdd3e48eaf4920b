"""Text renderings of a what-if sweep: a terminal table, Markdown and JSON, plus the number
formats every report shares (money, days, SI counts)."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from meshplan.ir.precision import AUTO

if TYPE_CHECKING:  # pragma: no cover
    from meshplan.reports.whatif import PriceSource, WhatIf, WhatIfRow

__all__ = ["to_table", "to_markdown", "to_json", "fmt_money", "fmt_days", "fmt_si", "fmt_pct",
           "compact_layout", "verdicts", "MARK_SYMBOLS", "COLUMNS"]

# one letter per mark in the terminal table, explained under it
MARK_SYMBOLS = {"cheapest": "C", "fastest": "F", "pareto": "P"}

# (header, meaning) — the meanings are printed under the Markdown table and in the HTML report
COLUMNS = (
    ("GPU", "GPU type (or the cluster file used as the node type)"),
    ("GPUs", "GPU count (nodes x GPUs per node)"),
    ("layout", "the planner's best layout at this size (degrees of 1 and the defaults z1, mbs1, rc=none, "
               "1f1b left out; the JSON has the full layout)"),
    ("tokens/s", "whole-cluster training throughput"),
    ("MFU", "model FLOP/s / dense BF16 peak (Megatron-LM convention)"),
    ("days", "time to train the token budget"),
    ("GPU-hours", "GPUs x time"),
    ("cost", "GPU-hours x on-demand price per GPU-hour"),
    ("headroom", "usable memory per GPU minus the predicted peak"),
    ("limited by", "largest of pipeline bubble, exposed DP / TP comm, other exposed comm (CP, EP, PP p2p) "
                   "and memory (time spent recomputing); 'compute' when none reaches 5% of the step"),
)


# ---- number formats ---------------------------------------------------------------------------
def _sig(x: float) -> str:
    """Three significant digits at most, no exponent, no trailing zeros: 1.23, 12.3, 123, 20."""
    if x == 0:
        return "0"
    digits = max(0, 2 - int(math.floor(math.log10(abs(x)))))
    text = f"{x:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def fmt_si(x: float | None) -> str:
    """12345 -> '12.3k', 2.5e12 -> '2.5T', 2e7 -> '20M'."""
    if x is None:
        return "n/a"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return _sig(x / scale) + suffix
    return _sig(x)


def fmt_money(x: float | None) -> str:
    if x is None:
        return "n/a"
    return "$" + fmt_si(x)


def fmt_days(days: float | None) -> str:
    if days is None:
        return "n/a"
    if days < 1:
        return f"{days * 24:.1f} h".replace(".0 h", " h")
    return (f"{days:.1f}".removesuffix(".0") if days < 100 else f"{days:,.0f}") + " days"


def fmt_pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


def compact_layout(short: str) -> str:
    """'tp2 cp8 pp64 dp1 z1 mbs1 rc=none zb' -> 'tp2 cp8 pp64 zb': degrees of 1 and defaults dropped."""
    keep = []
    for part in short.split():
        if part in ("z1", "mbs1", "rc=none", "1f1b") or part in ("tp1", "cp1", "pp1", "dp1"):
            continue
        keep.append(part)
    return " ".join(keep) or "dp1"


def _marks(w: WhatIf, r: WhatIfRow) -> str:
    return "".join(MARK_SYMBOLS[m] for m in w.marks_of(r.key))


def _cells(w: WhatIf, r: WhatIfRow) -> list[str]:
    if not r.ok:
        return [r.gpu, str(r.num_gpus), r.status, "", "", "", "", "", "", "", ""]
    limiter = r.limiter if r.limiter == "compute" else f"{r.limiter} {r.limiter_share * 100:.0f}%"
    layout = compact_layout(r.layout) + (f" {r.precision}" if w.precision == AUTO else "")
    return [r.gpu, str(r.num_gpus), layout, fmt_si(r.tokens_per_s),
            fmt_pct(r.mfu), f"{r.days:.1f}", fmt_si(r.gpu_hours), fmt_money(r.cost_usd),
            f"{r.headroom_gb:.1f} GB", limiter, _marks(w, r)]


_HEAD = [c for c, _ in COLUMNS] + ["marks"]
_RIGHT = {"GPUs", "tokens/s", "MFU", "days", "GPU-hours", "cost", "headroom"}


def _header(w: WhatIf) -> list[str]:
    dl = f", deadline {fmt_days(w.deadline_days)}" if w.deadline_days is not None else ""
    bu = f", budget {fmt_money(w.budget_usd)}" if w.budget_usd is not None else ""
    return [f"What-if: {w.model}, {fmt_si(w.tokens)} tokens, seq {w.seq_len}, global batch {w.global_batch} "
            f"sequences, {w.precision}{dl}{bu}"]


def _legend(w: WhatIf) -> str:
    dl = f"within {fmt_days(w.deadline_days)}" if w.deadline_days is not None else "overall"
    bu = f"within {fmt_money(w.budget_usd)}" if w.budget_usd is not None else "overall"
    return f"marks: C cheapest {dl}, F fastest {bu}, P on the time-cost Pareto front"


def _footnotes(w: WhatIf) -> list[str]:
    return [f"{r.num_gpus} x {r.gpu} {r.status}: {r.reason}" for r in w.rows if not r.ok]


def _price_lines(w: WhatIf) -> list[str]:
    out = []
    for p in w.prices:
        price = f"${p.usd_per_gpu_hour:.2f}/GPU-hour" if p.usd_per_gpu_hour is not None else "no price"
        out.append(f"{p.gpu}: {price} — {p.source}")
    return out


def to_table(w: WhatIf) -> str:
    """A fixed-width table for the terminal, followed by the verdicts, footnotes and price sources."""
    rows = [_cells(w, r) for r in w.rows]
    widths = [max(len(h), *(len(c[i]) for c in rows)) if rows else len(h) for i, h in enumerate(_HEAD)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(wd) if h in _RIGHT else c.ljust(wd)
                         for c, wd, h in zip(cells, widths, _HEAD)).rstrip()

    out = _header(w) + ["", line(_HEAD), line(["-" * wd for wd in widths])]
    prev = None
    for r, cells in zip(w.rows, rows):
        if prev is not None and r.gpu != prev:
            out.append("")
        prev = r.gpu
        if not r.ok:   # the status spans the numeric columns
            cells = cells[:2] + [f"{r.status} (see below)"]
            out.append("  ".join(c.rjust(wd) if h in _RIGHT else c.ljust(wd)
                                 for c, wd, h in zip(cells, widths, _HEAD)))
        else:
            out.append(line(cells))
    out += ["", _legend(w)]
    if w.messages:
        out += [""] + [f"* {m}" for m in w.messages]
    notes = _footnotes(w)
    if notes:
        out += ["", "No plan:"] + [f"  {n}" for n in notes]
    out += ["", "Prices (on demand, per GPU-hour):"] + [f"  {p}" for p in _price_lines(w)]
    return "\n".join(out)


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def to_markdown(w: WhatIf) -> str:
    """A Markdown report: verdicts, the table (marks in words), column meanings, price sources."""
    names = {"cheapest": "cheapest" + (f" ≤ {fmt_days(w.deadline_days)}" if w.deadline_days is not None else ""),
             "fastest": "fastest" + (f" ≤ {fmt_money(w.budget_usd)}" if w.budget_usd is not None else ""),
             "pareto": "Pareto"}
    out = [f"## {_header(w)[0].removeprefix('What-if: ')}", ""]
    out += [f"- {_md_escape(m)}" for m in w.messages] + ([""] if w.messages else [])
    out.append("| " + " | ".join(_HEAD) + " |")
    out.append("|" + "|".join("---:" if h in _RIGHT else "---" for h in _HEAD) + "|")
    for r in w.rows:
        cells = _cells(w, r)
        if r.ok:
            cells[-1] = ", ".join(names[m] for m in w.marks_of(r.key))
            if w.marks_of(r.key)[:1] in (("cheapest",), ("fastest",)):
                cells[0] = f"**{cells[0]}**"
        else:
            cells[2] = f"{r.status} (see notes)"
        out.append("| " + " | ".join(_md_escape(c) for c in cells) + " |")
    out.append("")
    notes = _footnotes(w)
    if notes:
        out += ["Notes:", ""] + [f"- {_md_escape(n)}" for n in notes] + [""]
    out += ["Columns:", ""] + [f"- **{h}**: {m}" for h, m in COLUMNS] + [""]
    out += ["Prices (on demand, USD per GPU-hour):", ""] + [f"- {_md_escape(p)}" for p in _price_lines(w)]
    return "\n".join(out) + "\n"


def to_json(w: WhatIf, indent: int | None = 2) -> str:
    return json.dumps(w.to_dict(), indent=indent)


# ---- verdicts ---------------------------------------------------------------------------------
def _describe(r: WhatIfRow) -> str:
    cost = f", {fmt_money(r.cost_usd)}" if r.cost_usd is not None else ", cost unknown (no price)"
    return f"{r.num_gpus} x {r.gpu} ({fmt_days(r.days)}{cost})"


def verdicts(rows: Sequence[WhatIfRow], marks: Mapping[str, Any], *, model: str, tokens: float,
             deadline_days: float | None, budget_usd: float | None, prices: Sequence[PriceSource]) -> list[str]:
    """The sentences a reader must see: what meets the deadline / budget, or that nothing does and
    the nearest options; models that fit nowhere; GPUs without a price."""
    from meshplan.reports.whatif import by_cost, by_time   # whatif imports this module: at call time
    ok = [r for r in rows if r.ok]
    out: list[str] = []
    if not ok:
        failed = [r for r in rows if not r.ok]
        biggest = max(failed, key=lambda r: r.num_gpus * (r.capacity_gb or 0.0)) if failed else None
        detail = f" The largest option, {biggest.num_gpus} x {biggest.gpu}: {biggest.reason}" if biggest else ""
        out.append(f"{model} fits on none of the {len(rows)} options.{detail} Try more GPUs, a GPU with "
                   "more memory, or a shorter sequence.")
        return out
    for p in prices:
        if p.usd_per_gpu_hour is None:
            out.append(f"No price is known for {p.gpu} ({p.source}): its cost is unknown and it is left out of "
                       f"the cost marks; give one with --price {p.gpu}=USD_PER_GPU_HOUR.")
    tok = fmt_si(tokens)
    if deadline_days is not None:
        if marks["cheapest"] is not None:
            out.append(f"Cheapest option that trains {tok} tokens within {fmt_days(deadline_days)}: "
                       f"{_describe(next(r for r in ok if r.key == marks['cheapest']))}.")
        else:
            nearest = sorted(ok, key=by_time)[:3]
            out.append(f"No option trains {tok} tokens within {fmt_days(deadline_days)}. Nearest (fastest): "
                       + "; ".join(_describe(r) for r in nearest) + ". More GPUs or faster GPUs are needed.")
    if budget_usd is not None:
        if marks["fastest"] is not None:
            out.append(f"Fastest option within {fmt_money(budget_usd)}: "
                       f"{_describe(next(r for r in ok if r.key == marks['fastest']))}.")
        else:
            priced = sorted((r for r in ok if r.cost_usd is not None), key=by_cost)[:3]
            out.append(f"No option trains {tok} tokens within {fmt_money(budget_usd)}. Nearest (cheapest): "
                       + ("; ".join(_describe(r) for r in priced) if priced else "none has a price") + ".")
    if deadline_days is not None and budget_usd is not None and marks["cheapest"] and marks["fastest"]:
        c = next(r for r in ok if r.key == marks["cheapest"])
        if c.cost_usd > budget_usd:
            out.append(f"No option meets both the {fmt_days(deadline_days)} deadline and the "
                       f"{fmt_money(budget_usd)} budget: finishing in time costs at least {fmt_money(c.cost_usd)}.")
    if deadline_days is None and budget_usd is None and marks["cheapest_overall"] and marks["fastest_overall"]:
        out.append(f"Cheapest: {_describe(next(r for r in ok if r.key == marks['cheapest_overall']))}. "
                   f"Fastest: {_describe(next(r for r in ok if r.key == marks['fastest_overall']))}.")
    return out
