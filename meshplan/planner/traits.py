"""The model facts `meshplan.ir.support.runtime_limits` needs, read from a traced `ModelProfile`."""

from __future__ import annotations

from meshplan.ir.profile import ModelProfile
from meshplan.ir.routed_experts import is_routed_experts
from meshplan.ir.support import ModelTraits

__all__ = ["model_traits", "packing"]


def packing(block, linear) -> str | None:
    """The packed-projection label of one linear of a traced block, or None: "colwise_qkv" for a
    weight whose rows hold Q, K and V heads together (q_dim + 2 kv_dim outputs), "colwise_gate_up"
    for one holding a gated MLP's gate and up projections (2 x ffn_hidden outputs)."""
    if linear.role == "attn_qkv" and block.heads and linear.out_features == block.q_dim + 2 * block.kv_dim \
            and sum(li.role == "attn_qkv" for li in block.linears) == 1:
        return "colwise_qkv"
    if linear.role == "mlp_in" and block.gated and block.ffn_hidden and linear.out_features == 2 * block.ffn_hidden:
        return "colwise_gate_up"
    return None


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
    """meshplan's stacked-weight experts (forward(x, counts)), or transformers-style routed experts
    the runtime adapts (runtime/hf_experts.py, matched by structure) in MoE layers that tensor
    parallelism can also fold (the trait opens tp > 1 too): layers with no linear of their own
    beside the experts (Mixtral: router and experts), or with a `routed(x)` method
    (runtime/moe_folding.py). Without a module, meshplan's model."""
    if module is None:
        return True
    from torch import nn

    from meshplan.models.moe import GroupedExperts
    if any(isinstance(m, GroupedExperts) for m in module.modules()):
        return True
    routed = [fqn for fqn, m in module.named_modules() if is_routed_experts(m)]
    for fqn in routed:
        layer = module.get_submodule(fqn.rpartition(".")[0])
        experts = module.get_submodule(fqn)
        linears = [m for m in layer.modules() if isinstance(m, nn.Linear)
                   and not any(m is e for e in experts.modules())]
        if linears and not callable(getattr(layer, "routed", None)):
            return False    # e.g. Qwen2-MoE's shared expert: tp > 1 would be refused (moe_folding)
    return bool(routed)


def _etp_experts(module) -> bool:
    """Every expert module declares how expert tensor parallelism splits it (`etp_split`,
    meshplan's GroupedExperts); without a module, meshplan's model."""
    if module is None:
        return True
    return not any(is_routed_experts(m) and not getattr(m, "etp_split", None) for m in module.modules())


def _partly_fused_qkv(block) -> bool:
    """Q, K and V come from two linears (e.g. q separate, k|v fused), or from one whose width is
    not q + 2 kv (a packing the runtime does not split per part), or from a fused one read by an
    attention that runs in the block's own forward (no attention sub-module: the runtime can
    neither find its head counts nor make them local)."""
    qkv = [li for li in block.linears if li.role == "attn_qkv"]
    if not block.heads or not qkv:
        return False
    if len(qkv) == 2 or (len(qkv) == 1 and packing(block, qkv[0]) is None):
        return True
    inst = block.instances[0] if block.instances else ""
    return len(qkv) == 1 and bool(inst) and any(o.kind == "attention" and o.module == inst for o in block.ops)


def model_traits(profile: ModelProfile, module=None) -> ModelTraits:
    """`module`: the nn.Module the profile was traced from, when there is one."""
    blocks = profile.layer_blocks()
    fused_qkv = fused_gate_up = partly_fused_qkv = False
    sdpa_causal = True
    for b in blocks:
        for lin in b.linears:
            fused_qkv = fused_qkv or packing(b, lin) == "colwise_qkv"
            fused_gate_up = fused_gate_up or packing(b, lin) == "colwise_gate_up"
        partly_fused_qkv = partly_fused_qkv or _partly_fused_qkv(b)
        if b.heads and b.ops:     # analytic profiles (from a config, no graph) are meshplan's SDPA models
            sdpa = [o for o in b.ops if o.kind == "attention" and "scaled_dot_product" in o.target]
            sdpa_causal = sdpa_causal and bool(sdpa) and b.causal
    return ModelTraits(moe=any(b.is_moe for b in blocks), fused_qkv=fused_qkv, fused_gate_up=fused_gate_up,
                       partly_fused_qkv=partly_fused_qkv, sdpa_causal=sdpa_causal, cp_positions=_cp_positions(module),
                       ep_experts=_ep_experts(module), etp_experts=_etp_experts(module),
                       layers=profile.num_layers)
