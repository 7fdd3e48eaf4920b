"""`meshplan calibrate`: measure this machine and write a cluster profile the cost model reads.

Measurements (one `Calibration`, kept in the profile JSON next to the cluster):
- matrix multiply throughput at a few square and transformer-like shapes, in bf16 and fp32 on
  CPU, bf16 (+ fp8 via `torch._scaled_mm` where the GPU has FP8 units) on CUDA; best of several
  timed repetitions after warm-up, CUDA timed with events and synchronised;
- streaming memory bandwidth (a large tensor `copy_`, read + write counted);
- all_reduce and all_gather over `nproc` local processes (gloo on CPU, NCCL on CUDA), reported as
  nccl-tests bus bandwidth: busbw = S/t x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather, S the
  all-reduce buffer / the all-gather output (reference/cost_models.md §7). Each size's time is the
  median over iterations of the slowest rank.

How they map onto `Cluster` / `GPUSpec` fields (docs/exports.md, "calibrate"):
- CPU (base local-cpu): the local-cpu preset's own convention (meshplan/cluster/constants.py):
  host rates divided by the process count. bf16_tflops / fp32_tflops = best matmul rate / nproc,
  the bf16 candidates including the host rate nproc one-thread processes sustain while all of
  them multiply at once (a matmul row of nproc x the per-process rate, measured inside the
  collective benchmark's processes: robust to other work on the host, which a two-thread matmul
  in one process is not - it needs both cores at the same moment), gemm_efficiency = 1 (the rate *is* the achievable peak), hbm_tb_s = copy rate / nproc,
  scaleup_gb_s = the same in GB/s, scaleup_busbw_gb_s = measured all-reduce busbw at the largest size.
- CUDA (a GPU preset as base): the datasheet peaks stay; gemm_efficiency (and fp8_gemm_efficiency)
  = best measured rate / peak (the MAMF ratio the presets use); hbm_tb_s = copy rate / HBM_EFF, so
  the cost model's achieved rate equals the measured one; scaleup_busbw_gb_s = all-reduce busbw
  (on NVLS-capable GPUs with >= NVLS_MIN_GPUS processes: nvls_busbw_gb_s = all-reduce busbw and
  scaleup_busbw_gb_s = all-gather busbw, since NVLS reduces in the switch).
- Latency: the smallest all-reduce's time t0 on n ranks is base + 2(n-1) hops (NCCL ring steps).
  On CPU, t0 is measured the way training meets it ("all_reduce_amid_compute"): each rank does
  cpu_probes.AMID_WORK_S of matmul work and then the all-reduce, with no barrier in between, and t0 is the
  iteration time minus the work alone, less the collective's own CPU work packed onto the cores
  (host work the model charges per collective, host.py: the latency is the wait beyond it). With
  more processes than cores a collective completes only when every peer has been scheduled again;
  a barrier-synchronised benchmark hides that (on the 2-core host with 4 processes: ~1.1 ms amid
  compute against ~0.3 ms idle, 2026-11-24, benchmarks/cpu_collective_sync.py), and TP / EP / CP
  / PP issue one per layer and micro-batch. With >= 4 ranks the same is measured for an
  all-reduce within pairs, alternating two pairings that cross ("pair_all_reduce_amid_compute",
  as TP x DP or EP x DP pair the ranks), and base and hop are fitted to the two points; else the
  base's base_latency_us is kept and the per-hop latency fitted (when t0 is below the base
  latency, half of t0 is taken as base and the rest spread over the hops).
- Not measured (one host cannot): the network (nic_gb_s, net_latency_us), memory capacity.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from meshplan.cluster import CLUSTER_JSON_VERSION, Cluster
from meshplan.cost_models.constants import HBM_EFF, NVLS_MIN_GPUS
from meshplan.cost_models.cpu_probes import (
    CPU_CONCURRENT_SHAPE,
    amid_compute_latency,
    concurrent_matmul_tflops,
    concurrent_op_us,
    coupled_pairs,
)
from meshplan.errors import ConfigError

__all__ = ["MatmulResult", "CollectiveResult", "Calibration", "measure", "calibrated_cluster", "calibrate",
           "run_calibration", "save_profile", "load_calibration", "base_cluster"]

CALIBRATION_VERSION = 1

# Shapes (m, n, k). Square GEMMs find the peak; (tokens x hidden) x (hidden x 4 hidden) is an MLP
# GEMM of a small transformer. CPU sizes keep --quick to a few seconds on 2 cores (2048^3 bf16 ran
# in 0.047 s on the machine of the local-cpu preset); CUDA sizes reach the MAMF plateau (stas00
# ml-engineering's mamf-finder sweeps up to ~16k; 8192^3 is within ~2% of its best on H100).
CPU_SHAPES_QUICK = ((1024, 1024, 1024), (2048, 2048, 2048))
CPU_SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (4096, 1024, 4096))
CUDA_SHAPES_QUICK = ((4096, 4096, 4096), (8192, 8192, 8192))
CUDA_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192), (8192, 4096, 14336))
# Timed repetitions after warm-up (best one kept: the achievable rate).
MATMUL_WARMUP, MATMUL_REPS_QUICK, MATMUL_REPS = 1, 3, 5
CUDA_MATMUL_WARMUP = 5     # clocks and cuBLAS heuristics settle over the first few launches
# Copy sizes: far above any cache (256 MiB is the local-cpu preset's measurement).
COPY_BYTES_QUICK, COPY_BYTES = 64 << 20, 256 << 20
CUDA_COPY_BYTES = 1 << 30
# Collective sizes (bytes of S as nccl-tests defines it). The smallest gives the latency, the
# largest the bandwidth; gloo on CPU plateaus by ~16 MiB (cpu_platform.md §2: 32 MiB in 27-40 ms).
COLL_BYTES_QUICK = (4, 1 << 20, 16 << 20)
COLL_BYTES = (4, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
CUDA_COLL_BYTES = (4, 1 << 20, 64 << 20, 512 << 20)
COLL_ITERS_QUICK, COLL_ITERS = 5, 10
COLL_WARMUP = 2
COLL_TIMEOUT_S = 300.0     # the whole multi-process measurement


@dataclass(frozen=True, kw_only=True)
class MatmulResult:
    dtype: str
    m: int
    n: int
    k: int
    seconds: float
    tflops: float


@dataclass(frozen=True, kw_only=True)
class CollectiveResult:
    op: str               # "all_reduce" | "all_gather"
    nbytes: int           # nccl-tests S
    world: int
    seconds: float
    algbw_gb_s: float
    busbw_gb_s: float


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """The raw measurements of one `meshplan calibrate` run."""

    device: str                      # "cpu" or the CUDA device name
    backend: str                     # "gloo" | "nccl" | "" (no collectives: nproc 1)
    nproc: int
    threads: int                     # torch intra-op threads used for the matmuls
    quick: bool
    matmul: tuple[MatmulResult, ...]
    copy_gb_s: float                 # streaming copy, read + write bytes per second / 1e9
    collectives: tuple[CollectiveResult, ...] = ()
    seconds: float = 0.0             # wall time of the whole measurement
    torch_version: str = ""
    host: str = ""
    date: str = ""
    cpu_op_us: float | None = None   # CPU: small-op time in every process at once (cpu_probes.concurrent_op_us)
    version: int = CALIBRATION_VERSION

    def __post_init__(self) -> None:
        if not self.matmul:
            raise ConfigError("a calibration needs at least one matmul measurement")
        if not self.copy_gb_s > 0:
            raise ConfigError(f"calibration copy_gb_s must be positive, got {self.copy_gb_s!r}")

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"

    def best_tflops(self, dtype: str) -> float | None:
        rates = [r.tflops for r in self.matmul if r.dtype == dtype]
        return max(rates) if rates else None

    def busbw_gb_s(self, op: str) -> float | None:
        """busbw at the largest measured size (the bandwidth plateau)."""
        rows = [r for r in self.collectives if r.op == op]
        return max(rows, key=lambda r: r.nbytes).busbw_gb_s if rows else None

    def small_latency_us(self, op: str = "all_reduce") -> float | None:
        rows = [r for r in self.collectives if r.op == op]
        return min(rows, key=lambda r: r.nbytes).seconds * 1e6 if rows else None

    def training_latency_us(self) -> float | None:
        """The smallest all-reduce as training meets it: amid compute where measured (CPU), else idle."""
        return self.small_latency_us("all_reduce_amid_compute") or self.small_latency_us("all_reduce")

    def pair_latency_us(self) -> float | None:
        """A small all-reduce between two ranks amid compute, pairs crossing (CPU, >= 4 ranks)."""
        return self.small_latency_us("pair_all_reduce_amid_compute")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Calibration":
        d = dict(d)
        if d.get("version") != CALIBRATION_VERSION:
            raise ConfigError(f"calibration version {d.get('version')!r} is not supported (expects "
                              f"{CALIBRATION_VERSION}); re-run meshplan calibrate")
        try:
            d["matmul"] = tuple(MatmulResult(**r) for r in d.get("matmul", ()))
            d["collectives"] = tuple(CollectiveResult(**r) for r in d.get("collectives", ()))
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"malformed calibration record: {e}") from None


# ---- measurements -----------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device != "cpu":
        import torch
        torch.cuda.synchronize()


def _time(fn: Callable[[], Any], device: str, warmup: int, reps: int) -> float:
    """Best wall time of `reps` calls after `warmup` calls (CUDA: events, synchronised)."""
    import torch
    for _ in range(warmup):
        fn()
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        if device == "cpu":
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
    return best


def _matmuls(device: str, quick: bool, fp8: bool, progress: Callable[[str], None]) -> list[MatmulResult]:
    import torch
    cpu = device == "cpu"
    shapes = (CPU_SHAPES_QUICK if quick else CPU_SHAPES) if cpu else (CUDA_SHAPES_QUICK if quick else CUDA_SHAPES)
    dtypes = ("bfloat16", "float32") if cpu else ("bfloat16",) + (("float8_e4m3fn",) if fp8 else ())
    warm = MATMUL_WARMUP if cpu else CUDA_MATMUL_WARMUP
    reps = MATMUL_REPS_QUICK if quick else MATMUL_REPS
    out = []
    gen = torch.Generator(device=device).manual_seed(0)
    for dt in dtypes:
        for m, n, k in shapes:
            if dt == "float8_e4m3fn":
                a = torch.randn(m, k, device=device, generator=gen).to(torch.float8_e4m3fn)
                b = torch.randn(n, k, device=device, generator=gen).to(torch.float8_e4m3fn).t()   # column-major
                one = torch.ones((), device=device)
                fn = lambda a=a, b=b, one=one: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            else:
                a = torch.randn(m, k, device=device, dtype=getattr(torch, dt), generator=gen)
                b = torch.randn(k, n, device=device, dtype=getattr(torch, dt), generator=gen)
                fn = lambda a=a, b=b: a @ b
            try:
                s = _time(fn, device, warm, reps)
            except (RuntimeError, NotImplementedError) as e:   # e.g. no FP8 GEMM on this GPU
                progress(f"  matmul {dt} {m}x{n}x{k}: skipped ({str(e).splitlines()[0][:80]})")
                break
            r = MatmulResult(dtype=dt, m=m, n=n, k=k, seconds=s, tflops=2.0 * m * n * k / s / 1e12)
            progress(f"  matmul {dt:>13s} {m}x{n}x{k}: {s * 1e3:8.2f} ms = {r.tflops * 1e3:9.1f} GFLOP/s")
            out.append(r)
            del a, b
    return out


def _copy_rate(device: str, quick: bool, progress: Callable[[str], None]) -> float:
    import torch
    nbytes = (COPY_BYTES_QUICK if quick else COPY_BYTES) if device == "cpu" else CUDA_COPY_BYTES
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    s = _time(lambda: dst.copy_(src), device, 1, 3 if quick else 5)
    rate = 2 * nbytes / s / 1e9   # read + write
    progress(f"  copy {nbytes >> 20} MiB: {s * 1e3:.2f} ms = {rate:.1f} GB/s (read + write)")
    return rate


def _busbw_factor(op: str, n: int) -> float:
    return 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def _collective_worker(rank: int, world: int, store: str, backend: str, sizes: tuple[int, ...], iters: int,
                       out_path: str) -> None:
    """One rank of the collective benchmark (module level: spawn pickles it by name)."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)   # one thread per rank, as in the local-cpu preset's measurement
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLL_TIMEOUT_S))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rows = []
    try:
        for op in ("all_reduce", "all_gather"):
            for nbytes in sizes:
                # float32 elements; the all-gather's S is its output, `world` equal shards
                per_rank = max(1, nbytes // 4 // world) if op == "all_gather" else max(1, nbytes // 4)
                x = torch.ones(per_rank, dtype=torch.float32, device=device)
                y = torch.empty(per_rank * world, dtype=torch.float32, device=device) if op == "all_gather" else None
                fn = (lambda: dist.all_reduce(x)) if op == "all_reduce" else (lambda: gather(y, x))
                for _ in range(COLL_WARMUP):
                    fn()
                times = []
                for _ in range(iters):
                    dist.barrier()
                    if backend == "nccl":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn()
                    if backend == "nccl":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                t = torch.tensor([statistics.median(times)], dtype=torch.float64,
                                 device=device if backend == "nccl" else "cpu")
                dist.all_reduce(t, op=dist.ReduceOp.MAX)   # the slowest rank sets the pace
                size = per_rank * 4 * (world if op == "all_gather" else 1)
                rows.append(dict(op=op, nbytes=size, world=world, seconds=float(t.item())))
        process_rate, op_us = 0.0, None
        if backend == "gloo":
            rows.append(dict(op="all_reduce_amid_compute", nbytes=4, world=world,
                             seconds=amid_compute_latency(iters)))
            pairs = coupled_pairs(rank, world)
            if pairs is not None:
                rows.append(dict(op="pair_all_reduce_amid_compute", nbytes=4, world=2,
                                 seconds=amid_compute_latency(iters, pairs)))
            process_rate = concurrent_matmul_tflops(world)
            op_us = concurrent_op_us(world)
        if rank == 0:
            Path(out_path).write_text(json.dumps({"rows": rows, "process_bf16_tflops": process_rate,
                                                  "process_op_us": op_us}))
    finally:
        dist.destroy_process_group()


def _collectives(backend: str, nproc: int, quick: bool,
                 progress: Callable[[str], None]) -> tuple[list[CollectiveResult], float]:
    import torch.multiprocessing as tmp
    sizes = CUDA_COLL_BYTES if backend == "nccl" else (COLL_BYTES_QUICK if quick else COLL_BYTES)
    iters = COLL_ITERS_QUICK if quick else COLL_ITERS
    with tempfile.TemporaryDirectory(prefix="meshplan-calibrate-") as d:
        out = os.path.join(d, "collectives.json")
        progress(f"  starting {nproc} {backend} processes ...")
        ctx = tmp.start_processes(_collective_worker, args=(nproc, os.path.join(d, "store"), backend, sizes, iters, out),
                                  nprocs=nproc, join=False, start_method="spawn")
        deadline = time.monotonic() + COLL_TIMEOUT_S
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise ConfigError(f"the {backend} collective benchmark on {nproc} processes did not finish in "
                                  f"{COLL_TIMEOUT_S:.0f} s; try --nproc 2 or --quick")
        doc = json.loads(Path(out).read_text())
    rows, process_rate = doc["rows"], float(doc.get("process_bf16_tflops") or 0.0)
    results = []
    for r in rows:
        algbw = r["nbytes"] / r["seconds"] / 1e9
        res = CollectiveResult(op=r["op"], nbytes=r["nbytes"], world=r["world"], seconds=r["seconds"],
                               algbw_gb_s=algbw, busbw_gb_s=algbw * _busbw_factor(r["op"], r["world"]))
        progress(f"  {res.op:>10s} {_human(res.nbytes):>9s} on {nproc}: {res.seconds * 1e6:10.1f} us, "
                 f"busbw {res.busbw_gb_s:7.3f} GB/s")
        results.append(res)
    if process_rate:
        progress(f"  matmul bfloat16 {'x'.join(map(str, CPU_CONCURRENT_SHAPE))} in each of {nproc} processes at once: "
                 f"{process_rate * 1e3:.1f} GFLOP/s per process")
    op_us = doc.get("process_op_us")
    if op_us:
        progress(f"  small autograd op in each of {nproc} processes at once: {op_us:.2f} us")
    return results, process_rate, op_us


def _human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def measure(*, device: str = "cpu", nproc: int = 2, quick: bool = False, fp8: bool = False,
            progress: Callable[[str], None] | None = None) -> Calibration:
    """Run the measurements on `device` ("cpu" or "cuda") with `nproc` processes for collectives."""
    import torch
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"nproc must be a positive whole number of processes, got {nproc!r}")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"calibration device {device!r}: use 'cpu' or 'cuda'")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("no CUDA device is visible here; calibrate with --base local-cpu, or run on the GPU host")
        if nproc > torch.cuda.device_count():
            raise ConfigError(f"--nproc {nproc} needs {nproc} GPUs, this host has {torch.cuda.device_count()}; "
                              f"use --nproc {torch.cuda.device_count()} or fewer")
    t0 = time.perf_counter()
    name = "cpu" if device == "cpu" else torch.cuda.get_device_name(0)
    say(f"calibrating {name} (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    matmul = _matmuls(device, quick, fp8 and device == "cuda", say)
    copy = _copy_rate(device, quick, say)
    backend = "" if nproc == 1 else ("nccl" if device == "cuda" else "gloo")
    colls, process_rate, op_us = _collectives(backend, nproc, quick, say) if backend else ([], 0.0, None)
    if process_rate and device == "cpu":
        # the host's rate as nproc one-thread processes get it all at once (cpu_probes);
        # best_tflops keeps the higher of it and the two-thread matmuls above
        m_, n_, k_ = CPU_CONCURRENT_SHAPE
        matmul.append(MatmulResult(dtype="bfloat16", m=m_, n=n_, k=k_, seconds=2.0 * m_ * n_ * k_ / (process_rate * 1e12),
                                   tflops=process_rate * nproc))
    if not backend:
        say("  nproc 1: no collectives measured; communication figures stay the base's")
    return Calibration(device=name, backend=backend, nproc=nproc, threads=torch.get_num_threads(), quick=quick,
                       matmul=tuple(matmul), copy_gb_s=copy, collectives=tuple(colls),
                       seconds=time.perf_counter() - t0, torch_version=torch.__version__,
                       host=platform.node(), date=datetime.date.today().isoformat(),
                       cpu_op_us=op_us if device == "cpu" else None)


# ---- mapping onto Cluster -----------------------------------------------------------------------------
def base_cluster(base: str | Cluster, nproc: int) -> Cluster:
    """The cluster a calibration starts from: a preset name, a cluster JSON path or a Cluster."""
    if isinstance(base, Cluster):
        return base
    if not isinstance(base, str) or not base:
        raise ConfigError(f"base must be a cluster preset name or a cluster JSON path, got {base!r}")
    if base.endswith(".json"):
        if not os.path.exists(base):
            raise ConfigError(f"base cluster file {base!r} does not exist")
        return Cluster.load(base)
    if base.strip().lower() in ("local-cpu", "local_cpu"):
        return Cluster.preset("local-cpu", nproc=nproc)
    return Cluster.preset(base)


def _fit_latency(base: Cluster, cal: Calibration) -> tuple[float, float]:
    """(base_latency_us, scaleup_latency_us) from the smallest all-reduce (see module docstring).

    With a pair all-reduce measured too (CPU, >= 4 ranks), both come from the two points: t_pair =
    base + 2 hops, t_world = base + 2(n-1) hops. On an oversubscribed host the base dominates (a
    blocked peer waits to be scheduled again whatever the group's size: 2026-11-25, 4 processes on
    2 cores, 0.7-1.2 ms for a pair against 1.1-1.2 ms for all four), which a base kept from the
    preset and the rest spread over the hops put at a fraction of that for the pairs TP, EP and CP
    use. Least squares with hops >= 0: a pair measured no faster than the world gives one base."""
    t0 = cal.training_latency_us()
    if t0 is None or cal.nproc < 2:
        return base.base_latency_us, base.scaleup_latency_us
    hops = 2 * (cal.nproc - 1)
    tp = cal.pair_latency_us()
    if tp is not None and hops > 2:
        if tp >= t0:                 # no growth with the group's size: one base fits both points
            return (tp + t0) / 2, 0.0
        hop = (t0 - tp) / (hops - 2)
        return tp - 2 * hop, hop
    if t0 > base.base_latency_us:
        return base.base_latency_us, (t0 - base.base_latency_us) / hops
    return t0 / 2, t0 / 2 / hops


def calibrated_cluster(base: Cluster, cal: Calibration) -> Cluster:
    """`base` with the measured numbers in place of its compute, memory-bandwidth and scale-up
    communication figures (pure: no measurement here)."""
    g = base.gpu
    n = cal.nproc
    bf16 = cal.best_tflops("bfloat16")
    if bf16 is None:
        raise ConfigError("the calibration has no bf16 matmul measurement")
    ar, ag = cal.busbw_gb_s("all_reduce"), cal.busbw_gb_s("all_gather")
    changes: dict[str, Any] = {}
    if cal.is_cpu:
        if g.scaleup != "loopback":
            raise ConfigError(f"a CPU calibration cannot describe {g.name}; use --base local-cpu, or calibrate "
                              f"on the {g.id} host")
        if base.gpus_per_node != n:
            raise ConfigError(f"the base cluster has {base.gpus_per_node} processes per host but {n} were "
                              f"measured; use --nproc {base.gpus_per_node} or base local-cpu")
        fp32 = cal.best_tflops("float32")
        changes.update(bf16_tflops=bf16 / n, fp32_tflops=(fp32 / n) if fp32 else g.fp32_tflops, gemm_efficiency=1.0,
                       hbm_tb_s=cal.copy_gb_s / 1000.0 / n, scaleup_gb_s=cal.copy_gb_s / n)
        if ar:
            changes["scaleup_busbw_gb_s"] = ar
        if cal.cpu_op_us:
            changes["cpu_op_us"] = cal.cpu_op_us
    else:
        changes["gemm_efficiency"] = min(1.0, bf16 / g.bf16_tflops)
        f8 = cal.best_tflops("float8_e4m3fn")
        if f8 and g.fp8_tflops:
            changes["fp8_gemm_efficiency"] = min(1.0, f8 / g.fp8_tflops)
        changes["hbm_tb_s"] = cal.copy_gb_s / 1000.0 / HBM_EFF
        if ar:
            if g.nvls_busbw_gb_s and n >= NVLS_MIN_GPUS and ag:
                changes.update(nvls_busbw_gb_s=ar, scaleup_busbw_gb_s=ag)
            else:
                changes["scaleup_busbw_gb_s"] = ar
    what = ", ".join(f"{k}={v:.4g}" for k, v in changes.items() if isinstance(v, float))
    changes["name"] = f"{g.name} (calibrated)"
    changes["sources"] = (f"meshplan calibrate {cal.date} on {cal.host or 'this host'} ({cal.device}, torch "
                          f"{cal.torch_version}, nproc {n}{', quick' if cal.quick else ''}): {what}; "
                          f"not measured, from the base: {g.sources}")
    spec = dataclasses.replace(g, **changes)
    base_lat, hop = _fit_latency(base, cal)
    return Cluster(gpu=spec, nodes=base.nodes, gpus_per_node=base.gpus_per_node, scaleup_domain=base.scaleup_domain,
                   nic_gb_s=base.nic_gb_s, net_latency_us=base.net_latency_us, scaleup_latency_us=hop,
                   base_latency_us=base_lat, memory_reserved_gb=base.memory_reserved_gb,
                   name=f"{base.name}-calibrated")


def run_calibration(base: str | Cluster = "local-cpu", nproc: int = 2, quick: bool = False, *,
                    progress: Callable[[str], None] | None = None) -> tuple[Cluster, Calibration]:
    """Measure this machine and return (calibrated cluster, raw measurements)."""
    b = base_cluster(base, nproc)
    device = "cpu" if b.gpu.scaleup == "loopback" else "cuda"
    if device == "cpu" and b.gpus_per_node != nproc:   # refuse before spending time measuring
        raise ConfigError(f"base cluster {b.name!r} has {b.gpus_per_node} processes per host but --nproc is "
                          f"{nproc}; use --nproc {b.gpus_per_node} or --base local-cpu")
    cal = measure(device=device, nproc=nproc, quick=quick, fp8=bool(b.gpu.fp8_tflops), progress=progress)
    return calibrated_cluster(b, cal), cal


def calibrate(base: str | Cluster = "local-cpu", nproc: int = 2, quick: bool = False, *,
              progress: Callable[[str], None] | None = None) -> Cluster:
    """A `Cluster` with this machine's measured throughput and bandwidths (see the module docstring)."""
    return run_calibration(base, nproc, quick, progress=progress)[0]


def save_profile(cluster: Cluster, cal: Calibration | None, path: str | os.PathLike[str]) -> None:
    """Write a cluster profile that `Cluster.load` (and so `--cluster path.json`) reads; the raw
    measurements ride along under "calibration" (Cluster.load ignores them)."""
    doc = {"version": CLUSTER_JSON_VERSION, "kind": "meshplan.Cluster", "cluster": cluster.to_dict()}
    if cal is not None:
        doc["calibration"] = cal.to_dict()
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def load_calibration(path: str | os.PathLike[str]) -> Calibration | None:
    """The raw measurements stored in a profile written by `save_profile` (None if it has none)."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not JSON: {e}") from None
    data = doc.get("calibration") if isinstance(doc, dict) else None
    return Calibration.from_dict(data) if data else None
