"""The GPU table: `GPUSpec` (one accelerator), the sourced specs of each GPU meshplan knows,
the per-process spec of this machine's CPU (`cpu_gpu_spec`), and name lookup (`gpu`, aliases).

A `GPUSpec` holds dense peaks, memory, measured GEMM efficiency, its scale-up fabric (NVSwitch,
xGMI, PCIe, loopback) with a measured all-reduce bus bandwidth, its typical NIC, power and price.
The figures' sources are in the comments next to them (constants in meshplan/cluster/constants.py).
Also the field checks the Cluster shares (`_check_int`, `_check_positive`, `_build`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from meshplan.cluster.constants import (
    CPU_HOST_BF16_TFLOPS, CPU_HOST_FP32_TFLOPS, CPU_HOST_LOOPBACK_BUSBW_GB_S, CPU_HOST_MEM_TB_S,
    CPU_NIC_BUSBW_GB_S, CPU_NIC_GBIT, EDR100_BUSBW_GB_S, FALLBACK_HOST_RAM_GB, HDR200_BUSBW_GB_S,
    NDR400_BUSBW_GB_S, PCIE_MAMF_PENALTY,
)
from meshplan.errors import ConfigError, UnknownNameError

__all__ = ["GPUSpec", "GPUS", "SCALEUP_KINDS", "gpu", "cpu_gpu_spec"]

SCALEUP_KINDS = ("nvswitch", "xgmi", "pcie", "nvlink-bridge", "loopback")


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
    # CPU processes: microseconds one small autograd op (a mul of an 8x8 tensor in a chain of 60)
    # takes in each process while every process runs them at once, as `meshplan calibrate`
    # measures it; the cost model scales its host-work rates (dispatch, element-wise, SDPA, gloo
    # host work) by it (compute.cpu_rate_scale). None: derived from the matmul rate.
    cpu_op_us: float | None = None

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
        for name in ("fp8_tflops", "nvls_busbw_gb_s", "per_peer_gb_s", "tdp_w", "fp32_tflops", "cpu_op_us"):
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
