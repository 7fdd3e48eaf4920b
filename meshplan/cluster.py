"""GPUs and clusters: the hardware facts the cost model reads.

A `GPUSpec` is one accelerator: dense peaks, memory, measured GEMM efficiency, its scale-up
fabric (NVSwitch, xGMI, PCIe, loopback) with a measured all-reduce bus bandwidth, its typical NIC,
power and price. A `Cluster` is `nodes` x `gpus_per_node` of one GPU plus the few numbers that
depend on the deployment (scale-up domain size, achieved NIC bandwidth, latencies, memory reserve).

Every figure comes from ../shared/data/hardware.csv (columns named in the comments) or
reference/cost_models.md; figures the CSV lacks are derived and marked "estimate" with the
reasoning. Bandwidths follow the nccl-tests definitions (busbw, GB/s = 1e9 B/s); TFLOPS are dense.

Rank order is node-major: consecutive ranks share a node, and a scale-up domain is a block of
`scaleup_domain` consecutive ranks (one HGX node, or 18 GB200 trays of 4 in an NVL72 rack).
`Cluster.placement` answers how a communicator of a given shape falls onto those domains.

Importing this module is cheap: no torch, no measurements; the local-cpu numbers are constants
measured once and written down below.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from meshplan.errors import ConfigError, LayoutError, UnknownNameError

__all__ = [
    "GPUSpec", "Cluster", "GPUS", "PRESETS", "gpu", "cpu_gpu_spec",
    "SCALEUP_KINDS", "CLUSTER_JSON_VERSION",
]

CLUSTER_JSON_VERSION = 1
SCALEUP_KINDS = ("nvswitch", "xgmi", "pcie", "nvlink-bridge", "loopback")

# ---- collective latencies (microseconds) ------------------------------------------------------
# NCCL's own cost model, Ring algorithm, Simple protocol (NVIDIA/nccl src/graph/tuning.cc;
# cost_models.md §7): base per collective, per hop over NVLink / PCIe / the network.
NCCL_BASE_LATENCY_US = 8.4
NCCL_NVLINK_HOP_US = 3.4
NCCL_PCIE_HOP_US = 5.7
NCCL_NET_HOP_US = 14.0
# RCCL's table for the same model (ROCm/rccl src/graph/tuning.cc, Ring/Simple): a higher base,
# a slightly cheaper xGMI hop. The network hop stays NCCL's: it is the same InfiniBand.
RCCL_BASE_LATENCY_US = 27.9
RCCL_XGMI_HOP_US = 2.7

# ---- memory the training process cannot use ----------------------------------------------------
# The CUDA context appears on the first CUDA call: 723 MiB on a PyTorch process
# (discuss.pytorch.org "What is the reason for pytorch's GPU memory floor").
CUDA_CONTEXT_GB = 0.75
# Estimate: NCCL communicators allocate per-channel, per-peer staging buffers (NCCL_BUFFSIZE 4 MiB
# each); a 3-D/4-D layout opens several communicators, which adds up to about 1 GB.
NCCL_BUFFERS_GB = 1.0
# Estimate: the PyTorch caching allocator's reserved-but-unallocated memory at peak, a few % of HBM
# in long training runs. 2% is the largest value for which every published layout in
# data/published_runs.csv still fits by meshplan's memory model (benchmarks/validate_published.py).
ALLOCATOR_FRAGMENTATION_FRAC = 0.02

# ---- achieved network bandwidth per NIC (GB/s, nccl-tests busbw) -------------------------------
NDR400_BUSBW_GB_S = 47.0    # NDR 400 Gb/s: 46-48 GB/s (nccl-tests #290; hardware.csv), midpoint
EDR100_BUSBW_GB_S = 12.2    # 100 Gb/s: 12.2 GB/s (nccl-tests #29)
HDR200_BUSBW_GB_S = 2 * EDR100_BUSBW_GB_S   # hardware.csv A100 row: "~24 (derived: 2x the 12.2)"

# PCIe cards run power-limited clocks: A100 PCIe reaches 81.1 % of peak in the MAMF table where
# A100 SXM reaches 86.9 % (stas00/ml-engineering compute/accelerator/README.md). Used to estimate
# the GEMM efficiency of PCIe parts that have no MAMF entry (H100 PCIe, L40S).
PCIE_MAMF_PENALTY = 81.1 / 86.9

# ---- this machine, for local-cpu (measured 2026-11-22, 2-core AMD EPYC VM, torch 2.13.0 CPU) -----
# 2048^3 matmul, best of 3, torch.set_num_threads(2): fp32 0.106 s = 161 GFLOP/s,
# bf16 0.047 s = 362 GFLOP/s (1 thread: 82 / 188 GFLOP/s). cpu_platform.md §9 agrees at 4096^3
# (fp32 0.89 s = 154, bf16 0.40 s = 344 GFLOP/s). Processes share the host, so each gets 1/nproc.
CPU_HOST_FP32_TFLOPS = 0.161
CPU_HOST_BF16_TFLOPS = 0.362
# 256 MiB tensor copy_, 2 threads: 44 GB/s counting read + write.
CPU_HOST_MEM_TB_S = 0.044
# gloo all_reduce over loopback, one thread per rank, measured with world 2 and 4 on this machine:
# 32 MiB took 34-40 ms (world 2) and 76-87 ms (world 4), i.e. busbw 0.84-0.99 and 0.58-0.66 GB/s.
# cpu_platform.md §2 saw 27 ms on a quieter run. The reduction is CPU work shared by all ranks, so
# the host moves a roughly constant ~2.3 GB/s of busbw in total and each rank gets 1/nproc of it.
CPU_HOST_LOOPBACK_BUSBW_GB_S = 2.3
# A 4-byte all_reduce took 0.33-0.95 ms (world 2) and 1.1-2.2 ms (world 4): about 100 us of fixed
# cost plus ~175 us per ring hop (2(n-1) hops).
CPU_LOOPBACK_BASE_US = 100.0
CPU_LOOPBACK_HOP_US = 175.0
# Estimate: gloo between hosts over TCP, per hop (kernel network stack + gloo's own pair protocol).
CPU_NET_HOP_US = 250.0
# Estimate: gloo across hosts over 10 Gb Ethernet (1.25 GB/s line rate, ~90 % achieved), shared by
# the processes of a host.
CPU_NIC_GBIT = 10.0
CPU_NIC_BUSBW_GB_S = 1.1
# Resident memory of a gloo rank after `import torch` + init_process_group: 258 MB (measured).
CPU_PROCESS_RESERVED_GB = 0.3
# Used when os.sysconf cannot report physical memory (non-POSIX hosts).
FALLBACK_HOST_RAM_GB = 16.0


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """One accelerator. Peaks are dense; bandwidths in GB/s, unidirectional unless named busbw."""

    id: str                    # "h100-sxm"
    name: str                  # "NVIDIA H100 SXM5 80GB"
    bf16_tflops: float         # dense peak
    fp8_tflops: float | None   # dense peak; None = no FP8 units
    hbm_gb: float
    hbm_tb_s: float
    gemm_efficiency: float     # achieved large BF16 GEMM / bf16 peak (MAMF / peak)
    fp8_gemm_efficiency: float | None   # achieved FP8 GEMM / fp8 peak
    scaleup: str               # one of SCALEUP_KINDS
    scaleup_gb_s: float        # unidirectional line rate per GPU
    scaleup_domain: int        # GPUs per scale-up domain
    scaleup_busbw_gb_s: float  # achieved ring all-reduce busbw across a full domain
    nvls_busbw_gb_s: float | None   # NVLS in-switch reduction busbw, full domain; None = unsupported
    per_peer_gb_s: float | None     # full-mesh fabrics (xGMI): one GPU pair; None for switched ones
    nic_gbit: float            # typical NIC line rate per GPU (Gbit/s)
    nic_busbw_gb_s: float      # achieved busbw per NIC in NCCL (GB/s)
    tdp_w: float | None
    price_usd_per_hour: float | None   # on-demand, per GPU
    price_source: str = field(repr=False)
    sources: str = field(repr=False)
    # Beyond the cost model's core set:
    node_gpus: int = 8         # GPUs per server / tray as usually deployed (default gpus_per_node);
                               # scaleup_domain > node_gpus means the fabric spans nodes (NVL72)
    fp32_tflops: float | None = None   # dense FP32 matmul rate where recorded (CPU), else None
    # Collectives run beside compute (NCCL on SMs / copy engines while kernels run), so the cost
    # model may hide them behind it. False for CPU processes: gloo reduces on the same cores that
    # compute, and with every core busy nothing runs concurrently.
    comm_overlap: bool = True

    def __post_init__(self) -> None:
        where = f"GPU {self.id!r}"
        if not isinstance(self.id, str) or not self.id:
            raise ConfigError("a GPUSpec needs a non-empty string id, e.g. 'h100-sxm'")
        if self.scaleup not in SCALEUP_KINDS:
            raise ConfigError(f"{where}: scaleup {self.scaleup!r} is not one of {', '.join(SCALEUP_KINDS)}")
        for name in ("scaleup_domain", "node_gpus"):
            _check_int(where, name, getattr(self, name))
        for name in ("bf16_tflops", "hbm_gb", "hbm_tb_s", "scaleup_gb_s", "scaleup_busbw_gb_s",
                     "nic_gbit", "nic_busbw_gb_s"):
            _check_positive(where, name, getattr(self, name))
        for name in ("fp8_tflops", "nvls_busbw_gb_s", "per_peer_gb_s", "tdp_w", "fp32_tflops"):
            if getattr(self, name) is not None:
                _check_positive(where, name, getattr(self, name))
        if self.price_usd_per_hour is not None:
            _check_positive(where, "price_usd_per_hour", self.price_usd_per_hour, allow_zero=True)
        for name in ("gemm_efficiency", "fp8_gemm_efficiency"):
            value = getattr(self, name)
            required = name == "gemm_efficiency"
            if (required or value is not None) and not (
                    isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1):
                raise ConfigError(f"{where}: {name} must be a fraction in (0, 1], got {value!r}")
        if not isinstance(self.comm_overlap, bool):
            raise ConfigError(f"{where}: comm_overlap must be true or false, got {self.comm_overlap!r}")
        if (self.fp8_tflops is None) != (self.fp8_gemm_efficiency is None):
            raise ConfigError(f"{where}: give both fp8_tflops and fp8_gemm_efficiency, or neither "
                              "(None means the GPU has no FP8 units)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPUSpec:
        return _build(cls, data, "GPU spec")


def _check_int(where: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {name} must be a positive whole number, got {value!r}")


def _check_positive(where: str, name: str, value: Any, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{where}: {name} must be a {'non-negative' if allow_zero else 'positive'} "
                          f"number, got {value!r}")


def _build(cls: type, data: Any, what: str) -> Any:
    """cls(**data) with unknown / missing keys reported as ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must be a JSON object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{what} has unknown fields {unknown}; known fields: {', '.join(sorted(names))}")
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = sorted(required - set(data))
    if missing:
        raise ConfigError(f"{what} is missing fields {missing}")
    return cls(**data)


# ---- the GPU table ------------------------------------------------------------------------------
_ML_ENG_SPECS = "stas00/ml-engineering compute/accelerator/README.md (TFLOPS + memory tables)"
_MAMF = "stas00/ml-engineering compute/accelerator/README.md (Maximum Achievable Matmul FLOPS table)"
_CW = "coreweave.com/pricing read 2026-09-20 via api-evangelist/coreweave"
_LAMBDA = "lambda.ai/instances read 2026-09-20 via api-evangelist/lambda-labs"

# H100-class NVLink4 + NVSwitch all-reduce busbw on 8 GPUs (nccl #1455, nccl-tests #212).
_H100_RING_BUSBW = 370.0
_H100_NVLS_BUSBW = 480.0
# H800 is an H100 SXM with NVLink cut to 400 GB/s bidirectional = 200 unidirectional per GPU
# (H100: 900 / 450). Achieved busbw scales with line rate: 370 x 200/450 = 164 GB/s ring, which
# matches the ~160 GB/s NVLink DeepSeek-V3 report for their H800s (arXiv 2412.19437 §3.2.2).
_H800_LINK_RATIO = 200.0 / 450.0
# B200/GB200 NVLink5 busbw is not measured in any stored source. The 8x B300 proxy (nccl #2140:
# 695 ring / 845 NVLS) has the same 900 GB/s NVLink5 line rate, so the scale factor is 900/900 = 1.
_BLACKWELL_LINK_RATIO = 900.0 / 900.0
# 8x H100 PCIe (no NVSwitch) all-reduce: 35-45 GB/s busbw (hardware.csv, alayanew nccl-tests blog).
_H100_PCIE_BUSBW = 40.0

_GPU_LIST: tuple[GPUSpec, ...] = (
    GPUSpec(
        id="a100-40gb", name="NVIDIA A100 SXM4 40GB",
        bf16_tflops=312.0, fp8_tflops=None, hbm_gb=40.0, hbm_tb_s=1.555,
        gemm_efficiency=271.2 / 312.0, fp8_gemm_efficiency=None,   # MAMF 271.2 (A100 SXM)
        scaleup="nvswitch", scaleup_gb_s=300.0, scaleup_domain=8,
        scaleup_busbw_gb_s=240.0,         # "230-250 (8 GPUs)": midpoint
        nvls_busbw_gb_s=None,             # NVSwitch gen2 has no in-switch reduction
        per_peer_gb_s=None, nic_gbit=200.0, nic_busbw_gb_s=HDR200_BUSBW_GB_S,
        tdp_w=400.0, price_usd_per_hour=1.99, price_source=f"Lambda 8x A100 SXM 40GB ({_LAMBDA})",
        sources=f"{_ML_ENG_SPECS}; {_MAMF}; ml-engineering network/README.md; nccl-tests #29",
    ),
    GPUSpec(
        id="a100-80gb", name="NVIDIA A100 SXM4 80GB",
        bf16_tflops=312.0, fp8_tflops=None, hbm_gb=80.0, hbm_tb_s=2.039,
        gemm_efficiency=271.2 / 312.0, fp8_gemm_efficiency=None,
        scaleup="nvswitch", scaleup_gb_s=300.0, scaleup_domain=8,
        scaleup_busbw_gb_s=240.0, nvls_busbw_gb_s=None, per_peer_gb_s=None,
        nic_gbit=200.0, nic_busbw_gb_s=HDR200_BUSBW_GB_S,   # DGX A100: 8x 200Gb HDR per node
        tdp_w=400.0, price_usd_per_hour=2.7, price_source=f"CoreWeave A100 $21.60/8 ({_CW})",
        sources=f"{_ML_ENG_SPECS}; {_MAMF}; ml-engineering network/README.md; nccl-tests #29",
    ),
    GPUSpec(
        id="h100-sxm", name="NVIDIA H100 SXM5 80GB",
        bf16_tflops=989.0, fp8_tflops=1979.0, hbm_gb=80.0, hbm_tb_s=3.35,
        gemm_efficiency=794.5 / 989.0, fp8_gemm_efficiency=1402.6 / 1979.0,
        scaleup="nvswitch", scaleup_gb_s=450.0, scaleup_domain=8,
        scaleup_busbw_gb_s=_H100_RING_BUSBW, nvls_busbw_gb_s=_H100_NVLS_BUSBW, per_peer_gb_s=None,
        nic_gbit=400.0, nic_busbw_gb_s=NDR400_BUSBW_GB_S,
        tdp_w=700.0, price_usd_per_hour=6.16, price_source=f"CoreWeave HGX H100 $49.24/8 ({_CW})",
        sources=f"{_ML_ENG_SPECS}; {_MAMF}; nccl #1455, nccl-tests #212, nccl-tests #290",
    ),
    GPUSpec(
        id="h100-pcie", name="NVIDIA H100 PCIe 80GB",
        bf16_tflops=756.0, fp8_tflops=1513.0, hbm_gb=80.0, hbm_tb_s=2.0,
        # estimate: no MAMF entry; H100 SXM efficiency x the PCIe penalty seen on A100
        gemm_efficiency=794.5 / 989.0 * PCIE_MAMF_PENALTY,
        fp8_gemm_efficiency=1402.6 / 1979.0 * PCIE_MAMF_PENALTY,
        # The CSV's scale-up domain is 1 (no NVLink without a bridge). We model the server's PCIe
        # tree as the domain instead: GPUs of one 8-GPU box all-reduce at a measured 35-45 GB/s
        # without touching the NIC, which a domain of 1 would wrongly send over the network.
        scaleup="pcie", scaleup_gb_s=63.0, scaleup_domain=8,
        scaleup_busbw_gb_s=_H100_PCIE_BUSBW, nvls_busbw_gb_s=None, per_peer_gb_s=None,
        # estimate: the CSV says "deployment-specific"; one 200G NIC per GPU, as on A100 HGX
        nic_gbit=200.0, nic_busbw_gb_s=HDR200_BUSBW_GB_S,
        tdp_w=350.0, price_usd_per_hour=3.29, price_source=f"Lambda 1x H100 PCIe ({_LAMBDA})",
        sources=f"{_ML_ENG_SPECS}; ml-engineering network/README.md (PCIe5 63 GB/s); NVIDIA "
                "PB-11133-001 (350 W); docs.alayanew.com nccl-tests blog (35-45 GB/s busbw)",
    ),
    GPUSpec(
        id="h800", name="NVIDIA H800 SXM5 80GB",
        bf16_tflops=989.0, fp8_tflops=1979.0, hbm_gb=80.0, hbm_tb_s=3.35,   # H100 SXM silicon
        gemm_efficiency=794.5 / 989.0, fp8_gemm_efficiency=1402.6 / 1979.0,
        scaleup="nvswitch", scaleup_gb_s=450.0 * _H800_LINK_RATIO, scaleup_domain=8,
        scaleup_busbw_gb_s=_H100_RING_BUSBW * _H800_LINK_RATIO,   # estimate, see _H800_LINK_RATIO
        nvls_busbw_gb_s=_H100_NVLS_BUSBW * _H800_LINK_RATIO,      # estimate, same scaling
        per_peer_gb_s=None,
        # DeepSeek-V3's H800 cluster: one 400G IB NIC per GPU, ~50 GB/s achieved (§3.2.2)
        nic_gbit=400.0, nic_busbw_gb_s=NDR400_BUSBW_GB_S,
        tdp_w=700.0, price_usd_per_hour=None, price_source="no on-demand list price (export-market part)",
        sources=f"{_ML_ENG_SPECS} (H100 SXM); NVIDIA H800 spec (NVLink 400 GB/s); DeepSeek-V3 "
                "report arXiv 2412.19437 §3.2.2 (NVLink 160 GB/s, IB 50 GB/s)",
    ),
    GPUSpec(
        id="h200", name="NVIDIA H200 SXM 141GB",
        bf16_tflops=989.0, fp8_tflops=1979.0, hbm_gb=141.0, hbm_tb_s=4.8,
        gemm_efficiency=794.5 / 989.0,    # MAMF table: "H200 is the same" as H100
        fp8_gemm_efficiency=1453.4 / 1979.0,
        scaleup="nvswitch", scaleup_gb_s=450.0, scaleup_domain=8,
        scaleup_busbw_gb_s=_H100_RING_BUSBW,   # no ring figure stored; same NVLink4 as H100
        nvls_busbw_gb_s=475.0,                 # nccl-tests #272
        per_peer_gb_s=None, nic_gbit=400.0, nic_busbw_gb_s=NDR400_BUSBW_GB_S,
        tdp_w=700.0, price_usd_per_hour=6.31, price_source=f"CoreWeave HGX H200 $50.44/8 ({_CW})",
        sources=f"{_ML_ENG_SPECS}; {_MAMF}; nccl-tests #272, nccl-tests #290",
    ),
    GPUSpec(
        id="b200", name="NVIDIA B200 (HGX/DGX, 1000 W)",
        bf16_tflops=2250.0, fp8_tflops=4500.0, hbm_gb=180.0, hbm_tb_s=8.0,   # 180 usable of 192
        gemm_efficiency=1745.0 / 2250.0, fp8_gemm_efficiency=3432.5 / 4500.0,
        scaleup="nvswitch", scaleup_gb_s=900.0, scaleup_domain=8,
        scaleup_busbw_gb_s=695.0 * _BLACKWELL_LINK_RATIO,   # estimate from the B300 proxy
        nvls_busbw_gb_s=845.0 * _BLACKWELL_LINK_RATIO,      # estimate from the B300 proxy
        per_peer_gb_s=None, nic_gbit=400.0, nic_busbw_gb_s=NDR400_BUSBW_GB_S,
        tdp_w=1000.0, price_usd_per_hour=8.6, price_source=f"CoreWeave HGX B200 $68.80/8 ({_CW})",
        sources=f"{_ML_ENG_SPECS} (DGX B200 datasheet); glennklockwood.com B200; {_MAMF}; "
                "nccl #2140 (B300 busbw proxy)",
    ),
    GPUSpec(
        id="gb200", name="NVIDIA GB200 (NVL72, per GPU)",
        bf16_tflops=2500.0, fp8_tflops=5000.0, hbm_gb=186.0, hbm_tb_s=8.0,
        gemm_efficiency=1822.0 / 2500.0, fp8_gemm_efficiency=3615.6 / 5000.0,
        scaleup="nvswitch", scaleup_gb_s=900.0, scaleup_domain=72, node_gpus=4,
        # estimate: nothing measured on NVL72. A switched ring's busbw does not fall with the
        # number of GPUs, so the 8-GPU B300 proxy stands in for the 72-GPU domain.
        scaleup_busbw_gb_s=695.0 * _BLACKWELL_LINK_RATIO,
        nvls_busbw_gb_s=845.0 * _BLACKWELL_LINK_RATIO,
        per_peer_gb_s=None,
        # estimate: CSV "deployment-specific"; one 400G ConnectX-7 per GPU (4 per tray)
        nic_gbit=400.0, nic_busbw_gb_s=NDR400_BUSBW_GB_S,
        tdp_w=1200.0,                     # "~1200 (GPU config)"
        price_usd_per_hour=10.5, price_source=f"CoreWeave GB200 NVL72 $42.00 per 4-GPU tray ({_CW})",
        sources=f"{_ML_ENG_SPECS} (GB200 NVL72 spec); glennklockwood.com B200 (1200 W); {_MAMF}",
    ),
    GPUSpec(
        id="mi300x", name="AMD Instinct MI300X",
        bf16_tflops=1307.4, fp8_tflops=2614.9, hbm_gb=192.0, hbm_tb_s=5.3,
        gemm_efficiency=668.4 / 1307.4,   # community MAMF (AMD's own MAF: 708, i.e. 0.54)
        fp8_gemm_efficiency=1273.0 / 2614.9,   # AMD MAF table; no community FP8 figure
        scaleup="xgmi", scaleup_gb_s=448.0, scaleup_domain=8,   # 7 peers x 64 GB/s
        scaleup_busbw_gb_s=312.9,         # 8 GPUs; only 47.7 for 2 (one 64 GB/s peer link)
        nvls_busbw_gb_s=None, per_peer_gb_s=64.0,
        # Azure ND MI300X v5: 8x 400 Gb NDR per VM; busbw not stored, taken as NDR's 46-48 GB/s
        nic_gbit=400.0, nic_busbw_gb_s=NDR400_BUSBW_GB_S,
        tdp_w=750.0, price_usd_per_hour=2.59,
        price_source="DigitalOcean 1x MI300X list price (HF dataset tokenwatt/gpu-cloud-prices, 2026-10-07)",
        sources=f"{_ML_ENG_SPECS}; {_MAMF}; ROCm/rocm-blogs measuring-max-achievable-flops-part2 "
                "(AMD MAF); ml-engineering network/README.md (all_reduce_bench busbw)",
    ),
    GPUSpec(
        id="mi325x", name="AMD Instinct MI325X",
        bf16_tflops=1307.4, fp8_tflops=2614.9, hbm_gb=256.0, hbm_tb_s=6.0,
        gemm_efficiency=784.9 / 1307.4, fp8_gemm_efficiency=1519.0 / 2614.9,
        scaleup="xgmi", scaleup_gb_s=448.0, scaleup_domain=8,
        scaleup_busbw_gb_s=312.9,         # estimate: not measured; same xGMI mesh as MI300X
        nvls_busbw_gb_s=None, per_peer_gb_s=64.0,
        nic_gbit=400.0, nic_busbw_gb_s=NDR400_BUSBW_GB_S,   # CSV "400 typical"; busbw estimate
        tdp_w=1000.0, price_usd_per_hour=None, price_source="no reputable stored on-demand price found",
        sources=f"{_ML_ENG_SPECS}; {_MAMF}; ROCm/rocm-blogs measuring-max-achievable-flops-part2",
    ),
    GPUSpec(
        id="l40s", name="NVIDIA L40S",
        bf16_tflops=362.0, fp8_tflops=733.0, hbm_gb=48.0, hbm_tb_s=0.864,   # GDDR6
        # estimate: no MAMF entry; H100 SXM efficiency x the PCIe penalty seen on A100
        gemm_efficiency=794.5 / 989.0 * PCIE_MAMF_PENALTY,
        fp8_gemm_efficiency=1402.6 / 1979.0 * PCIE_MAMF_PENALTY,
        # PCIe tree of the 8-GPU server as the domain (see h100-pcie); busbw estimate: the H100
        # PCIe figure scaled by line rate, Gen4 31 / Gen5 63 GB/s
        scaleup="pcie", scaleup_gb_s=31.0, scaleup_domain=8,
        scaleup_busbw_gb_s=_H100_PCIE_BUSBW * 31.0 / 63.0, nvls_busbw_gb_s=None, per_peer_gb_s=None,
        # estimate: CSV "deployment-specific"; L40S servers are built for inference, 100G per GPU
        nic_gbit=100.0, nic_busbw_gb_s=EDR100_BUSBW_GB_S,
        tdp_w=350.0, price_usd_per_hour=2.25, price_source=f"CoreWeave L40S $18.00/8 ({_CW})",
        sources=f"{_ML_ENG_SPECS} (NVIDIA L40S spec); ml-engineering network/README.md (PCIe4 31 GB/s)",
    ),
)


def _host_ram_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (AttributeError, ValueError, OSError):
        return FALLBACK_HOST_RAM_GB


def cpu_gpu_spec(nproc: int = 4) -> GPUSpec:
    """One of `nproc` CPU training processes sharing this host (gloo over loopback).

    Throughput, memory and loopback bandwidth are the host's, divided by `nproc`. RAM is read
    from the OS now; the compute and bandwidth figures are the constants measured above.
    """
    _check_int("local-cpu", "nproc", nproc)
    return GPUSpec(
        id="cpu", name=f"CPU process (1 of {nproc} on this host)",
        bf16_tflops=CPU_HOST_BF16_TFLOPS / nproc, fp8_tflops=None,   # FP8 is emulated, no speed-up
        fp32_tflops=CPU_HOST_FP32_TFLOPS / nproc,
        hbm_gb=_host_ram_gb() / nproc, hbm_tb_s=CPU_HOST_MEM_TB_S / nproc,
        # The peaks above are measured matmul rates, so the achieved fraction is 1 by definition.
        gemm_efficiency=1.0, fp8_gemm_efficiency=None,
        scaleup="loopback", scaleup_gb_s=CPU_HOST_MEM_TB_S * 1000.0 / nproc, scaleup_domain=nproc,
        scaleup_busbw_gb_s=CPU_HOST_LOOPBACK_BUSBW_GB_S / nproc, nvls_busbw_gb_s=None,
        per_peer_gb_s=None, nic_gbit=CPU_NIC_GBIT, nic_busbw_gb_s=CPU_NIC_BUSBW_GB_S / nproc,
        tdp_w=None, price_usd_per_hour=None, price_source="local machine", node_gpus=nproc, comm_overlap=False,
        sources="measured 2026-11-22 on a 2-core AMD EPYC VM (meshplan/cluster.py constants); "
                "reference/cpu_platform.md",
    )


GPUS: dict[str, GPUSpec] = {spec.id: spec for spec in _GPU_LIST}
GPUS["cpu"] = cpu_gpu_spec()

_GPU_ALIASES = {
    "h100": "h100-sxm", "h100-sxm5": "h100-sxm", "h100-80gb": "h100-sxm", "h100-sxm-80gb": "h100-sxm",
    "a100": "a100-80gb", "a100-80g": "a100-80gb", "a100-sxm": "a100-80gb", "a100-40g": "a100-40gb",
    "h200-sxm": "h200", "h200-141gb": "h200", "b200-sxm": "b200", "gb200-nvl72": "gb200",
    "mi300": "mi300x", "mi325": "mi325x", "h800-sxm": "h800", "h100pcie": "h100-pcie",
}


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def gpu(name: str | GPUSpec) -> GPUSpec:
    """The GPUSpec for an id ("h100-sxm") or alias ("H100", "a100"); a GPUSpec passes through."""
    if isinstance(name, GPUSpec):
        return name
    if not isinstance(name, str):
        raise ConfigError(f"a GPU is named by a string id or given as a GPUSpec, got {name!r}")
    key = _norm(name)
    key = _GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise UnknownNameError("GPU", name, list(GPUS))
    return GPUS[key]


_resolve_gpu = gpu   # Cluster.__init__ has a parameter named `gpu`


# ---- clusters -----------------------------------------------------------------------------------
_DERIVED = ("scaleup_domain", "nic_gb_s", "net_latency_us", "scaleup_latency_us",
            "base_latency_us", "memory_reserved_gb", "name")


def _defaults(g: GPUSpec, gpus_per_node: int, num_gpus: int) -> dict[str, Any]:
    """Values of the deployment fields a user did not set, for this GPU and shape."""
    if g.scaleup_domain > g.node_gpus:       # rack-scale fabric (NVL72): domains span nodes
        domain = min(g.scaleup_domain, num_gpus)
    else:                                    # board-level fabric: a domain never leaves its node
        domain = min(g.scaleup_domain, gpus_per_node)
    if g.scaleup == "loopback":
        base, hop, net = CPU_LOOPBACK_BASE_US, CPU_LOOPBACK_HOP_US, CPU_NET_HOP_US
        reserved = CPU_PROCESS_RESERVED_GB
    else:
        if g.scaleup == "xgmi":
            base, hop = RCCL_BASE_LATENCY_US, RCCL_XGMI_HOP_US
        elif g.scaleup == "pcie":
            base, hop = NCCL_BASE_LATENCY_US, NCCL_PCIE_HOP_US
        else:
            base, hop = NCCL_BASE_LATENCY_US, NCCL_NVLINK_HOP_US
        net = NCCL_NET_HOP_US
        reserved = round(CUDA_CONTEXT_GB + NCCL_BUFFERS_GB + ALLOCATOR_FRAGMENTATION_FRAC * g.hbm_gb, 3)
    return dict(scaleup_domain=domain, nic_gb_s=g.nic_busbw_gb_s, net_latency_us=net,
                scaleup_latency_us=hop, base_latency_us=base, memory_reserved_gb=reserved,
                name=f"{gpus_per_node}x{g.id}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, kw_only=True, init=False, repr=False)
class Cluster:
    """`nodes` x `gpus_per_node` GPUs of one kind, with the deployment's network figures.

    Build one with `Cluster.preset("dgx-h100", nodes=16)` or
    `Cluster(gpu="h100-sxm", num_gpus=16, gpus_per_node=8)` (or `nodes=2`); every field left out
    gets the GPU's default. `dataclasses.fields` / `dataclasses.replace` work; `replace` here also
    re-derives the fields that were still at the old defaults.
    """

    gpu: GPUSpec
    nodes: int
    gpus_per_node: int
    scaleup_domain: int        # GPUs per scale-up domain (72 for NVL72: 18 trays of 4)
    nic_gb_s: float            # achieved network busbw per GPU (GB/s)
    net_latency_us: float      # per-hop network latency
    scaleup_latency_us: float  # per-hop scale-up latency
    base_latency_us: float     # per-collective launch/base latency
    memory_reserved_gb: float  # CUDA context + NCCL buffers + allocator fragmentation (see constants)
    name: str

    def __init__(
        self, *, gpu: GPUSpec | str, nodes: int | None = None, gpus_per_node: int | None = None,
        num_gpus: int | None = None, scaleup_domain: int | None = None, nic_gb_s: float | None = None,
        net_latency_us: float | None = None, scaleup_latency_us: float | None = None,
        base_latency_us: float | None = None, memory_reserved_gb: float | None = None,
        name: str | None = None,
    ) -> None:
        for label, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node), ("num_gpus", num_gpus)):
            if value is not None:
                _check_int("cluster", label, value)
        if isinstance(gpu, str) and _norm(gpu) == "cpu":
            # CPU "GPUs" are processes sharing a host: size the per-process spec to the node.
            per_host = gpus_per_node or (num_gpus // (nodes or 1) if num_gpus else 4)
            spec = cpu_gpu_spec(max(1, per_host))
        else:
            spec = _resolve_gpu(gpu)
        if gpus_per_node is None:
            gpus_per_node = spec.node_gpus
            if num_gpus is not None and nodes is None and num_gpus < gpus_per_node:
                gpus_per_node = num_gpus           # part of one server
        if num_gpus is not None:
            if num_gpus % gpus_per_node:
                near = sorted({max(1, num_gpus // gpus_per_node), num_gpus // gpus_per_node + 1})
                raise ConfigError(
                    f"{num_gpus} GPUs is not a whole number of {gpus_per_node}-GPU nodes; use "
                    f"num_gpus={' or '.join(str(n * gpus_per_node) for n in near)}, or a "
                    f"gpus_per_node dividing {num_gpus}: {_divisors(num_gpus)}")
            if nodes is not None and nodes * gpus_per_node != num_gpus:
                raise ConfigError(f"nodes={nodes} x gpus_per_node={gpus_per_node} is "
                                  f"{nodes * gpus_per_node} GPUs, not num_gpus={num_gpus}; give one of them")
            nodes = num_gpus // gpus_per_node
        nodes = 1 if nodes is None else nodes
        given = dict(scaleup_domain=scaleup_domain, nic_gb_s=nic_gb_s, net_latency_us=net_latency_us,
                     scaleup_latency_us=scaleup_latency_us, base_latency_us=base_latency_us,
                     memory_reserved_gb=memory_reserved_gb, name=name)
        values = _defaults(spec, gpus_per_node, nodes * gpus_per_node)
        values.update({k: v for k, v in given.items() if v is not None})
        for key, value in dict(gpu=spec, nodes=nodes, gpus_per_node=gpus_per_node, **values).items():
            object.__setattr__(self, key, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        if not isinstance(self.gpu, GPUSpec):
            raise ConfigError(f"cluster gpu must be a GPUSpec or a GPU id, got {self.gpu!r}")
        where = f"cluster {self.name!r}"
        for label in ("nodes", "gpus_per_node", "scaleup_domain"):
            _check_int(where, label, getattr(self, label))
        _check_positive(where, "nic_gb_s", self.nic_gb_s)
        for label in ("net_latency_us", "scaleup_latency_us", "base_latency_us", "memory_reserved_gb"):
            _check_positive(where, label, getattr(self, label), allow_zero=True)
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"{where}: name must be a non-empty string")
        if self.memory_reserved_gb >= self.gpu.hbm_gb:
            raise ConfigError(f"{where}: memory_reserved_gb={self.memory_reserved_gb:g} leaves nothing "
                              f"of the {self.gpu.hbm_gb:g} GB on a {self.gpu.id}")
        self._check_domain(where)

    def _check_domain(self, where: str) -> None:
        d, gpn, n, g = self.scaleup_domain, self.gpus_per_node, self.num_gpus, self.gpu
        if d > g.scaleup_domain:
            raise ConfigError(f"{where}: scaleup_domain={d} exceeds the {g.scaleup_domain}-GPU "
                              f"{g.scaleup} domain of a {g.id}")
        if d <= gpn:
            if gpn % d:
                ok = [x for x in _divisors(gpn) if x <= g.scaleup_domain]
                raise ConfigError(f"{where}: scale-up domains of {d} GPUs do not tile a {gpn}-GPU "
                                  f"node; use scaleup_domain in {ok}")
            return
        if g.scaleup_domain <= g.node_gpus:
            raise ConfigError(f"{where}: a {g.id} {g.scaleup} domain cannot span nodes, but "
                              f"scaleup_domain={d} > gpus_per_node={gpn}; use at most {gpn}")
        if d % gpn or n % d:
            ok = [x for x in _divisors(n) if x % gpn == 0 and x <= g.scaleup_domain]
            per_rack = g.scaleup_domain // gpn
            raise ConfigError(
                f"{where}: {n} GPUs in {self.nodes} nodes of {gpn} do not split into whole "
                f"{d}-GPU scale-up domains; use a multiple of {per_rack} nodes (or at most {per_rack}), "
                f"or set scaleup_domain to one of {ok}")

    # ---- derived sizes ----
    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_memory_gb(self) -> float:
        return self.gpu.hbm_gb - self.memory_reserved_gb

    @property
    def num_domains(self) -> int:
        return self.num_gpus // self.scaleup_domain

    @property
    def price_usd_per_hour(self) -> float | None:
        """On-demand price of the whole cluster, or None where the GPU has no price."""
        p = self.gpu.price_usd_per_hour
        return None if p is None else p * self.num_gpus

    def placement(self, group_size: int, stride: int) -> tuple[int, int]:
        """How a communicator falls onto scale-up domains: (ranks_per_domain, domains_spanned).

        The communicator has `group_size` ranks, `stride` ranks apart in node-major rank order
        (a mesh axis whose inner axes multiply to `stride`), and the world is tiled by such groups.
        When the groups line up with the domains (stride a multiple of the domain, or groups that
        fill whole domains, or fit inside one), every group puts exactly `ranks_per_domain` ranks
        in each of `domains_spanned` domains, and the product is `group_size`. Otherwise groups
        differ; the answer is then the worst case over all groups, for costing the slowest one:
        the most domains any group touches, and the fewest ranks any group has in one domain
        (the ranks whose links carry the traffic leaving it), so the product is below group_size.

        dgx-h100 x 16 nodes: (8, 1) -> (8, 1); (16, 1) -> (8, 2); (4, 8) -> (1, 4); (4, 2) -> (4, 1).
        """
        for label, value in (("group_size", group_size), ("stride", stride)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"placement: {label} must be a positive whole number, got {value!r}")
        span = group_size * stride
        if self.num_gpus % span:
            raise LayoutError(
                f"a group of {group_size} ranks {stride} apart spans {span} ranks, which does not "
                f"divide the {self.num_gpus} GPUs of cluster {self.name!r}; group_size x stride must "
                f"be one of {_divisors(self.num_gpus)}")
        return _placement(self.num_gpus, self.scaleup_domain, group_size, stride)

    # ---- construction helpers ----
    @classmethod
    def preset(cls, name: str, nodes: int | None = None, **options: Any) -> Cluster:
        """A named cluster: `Cluster.preset("dgx-h100", nodes=16)`; see `Cluster.presets()`.

        Options: `num_gpus` instead of `nodes`, `nproc` for local-cpu, and any Cluster field.
        """
        key = _norm(name) if isinstance(name, str) else name
        if key not in PRESETS:
            raise UnknownNameError("cluster preset", name, list(PRESETS))
        allowed = {"num_gpus", *_DERIVED, "gpus_per_node"} | ({"nproc"} if key == "local-cpu" else set())
        bad = sorted(set(options) - allowed)
        if bad:
            raise ConfigError(f"preset {key!r} does not take {bad}; it takes nodes and "
                              f"{', '.join(sorted(allowed))}")
        return PRESETS[key](nodes=nodes, **options)

    @staticmethod
    def presets() -> list[str]:
        return sorted(PRESETS)

    def replace(self, **changes: Any) -> Cluster:
        """A copy with `changes`; fields still at their defaults follow a new gpu / shape."""
        old = _defaults(self.gpu, self.gpus_per_node, self.num_gpus)
        kwargs: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if "num_gpus" in changes and "nodes" not in changes:
            del kwargs["nodes"]
        if "gpu" in changes and "name" not in changes and _resolve_gpu(changes["gpu"]) != self.gpu:
            kwargs["name"] = None   # a preset's name describes its old GPU
        if "gpu" not in changes and self.gpu == cpu_gpu_spec(self.gpu.node_gpus):
            kwargs["gpu"] = "cpu"   # the per-process CPU spec follows the new process count
        for key in _DERIVED:
            if key not in changes and kwargs[key] == old[key]:
                kwargs[key] = None
        kwargs.update(changes)
        return Cluster(**kwargs)

    # ---- serialisation ----
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["gpu"] = self.gpu.to_dict()
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps({"version": CLUSTER_JSON_VERSION, "kind": "meshplan.Cluster",
                           "cluster": self.to_dict()}, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Cluster:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"cluster JSON does not parse: {exc}") from None
        if not isinstance(doc, dict) or "cluster" not in doc:
            raise ConfigError("cluster JSON must be an object with 'version' and 'cluster' keys "
                              "(as written by Cluster.to_json)")
        if doc.get("version") != CLUSTER_JSON_VERSION:
            raise ConfigError(f"cluster JSON version {doc.get('version')!r} is not supported; this "
                              f"meshplan reads version {CLUSTER_JSON_VERSION}")
        data = doc["cluster"]
        if not isinstance(data, dict) or not isinstance(data.get("gpu"), dict):
            raise ConfigError("cluster JSON: 'cluster' must be an object with a 'gpu' object")
        data = dict(data, gpu=GPUSpec.from_dict(data["gpu"]))
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) != names:
            raise ConfigError(f"cluster JSON fields {sorted(data)} differ from {sorted(names)}")
        return cls(**data)

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Cluster:
        return cls.from_json(Path(path).read_text())

    def fingerprint(self) -> str:
        """12 hex digits identifying the performance-relevant content (names and sources excluded)."""
        data = self.to_dict()
        del data["name"]
        for key in ("name", "sources", "price_source"):
            del data["gpu"][key]
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]

    def __repr__(self) -> str:
        parts = [f"gpu={self.gpu.id!r}"] + [f"{f.name}={getattr(self, f.name)!r}"
                                             for f in dataclasses.fields(self) if f.name != "gpu"]
        return f"Cluster({', '.join(parts)})"

    def describe(self) -> str:
        """A few human-readable lines (for the CLI and reports)."""
        g = self.gpu
        fp8 = f", FP8 {g.fp8_tflops:g}" if g.fp8_tflops else ""
        price = self.price_usd_per_hour
        return "\n".join([
            f"{self.name}: {self.nodes} node(s) x {self.gpus_per_node} {g.name} = {self.num_gpus} GPUs",
            f"  compute  BF16 {g.bf16_tflops:g} TFLOPS dense{fp8} (GEMM efficiency {g.gemm_efficiency:.2f})",
            f"  memory   {g.hbm_gb:.4g} GB at {g.hbm_tb_s:.3g} TB/s, {self.usable_memory_gb:.1f} GB usable",
            f"  scale-up {g.scaleup}, {self.num_domains} domain(s) of {self.scaleup_domain}, "
            f"busbw {g.scaleup_busbw_gb_s:.3g} GB/s",
            f"  network  {self.nic_gb_s:.3g} GB/s busbw per GPU",
            "  price    " + (f"${price:,.2f}/h on demand" if price is not None else "unknown"),
        ])


@lru_cache(maxsize=4096)
def _placement(num_gpus: int, domain: int, group_size: int, stride: int) -> tuple[int, int]:
    if group_size == 1:
        return (1, 1)
    if stride >= domain:                 # consecutive members are >= a domain apart
        return (1, group_size)
    if domain % stride == 0:
        per_domain = domain // stride    # members of one group a domain can hold
        if per_domain % group_size == 0:
            return (group_size, 1)
        if group_size % per_domain == 0:
            return (per_domain, group_size // per_domain)
    # Groups straddle domain boundaries unevenly: enumerate the groups of one period of the
    # pattern (it repeats every lcm(span, domain) ranks).
    span = group_size * stride
    period = min(num_gpus, span * domain // math.gcd(span, domain))
    most_domains, fewest_ranks = 1, group_size
    for start in range(0, period, span):
        for offset in range(stride):
            counts = Counter((start + offset + k * stride) // domain for k in range(group_size))
            most_domains = max(most_domains, len(counts))
            fewest_ranks = min(fewest_ranks, min(counts.values()))
    return (fewest_ranks, most_domains)


# ---- presets (plain functions) ------------------------------------------------------------------
def _server_preset(preset: str, gpu_id: str, gpus_per_node: int, default_nodes: int,
                   doc: str) -> Callable[..., Cluster]:
    def build(*, nodes: int | None = None, num_gpus: int | None = None, **fields: Any) -> Cluster:
        if nodes is None and num_gpus is None:
            nodes = default_nodes
        kwargs: dict[str, Any] = dict(gpus_per_node=gpus_per_node, name=preset)
        kwargs.update(fields)
        return Cluster(gpu=gpu_id, nodes=nodes, num_gpus=num_gpus, **kwargs)

    build.__name__ = build.__qualname__ = preset.replace("-", "_")
    build.__doc__ = doc
    return build


def _local_cpu(*, nodes: int | None = None, num_gpus: int | None = None, nproc: int | None = None,
               **fields: Any) -> Cluster:
    """This machine's CPU: `nproc` gloo processes (default 4) on one host."""
    if nodes not in (None, 1):
        raise ConfigError("local-cpu describes this one machine (nodes=1); for several hosts use "
                          "Cluster(gpu='cpu', nodes=..., gpus_per_node=...)")
    if nproc is not None and num_gpus is not None and nproc != num_gpus:
        raise ConfigError(f"local-cpu: nproc={nproc} and num_gpus={num_gpus} disagree; give one")
    n = nproc if nproc is not None else (num_gpus if num_gpus is not None else 4)
    kwargs: dict[str, Any] = dict(name="local-cpu")
    kwargs.update(fields)
    return Cluster(gpu=cpu_gpu_spec(n), nodes=1, gpus_per_node=n, **kwargs)


PRESETS: dict[str, Callable[..., Cluster]] = {
    "dgx-a100": _server_preset("dgx-a100", "a100-80gb", 8, 1, "DGX A100: 8x A100 80GB, NVSwitch, 8x 200G HDR."),
    "hgx-a100-40gb": _server_preset("hgx-a100-40gb", "a100-40gb", 8, 1, "HGX A100 40GB (AWS p4d): 8 GPUs, NVSwitch."),
    "dgx-h100": _server_preset("dgx-h100", "h100-sxm", 8, 1, "DGX/HGX H100: 8x H100 SXM, NVSwitch, 8x 400G NDR."),
    "h100-pcie-8": _server_preset("h100-pcie-8", "h100-pcie", 8, 1, "8x H100 PCIe in one server, no NVLink."),
    "h800-8": _server_preset("h800-8", "h800", 8, 1, "HGX H800: 8x H800 (NVLink cut to 400 GB/s), 400G IB."),
    "hgx-h200": _server_preset("hgx-h200", "h200", 8, 1, "HGX H200: 8x H200, NVSwitch, 8x 400G NDR."),
    "dgx-b200": _server_preset("dgx-b200", "b200", 8, 1, "DGX/HGX B200: 8x B200, NVLink5 NVSwitch."),
    "gb200-nvl72": _server_preset("gb200-nvl72", "gb200", 4, 18,
                                  "GB200 NVL72: trays of 4 GPUs, 18 trays per 72-GPU NVLink domain; nodes = trays."),
    "mi300x-8": _server_preset("mi300x-8", "mi300x", 8, 1, "8x MI300X on xGMI full mesh, 8x 400G NDR."),
    "mi325x-8": _server_preset("mi325x-8", "mi325x", 8, 1, "8x MI325X on xGMI full mesh."),
    "l40s-8": _server_preset("l40s-8", "l40s", 8, 1, "8x L40S PCIe, no NVLink."),
    "local-cpu": _local_cpu,
}
