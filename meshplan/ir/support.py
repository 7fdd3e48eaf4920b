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

__all__ = ["ModelTraits", "runtime_limits", "TP_ROLE_PLACEMENT", "block_placement_limits"]

# Tensor parallelism the runtime runs inside a block: Megatron-LM's pattern, one linear role ->
# one DTensor placement; the attention between a column- and a row-parallel linear is head-local.
TP_ROLE_PLACEMENT = {"attn_qkv": "colwise", "mlp_in": "colwise", "shared_in": "colwise",
                     "attn_out": "rowwise", "mlp_out": "rowwise", "shared_out": "rowwise",
                     "router": "replicate", "expert_in": "expert", "expert_out": "expert", "other": "replicate"}


@dataclass(frozen=True, kw_only=True)
class ModelTraits:
    """What the runtime's sharding depends on, as read from the traced model.

    `moe`: the model has routed experts. `fused_qkv`: an attention projection computes Q, K and V
    in one weight (rows are Q|K|V, so TP must split it per head, not by raw rows).
    `sdpa_causal`: every attention goes through F.scaled_dot_product_attention with is_causal
    (what context parallelism's ring swaps). `fused_gate_up`: one weight holds the SwiGLU gate
    and up projections. `cp_positions`: the runtime knows how to give each CP rank its tokens'
    positions (meshplan's models; transformers models with rotary embeddings), which a model
    that computes positions in its own forward (`arange(T)`) defeats. `layers`: transformer
    blocks, for the pipeline split. `ep_experts`: the routed experts are stacked weights whose
    forward takes tokens sorted by expert and per-expert counts (meshplan's MoE), which expert
    parallelism moves between ranks; transformers' expert modules are not.
    """

    moe: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    sdpa_causal: bool = True
    cp_positions: bool = True
    ep_experts: bool = True
    layers: int = 0


def _get(layout: Mapping[str, Any] | Any, key: str, default: Any) -> Any:
    if isinstance(layout, Mapping):
        return layout.get(key, default)
    return getattr(layout, key, default)


def runtime_limits(layout: Mapping[str, Any] | Any, traits: ModelTraits | None = None) -> list[str]:
    """Reasons the runtime cannot run `layout` (a Layout or its dict) for a model with `traits`;
    empty when it can. Each reason names the limit in the user's terms and what would work."""
    g = lambda k, d=1: int(_get(layout, k, d) or d)   # noqa: E731 - a local shorthand
    tp, cp, ep, etp, pp, vp, dp = (g(k) for k in ("tp", "cp", "ep", "etp", "pp", "vp", "dp"))
    zero = int(_get(layout, "zero", 1))
    fsdp_shard = int(_get(layout, "fsdp_shard", 0) or 0)
    out: list[str] = []
    if ep > 1 and (tp > 1 or cp > 1 or etp > 1):
        out.append(f"expert parallelism (ep={ep}) together with tp={tp}, cp={cp}, etp={etp} needs MoE "
                   "parallel folding (experts over their own EP x ETP x EDP groups), which the runtime does "
                   "not have yet; it runs EP with experts over the data-parallel ranks (tp=cp=etp=1)")
    if ep > 1 and zero == 3 and 0 < fsdp_shard < dp * cp:
        out.append(f"expert parallelism (ep={ep}) with HSDP (fsdp_shard={fsdp_shard}) is not supported by "
                   "the runtime; use full sharding (fsdp_shard=0) or ep=1")
    if traits is not None:
        if traits.moe and ep > 1 and not traits.ep_experts:
            out.append(f"expert parallelism (ep={ep}) needs expert modules whose forward takes tokens sorted "
                       "by expert and per-expert counts (meshplan's MoE); this model's experts do not; use ep=1")
        if traits.moe and tp > 1:
            out.append(f"tensor parallelism (tp={tp}) on a MoE model: the runtime's TP does not shard expert "
                       "modules yet; use tp=1 (experts scale with ep instead)")
        if traits.fused_qkv and tp > 1:
            out.append(f"tensor parallelism (tp={tp}) on a fused QKV projection: splitting its rows would mix "
                       "Q, K and V heads across ranks, and the runtime does not yet split it per head; use tp=1")
        if traits.fused_gate_up and tp > 1:
            out.append(f"tensor parallelism (tp={tp}) on a fused gate/up projection: the runtime does not yet "
                       "split it by halves; use tp=1")
        if cp > 1 and not traits.cp_positions:
            out.append(f"context parallelism (cp={cp}) needs positions the runtime can split with the "
                       "sequence (meshplan's models, or transformers models with rotary embeddings); this "
                       "model computes its own; use cp=1")
        if cp > 1 and not traits.sdpa_causal:
            out.append(f"context parallelism (cp={cp}) needs every attention to go through "
                       "F.scaled_dot_product_attention(is_causal=True), which the runtime's ring attention "
                       "replaces; this model's attention does not; use cp=1")
        if traits.layers and pp * vp > traits.layers:
            out.append(f"pp={pp} x vp={vp} = {pp * vp} pipeline stages for {traits.layers} layers: every stage "
                       "needs at least one layer")
    return out


def block_placement_limits(placements: Mapping[str, str], roles: Mapping[str, str],
                           attention: tuple[str, ...] = ()) -> list[str]:
    """Reasons the runtime cannot run one block's TP placements: `placements` {module: label},
    `roles` {linear: role}, `attention` the block's attention modules. The sharding ILP may find
    other valid dataflows (e.g. gathering the attention output and splitting wo by columns); the
    runtime runs the pattern above, so the planner falls back to it for such blocks."""
    out = []
    for name, role in roles.items():
        want = TP_ROLE_PLACEMENT.get(role, "replicate")
        got = placements.get(name)
        if got is not None and got != want:
            out.append(f"{name} ({role}) placed {got!r}; the runtime shards a {role} linear {want!r}")
    for name in attention:
        got = placements.get(name)
        if got is not None and got != "heads":
            out.append(f"attention {name} placed {got!r}; the runtime runs attention head-local ('heads')")
    return out
