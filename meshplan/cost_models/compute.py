"""Per-GPU compute time of one layer for one micro-batch: roofline GEMMs, flash attention,
memory-bound element-wise work (cost_models.md §1, §9).

All functions are pure: (shapes, dtype, cluster) -> seconds. What depends on the hardware (a
kernel call's fixed cost, attention kernels, element-wise rates) is asked of the cluster's device
(cost_models.device: GPUs in gpu.py, local CPU processes in host.py); the roofline both share is
cost_models.roofline.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.cost_models import constants as K
from meshplan.cost_models.attention import AttnShape
from meshplan.cost_models.device import device_of
from meshplan.cost_models.roofline import (
    fp8_cast_time,
    fp8_quant_bytes,
    fp8_recipe_factor,
    fp8_weight_gathered,
    gemm_roofline,
    hbm_rate,
    matmul_rate,
    torchao_precomputes_scales,
    torchao_weight_cast_bytes,
)

__all__ = ["gemm_time", "attention_time", "elementwise_time", "matmul_rate", "fp8_weight_cast_time", "fp8_eager",
           "Fp8WeightCasts", "fp8_weight_casts",
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
    output gradient, a third per GEMM of the three a linear runs). The (k x n) weight's casts are
    priced apart, as its stack runs them (`fp8_weight_casts`: once per step for Transformer Engine,
    every micro-batch for torchao), so they are not charged here unless `weight_cast` (an operand
    that is not a weight). `recipe`
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


@dataclass(frozen=True)
class Fp8WeightCasts:
    """Seconds one GPU spends casting its FP8 linears' weights: once per step, and in each micro-batch's
    forward and backward (where a pipeline schedule and the FSDP overlap see them)."""

    step_s: float = 0.0
    fwd_s: float = 0.0
    bwd_s: float = 0.0

    def per_step(self, microbatches: int) -> float:
        return self.step_s + microbatches * (self.fwd_s + self.bwd_s)


def fp8_weight_casts(dense: float, expert: float, cluster, layout, recipe: str = "tensorwise",
                     stack=None, *, fp32_weights: bool | None = None) -> Fp8WeightCasts:
    """The casts of `dense` + `expert` FP8 weight elements held by one GPU into the copies the forward
    and input-gradient GEMMs read (Hopper FP8 GEMMs take only the TN layout, so backward needs W^T),
    as the stack's FP8 library runs them (constants.FP8_QUANT_BYTES and what follows it):

    - Transformer Engine: once per step, on the first micro-batch, cached for the rest.
    - torchao: no cache; every micro-batch's forward casts each weight and its backward casts it
      again, at the measured rate (eager torchao's where the stack runs it uncompiled: `fp8_eager`)
      split between them by roofline.torchao_weight_cast_bytes, and scaled up where the linear
      reads fp32 weights (`fp32_weights`; None: where autocast runs over fp32 parameters,
      `_reads_fp32`). Where FSDP2 gathers the dense weights in FP8 (roofline.fp8_weight_gathered)
      the GEMMs cast nothing: each all-gather
      casts the GPU's fp32 shard (dense / layout.shard; again in backward when resharded after
      forward, once a step when torch.distributed.pipelining keeps them gathered), the backward
      copies the gathered FP8 weight into the input-gradient GEMM's layout, and precomputed scales
      read every shard once a step."""
    if dense + expert <= 0:
        return Fp8WeightCasts()
    hbm = hbm_rate(cluster)
    per_elt = fp8_quant_bytes(recipe, eager=fp8_eager(cluster, stack))
    if stack is None or stack.fp8_impl != "torchao":
        return Fp8WeightCasts(step_s=(dense + expert) * per_elt / hbm)
    local = expert
    step = fwd = bwd = 0.0
    if fp8_weight_gathered(layout, recipe, stack):
        shard = dense / layout.shard
        precomputed = torchao_precomputes_scales(stack)
        cast = shard * K.FP8_GATHER_CAST_BYTES[precomputed] / hbm
        if precomputed:
            step += shard * K.FP8_GATHER_PRECOMPUTE_BYTES / hbm
        if stack.pp_fsdp_deferred and layout.pp > 1 and not layout.reshard_after_forward:
            step += cast                     # gathered once, kept for every micro-batch
        else:
            fwd += cast
            bwd += cast if layout.reshard_after_forward else 0.0
        bwd += dense * K.FP8_GATHERED_TRANSPOSE_BYTES / hbm
    else:
        local += dense
    # the measured rate is for bf16 weights; the derived bytes scale it to the width read and split it
    f16, b16 = torchao_weight_cast_bytes(K.BF16)
    if fp32_weights is None:
        fp32_weights = _reads_fp32(layout, stack)
    f, b = torchao_weight_cast_bytes(K.FP32 if fp32_weights else K.BF16)
    cast = local * per_elt / hbm / (f16 + b16)
    return Fp8WeightCasts(step_s=step, fwd_s=fwd + cast * f, bwd_s=bwd + cast * b)


def _reads_fp32(layout, stack) -> bool:
    """Whether torchao's linears cast the fp32 parameters themselves: autocast gives the mixed
    precision over them (Stack.master_weights "params" where no FSDP2 wrapper holds bf16 copies:
    memory.autocast_runs), rather than FSDP2's bf16 param_dtype copies or a bf16 model."""
    # imported here: memory imports ranks, which imports this module
    from meshplan.cost_models.memory import autocast_runs
    return stack.master_weights == "params" and autocast_runs(layout)


@dataclass(frozen=True)
class _Unsharded:
    """The parts of a Layout fp8_weight_casts reads, for weights no FSDP shards."""

    zero: int = 0
    shard: int = 1
    tp: int = 1
    pp: int = 1
    reshard_after_forward: bool = True


_UNSHARDED = _Unsharded()


def fp8_weight_cast_time(weight_elements: float, cluster, recipe: str = "tensorwise", stack=None, *,
                         layout=None, microbatches: int = 1, expert: bool = False) -> float:
    """A step's casts of `weight_elements` FP8 weights (`fp8_weight_casts`) over `microbatches`
    micro-batches: one linear's, dense or `expert`. Without `layout`: bf16 weights, not sharded."""
    if weight_elements <= 0:
        return 0.0
    d, e = (0.0, weight_elements) if expert else (weight_elements, 0.0)
    if layout is None:      # bf16 weights no FSDP shards (the measured layers')
        return fp8_weight_casts(d, e, cluster, _UNSHARDED, recipe, stack, fp32_weights=False).per_step(microbatches)
    return fp8_weight_casts(d, e, cluster, layout, recipe, stack).per_step(microbatches)


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
