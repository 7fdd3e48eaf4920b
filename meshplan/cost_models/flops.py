"""Model FLOPs the way Megatron-LM counts them (cost_models.md §3).

Per token per layer, forward: 2 * (weights a token multiplies), routed experts counted topk
times (router omitted, as Megatron does); core attention 4*s*h_q forward, halved for causal
masking. Training = 3x forward (fwd + dgrad + wgrad). Logits: 2*h*V forward.
A sliding-window layer (BlockProfile.attn_window = w < s) counts the keys its band keeps: query i
attends min(i+1, w) keys, w - w^2/(2s) on average instead of s/2 (Megatron-Bridge's
num_floating_point_operations counts the same band, `swa_context`; docs/cost_model_mechanisms.md).
Multi-token prediction counts too, as Megatron-LM's `num_floating_point_operations`
(megatron/training/training.py) does: per depth one more layer of the last layer's kind, the
(2h -> h) projection (2 * 2h * h) and one more logits GEMM; MFU then includes the MTP work.
`hardware` FLOPs add the recomputed forward passes.
"""

from __future__ import annotations

from meshplan.ir.profile import MOE_ROLES, BlockProfile, ModelProfile

__all__ = ["layer_fwd_flops_per_token", "attention_fwd_flops_per_token", "attended_keys", "model_flops_per_step",
           "recompute_flops_per_step"]

_DENSE_ROLES_SKIPPED = ("router",)


def layer_fwd_flops_per_token(b: BlockProfile) -> float:
    """GEMM FLOPs per token of one layer (no attention core)."""
    return sum(li.flops_per_token for li in b.linears if li.role not in _DENSE_ROLES_SKIPPED)


def attended_keys(seq_len: float, window: int = 0, *, causal: bool = True, causal_half: bool = True) -> float:
    """Keys one query attends on average: s/2 under a causal mask (the continuous form Megatron
    uses; s with `causal_half=False`, the convention that counts the mask in full), w - w^2/(2s)
    under a causal band of w < s keys (w when counting in full)."""
    s = float(seq_len)
    if window and window < s:
        return window - window * window / (2.0 * s) if (causal_half and causal) else float(window)
    return s / 2 if (causal_half and causal) else s


def attention_fwd_flops_per_token(b: BlockProfile, seq_len: int, *, causal_half: bool = True) -> float:
    if not b.heads:
        return 0.0
    # QK^T (2 q_dim per attended key) and PV (2 o_dim per attended key)
    keys = attended_keys(seq_len, b.attn_window, causal=b.causal, causal_half=causal_half)
    return 2.0 * keys * (b.q_dim + b.o_dim)


def _unique_blocks(p: ModelProfile) -> list[tuple[BlockProfile, int]]:
    """Each unique block with the number of layers that run it: per-layer sums are per block x count."""
    counts: dict[int, int] = {}
    for i in p.layers:
        counts[i] = counts.get(i, 0) + 1
    return [(p.blocks[i], n) for i, n in counts.items()]


def model_flops_per_step(p: ModelProfile, seq_len: int, global_batch: int, *, causal_half: bool = True) -> float:
    """Fwd+bwd model FLOPs of one step over `global_batch` sequences (no recompute)."""
    tokens = float(seq_len) * global_batch
    per_token = 0.0
    for b, n in _unique_blocks(p):
        per_token += n * (layer_fwd_flops_per_token(b) + attention_fwd_flops_per_token(b, seq_len,
                                                                                    causal_half=causal_half))
    per_token += 2.0 * p.hidden * p.vocab        # output layer
    if p.mtp_depth and p.layers:
        last = p.blocks[p.layers[-1]]
        per_token += p.mtp_depth * (layer_fwd_flops_per_token(last)
                                    + attention_fwd_flops_per_token(last, seq_len, causal_half=causal_half)
                                    + 4.0 * p.hidden * p.hidden + 2.0 * p.hidden * p.vocab)
    return 3.0 * per_token * tokens


def recompute_flops_per_step(p: ModelProfile, seq_len: int, global_batch: int, layout) -> float:
    """Extra forward FLOPs spent recomputing, for hardware FLOPs / HFU."""
    tokens = float(seq_len) * global_batch
    rc = layout.recompute
    if rc == "none" or rc == 0 or rc == "norm_act":
        return 0.0      # norm_act: norms and the experts' activation are element-wise, no matmul redone
    blocks = _unique_blocks(p)
    if rc == "selective":
        return tokens * sum(n * attention_fwd_flops_per_token(b, seq_len) for b, n in blocks)
    if rc == "norm_moe":    # the MoE layers' GEMMs (router, experts, shared expert) run again
        return tokens * sum(n * li.flops_per_token for b, n in blocks for li in b.linears if li.role in MOE_ROLES)
    if rc == "mla_up":      # latent attention's up-projections and the dense MLPs run again
        return tokens * sum(n * li.flops_per_token for b, n in blocks for li in b.linears
                            if (b.latent_dim and li.role == "attn_qkv") or li.role in ("mlp_in", "mlp_out"))
    if rc == "op_sac":      # every second matmul runs again (torchtitan's op-level SAC)
        return tokens * sum(n * layer_fwd_flops_per_token(b) for b, n in blocks) / 2
    full = sum(n * (layer_fwd_flops_per_token(b) + attention_fwd_flops_per_token(b, seq_len)) for b, n in blocks)
    if rc == "full":
        return tokens * full
    frac = min(1.0, rc * layout.pp / max(1, p.num_layers))   # N layers per pipeline rank
    return tokens * full * frac
