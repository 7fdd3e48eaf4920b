"""Per-GPU memory of training state (cost_models.md §3, §5): weights, gradients, optimizer.

Bytes per parameter with bf16 weights, fp32 main gradients and fp32 Adam (master, m, v):
  zero 0 (DDP)                 2 + 4 + 12
  zero 1 (distributed optim.)  2 + 4 + 12/d
  zero 2 (+ sharded grads)     2 + (4 + 12)/d
  zero 3 (FSDP full shard)     (2 + 4 + 12)/d + the unsharded working set of the layers in use
where d is the data-parallel group the optimizer is sharded over (dp*cp for dense weights, the
expert-data-parallel degree for experts).
"""

from __future__ import annotations

from meshplan.cost_models import constants as K

__all__ = ["state_bytes"]


def state_bytes(params: float, shard: int, zero: int) -> dict[str, float]:
    """Weights / gradients / optimizer bytes for `params` parameters held by a GPU (already
    divided by TP/EP), with optimizer state sharded `shard` ways as the ZeRO stage says."""
    d = max(1, shard)
    weights = K.PARAM_BYTES * params / (d if zero >= 3 else 1)
    grads = K.GRAD_BYTES * params / (d if zero >= 2 else 1)
    opt = K.OPTIMIZER_BYTES * params / (d if zero >= 1 else 1)
    return {"weights": weights, "gradients": grads, "optimizer": opt}
