#!/usr/bin/env python
"""What a blocking collective costs CPU training processes that share too few cores.

`meshplan calibrate` measures collectives with every rank waiting in them, so it sees gloo's
latency and bandwidth. In training, a rank reaches a collective while its peers are still
computing, or descheduled: with more processes than cores, the collective completes only once
every peer has been given the core again. This measures that: `nproc` processes in groups of
`group` ranks (the TP groups of a layout), each iteration = a matmul of ~`work_ms` then a small
all_reduce in its group; the cost per collective is the iteration time minus the compute-only
iteration time, against the same all_reduce measured with the ranks idle.

    python benchmarks/cpu_collective_sync.py [--nproc 4] [--group 2] [--iters 200] [--work-ms 1.0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rank(rank: int, world: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    groups = [dist.new_group(list(range(s, s + cfg["group"]))) for s in range(0, world, cfg["group"])]
    mine = groups[rank // cfg["group"]]
    n = 64
    a = torch.randn(n, n)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    reps = max(1, int(cfg["work_ms"] * 1e-3 / ((time.perf_counter() - t0) / 20)))
    x = torch.zeros(256)

    def work():
        for _ in range(reps):
            a @ a

    def timed(fn):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(cfg["iters"]):
            fn()
        dist.barrier()
        return (time.perf_counter() - t) / cfg["iters"]

    idle = timed(lambda: dist.all_reduce(x, group=mine))
    compute = timed(work)
    both = timed(lambda: (work(), dist.all_reduce(x, group=mine)))
    return {"idle_s": idle, "compute_s": compute, "both_s": both}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--group", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--work-ms", type=float, default=1.0)
    args = ap.parse_args()
    from meshplan.train.spawn import run_ranks
    res = run_ranks(args.nproc, _rank, dict(group=args.group, iters=args.iters, work_ms=args.work_ms), timeout_s=600)
    med = {k: statistics.median(r[k] for r in res) for k in res[0]}
    sync = med["both_s"] - med["compute_s"]
    print(f"{args.nproc} processes, groups of {args.group}, ~{args.work_ms} ms of work per iteration")
    print(f"  small all_reduce, ranks idle:            {med['idle_s'] * 1e3:7.3f} ms")
    print(f"  compute alone per iteration:             {med['compute_s'] * 1e3:7.3f} ms")
    print(f"  compute + all_reduce per iteration:      {med['both_s'] * 1e3:7.3f} ms")
    print(f"  cost of the collective amid compute:     {sync * 1e3:7.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
