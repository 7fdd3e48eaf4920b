"""HTML reports and their inline SVG plots: one <svg> per plot, titles, axis labels with units,
legend entries, tick labels that do not overlap, no external assets; `meshplan plan --report`."""

from __future__ import annotations

import re
from html import unescape

import pytest

import meshplan as mp
from meshplan.profiling.analytic import profile_from_config
from meshplan.reports import svg
from meshplan.reports.html import plan_report_html, write_plan_report
from meshplan.reports.whatif import whatif

SEQ = 8192


@pytest.fixture(scope="module")
def sweep():
    prof = profile_from_config(mp.models.config("llama3-8b"), seq_len=SEQ)
    return whatif(prof, tokens="1T", seq_len=SEQ, global_batch=128, gpus=("h100-sxm", "b200"), counts=(8, 16, 64),
                  deadline_days=30, budget_usd="150k", progress=False)


@pytest.fixture(scope="module")
def pipelined_plan():
    # 16 H100s for a 70B model need pipeline stages: the memory plot then has one bar per stage
    prof = profile_from_config(mp.models.config("llama3-70b"), seq_len=SEQ)
    return mp.plan(prof, mp.Cluster.preset("dgx-h100", nodes=2), seq_len=SEQ, global_batch=128)


def _svgs(text: str) -> list[str]:
    return re.findall(r"<svg .*?</svg>", text, flags=re.S)


def _texts(svg_text: str, cls: str) -> list[str]:
    return [unescape(t) for t in re.findall(rf'<text class="{cls}"[^>]*>(.*?)</text>', svg_text)]


def _tick_boxes(svg_text: str) -> list[tuple[float, float, float, float]]:
    """Bounding boxes of the tick labels, with the same width estimate the plots use."""
    out = []
    for m in re.finditer(r'<text class="mp-tick" x="([-0-9.]+)" y="([-0-9.]+)" font-size="([0-9.]+)" '
                         r'text-anchor="(\w+)"[^>]*>(.*?)</text>', svg_text):
        x, y, size, anchor, s = float(m[1]), float(m[2]), float(m[3]), m[4], unescape(m[5])
        w = svg.text_width(s, size)
        x0 = x - w if anchor == "end" else x - w / 2 if anchor == "middle" else x
        out.append((x0, y - size, x0 + w, y))
    return out


def _no_overlap(boxes) -> bool:
    return not any(a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
                   for i, a in enumerate(boxes) for b in boxes[i + 1:])


# ---- the plotting helpers ----------------------------------------------------------------------
def test_nice_and_log_ticks():
    t = svg.nice_ticks(0, 173, 5)
    assert t[0] <= 0 and t[-1] >= 173 and len(set(round(b - a, 9) for a, b in zip(t, t[1:]))) == 1
    assert svg.log_ticks(900, 20000) == [1000, 2000, 5000, 10000, 20000]
    assert svg.log_ticks(1, 1e6) == [1, 10, 100, 1000, 10000, 100000, 1000000]


def test_line_plot_has_title_axes_legend_and_escapes():
    out = svg.line_plot({"a<b": [(1, 2), (2, 4)], "c": [(1, 1), (2, 3)]}, title="T & t", x_label="GPUs",
                        y_label="tokens/s")
    assert out.startswith("<svg ") and out.count("<svg ") == 1 and out.endswith("</svg>")
    assert "<title>T &amp; t</title>" in out and _texts(out, "mp-title") == ["T & t"]
    assert _texts(out, "mp-axis-label") == ["GPUs", "tokens/s"]
    assert _texts(out, "mp-legend-label") == ["a<b", "c"]
    assert "a<b" not in out                   # escaped everywhere
    assert _no_overlap(_tick_boxes(out))


def test_many_bars_thin_their_labels():
    bars = [(str(i), {"weights": 1.0 + i % 3, "activations": 2.0}) for i in range(128)]
    out = svg.stacked_bars(bars, title="m", x_label="stage", y_label="GB", limit=(6.0, "usable 6 GB"))
    assert out.count('class="mp-bar"') == 128
    boxes = _tick_boxes(out)
    assert 4 <= len(boxes) < 128 and _no_overlap(boxes)
    assert _texts(out, "mp-legend-label") == ["usable 6 GB", "activations", "weights"]


def test_scatter_labels_do_not_overlap():
    pts = {"x": [(1e6 + (i % 6) * 1e3, 10 + (i // 6) * 0.01, f"point{i}") for i in range(36)]}   # a tight cluster
    out = svg.scatter_plot(pts, title="s", x_label="cost (USD)", y_label="days", front=[(1e6, 10)],
                           h_guides=[(10.5, "deadline")], v_guides=[(1.1e6, "budget")])
    labels = [m for m in re.finditer(r'<text class="mp-point-label" x="([-0-9.]+)" y="([-0-9.]+)"[^>]*'
                                     r'text-anchor="(\w+)"[^>]*>(.*?)</text>', out)]
    boxes = []
    for m in labels:
        x, y, anchor, s = float(m[1]), float(m[2]), m[3], m[4]
        w = svg.text_width(s, svg.TICK_PX)
        x0 = x - w if anchor == "end" else x - w / 2 if anchor == "middle" else x
        boxes.append((x0, y - svg.TICK_PX, x0 + w, y))
    assert 0 < len(boxes) < 36 and _no_overlap(boxes)      # crowded labels are dropped, never stacked
    assert "Pareto front" in _texts(out, "mp-legend-label")
    assert _texts(out, "mp-guide-label") == ["budget", "deadline"]


# ---- the what-if report --------------------------------------------------------------------------
def test_whatif_html_has_one_svg_per_plot(sweep):
    html = sweep.to_html()
    plots = _svgs(html)
    titles = [_texts(p, "mp-title")[0] for p in plots]
    assert len(plots) == html.count("<svg ") == 5
    assert titles[:3] == ["Training throughput against GPU count", "Model FLOPs utilisation against GPU count",
                          "Time to train against cost (labels: GPU count)"]
    assert titles[3].startswith("Memory per GPU by pipeline stage") and titles[4].startswith("Step time split")
    axes = [_texts(p, "mp-axis-label") for p in plots]
    assert axes[0] == ["GPUs (log scale)", "throughput (tokens/s)"]
    assert axes[1] == ["GPUs (log scale)", "MFU (% of dense BF16 peak)"]
    assert axes[2][0].startswith("cost (USD") and axes[2][1].startswith("time to train (days)")
    assert axes[3] == ["all GPUs (pp = 1)", "memory per GPU (GB)"]
    assert axes[4] == ["time per training step"]
    legends = [_texts(p, "mp-legend-label") for p in plots]
    assert legends[0] == legends[1] == ["h100-sxm", "b200"]
    assert legends[2][:3] == ["h100-sxm", "b200", "Pareto front"] and "cheapest ≤ 30 days" in legends[2]
    assert legends[3][0].startswith("usable ") and {"weights", "gradients", "optimizer", "activations"} <= set(legends[3])
    assert any(l.startswith("compute: ") for l in legends[4])
    for p in plots:
        assert _no_overlap(_tick_boxes(p))


def test_whatif_html_is_self_contained_and_complete(sweep):
    html = sweep.to_html()
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert not re.search(r"<(script|link|img|iframe)\b", html)
    assert set(re.findall(r"https?://[^\s\"'<]+", html)) <= {"http://www.w3.org/2000/svg"}
    for r in sweep.rows:
        assert f"<td>{r.gpu}</td><td class=num>{r.num_gpus}</td>" in html
    assert "cheapest ≤ 30 days" in html and "Pareto" in html
    assert "CoreWeave HGX B200 $68.80/8" in html                     # the price source
    assert "Chosen option: 64 x b200" in html and "Predicted step" in html   # the plan's explain()
    for m in sweep.messages:
        assert m.replace("'", "&#x27;") in html


def test_does_not_fit_rows_in_html():
    prof = profile_from_config(mp.models.config("llama3-70b"), seq_len=SEQ)
    w = whatif(prof, tokens="1T", seq_len=SEQ, global_batch=128, gpus=("h100-sxm", "b200"), counts=(8,), progress=False)
    html = w.to_html()
    assert '<tr class="nofit">' in html and "<b>does not fit</b>" in html
    assert "Why some options have no plan" in html


# ---- the single-plan report ------------------------------------------------------------------------
def test_plan_report_per_stage_memory_and_step_split(pipelined_plan, tmp_path):
    est = pipelined_plan.estimate
    assert pipelined_plan.layout.pp > 1
    path = tmp_path / "plan.html"
    write_plan_report(pipelined_plan, path)
    html = path.read_text()
    assert html == plan_report_html(pipelined_plan)
    plots = _svgs(html)
    assert len(plots) == 2
    mem, step = plots
    assert mem.count('class="mp-bar"') == len(est.memory_by_stage) == pipelined_plan.layout.pp
    assert _texts(mem, "mp-axis-label") == ["pipeline stage (rank)", "memory per GPU (GB)"]
    assert f"usable {est.capacity_gb:.1f} GB of 80 GB" in _texts(mem, "mp-legend-label")
    parts = _texts(step, "mp-legend-label")
    assert any(p.startswith("compute: ") for p in parts)
    if est.time_s["bubble"] > 0:
        assert any(p.startswith("pipeline bubble: ") for p in parts)
    assert "Explanation" in html and unescape(html).count(pipelined_plan.explain()) == 1
    assert "<th>setting</th>" in html and f"pp={pipelined_plan.layout.pp}" in html


def test_cli_plan_report_writes_html(tmp_path, capsys):
    from meshplan.cli import main
    path = tmp_path / "p.html"
    rc = main(["plan", "--model", "tiny-llama", "--seq-len", "256", "--global-batch", "16", "--nodes", "1",
               "--report", str(path)])
    assert rc == 0 and path.exists()
    html = path.read_text()
    assert html.count("<svg ") == 2 and "meshplan plan: tiny-llama on 8 x h100-sxm" in html
    assert "report written to" in capsys.readouterr().err
