"""The model facts `meshplan.ir.support.runtime_limits` needs, read from a traced `ModelProfile`."""

from __future__ import annotations

from meshplan.ir.profile import ModelProfile
from meshplan.ir.routed_experts import is_routed_experts
from meshplan.ir.support import ModelTraits

__all__ = ["model_traits", "packing", "fold_shared_roles", "moe_balance", "balance_from_config"]


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
    the runtime adapts (runtime/hf_experts.py, matched by structure; expert tensor parallelism
    splits them too). Without a module, meshplan's model."""
    if module is None:
        return True
    from meshplan.models.moe import GroupedExperts
    return any(isinstance(m, GroupedExperts) or is_routed_experts(m) for m in module.modules())


def _folded_layers(module) -> list[str]:
    """FQNs of the MoE layers (parents of transformers-style routed experts) holding linears beside
    the experts (a shared expert and its gate: Qwen2-MoE) and no `routed(x)` method: tensor
    parallelism cannot split those linears (the layer's own forward combines them with the routed
    experts), so they run replicated over TP on each rank's tokens (runtime/moe_folding.py)."""
    from torch import nn
    out = []
    for fqn, experts in module.named_modules():
        if not is_routed_experts(experts):
            continue
        name = fqn.rpartition(".")[0]
        layer = module.get_submodule(name)
        inside = {id(m) for m in experts.modules()}
        if any(isinstance(m, nn.Linear) and id(m) not in inside for m in layer.modules()) \
                and not callable(getattr(layer, "routed", None)):
            out.append(name)
    return out


def _shared_linears(profile: ModelProfile, layers: list[str]) -> dict[str, set[str]]:
    """{block signature: names of its shared_in / shared_out linears inside `layers`}."""
    out: dict[str, set[str]] = {}
    for b in profile.blocks:
        names = {li.name for li in b.linears if li.role in ("shared_in", "shared_out")
                 and any(f"{inst}.{li.name}".startswith(m + ".") for inst in b.instances for m in layers)}
        if names:
            out[b.signature] = names
    return out


def fold_shared_roles(profile: ModelProfile, module) -> ModelProfile:
    """`profile` with the shared linears of the MoE layers in `_folded_layers(module)` given the
    role "shared_folded": placed "replicate" (meshplan.ir.support.TP_ROLE_PLACEMENT), they run
    with whole weights on each TP rank's sequence shard, so the cost model prices 1/tp of the
    tokens on whole weights. The profile itself when the model has no such layer."""
    import dataclasses
    shared = _shared_linears(profile, _folded_layers(module)) if module is not None else {}
    if not shared:
        return profile
    blocks = []
    for b in profile.blocks:
        names = shared.get(b.signature, set())
        fqns = {f"{inst}.{n}" for inst in b.instances for n in names}
        blocks.append(dataclasses.replace(
            b, linears=tuple(dataclasses.replace(li, role="shared_folded") if li.name in names else li
                             for li in b.linears),
            ops=tuple(dataclasses.replace(o, role="shared_folded") if o.kind == "linear" and o.module in fqns else o
                      for o in b.ops)) if names else b)
    return dataclasses.replace(profile, blocks=tuple(blocks))


def _moe_tp_fold(profile: ModelProfile, module) -> bool:
    """Whether tensor parallelism can fold the MoE layers as the planner places them: a layer
    with TP-split shared experts needs a `routed(x)` method (meshplan's MoE); one without
    (Qwen2-MoE) runs under TP with its shared linears placed "replicate", which the profile says
    by their role (`fold_shared_roles`). Without a module, meshplan's model."""
    return module is None or not _shared_linears(profile, _folded_layers(module))


def _partly_fused_qkv(block) -> bool:
    """Q, K and V come from two linears (e.g. q separate, k|v fused), or from one whose width is
    not q + 2 kv (a packing the runtime does not split per part), or from a fused one read by an
    attention that runs in the block's own forward (no attention sub-module: the runtime can
    neither find its head counts nor make them local)."""
    qkv = [li for li in block.linears if li.role == "attn_qkv"]
    if not block.heads or not qkv:
        return False
    if any(li.role == "attn_down" for li in block.linears):
        # MLA: queries and keys|values come from up-projections of latents, each head-major,
        # which TP splits by heads like separate wq / wk / wv
        return False
    if len(qkv) == 2 or (len(qkv) == 1 and packing(block, qkv[0]) is None):
        return True
    inst = block.instances[0] if block.instances else ""
    return len(qkv) == 1 and bool(inst) and any(o.kind == "attention" and o.module == inst for o in block.ops)


def _undeclared_shared_key(blocks, module) -> str:
    """Why TP cannot run a latent attention (down-projections, role attn_down) whose module does not
    name its shared rotary key (`shared_rope_key`, meshplan.models.mla): that key's gradient must be
    summed over the TP ranks' heads, and the runtime finds its columns only there."""
    for b in blocks:
        if not b.instances or not any(li.role == "attn_down" for li in b.linears):
            continue
        for o in b.ops:
            if o.kind != "attention" or not o.module.startswith(b.instances[0] + "."):
                continue
            try:
                attn = module.get_submodule(o.module)
            except AttributeError:
                continue
            if getattr(attn, "shared_rope_key", None) is None:
                return (f"{o.module} is a latent attention (low-rank down-projections before Q/K/V) that does not "
                        "declare `shared_rope_key` (linear name, first column of the key part every head "
                        "shares), whose gradient tensor parallelism must sum over the ranks' heads")
    return ""


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
    tp_forward = ""
    if module is not None:      # torch only when a module is probed: config-built profiles stay torch-free
        from meshplan.profiling.tp_probe import tp_probe
        tp_forward = _undeclared_shared_key(blocks, module) or tp_probe(module, profile)
    return ModelTraits(moe=any(b.is_moe for b in blocks), fused_qkv=fused_qkv, fused_gate_up=fused_gate_up,
                       partly_fused_qkv=partly_fused_qkv, sdpa_causal=sdpa_causal, cp_positions=_cp_positions(module),
                       ep_experts=_ep_experts(module), moe_tp_fold=_moe_tp_fold(profile, module),
                       layers=profile.num_layers, tp_forward=tp_forward,
                       expert_shapes=_expert_shapes(blocks), mtp=profile.mtp_depth,
                       attn_window=max((b.attn_window for b in blocks), default=0), attn_sinks=_sinks(profile, module))


def _sinks(profile: ModelProfile, module) -> bool:
    """Attention sinks: a parameter named `sinks` (meshplan's Attention, transformers'
    GptOssAttention). Without a module (a profile built from a config) there is no model for the
    runtime to run, and nothing to read."""
    if module is not None:
        return any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in module.named_parameters())
    return False


def _expert_shapes(blocks) -> tuple[tuple[int, int, int], ...]:
    """(experts, inner width, hidden) of each routed expert weight kind: the inner width is the
    output of the expert's input projection(s) and the input of its output projection."""
    out = set()
    for b in blocks:
        for li in b.linears:
            if li.role == "expert_in":
                out.add((li.count, li.out_features, li.in_features))
            elif li.role == "expert_out":
                out.add((li.count, li.in_features, li.out_features))
    return tuple(sorted(out))


# --- MoE routing balance (ModelProfile.moe_balance) --------------------------------------------
# Several MoE layers reading different settings (not seen in practice) record the least balanced,
# the one the cost model's worst case must cover.
_LEAST_BALANCED_FIRST = ("none", "unknown", "aux_loss", "expert_bias", "forced")


def balance_from_config(config) -> tuple[str, float | None]:
    """(moe_balance, capacity factor) of a meshplan `ModelConfig` or its mapping (moe_* keys, as
    `meshplan.profiling.analytic.profile_from_config` reads): forced balance overrides the router,
    then an auxiliary loss or an updated expert bias balances it; none of them leaves it free; a
    mapping naming none of them, "unknown"."""
    get = config.get if hasattr(config, "get") else (lambda k, d=None: getattr(config, k, d))
    keys = ("moe_force_balance", "moe_aux_loss_coeff", "moe_expert_bias")
    if hasattr(config, "get") and not any(k in config for k in keys):
        return "unknown", None           # a mapping that does not say (a published run's shape)
    cf = get("moe_capacity_factor", None)
    cf = float(cf) if cf else None
    if get("moe_force_balance", False):
        return "forced", cf
    if float(get("moe_aux_loss_coeff", 0.0) or 0.0) > 0:
        return "aux_loss", cf
    if get("moe_expert_bias", False):
        return "expert_bias", cf
    return "none", cf


def _hf_balance(config) -> str | None:
    """The balance a transformers config declares, or None when it declares none we know.
    `router_aux_loss_coef` (Mixtral, Qwen2-MoE, OLMoE, ...) joins the loss only when
    `output_router_logits` is True (the model's forward adds coef * aux to the loss it returns when
    given labels; meshplan's runtime computes the loss from the logits and adds it itself, under
    layouts that keep a micro-batch whole: runtime.model.ParallelModel._router_aux_loss).
    A DeepSeek-V3 style `e_score_correction_bias` (topk_method "noaux_tc") steers top-k, but
    transformers never updates it while training: a pretrained checkpoint's bias keeps its router
    balanced, a zero one from scratch does nothing, and a meta-device model cannot tell which."""
    coef = getattr(config, "router_aux_loss_coef", None)
    if coef is not None:
        if float(coef or 0.0) > 0 and bool(getattr(config, "output_router_logits", False)):
            return "aux_loss"
        if getattr(config, "topk_method", None) != "noaux_tc":
            return "none"
    return None


def moe_balance(module) -> tuple[str, float | None]:
    """(ModelProfile.moe_balance, the model's expert capacity factor) of an nn.Module: meshplan's
    MoE layers say it in their options (moe_force_balance, moe_aux_loss_coeff, moe_expert_bias,
    moe_capacity_factor); a transformers model in its config (`_hf_balance`); anything else, or a
    dense model, "unknown"."""
    from meshplan.models.moe import MoE
    found, caps = set(), set()
    for m in module.modules():
        if isinstance(m, MoE):
            if m.force_balance:
                found.add("forced")
            elif m.aux_loss_coeff > 0:
                found.add("aux_loss")
            elif m.bias_update:          # a sigmoid router's bias that is never updated balances nothing
                found.add("expert_bias")
            else:
                found.add("none")
            caps.add(float(m.capacity_factor) if m.capacity_factor else None)
    if found:
        # the loosest capacity bounds the worst case; a dropless layer leaves it unbounded
        cap = None if None in caps else max(caps)
        return next(b for b in _LEAST_BALANCED_FIRST if b in found), cap
    config = getattr(module, "config", None)
    if config is not None and hasattr(module, "can_generate"):      # a transformers PreTrainedModel
        return _hf_balance(config) or "unknown", None
    return "unknown", None
