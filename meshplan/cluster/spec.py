"""`GPUSpec`: the fields that describe one accelerator (dense peaks, memory, measured GEMM
efficiency, scale-up fabric and its measured all-reduce busbw, typical NIC, power, price, sources)
and their checks; also the field checks the Cluster shares (`_check_int`, `_check_positive`,
`_build`). The sourced specs themselves, and lookup by name, are in gpus.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from meshplan.errors import ConfigError

__all__ = ["GPUSpec", "SCALEUP_KINDS"]

SCALEUP_KINDS = ("nvswitch", "xgmi", "nvlink-mesh", "pcie", "nvlink-bridge", "loopback")


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
    # host work) by it (host.cpu_rate_scale). None: derived from the matmul rate.
    cpu_op_us: float | None = None
    # The host side, for activation offloading (cost_models/offload.py): the achieved copy rate
    # between host memory (pinned) and this GPU, per direction (GB/s), and the host DRAM of one server
    # of `node_gpus` GPUs (GB). None: not known; the cost model takes PCIe Gen5's and a DGX H100's.
    host_link_gb_s: float | None = None
    host_mem_gb: float | None = None

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
        for name in ("fp8_tflops", "nvls_busbw_gb_s", "per_peer_gb_s", "tdp_w", "fp32_tflops", "cpu_op_us",
                     "host_link_gb_s", "host_mem_gb"):
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
