"""benchmarks/runtime_vs_pytorch.py runs end to end (one row, one step: CI checks the script, not
the speed; `--quick` over every row is the CI benchmark, the full table is committed)."""

from __future__ import annotations

import sys
from pathlib import Path

import procs

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "runtime_vs_pytorch.py"


def test_one_row_runs_and_prints_the_table(tmp_path):
    out = tmp_path / "table.md"
    proc = procs.run([sys.executable, str(SCRIPT), "--quick", "--rows", "one", "--steps", "1", "--out", str(out)],
                     what="benchmarks/runtime_vs_pytorch.py, one row", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "| one | tp1 cp1 pp1 dp1" in text and "eager+autocast" in text
    assert "| none |" in text           # one process: no data-parallel wrapper (no FSDP over one rank)
