"""The roofline both devices share: a GEMM's achieved matmul rate, its HBM traffic, the FP8
recipes' quantisation traffic. Device-specific pricing (what a kernel call costs beyond its
FLOPs, attention, element-wise passes) lives behind the device seam (cost_models.device)."""

from __future__ import annotations

from meshplan.cost_models import constants as K
from meshplan.errors import ConfigError
from meshplan.ir.layout import FP8_RECIPES

__all__ = ["matmul_rate", "hbm_rate", "fp8_recipe_factor", "fp8_quant_bytes", "gemm_roofline", "fp8_cast_time",
           "fp8_weight_gathered", "torchao_precomputes_scales", "torchao_weight_cast_bytes"]


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


def fp8_weight_gathered(layout, recipe: str, stack) -> bool:
    """Whether FSDP2 all-gathers the dense FP8 linears' weights in FP8: torchao's float8 all-gather
    (Float8LinearConfig.enable_fsdp_float8_all_gather wraps each weight in
    torchao/float8/fsdp_utils.py WeightWithDynamicFloat8CastTensor, whose fsdp_pre_all_gather casts
    the local shard and hands FSDP its FP8 bytes). torchao takes it only with tensorwise scales (its
    Float8LinearConfig asserts so); torchtitan turns it on wherever weights are sharded
    (export/torchtitan.py), as does meshplan's runtime for weights that TP does not shard
    (Stack.fp8_gather_under_tp)."""
    if stack is None or stack.fp8_impl != "torchao" or recipe != "tensorwise":
        return False
    if layout.zero < 3 or layout.shard <= 1:
        return False
    return stack.fp8_gather_under_tp or layout.tp == 1


def torchao_precomputes_scales(stack) -> bool:
    """Whether the stack calls torchao's precompute_float8_dynamic_scale_for_fsdp after each optimizer
    step (torchtitan does with its FP8 all-gather): one fused amax over every FP8 weight shard and
    one all-reduce, so each all-gather's cast reuses that scale. Without it (meshplan's runtime) every
    gather takes the shard's amax again (fsdp_pre_all_gather: hp_tensor_to_float8_dynamic with
    reduce_amax). Stack.fp8_precompute_scales."""
    return stack is not None and stack.fp8_precompute_scales


def torchao_weight_cast_bytes(width: float) -> tuple[float, float]:
    """(forward, backward) HBM bytes per element of torchao's casts of a weight stored in `width`
    bytes (constants, "torchao's weight casts"): the forward's amax and cast, the backward's cast with
    the saved scale."""
    return 2 * width + K.FP8, width + K.FP8


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
