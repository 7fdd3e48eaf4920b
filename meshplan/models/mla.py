"""Multi-head latent attention (MLA): DeepSeek-V2/V3's attention (arXiv 2412.19437 Sec. 2.1.1).

    MLAttention
      wq_a     nn.Linear(h, q_lora_rank)            query down-projection   (or, without q_lora_rank,
      q_norm   nn.RMSNorm(q_lora_rank)                                        one full-rank `wq`)
      wq_b     nn.Linear(q_lora_rank, heads * (nope + rope))
      wkv_a    nn.Linear(h, kv_lora_rank + rope)    the key/value latent | the shared rotary key
      kv_norm  nn.RMSNorm(kv_lora_rank)
      wkv_b    nn.Linear(kv_lora_rank, heads * (nope + v))   per-head key (nope part) | value
      wo       nn.Linear(heads * v, h)

Each head's query and key are [nope | rope] channels (qk = nope + rope wide); the rotary key part
is one head computed from x and shared by every head, and only the rope channels are rotated.
Values are v wide, so attention runs with different query/key and value widths, at the softmax
scale 1/sqrt(qk) (SDPA's default for that query width). YaRN's long-context rescaling of that
scale is not modelled: it matters only past the 4K pre-training context.

Heads are reshaped with -1, so tensor parallelism splits wq_b and wkv_b by heads (column-parallel)
and wo by its input (row-parallel) without touching this code; wq_a, wkv_a and both norms stay
whole on every rank. The rotary key is then one head every rank's heads read, so its gradient
is a sum over the ranks' heads: `SHARED_ROPE_KEY` tells the runtime which output columns of
wkv_a those are (meshplan.runtime.tensor_parallel sums them over the TP group in backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshplan.models.config import ModelConfig
from meshplan.models.layers import apply_rope

__all__ = ["MLAttention", "SHARED_ROPE_KEY"]

# attribute of the attention module: (linear name, first column) of the output columns every head
# reads (the rotary key), whose gradient tensor parallelism must sum over the ranks' heads
SHARED_ROPE_KEY = "shared_rope_key"


class MLAttention(nn.Module):
    """Causal multi-head latent attention (see the module docstring)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        h, n, b = config.hidden, config.heads, config.bias
        qk = self.nope + self.rope
        if config.q_lora_rank:
            self.wq_a: nn.Linear | None = nn.Linear(h, config.q_lora_rank, bias=b)
            self.q_norm: nn.RMSNorm | None = nn.RMSNorm(config.q_lora_rank, eps=config.norm_eps)
            self.wq_b: nn.Linear | None = nn.Linear(config.q_lora_rank, n * qk, bias=b)
            self.wq: nn.Linear | None = None
        else:
            self.wq_a = self.q_norm = self.wq_b = None
            self.wq = nn.Linear(h, n * qk, bias=b)
        self.wkv_a = nn.Linear(h, self.kv_lora_rank + self.rope, bias=b)
        self.kv_norm = nn.RMSNorm(self.kv_lora_rank, eps=config.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, n * (self.nope + self.v_dim), bias=b)
        self.wo = nn.Linear(n * self.v_dim, h, bias=b)
        setattr(self, SHARED_ROPE_KEY, ("wkv_a", self.kv_lora_rank))

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None, mask: Tensor | None = None) -> Tensor:
        """x (B, T, h) -> (B, T, h); mask as `Attention.forward` (None: causal)."""
        B, T, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(B, T, -1, self.nope + self.rope)                          # (B, T, n, qk)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(B, T, -1, self.nope + self.v_dim)   # (B, T, n, nope + v)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = k_pe.unsqueeze(2)                                             # (B, T, 1, rope)
        if rope is not None:
            q_pe, k_pe = apply_rope(q_pe, *rope), apply_rope(k_pe, *rope)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)       # (B, T, n, qk)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # (B, n, T, .)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))                # (B, T, h)
