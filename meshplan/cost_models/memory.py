"""Per-GPU memory of training state (cost_models.md §3, §5): weights, gradients, optimizer.

Bytes per parameter with bf16 weights, fp32 main gradients and fp32 Adam (master, m, v):
  zero 0 (DDP)                 2 + 4 + 12     (gradients 2 instead of 4 with grad_dtype="bf16")
  zero 1 (distributed optim.)  2 + 4 + 12/d
  zero 2 (+ sharded grads)     2 + (4 + 12)/d
  zero 3 (FSDP full shard)     (2 + 4 + 12)/d + the unsharded working set of the layers in use
where d is the data-parallel group the optimizer is sharded over (dp*cp for dense weights, the
expert-data-parallel degree for experts).

Optimizer state by `Layout.optimizer_dtype` (the dtype of Adam's m and v; master weights stay fp32):
  "fp32"  4 + 4 + 4 = 12 bytes per parameter (K.OPTIMIZER_BYTES; Megatron-LM's default)
  "bf16"  4 + 2 + 2 =  8 bytes per parameter (Transformer Engine FusedAdam with
          exp_avg_dtype=exp_avg_sq_dtype=bf16; Megatron-Core --exp-avg-dtype/--exp-avg-sq-dtype bf16)
"""

from __future__ import annotations

from meshplan.cost_models import constants as K

__all__ = ["state_bytes", "grad_bytes", "optimizer_bytes", "zero3_working_bytes"]

# master weights (always fp32) + Adam's two moments in the layout's optimizer_dtype
_MASTER_BYTES = K.FP32
_MOMENT_BYTES = {"fp32": K.FP32, "bf16": K.BF16}


def optimizer_bytes(layout) -> float:
    """Optimizer bytes per parameter: fp32 master weights + Adam m and v in layout.optimizer_dtype."""
    dtype = getattr(layout, "optimizer_dtype", "fp32")
    return _MASTER_BYTES + 2 * _MOMENT_BYTES[dtype]


def state_bytes(params: float, shard: int, zero: int, *, grad_bytes: float = K.GRAD_BYTES,
                optimizer_bytes: float = K.OPTIMIZER_BYTES) -> dict[str, float]:
    """Weights / gradients / optimizer bytes for `params` parameters held by a GPU (already
    divided by TP/EP), with optimizer state sharded `shard` ways as the ZeRO stage says.
    `grad_bytes`: bytes per gradient element of the gradient buffer (4 fp32, 2 bf16);
    `optimizer_bytes`: per parameter (12 with fp32 Adam moments, 8 with bf16: optimizer_bytes())."""
    d = max(1, shard)
    weights = K.PARAM_BYTES * params / (d if zero >= 3 else 1)
    grads = grad_bytes * params / (d if zero >= 2 else 1)
    opt = optimizer_bytes * params / (d if zero >= 1 else 1)
    return {"weights": weights, "gradients": grads, "optimizer": opt}


def grad_bytes(layout) -> float:
    """Bytes per element of the gradient buffer and of its reduction (layout.grad_dtype)."""
    return K.GRAD_BYTES if layout.grad_dtype == "fp32" else K.BF16


def zero3_working_bytes(layout, blocks, grad_elem_bytes: float) -> tuple[float, float]:
    """(weights, gradients) bytes of ZeRO-3's unsharded working set on a rank holding `blocks`.

    - "fsdp2" / "megatron": the unit is a transformer block. Forward holds the current and the
      prefetched block; backward also holds the current block's unsharded gradients before the
      reduce-scatter (bf16 for FSDP2, which casts to the reduce dtype per bucket; the gradient
      buffer's dtype for Megatron-FSDP, which reduces straight from its main-grad buffer).
    - "deepspeed": parameters are gathered per sub-module (nn.Linear) by a coordinator that keeps
      at most `stage3_max_live_parameters` live (a larger module is still gathered whole) and
      prefetches `stage3_prefetch_bucket_size` ahead; gradients leave through a bucket of
      `reduce_bucket_size` elements, the largest module's gradient being produced whole.
    """
    tp = layout.tp
    big = max((b.params - b.expert_params) / tp + b.expert_params / (layout.ep * layout.etp) for b in blocks)
    if layout.fsdp_impl == "deepspeed":
        largest = max((li.in_features * li.out_features for b in blocks for li in b.linears), default=0) / tp
        live = max(largest, min(K.DS_MAX_LIVE_PARAMS, largest + K.DS_PREFETCH_BUCKET))
        return K.PARAM_BYTES * live, K.PARAM_BYTES * max(largest, K.DS_REDUCE_BUCKET)
    g = grad_elem_bytes if layout.fsdp_impl == "megatron" else K.PARAM_BYTES
    return 2 * K.PARAM_BYTES * big, g * big
