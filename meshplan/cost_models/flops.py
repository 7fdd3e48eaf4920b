"""Model FLOPs the way Megatron-LM counts them (cost_models.md §3).

Per token per layer, forward: 2 * (weights a token multiplies), routed experts counted topk
times (router omitted, as Megatron does); core attention 4*s*h_q forward, halved for causal
masking. Training = 3x forward (fwd + dgrad + wgrad). Logits: 2*h*V forward.
`hardware` FLOPs add the recomputed forward passes.
"""

from __future__ import annotations

from meshplan.ir.profile import BlockProfile, ModelProfile

__all__ = ["layer_fwd_flops_per_token", "attention_fwd_flops_per_token", "model_flops_per_step",
           "recompute_flops_per_step"]

_DENSE_ROLES_SKIPPED = ("router",)


def layer_fwd_flops_per_token(b: BlockProfile) -> float:
    """GEMM FLOPs per token of one layer (no attention core)."""
    return sum(li.flops_per_token for li in b.linears if li.role not in _DENSE_ROLES_SKIPPED)


def attention_fwd_flops_per_token(b: BlockProfile, seq_len: int, *, causal_half: bool = True) -> float:
    if not b.heads:
        return 0.0
    f = 4.0 * seq_len * b.q_dim          # QK^T and PV, each 2*s*h_q per query token
    return f / 2 if (causal_half and b.causal) else f


def model_flops_per_step(p: ModelProfile, seq_len: int, global_batch: int, *, causal_half: bool = True) -> float:
    """Fwd+bwd model FLOPs of one step over `global_batch` sequences (no recompute)."""
    tokens = float(seq_len) * global_batch
    per_token = 0.0
    for b in p.layer_blocks():
        per_token += layer_fwd_flops_per_token(b) + attention_fwd_flops_per_token(b, seq_len, causal_half=causal_half)
    per_token += 2.0 * p.hidden * p.vocab        # output layer
    return 3.0 * per_token * tokens


def recompute_flops_per_step(p: ModelProfile, seq_len: int, global_batch: int, layout) -> float:
    """Extra forward FLOPs spent recomputing, for hardware FLOPs / HFU."""
    tokens = float(seq_len) * global_batch
    blocks = p.layer_blocks()
    rc = layout.recompute
    if rc == "none" or rc == 0:
        return 0.0
    if rc == "selective":
        return tokens * sum(attention_fwd_flops_per_token(b, seq_len) for b in blocks)
    if rc == "norm_act":
        return 0.0      # norms and the experts' activation are element-wise: no matmul FLOPs are redone
    if rc == "norm_moe":    # the MoE layers' GEMMs (router, experts, shared expert) run again
        moe_roles = ("router", "expert_in", "expert_out", "shared_in", "shared_out", "shared_folded")
        return tokens * sum(li.flops_per_token for b in blocks for li in b.linears if li.role in moe_roles)
    if rc == "op_sac":      # every second matmul runs again (torchtitan's op-level SAC)
        return tokens * sum(layer_fwd_flops_per_token(b) for b in blocks) / 2
    full = [layer_fwd_flops_per_token(b) + attention_fwd_flops_per_token(b, seq_len) for b in blocks]
    if rc == "full":
        return tokens * sum(full)
    frac = min(1.0, rc * layout.pp / max(1, len(blocks)))   # N layers per pipeline rank
    return tokens * sum(full) * frac
