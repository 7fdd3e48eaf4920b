"""The validation benchmark runs, and its conventions hold (quick mode runs in CI too)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from meshplan.cost_models.validation import DEFAULT_CSV, load_rows, model_config, run_row, split_of

pytestmark = pytest.mark.skipif(not Path(DEFAULT_CSV).exists(), reason="shared/data/published_runs.csv not present")


def _rows():
    return {r.id: r for r in load_rows()}


def test_split_is_deterministic_and_mixed():
    """About a third of the rows fit the constants; DeepSpeed ZeRO-3 rows never do."""
    ids = [r.id for r in load_rows()]
    splits = [split_of(i) for i in ids]
    assert splits == [split_of(i) for i in ids]
    assert 0.2 < splits.count("fit") / len(splits) < 0.5


def test_megatron_row_uses_eq3_and_lands_near_measurement():
    r = _rows()["megatron-sc21-t1-145.6B"]
    res = run_row(r, traced=False)
    assert res.predicted is not None and res.fits
    assert res.layout["tp"] == 8 and res.layout["pp"] == 8 and res.layout["recompute"] == "full"
    assert res.layout["flash_attention"] is False and res.layout["sp"] is False
    assert abs(res.error) < 0.25


def test_step_time_row_compares_seconds():
    res = run_row(_rows()["korthikanti-175B-seqsel"], traced=False)
    assert res.metric == "step_time_s"
    assert math.isclose(res.predicted, res.estimate.step_time_s)
    assert abs(res.error) < 0.25


def test_rows_without_layout_are_skipped_with_reason():
    res = run_row(_rows()["opt-175b"], traced=False)
    assert res.predicted is None and res.skipped


def test_moe_row_fills_architecture_from_preset():
    cfg = model_config(_rows()["modelzoo-qwen3-235b-h100-xnode-ep"])
    assert cfg["experts"] == 128 and cfg["topk"] == 8 and cfg["head_dim"] == 128 and cfg["vocab"] > 100_000


def test_quick_benchmark_runs(capsys):
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "validate_published.py"
    spec = importlib.util.spec_from_file_location("validate_published", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--quick", "--analytic"]) == 0
    out = capsys.readouterr().out
    assert "OVERALL" in out and "predicted NOT to fit" in out


def test_deepspeed_zero3_rows_are_reported_but_never_fitted():
    rows = [r for r in load_rows() if r.family == "deepspeed-zero3"]
    assert rows and all(split_of(r.id, r.family) == "test" for r in rows)
