"""The device seam: one place decides how the hardware a cluster names is priced.

A cluster of GPUs is priced by `gpu.GpuDevice` (kernels, HBM, the published runs' regimes); the
local CPU processes the default job runs on by `host.CpuHostDevice` (the host is the device:
every op, dispatch and gloo collective has a measured host cost). Both answer the same questions
(`Device`), so the estimate's formulas ask the device instead of branching on what it is.
"""

from __future__ import annotations

from typing import Protocol

from meshplan.cost_models import constants as K
from meshplan.cost_models.gpu import GPU
from meshplan.cost_models.host import CPU_HOST

__all__ = ["Device", "device_of", "is_cpu"]


class Device(Protocol):
    """What the estimate asks of the hardware it prices (all seconds, one GPU or process)."""

    kind: str
    validated_by_published_runs: bool
    # the per-call ops around meshplan's ring attention are host work priced by measured op cost
    # (host.cp_host_time) rather than element-wise passes on the device (cp.meshplan_cp_merge)
    ring_ops_on_host: bool

    def runs_compile(self, stack) -> bool: ...
    def gemm_fixed_s(self, cluster, fp8: bool) -> float: ...
    def grouped_gemm_time(self, rows: float, n: float, k: float, cluster, *, groups: float, fp8: bool,
                          recipe: str, fitted: K.Fitted) -> float: ...
    def attention_time(self, flops_fwd: float, cluster, *, backward: bool, kernel: str, shape,
                       fitted: K.Fitted) -> float: ...
    def elementwise_time(self, nbytes: float, cluster) -> float: ...
    def permute_time(self, nbytes: float, cluster) -> float: ...
    def op_overhead(self, ops, cluster, fitted: K.Fitted) -> tuple[float, float]: ...
    def layer_host(self, b, layout, cluster, policy: str) -> dict[str, tuple[float, float]]: ...
    def moe_host_wait(self, b, layout, stack, fp8_recipe: str | None = None) -> tuple[float, float]: ...
    def edge_host(self, profile, layout, cluster, *, first: bool, last: bool) -> tuple[float, float]: ...
    def expert_fsdp_units(self, n_moe_layers: int, layout) -> int: ...
    def fsdp_copy_time(self, nbytes: float, cluster) -> float: ...
    def pipeline_bubble(self, cluster, layout, busy: float, bubble: float) -> float: ...
    def pipeline_lower_bound(self, layout, m: int, total_fb: float) -> float: ...
    def pp_host_time(self, layout, cluster, m: int) -> float: ...
    def step_overhead(self, profile, cluster, layout, ranks, stack) -> float: ...


def is_cpu(cluster) -> bool:
    """CPU processes (local-cpu or a calibrated profile of it): compute runs on host cores."""
    return cluster.gpu.id == "cpu"


def device_of(cluster) -> Device:
    """The pricing of `cluster`'s hardware."""
    return CPU_HOST if is_cpu(cluster) else GPU
