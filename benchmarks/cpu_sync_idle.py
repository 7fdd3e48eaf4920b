#!/usr/bin/env python
"""Idle time a blocking collective costs when processes outnumber cores.

4 one-thread gloo processes on the host's 2 cores each run a chunk of CPU work (bf16 matmuls,
~W ms of CPU) and then block in a collective: an all-reduce of one number over all 4 ranks; an
all-to-all within pairs (0,1)(2,3), as expert parallelism's dispatch alone; or the same pair
all-to-all alternating with an all-reduce within the crossing pairs (0,2)(1,3), as EP x DP, TP x DP
and CP x DP pair the ranks. The scheduler keeps both cores busy while at least two processes can
run; near a synchronisation point the last process to arrive runs alone and the other core idles.
Per iteration: wall seconds minus what the processes' CPU time fills on the cores (process CPU x
nproc / cores, the `packed` step of cpu_closing_loop.py), less the collective's own host work
measured on its own (the same loop with no work chunk, whose wall time is all collective): the
idle per synchronisation point. Reported for several W.

What it shows (benchmarks/results/cpu_sync_idle-2026-11-25.txt): pairs of one pairing alone
drift out of phase and fill each other's waits (idle ~0), but pairs that cross keep every rank in
step and stall the host like an all-reduce over all four. `meshplan calibrate` measures that wait amid compute for both
(cost_models/cpu_probes.amid_compute_latency) and fits the loopback base and hop latency to the two.

    python benchmarks/cpu_sync_idle.py [--iters 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import torchrun_json  # noqa: E402
from _report import emit  # noqa: E402

NPROC, CORES = 4, 2
WORK_MS = (0, 1, 3, 10)


def worker(kind: str, work_ms: float, iters: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    crossing = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    a = torch.randn(128, 128, dtype=torch.bfloat16)
    t0 = time.process_time()
    for _ in range(50):
        a @ a
    per_mm = (time.process_time() - t0) / 50
    n_mm = int(round(work_ms * 1e-3 / per_mm))
    one = torch.ones(1)
    send, recv = torch.ones(2), torch.empty(2)
    samples = []
    for i in range(iters):
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(n_mm):
            a @ a
        if kind == "all_reduce":
            dist.all_reduce(one)
        elif kind == "crossing" and i % 2:
            dist.all_reduce(one, group=crossing)
        else:
            dist.all_to_all_single(recv, send, group=pair)
        samples.append((time.perf_counter() - w0, time.process_time() - c0))
    samples = samples[iters // 5:]
    res = {"wall": statistics.median(s[0] for s in samples), "cpu": statistics.median(s[1] for s in samples)}
    parts: list = [None] * NPROC
    dist.all_gather_object(parts, res)
    if rank == 0:
        Path(out).write_text(json.dumps(parts))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker[0], float(args.worker[1]), int(args.worker[2]), args.worker[3])
        return 0
    lines = [f"# idle per blocking collective, {NPROC} one-thread gloo processes on {os.cpu_count()} cores, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"{'collective':22s} {'work ms':>7s} {'wall ms':>8s} {'cpu ms':>7s} {'packed ms':>9s} {'idle ms':>8s}"]
    for kind in ("all_reduce", "pair all_to_all", "pairs crossing"):
        base = None
        for w in WORK_MS:
            parts = torchrun_json(__file__, [kind.split()[-1], str(w), str(args.iters)], NPROC, f"{kind} {w} ms")
            wall = statistics.fmean(p["wall"] for p in parts)
            cpu = statistics.fmean(p["cpu"] for p in parts)
            packed = cpu * NPROC / CORES
            if base is None:            # no work: the collective alone, its wall time all its own
                base = wall - packed
            lines.append(f"{kind:22s} {w:7.0f} {wall * 1e3:8.2f} {cpu * 1e3:7.2f} {packed * 1e3:9.2f} "
                         f"{(wall - packed - base) * 1e3 if w else 0.0:8.2f}")
    return emit(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
