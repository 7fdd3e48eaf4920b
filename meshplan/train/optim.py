"""The optimizer the plan's layout asks for: AdamW with fp32 or bf16 moments, or Muon.

`Layout.optimizer` picks the algorithm: "adamw" (below) or "muon" (train/muon.py: Muon for the
hidden matrices, orthogonalised by Newton-Schulz on one owner rank per matrix, AdamW for
embeddings, head, norms and routers; `optimizer_dtype` does not apply to it).

`Layout.optimizer_dtype` (cost_models/layout.py) is the dtype of Adam's two moments:

- "fp32" (default): `torch.optim.AdamW`; master weights, m and v in fp32 (12 bytes/param).
- "bf16": master weights stay fp32 (the parameters FSDP shards are fp32), m and v are stored in
  bf16 (8 bytes/param), as Transformer Engine's FusedAdam(exp_avg_dtype=bf16,
  exp_avg_sq_dtype=bf16) and Megatron-Core's --exp-avg-dtype/--exp-avg-sq-dtype bf16 do. On CPU
  (and on GPUs without Transformer Engine) `AdamWBF16Moments` below runs it: each step reads the
  moments into fp32, updates them and the weight in fp32, and rounds the moments back to bf16
  (round to nearest even). With Transformer Engine on CUDA, its FusedAdam runs instead.

The update equals torch's AdamW (decoupled weight decay, bias correction) up to the moments'
bf16 rounding. The state keys are torch's (step, exp_avg, exp_avg_sq), so checkpoints
(checkpoint.optimizer_state, DCP) work the same and reshard like the parameters.
"""

from __future__ import annotations

import torch

from meshplan.errors import ConfigError
from meshplan.ir.layout import OPTIMIZER_DTYPES

__all__ = ["AdamWBF16Moments", "build_optimizer", "OPTIMIZER_DTYPES", "OPTIMIZERS"]

OPTIMIZERS = ("adamw", "muon")


class AdamWBF16Moments(torch.optim.AdamW):
    """AdamW over fp32 parameters (the master weights) with bf16 first and second moments.

    A subclass of torch's AdamW (same hyper-parameters, state keys and checkpoint handling) whose
    step stores the moments in `moment_dtype`. State loaded in another dtype (a checkpoint written
    with fp32 moments, or zeros created by checkpoint.load) is converted at the next step."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, moment_dtype: torch.dtype = torch.bfloat16):
        if not lr > 0:
            raise ConfigError(f"lr must be > 0, got {lr!r}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.moment_dtype = moment_dtype

    def _init_state(self, p: torch.Tensor, dtype: torch.dtype) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        for k in ("exp_avg", "exp_avg_sq"):
            if st[k].dtype != dtype:
                st[k] = st[k].to(dtype)
        return st

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            dtype = self.moment_dtype
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self._init_state(p, dtype)
                st["step"] += 1
                t = float(st["step"])
                # elementwise: work on the local shards (DTensor dispatch costs ~0.1 ms an op; the
                # state stays a DTensor for checkpoints, its local tensor is updated in place)
                w, g, m_st, v_st = (local_shard(x) for x in (p, p.grad, st["exp_avg"], st["exp_avg_sq"]))
                g = g.float()
                m = m_st.float().lerp_(g, 1 - b1)                      # fp32 arithmetic, bf16 storage
                v = v_st.float().mul_(b2).addcmul_(g, g, value=1 - b2)
                m_st.copy_(m)
                v_st.copy_(v)
                if wd:
                    w.mul_(1 - lr * wd)
                bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
                denom = (v.sqrt() / (bc2 ** 0.5)).add_(eps)
                w.addcdiv_(m, denom, value=-lr / bc1)
        return loss


def closure_loss(closure):
    """torch.optim's closure convention: re-evaluate the loss with gradients enabled (inside a step
    that runs under no_grad), or None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (updated in place by the optimizers), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _te_fused_adam(params, **kw):
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam
    except ImportError:
        return None
    return FusedAdam(params, adam_w_mode=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, **kw)


def build_optimizer(params, *, optimizer_dtype: str = "fp32", lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                    weight_decay: float = 0.0, device: torch.device | None = None,
                    use_transformer_engine: bool = False, optimizer: str = "adamw") -> torch.optim.Optimizer:
    """AdamW with the moments in `optimizer_dtype` (see the module docstring), or `optimizer="muon"`
    (train/muon.py; `params` must then be (name, parameter) pairs: the names tell the embedding,
    head and routers, which stay on AdamW). `params` may be (name, parameter) pairs for AdamW too.
    TE's FusedAdam only when asked (`use_transformer_engine`) on CUDA and installed: it does not
    take DTensor parameters (TP/FSDP2 shards), so meshplan's own AdamWBF16Moments is the default."""
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer={optimizer!r}: use one of {OPTIMIZERS}")
    if optimizer_dtype not in OPTIMIZER_DTYPES:
        raise ConfigError(f"optimizer_dtype={optimizer_dtype!r}: use one of {OPTIMIZER_DTYPES}")
    params = list(params)
    if optimizer == "muon":
        from meshplan.train.muon import Muon
        return Muon(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    params = [p[1] if isinstance(p, tuple) else p for p in params]
    if optimizer_dtype == "fp32":
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if use_transformer_engine and device is not None and device.type == "cuda":
        opt = _te_fused_adam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if opt is not None:
            return opt
    return AdamWBF16Moments(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
