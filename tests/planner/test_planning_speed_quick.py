"""benchmarks/planning_speed.py --quick runs end to end (its times are not judged here: the
benchmark itself judges them on a quiet machine) and prints the table and the sweep line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "planning_speed.py"


def test_quick_benchmark_prints_its_table(tmp_path):
    out = tmp_path / "speed.txt"
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    text = out.read_text()
    assert "llama3-8b@16 dgx-h100" in text and "FAILED" not in text
    assert "what-if sweep, llama3-70b, 1 GPU types x 2 counts = 2 clusters" in text and "2 of 2 planned" in text
