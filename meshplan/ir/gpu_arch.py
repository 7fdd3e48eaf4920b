"""The GPU architecture generation of a GPU id (meshplan.cluster's catalogue): what kernels are
written for and what a software stack's settings depend on."""

from __future__ import annotations

__all__ = ["gpu_generation", "orders_kernels_by_queue"]


def gpu_generation(gpu_id: str) -> str:
    """The tensor-core generation: "ampere" (A100, and Ada's L40S, which runs the same mma.sync
    kernels), "hopper" (H100, H800, H200, GH200), "blackwell" (B200, GB200, B300, GB300), "other" (AMD, CPU
    processes)."""
    if gpu_id.startswith(("a100", "l40s")):
        return "ampere"
    if gpu_id.startswith(("h100", "h800", "h200", "gh200")):
        return "hopper"
    if gpu_id.startswith(("b200", "gb200", "b300", "gb300")):
        return "blackwell"
    return "other"


def orders_kernels_by_queue(gpu_id: str) -> bool:
    """Whether Megatron-Core's tensor- and context-parallel communication overlap on this GPU needs
    kernels to run in the order the host issues them, i.e. one hardware queue
    (CUDA_DEVICE_MAX_CONNECTIONS=1): NVIDIA GPUs before Blackwell (Megatron-LM arguments.py:
    "CUDA_DEVICE_MAX_CONNECTIONS requirement no longer exists since the Blackwell architecture")."""
    return gpu_generation(gpu_id) in ("ampere", "hopper")
