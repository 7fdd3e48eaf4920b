"""The model facts `meshplan.ir.support.runtime_limits` needs, read from a traced `ModelProfile`."""

from __future__ import annotations

from meshplan.ir.profile import ModelProfile
from meshplan.ir.support import ModelTraits

__all__ = ["model_traits"]


def _cp_positions(module) -> bool:
    """Whether the runtime's context parallelism can place this model's positions per CP rank:
    meshplan's Transformer (rope tables / position buffers it reorders) or a transformers model
    with SDPA attention and rotary embeddings (position ids). Without a module (a preset name or
    a config), the model is meshplan's own."""
    if module is None:
        return True
    from meshplan.models.transformer import Transformer
    if isinstance(module, Transformer):
        return True
    config = getattr(module, "config", None)
    if config is not None and hasattr(module, "can_generate"):      # a transformers PreTrainedModel
        return (getattr(config, "_attn_implementation", None) == "sdpa"
                and any("rotary" in type(m).__name__.lower() for m in module.modules()))
    return False


def _ep_experts(module) -> bool:
    """meshplan's stacked-weight experts (forward(x, counts)); without a module, meshplan's model."""
    if module is None:
        return True
    from meshplan.models.moe import GroupedExperts
    return any(isinstance(m, GroupedExperts) for m in module.modules())


def model_traits(profile: ModelProfile, module=None) -> ModelTraits:
    """`module`: the nn.Module the profile was traced from, when there is one."""
    blocks = profile.layer_blocks()
    fused_qkv = fused_gate_up = False
    sdpa_causal = True
    for b in blocks:
        for lin in b.linears:
            # one weight whose rows hold Q and K/V heads together (q_dim + 2 kv_dim, or 3 q_dim)
            if lin.role == "attn_qkv" and b.heads and lin.out_features > b.q_dim:
                fused_qkv = True
            if lin.role == "mlp_in" and b.gated and b.ffn_hidden and lin.out_features == 2 * b.ffn_hidden:
                fused_gate_up = True
        if b.heads and b.ops:     # analytic profiles (from a config, no graph) are meshplan's SDPA models
            sdpa = [o for o in b.ops if o.kind == "attention" and "scaled_dot_product" in o.target]
            sdpa_causal = sdpa_causal and bool(sdpa) and b.causal
    return ModelTraits(moe=any(b.is_moe for b in blocks), fused_qkv=fused_qkv, fused_gate_up=fused_gate_up,
                       sdpa_causal=sdpa_causal, cp_positions=_cp_positions(module),
                       ep_experts=_ep_experts(module), layers=profile.num_layers)
