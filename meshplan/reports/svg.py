"""Small plotting helpers that return inline SVG text (no dependencies, no external assets).

Four kinds: `line_plot` (series against x), `scatter_plot` (groups of points, an optional front
drawn through some of them, guide lines and ringed highlights), `stacked_bars` (vertical bars
split by category, with an optional limit line) and `hbar_stacked` (one horizontal bar split
into parts, with a legend of values). Every chart has a visible title, axis labels with units,
a legend, and tick labels thinned so that none overlap. Legends sit outside the plotting area.

Text widths are estimated (no font metrics here): CHAR_WIDTH_EM of the font size per character,
a little wider than the average sans-serif glyph so that estimates err on the side of space.
"""

from __future__ import annotations

import math
from html import escape
from typing import Callable, Mapping, Sequence

from meshplan.reports.render import fmt_si

__all__ = ["line_plot", "scatter_plot", "stacked_bars", "hbar_stacked", "PALETTE", "nice_ticks", "log_ticks",
           "text_width"]

# Okabe & Ito's colour-blind-safe palette (jfly.uni-koeln.de/color), black moved last.
# A neutral grey ninth colour keeps a 9-part step-time split distinct.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000", "#999999")
MARKERS = ("circle", "square", "triangle", "diamond")
_LIGHT = ("#E69F00", "#56B4E9", "#F0E442", "#999999")   # fills that need dark text
CHAR_WIDTH_EM = 0.6
FONT = "system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif"
TITLE_PX, LABEL_PX, TICK_PX = 15, 12, 11
Fmt = Callable[[float], str]


def text_width(text: str, size: float) -> float:
    return len(text) * size * CHAR_WIDTH_EM


def _f(x: float) -> str:
    return f"{x:.1f}".removesuffix(".0")


def _default_fmt(v: float) -> str:
    return fmt_si(v)


# ---- ticks and scales ---------------------------------------------------------------------------
def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n evenly spaced round values (1, 2, 2.5, 5 x 10^k) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step + 1e-9) * step
    ticks, v = [], start
    while v <= hi + step * 1e-6 or len(ticks) < 2:
        ticks.append(round(v, 12))
        v += step
    if ticks[-1] < hi:
        ticks.append(round(v, 12))
    return ticks


def log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten inside [lo, hi] (with 2 and 5 between them when the range is short)."""
    lo_e, hi_e = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    mults = (1, 2, 5) if math.log10(hi / lo) <= 2 else (1,)
    out = [m * 10 ** e for e in range(lo_e, hi_e + 1) for m in mults if lo <= m * 10 ** e <= hi]
    if len(out) < 2:
        out = [lo, hi]
    return out


class _Scale:
    """Maps data values in [lo, hi] to pixels in [p0, p1] (linear or log)."""

    def __init__(self, lo: float, hi: float, p0: float, p1: float, log: bool):
        if log:
            lo, hi = math.log10(lo), math.log10(hi)
        if hi == lo:
            hi = lo + 1.0
        self.lo, self.hi, self.p0, self.p1, self.log = lo, hi, p0, p1, log

    def __call__(self, v: float) -> float:
        if self.log:
            v = math.log10(max(v, 1e-300))
        return self.p0 + (v - self.lo) / (self.hi - self.lo) * (self.p1 - self.p0)


def _domain(values: Sequence[float], log: bool, ticks: Sequence[float] | None, pad: float = 0.06,
            zero: bool = False) -> tuple[float, float, list[float]]:
    vals = [v for v in values if v is not None and math.isfinite(v) and (v > 0 or not log)]
    if not vals:
        vals = [1.0, 10.0] if log else [0.0, 1.0]
    lo, hi = min(vals), max(vals)
    if log:
        if hi / lo < 1.5:
            lo, hi = lo / 1.3, hi * 1.3
        lo, hi = lo / (1 + pad) ** 2, hi * (1 + pad) ** 2
        t = list(ticks) if ticks else log_ticks(lo, hi)
        return min(lo, min(t)), max(hi, max(t)), t
    if zero:
        lo = min(0.0, lo)
    span = (hi - lo) or abs(hi) or 1.0
    lo2 = lo if (zero and lo == 0) else lo - pad * span
    t = list(ticks) if ticks else nice_ticks(lo2, hi + pad * span)
    return min(lo2, t[0]), max(hi + pad * span, t[-1]), t


def _thin(positions: list[tuple[float, str]], size: float, horizontal: bool, gap: float = 8.0) -> list[tuple[float, str]]:
    """Keep tick labels left to right, dropping any that would touch the previous one."""
    kept: list[tuple[float, str]] = []
    last_end = -math.inf
    for pos, label in sorted(positions):
        half = (text_width(label, size) if horizontal else size) / 2
        if pos - half >= last_end + gap:
            kept.append((pos, label))
            last_end = pos + half
    return kept


# ---- SVG pieces ----------------------------------------------------------------------------------
def _open(width: float, height: float, title: str) -> list[str]:
    return [f'<svg xmlns="http://www.w3.org/2000/svg" class="mp-plot" width="{_f(width)}" height="{_f(height)}" '
            f'viewBox="0 0 {_f(width)} {_f(height)}" role="img" aria-label="{escape(title)}" '
            f'font-family="{escape(FONT)}">',
            f"<title>{escape(title)}</title>",
            f'<rect x="0" y="0" width="{_f(width)}" height="{_f(height)}" fill="#ffffff"/>',
            f'<text class="mp-title" x="{_f(width / 2)}" y="22" text-anchor="middle" font-size="{TITLE_PX}" '
            f'font-weight="600" fill="#111">{escape(title)}</text>']


def _text(x: float, y: float, s: str, size: float = TICK_PX, anchor: str = "start", fill: str = "#333",
          extra: str = "", cls: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    return (f'<text{c} x="{_f(x)}" y="{_f(y)}" font-size="{size}" text-anchor="{anchor}" fill="{fill}"{extra}>'
            f"{escape(s)}</text>")


def _marker(kind: str, x: float, y: float, color: str, r: float = 4.0, tip: str = "") -> str:
    t = f"<title>{escape(tip)}</title>" if tip else ""
    style = f'fill="{color}" stroke="#fff" stroke-width="1"'
    if kind == "square":
        return f'<rect x="{_f(x - r)}" y="{_f(y - r)}" width="{_f(2 * r)}" height="{_f(2 * r)}" {style}>{t}</rect>'
    if kind == "triangle":
        pts = f"{_f(x)},{_f(y - r * 1.2)} {_f(x - r * 1.1)},{_f(y + r * 0.8)} {_f(x + r * 1.1)},{_f(y + r * 0.8)}"
        return f'<polygon points="{pts}" {style}>{t}</polygon>'
    if kind == "diamond":
        pts = f"{_f(x)},{_f(y - r * 1.3)} {_f(x + r * 1.1)},{_f(y)} {_f(x)},{_f(y + r * 1.3)} {_f(x - r * 1.1)},{_f(y)}"
        return f'<polygon points="{pts}" {style}>{t}</polygon>'
    return f'<circle cx="{_f(x)}" cy="{_f(y)}" r="{_f(r)}" {style}>{t}</circle>'


def _legend(entries: Sequence[tuple[str, str, str]], x: float, y: float) -> list[str]:
    """Entries (label, colour, kind): kind a marker name, 'line-<marker>', 'dash', 'box' or 'ring'."""
    out = ['<g class="mp-legend">']
    for i, (label, color, kind) in enumerate(entries):
        yy = y + i * 20
        if kind.startswith("line-"):    # a line with the series' marker on it
            out.append(f'<line x1="{_f(x)}" y1="{_f(yy)}" x2="{_f(x + 18)}" y2="{_f(yy)}" stroke="{color}" stroke-width="2.2"/>')
            out.append(_marker(kind.removeprefix("line-"), x + 9, yy, color, 3.5))
        elif kind == "dash":
            out.append(f'<line x1="{_f(x)}" y1="{_f(yy)}" x2="{_f(x + 18)}" y2="{_f(yy)}" stroke="{color}" '
                       'stroke-width="2" stroke-dasharray="5,3"/>')
        elif kind == "box":
            out.append(f'<rect x="{_f(x + 2)}" y="{_f(yy - 6)}" width="14" height="12" fill="{color}"/>')
        elif kind == "ring":
            out.append(f'<circle cx="{_f(x + 9)}" cy="{_f(yy)}" r="6" fill="none" stroke="{color}" stroke-width="2"/>')
        else:
            out.append(_marker(kind, x + 9, yy, color))
        out.append(_text(x + 26, yy + 4, label, LABEL_PX, cls="mp-legend-label"))
    out.append("</g>")
    return out


def _legend_width(labels: Sequence[str]) -> float:
    return (max((text_width(s, LABEL_PX) for s in labels), default=0.0) + 40) if labels else 0.0


def _axes(xs: _Scale, ys: _Scale, xticks: Sequence[float], yticks: Sequence[float], x_fmt: Fmt, y_fmt: Fmt,
          x_label: str, y_label: str, box: tuple[float, float, float, float], grid_x: bool = True) -> list[str]:
    left, top, right, bottom = box
    out = [f'<rect x="{_f(left)}" y="{_f(top)}" width="{_f(right - left)}" height="{_f(bottom - top)}" '
           'fill="#fafafa" stroke="#bbb"/>']
    for pos, lab in _thin([(ys(v), y_fmt(v)) for v in yticks if top - 0.5 <= ys(v) <= bottom + 0.5], TICK_PX, False, 4):
        out.append(f'<line x1="{_f(left)}" y1="{_f(pos)}" x2="{_f(right)}" y2="{_f(pos)}" stroke="#e3e3e3"/>')
        out.append(_text(left - 6, pos + 4, lab, anchor="end", cls="mp-tick"))
    for pos, lab in _thin([(xs(v), x_fmt(v)) for v in xticks if left - 0.5 <= xs(v) <= right + 0.5], TICK_PX, True):
        if grid_x:
            out.append(f'<line x1="{_f(pos)}" y1="{_f(top)}" x2="{_f(pos)}" y2="{_f(bottom)}" stroke="#e3e3e3"/>')
        out.append(f'<line x1="{_f(pos)}" y1="{_f(bottom)}" x2="{_f(pos)}" y2="{_f(bottom + 4)}" stroke="#777"/>')
        out.append(_text(pos, bottom + 17, lab, anchor="middle", cls="mp-tick"))
    out.append(_text((left + right) / 2, bottom + 38, x_label, LABEL_PX, "middle", "#111", cls="mp-axis-label"))
    cy = (top + bottom) / 2
    out.append(_text(16, cy, y_label, LABEL_PX, "middle", "#111", f' transform="rotate(-90 16 {_f(cy)})"',
                     cls="mp-axis-label"))
    return out


def _left_margin(yticks: Sequence[float], y_fmt: Fmt) -> float:
    return 40 + max((text_width(y_fmt(v), TICK_PX) for v in yticks), default=20.0)


# ---- charts --------------------------------------------------------------------------------------
def line_plot(series: Mapping[str, Sequence[tuple[float, float]]], *, title: str, x_label: str, y_label: str,
              log_x: bool = False, log_y: bool = False, x_ticks: Sequence[float] | None = None,
              x_fmt: Fmt | None = None, y_fmt: Fmt | None = None, y_zero: bool = False,
              width: float = 720, height: float = 380) -> str:
    """One line per series, a marker per point, legend on the right."""
    x_fmt, y_fmt = x_fmt or _default_fmt, y_fmt or _default_fmt
    xs_all = [x for pts in series.values() for x, _ in pts]
    ys_all = [y for pts in series.values() for _, y in pts]
    xlo, xhi, xt = _domain(xs_all, log_x, x_ticks, pad=0.04)
    ylo, yhi, yt = _domain(ys_all, log_y, None, zero=y_zero)
    names = list(series)
    left = _left_margin(yt, y_fmt)
    right = width - 20 - _legend_width(names)
    top, bottom = 44, height - 56
    xs, ys = _Scale(xlo, xhi, left, right, log_x), _Scale(ylo, yhi, bottom, top, log_y)
    out = _open(width, height, title) + _axes(xs, ys, xt, yt, x_fmt, y_fmt, x_label, y_label, (left, top, right, bottom))
    entries = []
    for i, name in enumerate(names):
        color, kind = PALETTE[i % len(PALETTE)], MARKERS[i % len(MARKERS)]
        pts = sorted(series[name])
        path = " ".join(f"{_f(xs(x))},{_f(ys(y))}" for x, y in pts)
        out.append(f'<g class="mp-series"><polyline points="{path}" fill="none" stroke="{color}" stroke-width="2.2"/>')
        out += [_marker(kind, xs(x), ys(y), color, tip=f"{name}: {x_fmt(x)} -> {y_fmt(y)}") for x, y in pts]
        out.append("</g>")
        entries.append((name, color, f"line-{kind}"))
    out += _legend(entries, right + 16, top + 10)
    out.append("</svg>")
    return "\n".join(out)


def _place_label(text: str, x: float, y: float, taken: list[tuple[float, float, float, float]],
                 bounds: tuple[float, float, float, float]) -> tuple[float, float, str] | None:
    """A spot next to (x, y) for `text` that overlaps no earlier label and stays in bounds."""
    w, h = text_width(text, TICK_PX), TICK_PX + 2
    for dx, dy, anchor in ((8, -6, "start"), (8, 14, "start"), (-8, -6, "end"), (-8, 14, "end"),
                           (0, -12, "middle"), (0, 20, "middle")):
        x0 = x + dx - (w if anchor == "end" else w / 2 if anchor == "middle" else 0)
        box = (x0, y + dy - h + 3, x0 + w, y + dy + 3)
        inside = bounds[0] <= box[0] and box[2] <= bounds[2] and bounds[1] <= box[1] and box[3] <= bounds[3]
        if inside and not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in taken):
            taken.append(box)
            return x + dx, y + dy, anchor
    return None


def scatter_plot(groups: Mapping[str, Sequence[tuple[float, float, str]]], *, title: str, x_label: str,
                 y_label: str, front: Sequence[tuple[float, float]] = (), front_label: str = "Pareto front",
                 highlights: Sequence[tuple[float, float, str]] = (), v_guides: Sequence[tuple[float, str]] = (),
                 h_guides: Sequence[tuple[float, str]] = (), log_x: bool = False, log_y: bool = False,
                 x_fmt: Fmt | None = None, y_fmt: Fmt | None = None, label_points: bool = True,
                 width: float = 720, height: float = 420) -> str:
    """Points by group (x, y, label); `front` is joined by a dashed line, `highlights` get a ring
    and their text, guides are dashed lines across the plot (a deadline, a budget)."""
    x_fmt, y_fmt = x_fmt or _default_fmt, y_fmt or _default_fmt
    pts_all = [(x, y) for pts in groups.values() for x, y, _ in pts]
    xlo, xhi, xt = _domain([p[0] for p in pts_all] + [v for v, _ in v_guides], log_x, None, pad=0.08)
    ylo, yhi, yt = _domain([p[1] for p in pts_all] + [v for v, _ in h_guides], log_y, None, pad=0.08)
    names = list(groups)
    legend_labels = names + ([front_label] if front else []) + [t for _, _, t in highlights]
    left = _left_margin(yt, y_fmt)
    right = width - 20 - _legend_width(legend_labels)
    top, bottom = 44, height - 56
    xs, ys = _Scale(xlo, xhi, left, right, log_x), _Scale(ylo, yhi, bottom, top, log_y)
    out = _open(width, height, title) + _axes(xs, ys, xt, yt, x_fmt, y_fmt, x_label, y_label, (left, top, right, bottom))
    taken: list[tuple[float, float, float, float]] = []
    for v, lab in v_guides:      # label at the top, right of the line
        px = xs(v)
        out.append(f'<line class="mp-guide" x1="{_f(px)}" y1="{_f(top)}" x2="{_f(px)}" y2="{_f(bottom)}" '
                   'stroke="#888" stroke-dasharray="4,4"/>')
        w_lab = text_width(lab, TICK_PX)
        x0 = px + 5 if px + 5 + w_lab <= right else px - 5 - w_lab
        out.append(_text(x0, top + 14, lab, fill="#555", cls="mp-guide-label"))
        taken.append((x0, top + 3, x0 + w_lab, top + 17))
    for v, lab in h_guides:      # label at the right end, above the line
        py = ys(v)
        out.append(f'<line class="mp-guide" x1="{_f(left)}" y1="{_f(py)}" x2="{_f(right)}" y2="{_f(py)}" '
                   'stroke="#888" stroke-dasharray="4,4"/>')
        w_lab = text_width(lab, TICK_PX)
        y0 = py - 5 if py - 5 - TICK_PX >= top else py + TICK_PX + 4
        out.append(_text(right - 6, y0, lab, anchor="end", fill="#555", cls="mp-guide-label"))
        taken.append((right - 6 - w_lab, y0 - TICK_PX, right - 6, y0 + 2))
    entries = []
    if front:
        path = " ".join(f"{_f(xs(x))},{_f(ys(y))}" for x, y in sorted(front))
        out.append(f'<polyline class="mp-front" points="{path}" fill="none" stroke="#444" stroke-width="1.6" '
                   'stroke-dasharray="6,4"/>')
    ring_colors = ("#D55E00", "#009E73", "#CC79A7")
    for i, (x, y, lab) in enumerate(highlights):
        out.append(f'<circle class="mp-highlight" cx="{_f(xs(x))}" cy="{_f(ys(y))}" r="{9 + 3 * i}" fill="none" '
                   f'stroke="{ring_colors[i % 3]}" stroke-width="2"/>')
    for i, name in enumerate(names):
        color, kind = PALETTE[i % len(PALETTE)], MARKERS[i % len(MARKERS)]
        out.append('<g class="mp-series">')
        for x, y, lab in groups[name]:
            out.append(_marker(kind, xs(x), ys(y), color, 4.5, tip=f"{lab}: {x_fmt(x)}, {y_fmt(y)}"))
        out.append("</g>")
        entries.append((name, color, kind))
    if label_points:
        on_front = {(round(x, 9), round(y, 9)) for x, y in front}
        ordered = sorted((pt for pts in groups.values() for pt in pts),
                         key=lambda p: (round(p[0], 9), round(p[1], 9)) not in on_front)
        for x, y, lab in ordered:
            spot = _place_label(lab, xs(x), ys(y), taken, (left, top, right, bottom))
            if spot:
                out.append(_text(spot[0], spot[1], lab, fill="#333", anchor=spot[2], cls="mp-point-label"))
    if front:
        entries.append((front_label, "#444", "dash"))
    entries += [(lab, ring_colors[i % 3], "ring") for i, (_, _, lab) in enumerate(highlights)]
    out += _legend(entries, right + 16, top + 10)
    out.append("</svg>")
    return "\n".join(out)


def stacked_bars(bars: Sequence[tuple[str, Mapping[str, float]]], *, title: str, x_label: str, y_label: str,
                 categories: Sequence[str] | None = None, limit: tuple[float, str] | None = None,
                 y_fmt: Fmt | None = None, width: float = 720, height: float = 380) -> str:
    """Vertical bars split by category (bottom to top in `categories` order); `limit` is a
    dashed horizontal line (a memory capacity). Bar labels are thinned so none overlap."""
    y_fmt = y_fmt or (lambda v: f"{v:g}")
    cats = list(categories) if categories else list(dict.fromkeys(c for _, d in bars for c in d))
    # colours follow the full category list, so a category keeps its colour when others are absent
    color = {c: PALETTE[j % len(PALETTE)] for j, c in enumerate(cats)}
    cats = [c for c in cats if any(d.get(c, 0.0) > 0 for _, d in bars)]
    totals = [sum(d.get(c, 0.0) for c in cats) for _, d in bars]
    ylo, yhi, yt = _domain(totals + ([limit[0]] if limit else []) + [0.0], False, None, pad=0.08, zero=True)
    left = _left_margin(yt, y_fmt)
    right = width - 20 - _legend_width(cats + ([limit[1]] if limit else []))
    top, bottom = 44, height - 56
    ys = _Scale(0.0, yhi, bottom, top, False)
    n = max(1, len(bars))
    slot = (right - left) / n
    bw = min(56.0, slot * 0.8)
    xs = _Scale(0, n, left, right, False)
    out = _open(width, height, title)
    centres = [(left + slot * (i + 0.5), lab) for i, (lab, _) in enumerate(bars)]
    out += _axes(xs, ys, [], yt, str, y_fmt, x_label, y_label, (left, top, right, bottom), grid_x=False)
    # label every k-th bar, k the smallest stride at which the widest label clears its neighbour
    widest = max((text_width(lab, TICK_PX) for _, lab in centres), default=0.0) + 8
    stride = max(1, math.ceil(widest / slot))
    for i, (cx, lab) in enumerate(centres):
        if i % stride == 0:
            out.append(_text(cx, bottom + 17, lab, anchor="middle", cls="mp-tick"))
    for i, (lab, d) in enumerate(bars):
        cx, base = left + slot * (i + 0.5), 0.0
        out.append('<g class="mp-bar">')
        for c in cats:
            v = d.get(c, 0.0)
            if v <= 0:
                continue
            y0, y1 = ys(base), ys(base + v)
            out.append(f'<rect x="{_f(cx - bw / 2)}" y="{_f(y1)}" width="{_f(bw)}" height="{_f(max(0.5, y0 - y1))}" '
                       f'fill="{color[c]}"><title>{escape(f"{lab}: {c} {y_fmt(v)}")}</title></rect>')
            base += v
        out.append("</g>")
    entries = [(c, color[c], "box") for c in cats][::-1]
    if limit:
        py = ys(limit[0])
        out.append(f'<line class="mp-limit" x1="{_f(left)}" y1="{_f(py)}" x2="{_f(right)}" y2="{_f(py)}" '
                   'stroke="#C00" stroke-width="1.8" stroke-dasharray="7,4"/>')
        entries = [(limit[1], "#C00", "dash")] + entries
    out += _legend(entries, right + 16, top + 10)
    out.append("</svg>")
    return "\n".join(out)


def hbar_stacked(parts: Mapping[str, float], *, title: str, unit: str = "s", x_label: str | None = None,
                 fmt: Fmt | None = None, width: float = 720) -> str:
    """One horizontal bar split into `parts` (zero parts dropped), with a scale underneath and a
    legend giving each part's value and share."""
    fmt = fmt or (lambda v: f"{v:.3g} {unit}")
    color = {k: PALETTE[j % len(PALETTE)] for j, k in enumerate(parts)}   # stable across charts
    items = [(k, v) for k, v in parts.items() if v > 0]
    total = sum(v for _, v in items) or 1.0
    left, right, top, bar_h = 24, width - 24, 44, 34
    ticks = nice_ticks(0, total, 6)
    xs = _Scale(0, ticks[-1], left, right, False)
    cols = max(1, min(3, int((right - left) // 230)))
    rows = math.ceil(len(items) / cols)
    axis_y = top + bar_h
    legend_y = axis_y + 62
    height = legend_y + rows * 20 + 10
    out = _open(width, height, title)
    x = 0.0
    for k, v in items:
        x0, x1 = xs(x), xs(x + v)
        out.append(f'<rect class="mp-part" x="{_f(x0)}" y="{_f(top)}" width="{_f(max(0.5, x1 - x0))}" height="{bar_h}" '
                   f'fill="{color[k]}"><title>{escape(f"{k}: {fmt(v)} ({v / total * 100:.1f}%)")}</title></rect>')
        share = f"{v / total * 100:.0f}%"
        if x1 - x0 > text_width(share, TICK_PX) + 8:
            txt = "#111" if color[k] in _LIGHT else "#fff"
            out.append(_text((x0 + x1) / 2, top + bar_h / 2 + 4, share, anchor="middle", fill=txt))
        x += v
    out.append(f'<line x1="{_f(left)}" y1="{_f(axis_y)}" x2="{_f(right)}" y2="{_f(axis_y)}" stroke="#777"/>')
    for pos, lab in _thin([(xs(t), fmt(t)) for t in ticks], TICK_PX, True):
        out.append(f'<line x1="{_f(pos)}" y1="{_f(axis_y)}" x2="{_f(pos)}" y2="{_f(axis_y + 4)}" stroke="#777"/>')
        out.append(_text(pos, axis_y + 17, lab, anchor="middle", cls="mp-tick"))
    out.append(_text((left + right) / 2, axis_y + 38, x_label or f"time per step ({unit})", LABEL_PX, "middle", "#111",
                     cls="mp-axis-label"))
    col_w = (right - left) / cols
    out.append('<g class="mp-legend">')
    for j, (k, v) in enumerate(items):
        cx, cy = left + (j % cols) * col_w, legend_y + (j // cols) * 20
        out.append(f'<rect x="{_f(cx)}" y="{_f(cy - 9)}" width="14" height="12" fill="{color[k]}"/>')
        out.append(_text(cx + 20, cy + 1, f"{k}: {fmt(v)} ({v / total * 100:.1f}%)", LABEL_PX, cls="mp-legend-label"))
    out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)
