"""What-if sweeps: parsing, the sweep's derived columns, marks against brute force, impossible
requests, rows that do not fit, JSON / Markdown renderings and the `meshplan whatif` CLI."""

from __future__ import annotations

import io
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshplan as mp
from meshplan.cluster import GPUS, Cluster
from meshplan.errors import ConfigError, UnknownNameError
from meshplan.profiling.analytic import profile_from_config
from meshplan.reports.whatif import (LIMITERS, WhatIf, WhatIfRow, compute_marks, parse_counts,
                                     parse_duration_days, parse_money, parse_prices, parse_tokens, whatif)

SEQ, GB = 8192, 128


def _profile(name: str):
    # the analytic profile: same architecture numbers as the traced one, no torch, so sweeps are fast
    return profile_from_config(mp.models.config(name), seq_len=SEQ)


@pytest.fixture(scope="module")
def sweep() -> WhatIf:
    return whatif(_profile("llama3-8b"), tokens="1T", seq_len=SEQ, global_batch=GB, gpus=("h100-sxm", "b200"),
                  counts=(8, 16, 64), deadline_days=30, budget_usd="150k", progress=False)


# ---- parsing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,value", [("15T", 15e12), ("300B", 300e9), ("2.5e12", 2.5e12), ("800M", 8e8),
                                        ("1.5t", 1.5e12), (" 20k ", 2e4), ("1_000_000", 1e6), (3e9, 3e9)])
def test_parse_tokens(text, value):
    assert parse_tokens(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["15Q", "", "T", "abc", "-5T", "0", "15TT", "1e", None])
def test_parse_tokens_rejects(text):
    with pytest.raises(ConfigError) as e:
        parse_tokens(text)
    msg = str(e.value)
    assert repr(text) in msg and "15T" in msg and "300B" in msg   # names the bad value and the accepted forms


@pytest.mark.parametrize("text,days", [("90d", 90.0), ("36h", 1.5), ("2w", 14.0), ("7", 7.0), (12, 12.0), ("0.5d", 0.5)])
def test_parse_duration(text, days):
    assert parse_duration_days(text) == pytest.approx(days)


@pytest.mark.parametrize("text", ["90x", "d", "-3d", "0h", "ninety days"])
def test_parse_duration_rejects(text):
    with pytest.raises(ConfigError, match="90d, 36h"):
        parse_duration_days(text)


@pytest.mark.parametrize("text,usd", [("20M", 2e7), ("1.5k", 1500.0), ("$300000", 3e5), ("$1,200", 1200.0),
                                      ("$1.2B", 1.2e9), (2.5, 2.5)])
def test_parse_money(text, usd):
    assert parse_money(text) == pytest.approx(usd)


@pytest.mark.parametrize("text", ["20MM", "$", "twenty", "-5", "0", "20 EUR"])
def test_parse_money_rejects(text):
    with pytest.raises(ConfigError, match=r"20M, 1\.5k, \$300000"):
        parse_money(text)


def test_parse_counts_and_prices():
    assert parse_counts("64, 8,16,8") == (8, 16, 64)
    assert parse_counts([16, 8]) == (8, 16)
    for bad in ("8,x", "0", "", "8,-16"):
        with pytest.raises(ConfigError, match="GPU count"):
            parse_counts(bad)
    assert parse_prices(["h100-sxm=2.5", "b200=$3,h200=2.9"]) == {"h100-sxm": 2.5, "b200": 3.0, "h200": 2.9}
    assert parse_prices({"b200": "1.5"}) == {"b200": 1.5}
    with pytest.raises(ConfigError, match="gpu=usd"):
        parse_prices(["h100-sxm"])
    with pytest.raises(ConfigError, match="amount"):
        parse_prices(["h100-sxm=cheap"])


# ---- the sweep --------------------------------------------------------------------------------
def test_sweep_rows_and_derived_columns(sweep):
    assert [r.key for r in sweep.rows] == ["h100-sxm@8", "h100-sxm@16", "h100-sxm@64", "b200@8", "b200@16", "b200@64"]
    assert sweep.model == "llama3-8b" and sweep.tokens == 1e12
    for r in sweep.rows:
        assert r.ok and r.nodes * r.gpus_per_node == r.num_gpus == r.estimate["num_gpus"]
        est = mp.Estimate.from_dict(r.estimate)
        assert r.tokens_per_s == pytest.approx(est.tokens_per_s_per_gpu * r.num_gpus)
        assert r.days * 86400 * r.tokens_per_s == pytest.approx(1e12)
        assert r.gpu_hours == pytest.approx(r.num_gpus * r.days * 24)
        price = GPUS[r.gpu_id].price_usd_per_hour
        assert r.price_usd_per_gpu_hour == price and r.cost_usd == pytest.approx(r.gpu_hours * price)
        assert r.headroom_gb == pytest.approx(est.capacity_gb - est.peak_memory_gb) and r.headroom_gb >= 0
        assert r.mfu == pytest.approx(est.mfu) and 0 < r.mfu < 1
        assert set(r.limits_s) == set(LIMITERS)
        assert r.limiter in (*LIMITERS, "compute")
        if r.limiter != "compute":
            assert r.limits_s[r.limiter] == max(r.limits_s.values())
            assert r.limiter_share == pytest.approx(r.limits_s[r.limiter] / r.step_time_s)
    # more GPUs finish sooner; the same GPU count on B200 is faster than on H100
    for g in ("h100-sxm", "b200"):
        days = [sweep.row(f"{g}@{n}").days for n in (8, 16, 64)]
        assert days == sorted(days, reverse=True)
    assert sweep.row("b200@64").days < sweep.row("h100-sxm@64").days


def test_price_sources_are_shown(sweep):
    by = {p.gpu: p for p in sweep.prices}
    assert by["h100-sxm"].usd_per_gpu_hour == GPUS["h100-sxm"].price_usd_per_hour == 6.16
    assert "2026-09-20" in by["b200"].source and not by["b200"].overridden
    text = sweep.to_table()
    assert "$6.16/GPU-hour" in text and "coreweave.com/pricing read 2026-09-20" in text


def test_price_override_changes_cost_and_is_marked():
    w = whatif(_profile("llama3-8b"), tokens="1T", seq_len=SEQ, global_batch=GB, gpus="b200", counts=(8,),
               prices=["b200=2"], progress=False)
    r = w.rows[0]
    assert r.price_usd_per_gpu_hour == 2.0 and r.cost_usd == pytest.approx(2.0 * r.gpu_hours)
    assert w.prices[0].overridden and "command line" in w.prices[0].source
    with pytest.raises(ConfigError, match="not among the swept GPUs"):
        whatif(_profile("llama3-8b"), tokens="1T", seq_len=SEQ, global_batch=GB, gpus="b200", counts=(8,),
               prices={"h100-sxm": 2.0}, progress=False)


def test_progress_line_goes_to_the_given_stream():
    buf = io.StringIO()
    whatif(_profile("llama3-8b"), tokens="1T", seq_len=SEQ, global_batch=GB, gpus="b200", counts=(8, 16),
           progress=buf)
    out = buf.getvalue()
    assert out.count("\r") >= 3 and "1/2 b200 x 16" in out and "2/2 done" in out and out.endswith("\n")


def test_progress_true_writes_to_stderr(capsys):
    whatif(_profile("llama3-8b"), tokens="1T", seq_len=SEQ, global_batch=GB, gpus="b200", counts=(8,), progress=True)
    err = capsys.readouterr().err
    assert "\rwhatif [" in err and "1/1 done" in err


# ---- marks ------------------------------------------------------------------------------------
def test_marks_on_the_sweep(sweep):
    ok = [r for r in sweep.rows if r.ok]
    within_deadline = [r for r in ok if r.days <= 30]
    assert sweep.cheapest == min(within_deadline, key=lambda r: r.cost_usd).key
    within_budget = [r for r in ok if r.cost_usd <= 150e3]
    assert sweep.fastest == min(within_budget, key=lambda r: r.days).key
    assert set(sweep.pareto) == _brute_pareto(ok)
    assert sweep.chosen == sweep.cheapest and sweep.plan is not None
    assert sweep.plan.estimate.num_gpus == sweep.row(sweep.chosen).num_gpus


def _brute_pareto(rows) -> set[str]:
    """An independent formulation: a row is on the front when it is the fastest at its cost and
    faster than every strictly cheaper row."""
    out = set()
    for r in rows:
        best_cheaper = min((s.days for s in rows if s.cost_usd < r.cost_usd), default=math.inf)
        best_same = min(s.days for s in rows if s.cost_usd == r.cost_usd)
        if r.days < best_cheaper and r.days == best_same:
            out.add(r.key)
    return out


def _row(i: int, days: float, cost: float | None) -> WhatIfRow:
    return WhatIfRow(gpu=f"g{i % 3}", gpu_id="h100-sxm", num_gpus=8 * (i + 1), nodes=i + 1, gpus_per_node=8,
                     status="ok", step_time_s=1.0, tokens_per_s=1.0, mfu=0.4, days=days, gpu_hours=1.0,
                     cost_usd=cost, peak_memory_gb=1.0, capacity_gb=2.0, headroom_gb=1.0)


@settings(max_examples=150, deadline=None)
@given(pts=st.lists(st.tuples(st.integers(1, 30), st.one_of(st.none(), st.integers(1, 30))), min_size=1, max_size=12),
       deadline=st.one_of(st.none(), st.integers(1, 30)), budget=st.one_of(st.none(), st.integers(1, 30)))
def test_marks_match_brute_force(pts, deadline, budget):
    rows = [_row(i, float(d), None if c is None else float(c)) for i, (d, c) in enumerate(pts)]
    m = compute_marks(rows, deadline_days=deadline, budget_usd=budget)
    priced = [r for r in rows if r.cost_usd is not None]
    meets = [r for r in priced if deadline is None or r.days <= deadline]
    if meets:
        assert m["cheapest"] is not None
        c = next(r for r in rows if r.key == m["cheapest"])
        assert c in meets and c.cost_usd == min(r.cost_usd for r in meets)
    else:
        assert m["cheapest"] is None
    within = rows if budget is None else [r for r in priced if r.cost_usd <= budget]
    if within:
        f = next(r for r in rows if r.key == m["fastest"])
        assert f in within and f.days == min(r.days for r in within)
    else:
        assert m["fastest"] is None
    front = _brute_pareto(priced)
    assert set(m["pareto"]) == front
    costs = [next(r for r in rows if r.key == k).cost_usd for k in m["pareto"]]
    assert costs == sorted(costs)
    # on the front, cheaper always means slower
    fr = sorted((r for r in priced if r.key in front), key=lambda r: (r.cost_usd, r.days))
    assert all(a.days >= b.days for a, b in zip(fr, fr[1:]))


# ---- impossible requests and rows that do not fit ---------------------------------------------
def test_impossible_deadline_and_budget_say_so_with_the_nearest_options():
    w = whatif(_profile("llama3-8b"), tokens="1T", seq_len=SEQ, global_batch=GB, gpus="b200", counts=(8, 16),
               deadline_days="36h", budget_usd="$1000", progress=False)
    assert w.cheapest is None and w.fastest is None
    text = "\n".join(w.messages)
    assert "No option trains 1T tokens within 1.5 days" in text
    assert "Nearest (fastest): 16 x b200" in text          # the fastest overall
    assert "No option trains 1T tokens within $1k" in text
    assert "Nearest (cheapest): 8 x b200" in text           # the cheapest overall
    assert w.chosen == w.fastest_overall == "b200@16"
    for rendered in (w.to_table(), w.to_markdown(), w.to_html()):
        assert "No option trains 1T tokens within 1.5 days" in rendered


def test_deadline_and_budget_that_no_single_option_meets():
    # limits derived from the unconstrained sweep (the cost model's numbers move as it improves):
    # a deadline only the 16-GPU option meets and a budget only the cheaper 8-GPU option meets
    free = whatif(_profile("llama3-8b"), tokens="1T", seq_len=SEQ, global_batch=GB, gpus="b200", counts=(8, 16),
                  progress=False)
    r8, r16 = free.row("b200@8"), free.row("b200@16")
    assert r16.days < r8.days and r8.cost_usd < r16.cost_usd
    deadline, budget = (r16.days + r8.days) / 2, (r8.cost_usd + r16.cost_usd) / 2
    w = whatif(_profile("llama3-8b"), tokens="1T", seq_len=SEQ, global_batch=GB, gpus="b200", counts=(8, 16),
               deadline_days=deadline, budget_usd=budget, progress=False)
    assert w.cheapest == "b200@16" and w.fastest == "b200@8"
    assert any("No option meets both the" in m and "deadline and the $" in m for m in w.messages)


def test_rows_that_do_not_fit_keep_the_sweep_going():
    w = whatif(_profile("llama3-70b"), tokens="1T", seq_len=SEQ, global_batch=GB, gpus=("h100-sxm", "b200"),
               counts=(8,), progress=False)
    h100, b200 = w.rows
    assert h100.status == "does not fit" and "no layout of llama3-70b" in h100.reason and h100.days is None
    assert b200.ok and w.chosen == "b200@8"
    assert "does not fit" in w.to_table() and h100.reason in w.to_table()
    assert h100.key not in w.pareto


def test_a_model_that_fits_nowhere_is_reported():
    w = whatif(_profile("llama3-405b"), tokens="15T", seq_len=SEQ, global_batch=GB, gpus=("h100-sxm", "h200"),
               counts=(8,), deadline_days=90, progress=False)
    assert not any(r.ok for r in w.rows) and w.chosen is None and w.plan is None
    assert w.cheapest is None and w.pareto == ()
    assert "llama3-405b fits on none of the 2 options" in w.messages[0]
    assert "Try more GPUs" in w.messages[0]
    assert "fits on none" in w.to_markdown() and "<svg" not in w.to_html()


# ---- bad input ----------------------------------------------------------------------------------
def test_bad_inputs_fail_before_planning():
    prof = _profile("llama3-8b")
    kw = dict(tokens="1T", seq_len=SEQ, global_batch=GB, progress=False)
    with pytest.raises(UnknownNameError, match="h900.*known GPUs"):
        whatif(prof, gpus="h100-sxm,h900", counts=(8,), **kw)
    with pytest.raises(ConfigError, match=r"12 GPUs of b200 .*multiples of 8 \(nearest: 8 or 16\)"):
        whatif(prof, gpus="b200", counts=(8, 12), **kw)
    with pytest.raises(ConfigError, match="no FP8"):
        whatif(prof, gpus="a100-80gb", counts=(8,), precision="fp8", **kw)
    with pytest.raises(ConfigError, match="15Q"):
        whatif(prof, gpus="b200", counts=(8,), **dict(kw, tokens="15Q"))
    with pytest.raises(ConfigError, match="does not exist"):
        whatif(prof, gpus="missing.json", counts=(8,), **kw)


def test_cluster_file_is_used_as_the_node_type(tmp_path):
    calibrated = Cluster.preset("dgx-h100").replace(nic_gb_s=20.0, name="my-h100")
    path = tmp_path / "calibrated-h100.json"
    calibrated.save(path)
    w = whatif(_profile("llama3-8b"), tokens="1T", seq_len=SEQ, global_batch=GB, gpus=[str(path)], counts=(16,),
               prices="calibrated-h100=3", progress=False)
    r = w.rows[0]
    assert r.gpu == "calibrated-h100" and r.gpu_id == "h100-sxm" and r.nodes == 2
    assert r.price_usd_per_gpu_hour == 3.0
    assert w.plan.cluster["nic_gb_s"] == 20.0 and w.plan.cluster["nodes"] == 2


# ---- renderings --------------------------------------------------------------------------------
def test_json_round_trip(sweep, tmp_path):
    text = sweep.to_json()
    back = WhatIf.from_json(text)
    assert back == sweep
    d = json.loads(text)
    assert d["version"] == 1 and len(d["rows"]) == 6 and d["cheapest"] == sweep.cheapest
    assert d["rows"][0]["estimate"]["memory_by_stage"]
    with pytest.raises(ConfigError, match="not valid JSON"):
        WhatIf.from_json("{")
    with pytest.raises(ConfigError, match="names no row"):
        WhatIf.from_dict(dict(d, cheapest="b200@4096"))


def test_markdown_table(sweep):
    md = sweep.to_markdown()
    lines = md.splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith("| GPU | GPUs | layout"))
    assert lines[head + 1].startswith("|---|---:|")
    body = lines[head + 2: head + 8]
    assert len(body) == 6 and all(l.count("|") == 12 for l in body)
    b64 = next(l for l in body if "| 64 |" in l and "b200" in l)
    r = sweep.row("b200@64")
    assert f"| {r.mfu * 100:.1f}% |" in b64 and f"{r.days:.1f}" in b64
    assert "cheapest ≤ 30 days" in md and "fastest ≤ $150k" in md and "Pareto" in md
    assert "**headroom**: usable memory per GPU minus the predicted peak" in md
    assert "coreweave.com/pricing read 2026-09-20" in md


def test_terminal_table_marks_and_legend(sweep):
    text = sweep.to_table()
    line = next(l for l in text.splitlines() if l.startswith("b200") and " 64 " in l)
    assert line.rstrip().endswith("CFP") or "C" in line.split()[-1]
    assert "marks: C cheapest within 30 days, F fastest within $150k" in text


def test_public_name():
    assert mp.whatif is whatif


def test_row_validation():
    with pytest.raises(ConfigError, match="status"):
        WhatIfRow(gpu="b200", gpu_id="b200", num_gpus=8, nodes=1, gpus_per_node=8, status="maybe", reason="x")
    with pytest.raises(ConfigError, match="needs a reason"):
        WhatIfRow(gpu="b200", gpu_id="b200", num_gpus=8, nodes=1, gpus_per_node=8, status="does not fit")
    with pytest.raises(ConfigError, match="planned row needs"):
        WhatIfRow(gpu="b200", gpu_id="b200", num_gpus=8, nodes=1, gpus_per_node=8, status="ok")


# ---- the CLI ----------------------------------------------------------------------------------
def test_cli_whatif_writes_json_markdown_and_html(tmp_path, capsys):
    from meshplan.cli import main
    j, m, h = tmp_path / "w.json", tmp_path / "w.md", tmp_path / "w.html"
    rc = main(["whatif", "--model", "tiny-llama", "--tokens", "2B", "--seq-len", "256", "--global-batch", "64",
               "--gpu", "h100-sxm,b200", "--gpus", "8,16", "--deadline", "36h", "--budget", "$500",
               "--price", "h100-sxm=2.5", "--json", str(j), "--markdown", str(m), "--html", str(h), "--no-progress"])
    out = capsys.readouterr()
    assert rc == 0
    assert "GPU" in out.out and "tokens/s" in out.out and "b200" in out.out
    assert "\r" not in out.err
    w = WhatIf.from_json(j.read_text())
    assert [r.key for r in w.rows] == ["h100-sxm@8", "h100-sxm@16", "b200@8", "b200@16"]
    assert w.row("h100-sxm@8").price_usd_per_gpu_hour == 2.5 and w.deadline_days == 1.5 and w.budget_usd == 500
    assert "| GPU | GPUs |" in m.read_text()
    assert h.read_text().count("<svg ") == 5


def test_cli_whatif_bad_value_is_an_error(capsys):
    from meshplan.cli import main
    assert main(["whatif", "--tokens", "15Q", "--gpu", "b200", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "15Q" in err and "15T, 300B" in err
    assert main(["whatif", "--tokens", "1T", "--gpu", "b200", "--gpus", "12"]) == 2
    assert "multiples of 8" in capsys.readouterr().err


def test_parallel_sweep_equals_the_serial_one(sweep):
    """jobs=2 plans the points in two worker processes (reports/whatif_pool.py): the same rows, in
    the same order, and the same chosen plan as planning them here."""
    par = whatif(_profile("llama3-8b"), tokens="1T", seq_len=SEQ, global_batch=GB, gpus=("h100-sxm", "b200"),
                 counts=(8, 16, 64), deadline_days=30, budget_usd="150k", progress=False, jobs=2)
    key = lambda w: [(r.gpu, r.num_gpus, r.status, r.layout, r.step_time_s, r.peak_memory_gb) for r in w.rows]
    assert key(par) == key(sweep)
    assert par.chosen == sweep.chosen
    strip = lambda p: {k: v for k, v in p.items() if k != "notes"}       # the notes carry the search's timing
    assert strip(par.chosen_plan) == strip(sweep.chosen_plan)


def test_jobs_must_be_a_positive_whole_number():
    with pytest.raises(ConfigError, match="jobs"):
        whatif(_profile("llama3-8b"), tokens="1T", seq_len=SEQ, global_batch=GB, gpus=("h100-sxm",), counts=(8,),
               progress=False, jobs=0)
