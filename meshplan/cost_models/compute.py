"""Per-GPU compute time of one layer for one micro-batch: roofline GEMMs, flash attention,
memory-bound element-wise work (cost_models.md §1, §9).

All functions are pure: (shapes, dtype, cluster) -> seconds. What depends on the hardware (a
kernel call's fixed cost, attention kernels, element-wise rates) is asked of the cluster's device
(cost_models.device: GPUs in gpu.py, local CPU processes in host.py); the roofline both share is
cost_models.roofline.
"""

from __future__ import annotations

from meshplan.cost_models import constants as K
from meshplan.cost_models.attention import AttnShape
from meshplan.cost_models.device import device_of
from meshplan.cost_models.roofline import (
    fp8_cast_time,
    fp8_quant_bytes,
    fp8_recipe_factor,
    gemm_roofline,
    hbm_rate,
    matmul_rate,
)

__all__ = ["gemm_time", "attention_time", "elementwise_time", "matmul_rate", "fp8_weight_cast_time", "fp8_eager",
           "grad_accumulation_time", "fp8_recipe_factor", "grouped_gemm_time", "permute_time"]


def fp8_eager(cluster, stack) -> bool:
    """Whether `stack` quantises FP8 linears with torchao's unfused eager ops on this cluster: its
    FP8 is torchao's (Stack.fp8_impl) and it does not compile here (a GPU device that does not
    run torch.compile for the stack). Transformer Engine's casts are fused CUDA kernels either way;
    CPU processes price FP8 as the host device does."""
    if stack is None or stack.fp8_impl != "torchao":
        return False
    dev = device_of(cluster)
    return dev.kind == "gpu" and not dev.runs_compile(stack)


def gemm_time(m: float, n: float, k: float, cluster, *, fp8: bool = False, count: float = 1.0,
              weight_cast: bool = False, recipe: str = "tensorwise", stack=None,
              fitted: K.Fitted = K.FITTED) -> float:
    """`count` GEMMs of (m x k) @ (k x n): max(compute, HBM traffic) plus a fixed per-kernel cost
    that makes small GEMMs inefficient (Calculon-style shape dependence).

    FP8 adds this GEMM's share of the linear's quantisation (roofline.fp8_cast_time: its input and
    output gradient, a third per GEMM of the three a linear runs). The (k x n) weight's FP8 copy is
    made once per step and reused by every micro-batch (Transformer Engine casts a weight on the
    first micro-batch and caches it and its transpose; that cast is `fp8_weight_cast_time`), so it
    is not charged here unless `weight_cast` (an operand that is not a cached weight). `recipe`
    prices the quantisation traffic and the GEMM rate; `stack` (a meshplan.ir.stack.Stack) decides
    whether the casts run fused or as eager torchao ops (`fp8_eager`)."""
    if m <= 0 or n <= 0 or k <= 0 or count <= 0:
        return 0.0
    one = gemm_roofline(m, n, k, cluster, fp8=fp8, fitted=fitted, recipe=recipe) + device_of(cluster).gemm_fixed_s(
        cluster, fp8)
    if fp8:   # quantise the inputs (fused cast + amax, or eager torchao's passes), memory-bound
        one += fp8_cast_time(m, n, k, cluster, recipe, weight=weight_cast, eager=fp8_eager(cluster, stack))
    return count * one


def grouped_gemm_time(rows: float, n: float, k: float, cluster, *, groups: float, fp8: bool = False,
                      recipe: str = "tensorwise", fitted: K.Fitted = K.FITTED) -> float:
    """`groups` GEMMs of (rows x k) @ (k x n) run as ONE grouped kernel (torch._grouped_mm, which
    meshplan's experts call; TE GroupedLinear / grouped_gemm under Megatron-Core --moe-grouped-gemm).
    Each group's rows occupy whole GEMM_TILE_M-row tiles, so the math is that of the padded rows; the
    HBM traffic, the FP8 input cast and the per-kernel fixed cost (launch, prologue, last wave) are
    paid on the real rows and once per kernel, not once per expert as separate GEMMs would.

    On CPU processes there is no grouped kernel: each group is a GEMM call of its own (the device
    decides: cost_models.device)."""
    if rows <= 0 or n <= 0 or k <= 0 or groups <= 0:
        return 0.0
    return device_of(cluster).grouped_gemm_time(rows, n, k, cluster, groups=groups, fp8=fp8, recipe=recipe,
                                                fitted=fitted)


def attention_time(flops_fwd: float, cluster, *, backward: bool, kernel: str = "flash",
                   shape: AttnShape | None = None, fitted: K.Fitted = K.FITTED) -> float:
    """Flash attention (BF16) on `flops_fwd` forward FLOPs (causal masking already halving them, as
    flops.attention_fwd_flops_per_token counts); backward does ATTN_BWD_FLOP_RATIO x.
    `kernel` is the implementation (constants.ATTN_KERNEL_RATE): "fa2" (= "flash") for
    FlashAttention-2 class kernels, "cudnn" / "fa3" for the Hopper kernels, "triton" for the Triton
    port of FlashAttention; the stack decides which runs (meshplan.ir.stack.Stack.attention_kernel).

    On GPUs the kernel runs at its measured plateau share of the MAMF (ATTN_FWD_EFF / ATTN_BWD_EFF
    for FlashAttention-2, times ATTN_KERNEL_RATE; in a step slowed as the GEMMs are) divided by `shape`'s penalty (attention.shape_penalty: diagonal and ragged tiles, per-CTA fixed
    work, wave quantisation), plus ATTN_KERNEL_FIXED_S per kernel launched (ATTN_BWD_KERNELS per
    backward call). `shape` is the calls one GPU runs (attention.layer_calls); without it the
    plateau rate alone is charged (a caller that does not know the sequence layout). CPU processes
    run PyTorch's CPU flash-attention kernel at its measured rates (host.CpuHostDevice)."""
    if flops_fwd <= 0:
        return 0.0
    return device_of(cluster).attention_time(flops_fwd, cluster, backward=backward, kernel=kernel, shape=shape,
                                             fitted=fitted)


def elementwise_time(nbytes: float, cluster) -> float:
    """A memory-bound element-wise pass over `nbytes`: HBM-bound on a GPU."""
    if nbytes <= 0:
        return 0.0
    return device_of(cluster).elementwise_time(nbytes, cluster)


def permute_time(nbytes: float, cluster) -> float:
    """A MoE token permutation's bytes (gather into expert order, scatter-add back): memory-bound on
    a GPU like any element-wise pass; on CPU cores the eager index_select / mul / index_add run at
    their own measured rate (constants.CPU_PERMUTE_GB_S_1T)."""
    if nbytes <= 0:
        return 0.0
    return device_of(cluster).permute_time(nbytes, cluster)


def fp8_weight_cast_time(weight_elements: float, cluster, recipe: str = "tensorwise", stack=None) -> float:
    """Once-per-step FP8 cast of `weight_elements` weights into the copies the forward and the
    input-gradient GEMMs read (Hopper FP8 GEMMs take only the TN layout, so backward needs W^T in
    FP8): the recipe's bytes per element (roofline.fp8_quant_bytes), eager torchao's where `stack`
    runs it uncompiled (`fp8_eager`)."""
    if weight_elements <= 0:
        return 0.0
    return weight_elements * fp8_quant_bytes(recipe, eager=fp8_eager(cluster, stack)) / hbm_rate(cluster)


def grad_accumulation_time(params: float, buffer_bytes: float, cluster) -> float:
    """One micro-batch's unfused gradient accumulation over `params` weights: the backward writes each
    weight gradient as a bf16 tensor and a separate pass adds it into the gradient buffer (read the
    bf16 gradient, read and write the buffer: 2 + 2 * buffer_bytes bytes per weight; 10 with fp32
    main gradients). Megatron-LM before 2022-02 did this in a backward hook per parameter,
    `param.main_grad.add_(param.grad.data)` (megatron/model/distributed.py, e.g. at cdde43385e, the
    code of Narayanan et al. SC'21); commit 83b1e42f30 (2022-02-13, "gradient accumulation fusion",
    on by default) folds the add into the weight-gradient GEMM (cuBLAS beta=1 into main_grad), as
    Transformer Engine's fuse_wgrad_accumulation and Megatron-Core do; AMD-AGI/Primus #995 describes
    the unfused path as "an extra full-size read-modify-write of main_grad per microbatch"."""
    if params <= 0:
        return 0.0
    return elementwise_time(params * (K.BF16 + 2 * buffer_bytes), cluster)
