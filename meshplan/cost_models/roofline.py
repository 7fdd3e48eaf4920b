"""The roofline both devices share: a GEMM's achieved matmul rate, its HBM traffic, the FP8
recipes' quantisation traffic. Device-specific pricing (what a kernel call costs beyond its
FLOPs, attention, element-wise passes) lives behind the device seam (cost_models.device)."""

from __future__ import annotations

from meshplan.cost_models import constants as K
from meshplan.errors import ConfigError
from meshplan.ir.layout import FP8_RECIPES

__all__ = ["matmul_rate", "hbm_rate", "fp8_recipe_factor", "gemm_roofline", "fp8_cast_time"]


def matmul_rate(cluster, fp8: bool, fitted: K.Fitted = K.FITTED) -> float:
    """Achieved FLOP/s of a large GEMM (MAMF), BF16 or FP8, in a training step."""
    gpu = cluster.gpu
    if fp8:
        return gpu.fp8_tflops * 1e12 * gpu.fp8_gemm_efficiency * fitted.training_gemm_eff
    return gpu.bf16_tflops * 1e12 * gpu.gemm_efficiency * fitted.training_gemm_eff


def hbm_rate(cluster) -> float:
    """Achieved bytes/s of a streaming pass over device memory."""
    return cluster.gpu.hbm_tb_s * 1e12 * K.HBM_EFF


def fp8_recipe_factor(recipe: str, cluster=None) -> float:
    """Quantisation traffic of an FP8 recipe relative to tensorwise (constants.FP8_QUANT_BYTES);
    raises where the GPU cannot run it (MXFP8 needs Blackwell's block-scaled tensor cores)."""
    if recipe not in K.FP8_QUANT_BYTES:
        raise ValueError(f"fp8 recipe {recipe!r}: use one of {FP8_RECIPES}")
    if recipe == "mxfp8" and cluster is not None and cluster.gpu.id not in K.MXFP8_GPUS:
        raise ConfigError(f"fp8 recipe 'mxfp8' needs MX block-scaled tensor cores (Blackwell: "
                          f"{', '.join(K.MXFP8_GPUS)}); {cluster.gpu.name} has none")
    return K.FP8_QUANT_BYTES[recipe] / K.FP8_QUANT_BYTES["tensorwise"]


def fp8_cast_time(elements: float, cluster, recipe: str) -> float:
    """Quantising `elements` inputs of FP8 GEMMs (fused cast + amax): memory-bound."""
    t = elements * K.FP8_CAST_BYTES_PER_ELEMENT / hbm_rate(cluster)
    return t if recipe == "tensorwise" else t * fp8_recipe_factor(recipe)


def gemm_roofline(m: float, n: float, k: float, cluster, *, fp8: bool = False, math_rows: float | None = None,
                  fitted: K.Fitted = K.FITTED, recipe: str = "tensorwise") -> float:
    """One (m x k) @ (k x n) GEMM at the roofline: max(math at the achieved matmul rate, HBM
    traffic of both operands and the bf16 output). `math_rows` replaces m in the math (rows padded
    to whole tiles); the traffic is that of the real rows. An FP8 GEMM runs at its recipe's share of
    the FP8 rate (constants.FP8_RECIPE_GEMM_RATE)."""
    elt = K.FP8 if fp8 else K.BF16
    rate = matmul_rate(cluster, fp8, fitted) * (K.FP8_RECIPE_GEMM_RATE[recipe] if fp8 else 1.0)
    t_compute = 2.0 * (m if math_rows is None else math_rows) * n * k / rate
    t_memory = ((m * k + k * n) * elt + m * n * K.BF16) / hbm_rate(cluster)
    return max(t_compute, t_memory)
