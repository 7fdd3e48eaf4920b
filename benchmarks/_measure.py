"""Timing pieces the CPU measurement scripts share: median process-CPU time of a call, and a
torchrun of a script's own `--worker` mode that hands back rank 0's JSON result."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def median_cpu_s(fn, *, samples: int, calls: int = 1, warmup: int = 5) -> float:
    """Median process-CPU seconds of one `fn()` call over `samples` samples of `calls` calls each
    (several calls a sample where one is too short for the clock)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(samples):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        ts.append((time.process_time() - t0) / calls)
    return statistics.median(ts)


def torchrun_json(script: str, worker_args: list[str], nproc: int, label: str):
    """Run `script --worker *worker_args OUT` on `nproc` one-thread torchrun processes; the JSON
    rank 0 wrote to OUT. Exits naming `label` and the processes' stderr if the run fails."""
    with tempfile.TemporaryDirectory() as d:
        res = Path(d) / "r.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               script, "--worker", *worker_args, str(res)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0 or not res.exists():
            raise SystemExit(f"{label} failed:\n{proc.stderr[-2000:]}")
        return json.loads(res.read_text())
