"""CPU host probes of `meshplan calibrate` (gloo processes, every rank at once): the matmul rate and
the small-op time each process gets while all of them run, and the wait a small all-reduce adds
amid compute, over all the ranks and within pairs that cross. Each function is collective: every
rank of the process group calls it. The mapping onto a Cluster is calibrate.py's."""

from __future__ import annotations

import os
import statistics
import time

__all__ = ["concurrent_matmul_tflops", "concurrent_op_us", "coupled_pairs", "amid_compute_latency"]

AMID_WORK_S = 1e-3            # per-rank work before each collective of the amid-compute measurement
AMID_ITERS, AMID_ROUNDS = 40, 5   # iterations per round (at least), rounds with / without the collective
# CPU: the per-process matmul measured in every rank at once (concurrent_matmul_tflops): 512^3 bf16
# (~1.4 ms on one idle core of the local-cpu host) repeated for CPU_CONCURRENT_S seconds in every
# rank, all starting together: the rate each sustains while all of them compute
CPU_CONCURRENT_SHAPE = (512, 512, 512)
CPU_CONCURRENT_S = 1.5
CPU_OP_CHAIN = 60          # ops per chain of the small-op measurement (concurrent_op_us)


def concurrent_matmul_tflops(world: int) -> float:
    """bf16 matmul TFLOP/s of one one-thread process while every rank runs the same matmuls
    (median over ranks; collective). On a shared CPU host this is the rate a training process
    gets: a two-thread matmul in one process (the `matmul` rows) needs both cores at once and
    falls far further behind when other work shares the host (2026-11-24, 2-core VM with other
    sessions' jobs: 73 GFLOP/s over 2 threads against 421 idle)."""
    import torch
    import torch.distributed as dist
    m, n, k = CPU_CONCURRENT_SHAPE
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    a @ b
    dist.barrier()
    # sustained, not best-of: a single short matmul may find a core to itself while the others wait
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < CPU_CONCURRENT_S:
        a @ b
        count += 1
    rate = 2.0 * m * n * k * count / (time.perf_counter() - t0) / 1e12
    rates = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(rates, torch.tensor([rate], dtype=torch.float64))
    return float(statistics.median(float(r.item()) for r in rates))


def concurrent_op_us(world: int) -> float:
    """Microseconds per small autograd op in one one-thread process while every rank runs them
    (median over ranks; collective): chains of CPU_OP_CHAIN multiplies of an 8x8 tensor with
    autograd on, the measurement constants.CPU_OP_FWD_S was defined by. Host work (dispatch,
    autograd recording, allocator) is what a CPU training process spends most of its time on at
    small shapes, and it does not follow the matmul rate (host.cpu_rate_scale)."""
    import torch
    import torch.distributed as dist

    def chain() -> None:
        y = torch.randn(8, 8, requires_grad=True)
        for _ in range(CPU_OP_CHAIN):
            y = y * 1.0001

    for _ in range(20):
        chain()
    dist.barrier()
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < CPU_CONCURRENT_S:
        chain()
        count += 1
    us = (time.perf_counter() - t0) / (count * CPU_OP_CHAIN) * 1e6
    vals = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(vals, torch.tensor([us], dtype=torch.float64))
    return float(statistics.median(float(v.item()) for v in vals))


def coupled_pairs(rank: int, world: int):
    """This rank's groups in two pairings of the ranks that cross each other, as EP x DP, TP x DP
    or CP x DP pair them ((0,1)(2,3)... and (0,n/2)(1,n/2+1)...), or None where there is no second
    pairing (fewer than 4 ranks, or an odd count). Collective: every rank creates every group."""
    import torch.distributed as dist
    if world < 4 or world % 2:
        return None
    h = world // 2
    mine = []
    for ranks in [[2 * i, 2 * i + 1] for i in range(h)] + [[i, i + h] for i in range(h)]:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine.append(g)
    return mine


def amid_compute_latency(iters: int, groups=None) -> float:
    """Seconds a small all-reduce adds to an iteration of ~AMID_WORK_S of matmul work, no barrier
    between iterations (see calibrate.py's docstring); the slowest rank's median (collective).

    With `groups` (coupled_pairs), the all-reduce alternates between the rank's two pair groups:
    pairs that cross each other keep all the ranks in step, as in training, where a pair
    collective then stalls the host like a world one (each process waits for its peer to be
    scheduled again, and the others wait in theirs); pairs of one pairing alone drift out of phase
    and fill each other's waits, which training's layouts do not."""
    import torch
    import torch.distributed as dist
    a, x = torch.randn(64, 64), torch.zeros(1)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    reps = max(1, round(AMID_WORK_S / ((time.perf_counter() - t0) / 10)))

    n = max(AMID_ITERS, 4 * iters)

    def per_iteration(with_collective: bool) -> float:
        """Wall seconds per iteration beyond the process's CPU seconds packed onto the cores."""
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        for i in range(n):
            for _ in range(reps):
                a @ a
            if with_collective:
                dist.all_reduce(x, group=groups[i % 2] if groups else None)
        return (time.perf_counter() - t - (time.process_time() - c) * packing) / n

    # the collective's own CPU work (gloo's loopback syscalls and hand-offs) is host work the cost
    # model charges per collective where the runtime issues it (host.py); the latency is the wait
    # beyond it. Rounds with and without the collective alternate and the median difference is
    # kept: one round of each swung by 2x between runs on the shared host (2026-11-25).
    packing = max(1.0, dist.get_world_size() / (os.cpu_count() or 1))
    extra = max(1e-6, statistics.median(per_iteration(True) - per_iteration(False) for _ in range(AMID_ROUNDS)))
    t = torch.tensor([extra], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
