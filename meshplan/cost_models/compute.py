"""Per-GPU compute time of one layer for one micro-batch: roofline GEMMs, flash attention,
memory-bound element-wise work (cost_models.md §1, §9).

All functions are pure: (shapes, dtype, cluster) -> seconds.
"""

from __future__ import annotations

from meshplan.cluster import CPU_HOST_BF16_TFLOPS
from meshplan.cost_models import constants as K
from meshplan.cost_models.attention import AttnShape, shape_penalty, sm_count
from meshplan.errors import ConfigError
from meshplan.ir.layout import FP8_RECIPES

__all__ = ["gemm_time", "attention_time", "elementwise_time", "matmul_rate", "fp8_weight_cast_time", "is_cpu",
           "grad_accumulation_time", "fp8_recipe_factor", "grouped_gemm_time", "permute_time",
           "cpu_thread_share", "cpu_speed", "cpu_rate_scale", "cpu_op_overhead"]


def is_cpu(cluster) -> bool:
    """CPU processes (local-cpu or a calibrated profile of it): compute runs on host cores, where
    attention, element-wise ops and per-op dispatch cost what the GPU roofline does not charge."""
    return cluster.gpu.id == "cpu"


def cpu_thread_share(cluster) -> float:
    """Fraction of one core each process gets: local-cpu's matmul rate is the host's (all cores)
    divided among the processes, so processes x rate / host rate recovers the host's cores."""
    return min(1.0, K.CPU_HOST_CORES * cluster.gpu.bf16_tflops / CPU_HOST_BF16_TFLOPS)


def cpu_speed(cluster) -> float:
    """This process's CPU speed relative to the host the CPU_* rates were measured on: its matmul
    rate per core (local-cpu's constant or a calibrated one) over the matmul rate measured alongside
    them (constants.CPU_MICRO_MATMUL_GFLOPS_1T)."""
    per_core = cluster.gpu.bf16_tflops * 1e12 / cpu_thread_share(cluster)
    return per_core / (K.CPU_MICRO_MATMUL_GFLOPS_1T * 1e9)


def cpu_rate_scale(cluster) -> float:
    """This process's rate for CPU work measured on one reference thread (the CPU_* constants):
    its share of a core times its speed relative to the reference host.

    A calibrated profile that measured the host's small-op time (GPUSpec.cpu_op_us: chains of
    autograd muls, the op CPU_OP_FWD_S is defined by, run in every process at once) scales the
    preset's rate by how much slower or faster that op runs than on the quiet reference host
    (CPU_QUIET_OP_US_1T per op on a core of its own): the host work this scales (dispatch,
    autograd, gloo's loopback work, small element-wise kernels) follows the host's small-op speed,
    and the CPU_* constants hold for the quiet host at the preset's rate. (Scaling them by the
    calibrated matmul rate instead predicted the default job 15% fast on the quiet host: 4
    one-thread processes sustain 109 GFLOP/s of 512^3 bf16 matmul each there, 1.2x the preset's
    2-thread 2048^3 rate split 4 ways, while its step matched the preset's prediction, dp4 0.133 s
    measured against 0.132 predicted.) Otherwise: the matmul-derived share x speed."""
    op_us = getattr(cluster.gpu, "cpu_op_us", None)
    if op_us:
        # preset share x preset speed x (the quiet op time at that share, CPU_QUIET_OP_US_1T / share,
        # over the measured one): the share cancels, the measurement already holds it
        preset_speed = CPU_HOST_BF16_TFLOPS / K.CPU_HOST_CORES * 1e3 / K.CPU_MICRO_MATMUL_GFLOPS_1T
        return preset_speed * K.CPU_QUIET_OP_US_1T / op_us
    return cpu_thread_share(cluster) * cpu_speed(cluster)


def cpu_op_overhead(ops, cluster) -> tuple[float, float]:
    """(forward, backward) seconds of host overhead for a traced op list on a CPU process: views and
    compute ops each pay their measured dispatch + autograd cost, slowed by the core share."""
    if not ops:
        return 0.0, 0.0
    views = sum(1 for o in ops if getattr(o, "kind", "") == "view")
    other = len(ops) - views
    slow = 1.0 / cpu_rate_scale(cluster)
    return ((views * K.CPU_VIEW_FWD_S + other * K.CPU_OP_FWD_S) * slow,
            (views * K.CPU_VIEW_BWD_S + other * K.CPU_OP_BWD_S) * slow)


def matmul_rate(cluster, fp8: bool, fitted: K.Fitted = K.FITTED) -> float:
    """Achieved FLOP/s of a large GEMM (MAMF), BF16 or FP8, in a training step."""
    gpu = cluster.gpu
    if fp8:
        return gpu.fp8_tflops * 1e12 * gpu.fp8_gemm_efficiency * fitted.training_gemm_eff
    return gpu.bf16_tflops * 1e12 * gpu.gemm_efficiency * fitted.training_gemm_eff


def fp8_recipe_factor(recipe: str, cluster=None) -> float:
    """Quantisation traffic of an FP8 recipe relative to tensorwise (constants.FP8_QUANT_BYTES);
    raises where the GPU cannot run it (MXFP8 needs Blackwell's block-scaled tensor cores)."""
    if recipe not in K.FP8_QUANT_BYTES:
        raise ValueError(f"fp8 recipe {recipe!r}: use one of {FP8_RECIPES}")
    if recipe == "mxfp8" and cluster is not None and cluster.gpu.id not in K.MXFP8_GPUS:
        raise ConfigError(f"fp8 recipe 'mxfp8' needs MX block-scaled tensor cores (Blackwell: "
                          f"{', '.join(K.MXFP8_GPUS)}); {cluster.gpu.name} has none")
    return K.FP8_QUANT_BYTES[recipe] / K.FP8_QUANT_BYTES["tensorwise"]


def gemm_time(m: float, n: float, k: float, cluster, *, fp8: bool = False, count: float = 1.0,
              weight_cast: bool = False, recipe: str = "tensorwise", fitted: K.Fitted = K.FITTED) -> float:
    """`count` GEMMs of (m x k) @ (k x n): max(compute, HBM traffic) plus a fixed per-kernel cost
    that makes small GEMMs inefficient (Calculon-style shape dependence).

    FP8 adds the quantisation of the (m x k) activation operand. The (k x n) weight's FP8 copy is
    made once per step and reused by every micro-batch (Transformer Engine casts a weight on the
    first micro-batch and caches it and its transpose; that cast is `fp8_weight_cast_time`), so it
    is not charged here unless `weight_cast` (an operand that is not a cached weight). `recipe` scales
    the quantisation traffic (fp8_recipe_factor)."""
    if m <= 0 or n <= 0 or k <= 0 or count <= 0:
        return 0.0
    flops = 2.0 * m * n * k
    elt = K.FP8 if fp8 else K.BF16
    nbytes = (m * k + k * n) * elt + m * n * K.BF16
    t_compute = flops / matmul_rate(cluster, fp8, fitted)
    t_memory = nbytes / (cluster.gpu.hbm_tb_s * 1e12 * K.HBM_EFF)
    fixed = _gemm_fixed(cluster, fp8)
    extra = 0.0
    if fp8:   # quantise the inputs (fused cast + amax), memory-bound
        cast = m * k + (k * n if weight_cast else 0.0)
        extra = cast * K.FP8_CAST_BYTES_PER_ELEMENT / (cluster.gpu.hbm_tb_s * 1e12 * K.HBM_EFF)
        if recipe != "tensorwise":
            extra *= fp8_recipe_factor(recipe)
    return count * (max(t_compute, t_memory) + fixed + extra)


def grouped_gemm_time(rows: float, n: float, k: float, cluster, *, groups: float, fp8: bool = False,
                      recipe: str = "tensorwise", fitted: K.Fitted = K.FITTED) -> float:
    """`groups` GEMMs of (rows x k) @ (k x n) run as ONE grouped kernel (torch._grouped_mm, which
    meshplan's experts call; TE GroupedLinear / grouped_gemm under Megatron-Core --moe-grouped-gemm).
    Each group's rows occupy whole GEMM_TILE_M-row tiles, so the math is that of the padded rows; the
    HBM traffic, the FP8 input cast and the per-kernel fixed cost (launch, prologue, last wave) are
    paid on the real rows and once per kernel, not once per expert as separate GEMMs would.

    On CPU processes there is no grouped kernel: meshplan::grouped_mm loops over the groups, one
    GEMM call each (models/grouped_mm.py), so each group is a GEMM of its own rows with its own
    fixed cost (its Python is host.moe_loop_host_time)."""
    if rows <= 0 or n <= 0 or k <= 0 or groups <= 0:
        return 0.0
    if is_cpu(cluster):
        return gemm_time(rows, n, k, cluster, count=groups, fitted=fitted)
    padded = -(-rows // K.GEMM_TILE_M) * K.GEMM_TILE_M if rows >= 1 else K.GEMM_TILE_M
    elt = K.FP8 if fp8 else K.BF16
    hbm = cluster.gpu.hbm_tb_s * 1e12 * K.HBM_EFF
    t_compute = 2.0 * padded * n * k / matmul_rate(cluster, fp8, fitted)
    t_memory = ((rows * k + k * n) * elt + rows * n * K.BF16) / hbm
    extra = 0.0
    if fp8:
        extra = rows * k * K.FP8_CAST_BYTES_PER_ELEMENT / hbm
        if recipe != "tensorwise":
            extra *= fp8_recipe_factor(recipe)
    return groups * (max(t_compute, t_memory) + extra) + _gemm_fixed(cluster, fp8)


def _gemm_fixed(cluster, fp8: bool) -> float:
    """Fixed seconds of one GEMM call beyond its FLOPs: a GPU kernel's launch, prologue and last
    wave; on a CPU process the GEMM library's per-call work (constants.CPU_GEMM_CALL_S, at this
    process's core share and speed)."""
    if is_cpu(cluster):
        return K.CPU_GEMM_CALL_S / cpu_rate_scale(cluster)
    return K.FP8_GEMM_FIXED_S if fp8 else K.GEMM_FIXED_S


def attention_time(flops_fwd: float, cluster, *, backward: bool, kernel: str = "flash",
                   shape: AttnShape | None = None, fitted: K.Fitted = K.FITTED) -> float:
    """Flash attention (BF16) on `flops_fwd` forward FLOPs (causal masking already halving them, as
    flops.attention_fwd_flops_per_token counts); backward does ATTN_BWD_FLOP_RATIO x.
    `kernel` is the implementation (constants.ATTN_KERNEL_RATE): "fa2" (= "flash") for
    FlashAttention-2 class kernels, "cudnn" / "fa3" for the Hopper kernels, "triton" for the Triton
    port of FlashAttention; the stack decides which runs (meshplan.ir.stack.Stack.attention_kernel).

    On GPUs the kernel runs at its plateau efficiency (ATTN_FWD_EFF / ATTN_BWD_EFF of the GEMM rate)
    divided by `shape`'s penalty (attention.shape_penalty: diagonal and ragged tiles, per-CTA fixed
    work, wave quantisation), plus ATTN_KERNEL_FIXED_S per kernel launched (ATTN_BWD_KERNELS per
    backward call). `shape` is the calls one GPU runs (attention.layer_calls); without it the
    plateau rate alone is charged (a caller that does not know the sequence layout)."""
    if flops_fwd <= 0:
        return 0.0
    if is_cpu(cluster):   # PyTorch's CPU flash-attention kernel, measured rates (constants.CPU_SDPA_*)
        rate = (K.CPU_SDPA_BWD_GFLOPS_1T if backward else K.CPU_SDPA_FWD_GFLOPS_1T) * 1e9 * cpu_rate_scale(cluster)
        return flops_fwd / rate
    try:
        speed = K.ATTN_KERNEL_RATE[kernel][1 if backward else 0]
    except KeyError:
        raise ValueError(f"unknown attention kernel {kernel!r}; known: {sorted(K.ATTN_KERNEL_RATE)}") from None
    rate = matmul_rate(cluster, False, fitted) * speed
    if backward:
        t = flops_fwd * K.ATTN_BWD_FLOP_RATIO / (rate * fitted.attn_bwd_eff)
    else:
        t = flops_fwd / (rate * fitted.attn_fwd_eff)
    if shape is None:
        return t
    launches = shape.kernels * (K.ATTN_BWD_KERNELS if backward else 1)
    return t * shape_penalty(shape, sm_count(cluster), backward=backward) + launches * K.ATTN_KERNEL_FIXED_S


def elementwise_time(nbytes: float, cluster) -> float:
    if nbytes <= 0:
        return 0.0
    if is_cpu(cluster):   # bf16 element-wise ops on CPU cores run far below the copy bandwidth
        return nbytes / (K.CPU_ELEMENTWISE_GB_S_1T * 1e9 * cpu_rate_scale(cluster))
    return nbytes / (cluster.gpu.hbm_tb_s * 1e12 * K.HBM_EFF)


def permute_time(nbytes: float, cluster) -> float:
    """A MoE token permutation's bytes (gather into expert order, scatter-add back): memory-bound on
    a GPU like any element-wise pass; on CPU cores the eager index_select / mul / index_add run at
    their own measured rate (constants.CPU_PERMUTE_GB_S_1T)."""
    if nbytes <= 0:
        return 0.0
    if is_cpu(cluster):
        return nbytes / (K.CPU_PERMUTE_GB_S_1T * 1e9 * cpu_rate_scale(cluster))
    return elementwise_time(nbytes, cluster)


def fp8_weight_cast_time(weight_elements: float, cluster, recipe: str = "tensorwise") -> float:
    """Once-per-step FP8 cast of `weight_elements` weights: read bf16, write the FP8 copy and its
    transpose (Hopper FP8 GEMMs take only the TN layout, so backward needs W^T in FP8); other recipes
    scale it by fp8_recipe_factor."""
    if weight_elements <= 0:
        return 0.0
    t = weight_elements * K.FP8_WEIGHT_CAST_BYTES / (cluster.gpu.hbm_tb_s * 1e12 * K.HBM_EFF)
    return t if recipe == "tensorwise" else t * fp8_recipe_factor(recipe)


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
