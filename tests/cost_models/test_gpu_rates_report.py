"""benchmarks/gpu_rates.py: its measuring parts run on CPU (`--dry-run`, what CI can check), and its
report prices every measured attention call and GEMM of the shipped H200 results with the cost model
for the GPU the numbers came from."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_rates-2026-11-27-h200.json"


def _module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("gpu_rates")
    finally:
        sys.path.pop(0)


def test_dry_run_measures_every_part_it_can_on_cpu(tmp_path):
    gr = _module()
    assert gr.main(["--dry-run", "--out-dir", str(tmp_path), "--parts", "ceilings,attention,cp,gemm"]) == 0
    res = json.loads(next(tmp_path.glob("gpu_rates-*-cpu-dry.json")).read_text())
    flash = [r for r in res["attention"] if r["backend"] == "flash"]
    assert flash and all(r["fwd_s"] > 0 and r["bwd_s"] > 0 for r in flash)
    assert any("error" in r for r in res["attention"] if r["backend"] == "cudnn")   # no cuDNN on CPU: reported
    assert {r["variant"] for r in res["gemm"]} >= {"bf16", "tensorwise", "rowwise"}


def test_report_prices_the_measured_calls_on_their_gpu(tmp_path):
    gr = _module()
    path = tmp_path / RESULTS.name
    shutil.copy(RESULTS, path)
    assert gr.main(["--report", str(path)]) == 0
    md = path.with_suffix(".md").read_text()
    assert "cost model for h200" in md
    rows = [line.split(" | ") for line in md.splitlines() if line.startswith(("| flash |", "| cudnn |"))]
    attention = [r for r in rows if len(r) == 11]
    assert len(attention) == 52                # 2 head dims x 2 masks x 6 lengths x 2 kernels + 4 long calls
    for r in attention:                       # fwd, pred fwd, bwd, pred bwd: all numbers, the model within 2x
        meas_f, pred_f, meas_b, pred_b = (float(r[i]) for i in (5, 6, 7, 8))
        assert 0.5 < pred_f / meas_f < 2 and 0.5 < pred_b / meas_b < 2, r
