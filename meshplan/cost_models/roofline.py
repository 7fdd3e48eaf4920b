"""The roofline both devices share: a GEMM's achieved matmul rate, its HBM traffic, the FP8
recipes' quantisation traffic. Device-specific pricing (what a kernel call costs beyond its
FLOPs, attention, element-wise passes) lives behind the device seam (cost_models.device)."""

from __future__ import annotations

from meshplan.cost_models import constants as K
from meshplan.errors import ConfigError
from meshplan.ir.layout import FP8_RECIPES

__all__ = ["matmul_rate", "hbm_rate", "fp8_recipe_factor", "fp8_quant_bytes", "gemm_roofline", "fp8_cast_time"]


# the GEMMs one linear runs per micro-batch (forward, input gradient, weight gradient), each of which
# the cost model prices at the forward's shape (cost_models.layer: backward = 2 x forward GEMMs)
_GEMMS_PER_LINEAR = 3


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


def fp8_quant_bytes(recipe: str, *, eager: bool = False) -> float:
    """HBM bytes moved per element of a tensor an FP8 linear quantises (its input, output gradient
    or weight) to make the FP8 copies its GEMMs read: fused kernels (constants.FP8_QUANT_BYTES), or
    eager torchao's chain of unfused ops (constants.FP8_EAGER_QUANT_BYTES)."""
    table = K.FP8_EAGER_QUANT_BYTES if eager else K.FP8_QUANT_BYTES
    if recipe not in table:
        known = tuple(table) if eager else FP8_RECIPES
        raise ValueError(f"fp8 recipe {recipe!r}{' (eager torchao)' if eager else ''}: use one of {known}")
    return table[recipe]


def fp8_cast_time(m: float, n: float, k: float, cluster, recipe: str, *, weight: bool = False,
                  eager: bool = False) -> float:
    """One GEMM's share of an (m x k) @ (k x n) FP8 linear's quantisation in one micro-batch: its
    input x (m x k) and output gradient dy (m x n), each quantised once into the copies the forward,
    input-gradient and weight-gradient GEMMs read, a third charged to each of the three GEMMs the cost
    model prices at this shape; with `weight`, the (k x n) weight too (an operand no cache keeps
    between micro-batches). Memory-bound; `eager` (torchao without torch.compile) adds a third of the
    measured fixed time per linear (constants.FP8_EAGER_LINEAR_FIXED_S)."""
    elements = m * k + m * n + (k * n if weight else 0.0)
    t = elements * fp8_quant_bytes(recipe, eager=eager) / hbm_rate(cluster)
    if eager:
        t += K.FP8_EAGER_LINEAR_FIXED_S[recipe]
    return t / _GEMMS_PER_LINEAR


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
