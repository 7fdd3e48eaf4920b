"""What the runtime can run: one declaration, read by the planner and by the runtime.

The planner's search never returns a layout that `runtime_limits` refuses (it still costs it, so
`Plan.explain()` can say when the fastest layout was excluded and why), and `parallelize`
refuses the same layouts with the same words before any collective runs. A limit lifted in the
runtime is lifted here, once.

This module imports nothing of meshplan above it: the planner (which must never import the
runtime) and the runtime (which must never import the planner) both read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshplan.ir.layout import Layout

__all__ = ["ModelTraits", "runtime_limits", "TP_ROLE_PLACEMENT", "block_placement_limits", "runs_as_ddp",
           "experts_folded"]

# Tensor parallelism the runtime runs inside a block: Megatron-LM's pattern, one linear role ->
# one DTensor placement; the attention between a column- and a row-parallel linear is head-local.
# "shared_folded": a shared expert's linear in a MoE layer that TP folds whole (no routed(x) method:
# transformers' Qwen2-MoE), replicated and run on each TP rank's tokens (runtime/moe_folding.py).
# "attn_down": a low-rank down-projection before the Q/K/V up-projections (multi-head latent
# attention's wq_a / wkv_a, models/mla.py), kept whole on every rank; the up-projections split by heads.
TP_ROLE_PLACEMENT = {"attn_qkv": "colwise", "attn_down": "replicate", "mlp_in": "colwise", "shared_in": "colwise",
                     "attn_out": "rowwise", "mlp_out": "rowwise", "shared_out": "rowwise",
                     "router": "replicate", "shared_folded": "replicate", "expert_in": "expert",
                     "expert_out": "expert", "other": "replicate"}


@dataclass(frozen=True, kw_only=True)
class ModelTraits:
    """What the runtime's sharding depends on, as read from the traced model.

    `moe`: the model has routed experts. `fused_qkv`: an attention projection computes Q, K and V
    in one weight (rows are Q|K|V, so TP must split it per head, not by raw rows).
    `sdpa_causal`: every attention goes through F.scaled_dot_product_attention with is_causal
    (what context parallelism's ring swaps). `fused_gate_up`: one weight holds the SwiGLU gate
    and up projections (both run under TP: each rank holds its slice of every part).
    `partly_fused_qkv`: Q, K and V come from two linears (e.g. K|V fused, Q separate), or from one
    whose width is not q + 2 kv, or from a fused one whose attention runs in the block's own
    forward (no attention sub-module), which TP does not split per part. `cp_positions`: the runtime knows how to give each CP rank its tokens'
    positions (meshplan's models; transformers models with rotary embeddings), which a model
    that computes positions in its own forward (`arange(T)`) defeats. `layers`: transformer
    blocks, for the pipeline split. `ep_experts`: the routed experts are modules expert
    parallelism can move tokens to (meshplan's stacked experts with forward(x, counts), or
    transformers' stacked gate_up_proj / down_proj experts, adapted by runtime/hf_experts.py);
    expert tensor parallelism splits each expert's inner features of both kinds (meshplan's
    `etp_split`; transformers' gate and up halves each, runtime/hf_experts.py).
    `moe_tp_fold`: tensor parallelism can fold the MoE layers as the planner places them: nothing
    TP splits beside the experts and router, or a `routed(x)` method beside TP-split shared
    experts, or shared experts placed "replicate" (role "shared_folded": transformers' Qwen2-MoE,
    meshplan.profiling.traits.fold_shared_roles).
    `tp_forward`: why the model's own forward does not run on tensor-parallel local shapes (its
    attention sizes reshapes from the full width; profiling/tp_probe.py), "" when it runs or the
    probe could not tell. `expert_shapes`: (experts, inner width, hidden) of each kind of routed
    expert weight (the inner width is what expert tensor parallelism splits).
    """

    moe: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    partly_fused_qkv: bool = False
    sdpa_causal: bool = True
    cp_positions: bool = True
    ep_experts: bool = True
    moe_tp_fold: bool = True
    layers: int = 0
    tp_forward: str = ""
    expert_shapes: tuple[tuple[int, int, int], ...] = ()
    mtp: int = 0    # multi-token-prediction depths (meshplan.models.mtp): every layout runs them
    attn_window: int = 0      # the widest sliding attention window of any block (0: none)
    attn_sinks: bool = False  # attention sinks: a learned per-head logit (a parameter of `heads` entries)


def runtime_limits(layout: Layout | Mapping[str, Any], traits: ModelTraits | None = None) -> list[str]:
    """Reasons the runtime cannot run `layout` for a model with `traits`; empty when it can. Each
    reason names the limit in the user's terms and what would work. A dict is read as
    Layout.from_dict reads it (missing keys take Layout's defaults)."""
    layout = Layout.coerce(layout)
    tp, cp, ep, etp, pp, vp, dp = layout.tp, layout.cp, layout.ep, layout.etp, layout.pp, layout.vp, layout.dp
    zero = layout.zero
    out: list[str] = []
    recipe, cp_comm = layout.fp8_recipe, layout.cp_comm_type
    if recipe not in ("tensorwise", "rowwise"):
        out.append(f"fp8_recipe={recipe!r}: the runtime's FP8 linears (torchao, Transformer Engine) run "
                   "tensorwise or rowwise scaling; use one of those")
    rc = layout.recompute
    if rc in ("norm_moe", "mla_up", "op_sac"):
        out.append(f"recompute={rc!r} is a policy of other stacks (Megatron-Core's --recompute-modules moe or "
                   "mla_up_proj, torchtitan's op-level selective checkpointing); the runtime recomputes 'none', "
                   "'selective', 'norm_act', 'full' or a number of fully recomputed layers")
    if layout.ep_comm_overlap and ep > 1:
        out.append("ep_comm_overlap: the runtime runs the expert all-to-all in line with compute (Megatron-Core's "
                   "--overlap-moe-expert-parallel-comm is what overlaps it); use ep_comm_overlap=False")
    if layout.offload_activations and rc in ("selective", "norm_act"):
        # both keep tensors outside autograd's saved-tensor hooks (selective checkpointing caches the
        # saved matmul outputs itself; norm_act's replay regions hold their inputs), so only part of
        # what the plan prices on the host would leave the GPU (runtime/offload.py)
        out.append(f"offload_activations with recompute={rc!r}: the runtime offloads what autograd saves through "
                   "its saved-tensor hooks, and this policy keeps its tensors outside them; use recompute "
                   "'none', 'full' or a number of fully recomputed layers with offloading, or turn offloading off")
    if layout.offload_activations and layout.tp_comm_overlap and tp > 1:
        out.append("offload_activations with tp_comm_overlap: the runtime's TP overlap is torch.compile's async TP, "
                   "and offloaded blocks run eagerly (their saved-tensor hooks are Python); use one of the two")
    # "flash" is the stack's own kernel, which for meshplan is SDPA's FlashAttention-2: "fa2" names it too
    if layout.attn_kernel not in ("flash", "fa2"):
        out.append(f"attn_kernel={layout.attn_kernel!r}: the runtime calls PyTorch's "
                   "scaled_dot_product_attention (FlashAttention-2 on CUDA); use attn_kernel='flash' (or 'fa2', "
                   "the same kernel)")
    if layout.moe_capacity_factor is not None:
        out.append(f"moe_capacity_factor={layout.moe_capacity_factor!r}: the runtime routes every "
                   "token to its experts (dropless), with no capacity padding or dropping; leave "
                   "moe_capacity_factor unset (None)")
    dispatcher = layout.moe_dispatcher
    if dispatcher != "alltoall":
        out.append(f"moe_dispatcher={dispatcher!r}: the runtime moves MoE tokens by one all-to-all copy per "
                   "(token, chosen expert) (runtime/expert_parallel.py), not DeepEP's per-GPU / per-domain "
                   "forwarding; use moe_dispatcher='alltoall'")
    impl = layout.fsdp_impl
    if impl != "fsdp2":
        out.append(f"fsdp_impl={impl!r}: the runtime's ZeRO-3 is PyTorch FSDP2 (fully_shard, one unit per "
                   "block, runtime/fsdp.py); use fsdp_impl='fsdp2'")
    out += _grad_dtype_limits(layout.grad_dtype, dp=dp, cp=cp, tp=tp, pp=pp, ep=ep, etp=etp,
                              zero=zero)
    if cp > 1 and cp_comm != "p2p":
        out.append(f"cp_comm_type={cp_comm!r}: the runtime's context parallelism is the ring of K/V blocks "
                   "('p2p'); use cp_comm_type='p2p'")
    if pp > 1 and tp > 1 and layout.schedule == "zbv" and layout.sp:
        # seen on gloo: the V's second chunk never receives its sequence-sharded activations
        out.append("the ZB-V schedule with tensor and sequence parallelism hangs in the runtime's pipeline "
                   "sends; use sp=False, or schedule 'zb' / '1f1b' / 'interleaved'")
    if etp > 1 and zero == 0 and tp == cp == pp == ep == 1 and dp > 1:
        out.append(f"expert tensor parallelism (etp={etp}) with zero=0 and no other model parallelism runs as "
                   "DDP, which keeps whole weights; use zero>=1 (FSDP2) or etp=1")
    if traits is not None:
        if traits.moe and (ep > 1 or etp > 1) and not traits.ep_experts:
            out.append(f"expert parallelism (ep={ep}, etp={etp}) needs expert modules the runtime can move tokens "
                       "to (meshplan's MoE, or stacked gate_up_proj / down_proj experts as in transformers' "
                       "Mixtral and Qwen2-MoE); this model's are not; use ep=1 and etp=1")
        if traits.moe and tp > 1 and not traits.ep_experts:
            out.append(f"tensor parallelism (tp={tp}) on a MoE model runs each MoE layer on the TP ranks' "
                       "own tokens (MoE parallel folding), which needs expert modules the runtime can move "
                       "tokens to; use tp=1")
        elif traits.moe and tp > 1 and not traits.moe_tp_fold:
            out.append(f"tensor parallelism (tp={tp}) on a MoE model runs each MoE layer on the TP ranks' own "
                       "tokens (MoE parallel folding); this model's MoE layers hold a shared expert beside the "
                       "routed experts and no routed(x) method, so the runtime runs that expert only replicated "
                       "over TP, but its profile places it tensor-parallel; plan from "
                       "meshplan.profiling.traits.fold_shared_roles(profile, model), which places it 'replicate', "
                       "or use tp=1 (ep and etp split the experts)")
        if traits.partly_fused_qkv and tp > 1:
            out.append(f"tensor parallelism (tp={tp}) on an attention whose Q, K and V come from two linears "
                       "(e.g. a fused K|V projection), from one whose width is not q + 2 kv, or from a fused "
                       "one read by attention code in the block's own forward (no attention sub-module "
                       "whose head counts the runtime can make local): the runtime splits a fused Q|K|V "
                       "projection per head of an attention module only; use tp=1")
        if tp > 1 and traits.tp_forward:
            out.append(f"tensor parallelism (tp={tp}): {traits.tp_forward}; the runtime runs the model's own "
                       "forward on each rank's slice of the attention and MLP features, so its reshapes must "
                       "use the attention's head counts (attributes such as n_heads, which the runtime divides "
                       "by tp) or -1, not the full width; use tp=1")
        out += _expert_shard_limits(traits, tp=tp, cp=cp, ep=ep, etp=etp, pp=pp, dp=dp, zero=zero)
        if cp > 1 and not traits.cp_positions:
            out.append(f"context parallelism (cp={cp}) needs positions the runtime can split with the "
                       "sequence (meshplan's models, or transformers models with rotary embeddings); this "
                       "model computes its own; use cp=1")
        if cp > 1 and not traits.sdpa_causal:
            out.append(f"context parallelism (cp={cp}) needs every attention to go through "
                       "F.scaled_dot_product_attention(is_causal=True), which the runtime's ring attention "
                       "replaces; this model's attention does not; use cp=1")
        if cp > 1 and traits.attn_window:
            out.append(f"context parallelism (cp={cp}) with sliding-window attention (window "
                       f"{traits.attn_window}): the runtime's ring attention runs the plain causal mask and "
                       "would drop the band; use cp=1 (windowed layers cost O(s x window), so long sequences "
                       "fit without CP)")
        if tp > 1 and traits.attn_sinks:
            out.append(f"tensor parallelism (tp={tp}) with attention sinks: the runtime splits the attention "
                       "projections by heads but keeps the per-head sink logits whole; use tp=1 (ep, etp, "
                       "pp and FSDP split GPT-OSS-style models)")
        if traits.layers and pp * vp > traits.layers:
            out.append(f"pp={pp} x vp={vp} = {pp * vp} pipeline stages for {traits.layers} layers: every stage "
                       "needs at least one layer")
    return out


def _grad_dtype_limits(grad_dtype: str, *, dp: int, cp: int, tp: int, pp: int, ep: int, etp: int,
                       zero: int) -> list[str]:
    """grad_dtype="bf16" runs as the data-parallel reduction in bf16: FSDP2's reduce_dtype
    (runtime/fsdp.py) or DDP's bf16 all-reduce hook (runtime/ddp.py). Where neither reduces a
    gradient, the runtime keeps fp32 gradients (autocast), which the cost model does not price."""
    if grad_dtype == "fp32":
        return []
    if dp * cp == 1:
        return [f"grad_dtype={grad_dtype!r} with one data-parallel rank (dp x cp = 1): the runtime reduces "
                "gradients in bf16 through FSDP2 or DDP, and with no data-parallel reduction it keeps fp32 "
                "gradients; use grad_dtype='fp32', or dp x cp > 1"]
    if ep > 1 and runs_as_ddp(zero=zero, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp):
        return [f"grad_dtype={grad_dtype!r} under DDP (zero=0) with expert parallelism (ep={ep}): the experts' "
                "gradients are all-reduced apart from DDP's buckets, in fp32; use zero>=1 (FSDP2 reduces every "
                "gradient in bf16) or grad_dtype='fp32'"]
    return []


def runs_as_ddp(*, zero: int, dp: int, tp: int, pp: int, cp: int, ep: int, etp: int = 1) -> bool:
    """Whether the runtime runs a layout's data parallelism as plain DDP (zero=0): replicated fp32
    weights, one bucketed all-reduce of the gradients overlapped with backward. DDP keeps plain
    tensors, so it runs without TP, PP and CP; with expert parallelism DDP leaves the experts (EP
    DTensors) alone and their gradients are all-reduced over the expert-data-parallel ranks after
    backward, as Megatron's DDP does without the distributed optimizer. zero=0 with TP, PP, CP or
    expert TP runs through FSDP2 as ZeRO-1 (less memory than planned, never more). The planner
    offers zero=0 only here."""
    return zero == 0 and dp > 1 and tp == pp == cp == etp == 1


def experts_folded(*, ep: int, etp: int, tp: int, moe: bool) -> bool:
    """Whether routed experts run on their own (edp, ep, etp) mesh over the dense dp x cp x tp ranks
    (MoE parallel folding, runtime/mesh.py): with expert or expert-tensor parallelism, or a MoE
    model under TP (its MoE layers then run on each TP rank's own tokens)."""
    return ep > 1 or etp > 1 or (moe and tp > 1)


def _expert_shard_limits(traits: ModelTraits, *, tp: int, cp: int, ep: int, etp: int, pp: int, dp: int,
                         zero: int) -> list[str]:
    """FSDP2 shards each routed expert weight over the expert-data-parallel ranks (the dense
    dp x cp x tp ranks regrouped as edp x ep x etp, runtime/mesh.py) along a dimension that splits
    evenly; it pads only dim 0, which with fewer local experts than edp ranks would put a whole
    expert on every rank (runtime/fsdp.py). A layout where no dimension divides is not run."""
    folded = experts_folded(ep=ep, etp=etp, tp=tp, moe=traits.moe)
    fsdp = dp * cp > 1 and not runs_as_ddp(zero=zero, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    edp = dp * cp * tp // max(1, ep * etp)
    if not (traits.expert_shapes and folded and fsdp and edp > 1):
        return []
    for experts, inner, hidden in traits.expert_shapes:
        if experts % ep or inner % etp:
            continue                    # indivisible ep / etp: refused where the degrees are checked
        local = (experts // ep, inner // etp, hidden)
        if not any(d % edp == 0 for d in local):
            return [f"FSDP shards each routed expert's weights over the {edp} expert-data-parallel ranks "
                    f"(dp x cp x tp / (ep x etp) = {dp * cp * tp} / {ep * etp}) along a dimension that divides "
                    f"evenly; this rank's {' x '.join(map(str, local))} has none; choose ep, etp or tp so that "
                    f"{edp} divides one of them"]
    return []


def block_placement_limits(placements: Mapping[str, str], roles: Mapping[str, str],
                           attention: tuple[str, ...] = (), packed: Mapping[str, str] | None = None) -> list[str]:
    """Reasons the runtime cannot run one block's TP placements: `placements` {module: label},
    `roles` {linear: role}, `attention` the block's attention modules, `packed` {linear: label}
    the packed projections (fused QKV / gate-up: meshplan.profiling.traits.packing), which the
    runtime shards per part ("colwise_qkv" / "colwise_gate_up"), never by plain rows. The sharding
    ILP may find other valid dataflows (e.g. gathering the attention output and splitting wo by
    columns); the runtime runs the pattern above, so the planner falls back to it for such blocks."""
    out = []
    packed = dict(packed or {})
    for name, role in roles.items():
        want = packed.get(name) or TP_ROLE_PLACEMENT.get(role, "replicate")
        got = placements.get(name)
        if got is not None and got != want and name in packed:
            out.append(f"{name} ({role}) is a packed projection placed {got!r}; the runtime shards it {want!r} "
                       "(each rank its slice of every part)")
        elif got is not None and got != want:
            out.append(f"{name} ({role}) placed {got!r}; the runtime shards a {role} linear {want!r}")
    for name in attention:
        got = placements.get(name)
        if got is not None and got != "heads":
            out.append(f"attention {name} placed {got!r}; the runtime runs attention head-local ('heads')")
        # modules inside an attention (MLA's latent norms) run on its input, which the runtime gathers
        # whole once for the attention's column-parallel linears: never on a sequence shard
        for inner, label in placements.items():
            if inner.startswith(name + ".") and label == "sequence":
                out.append(f"{inner} placed 'sequence' inside attention {name}, whose input the runtime gathers "
                           "whole; it runs 'replicate' there")
    return out
