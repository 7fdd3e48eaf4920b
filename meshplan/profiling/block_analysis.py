"""What one traced block computes, found by data flow (`analyse_block`), never by module names: a
linear is "attn_qkv" because its output reaches attention's q/k/v and nothing else, not because
it is called `q_proj`.

From the block's `Node`s (trace_nodes) and attention units (trace_patterns) it derives the
`BlockProfile` facts: attention geometry (heads, kv_heads, head_dim, causal), the role of every
linear (attn_qkv / attn_out / mlp_in / mlp_out / router / expert_in / expert_out / shared_*),
whether the MLP is gated, the norm kind, the hidden and FFN widths, and the MoE facts (experts,
top-k, expert parameters). Graph walks rely on the nodes' topological order.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable

from meshplan.ir.profile import LinearInfo
from meshplan.profiling.aten_ops import (
    CAUSAL_MASK_OPS,
    COMPARISON_OPS,
    GROUP_NORM_OPS,
    KV_STOP_OPS,
    LAYER_NORM_OPS,
    PASS_FORWARD_OPS,
    RMS_NORM_OPS,
    SLICE_OPS,
    VARIANCE_OPS,
)
from meshplan.profiling.trace_nodes import AttentionUnit, Node, arg

__all__ = ["analyse_block", "is_causal", "weight_of"]


def _walk(nodes: list[Node], start: Iterable[int], within: set[int] | None, up: bool,
          stop: Callable[[Node], bool] | None = None) -> set[int]:
    """Closure over inputs (up) or users (down), inside `within`; `stop` nodes are not expanded."""
    start = set(start)
    seen: set[int] = set()
    todo = [i for i in start if within is None or i in within]
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        n = nodes[i]
        if stop is not None and stop(n) and i not in start:
            continue
        for j in (n.inputs if up else n.users):
            if j not in seen and (within is None or j in within):
                todo.append(j)
    return seen


def _exclusive_region(nodes: list[Node], seeds: Iterable[int], sink: set[int], within: set[int]) -> set[int]:
    """Ancestors of `seeds` whose every user is in the region or in `sink`.

    The residual stream feeds attention AND the residual add, so it is not exclusive; the q/k/v
    projections (and MLA's low-rank down-projections and norms) feed only attention.
    """
    anc = _walk(nodes, seeds, within, up=True)
    region: set[int] = set()
    for i in sorted(anc, reverse=True):                  # users come after producers
        users = nodes[i].users
        if users and all(u in region or u in sink for u in users):
            region.add(i)
    return region


def _next_linears(nodes: list[Node], start: int, within: set[int]) -> set[int]:
    found: set[int] = set()
    todo, seen = [start], {start}
    while todo:
        for u in nodes[todo.pop()].users:
            if u in seen or u not in within:
                continue
            seen.add(u)
            if nodes[u].kind == "linear":
                found.add(u)
            elif nodes[u].base in PASS_FORWARD_OPS:
                todo.append(u)
    return found


def _linears_above(nodes: list[Node], start: int, within: set[int]) -> set[int]:
    """Nearest linear producers of `start`'s inputs (not crossing norms or attention)."""
    stop = {"linear", "norm", "attention"}
    anc = _walk(nodes, nodes[start].inputs, within, up=True, stop=lambda n: n.kind in stop)
    return {i for i in anc if nodes[i].kind == "linear"}


def _kv_heads(nodes: list[Node], k: int, head_dim: int) -> int:
    """Key heads BEFORE any repeat for GQA: the fewest elements per token along k's producers."""
    shape = nodes[k].shape
    tokens = math.prod(shape[:-3]) * shape[-2] if len(shape) >= 3 else shape[0]
    best = nodes[k].out[0].numel
    cur = k
    for _ in range(64):
        n = nodes[cur]
        best = min(best, n.out[0].numel)
        if (n.kind in ("linear", "matmul", "attention", "norm", "embedding") or n.placeholder
                or n.base in KV_STOP_OPS):
            break
        floats = [i for i in n.inputs if nodes[i].is_float]
        if not floats:
            break
        cur = max(floats, key=lambda i: nodes[i].out[0].numel)
    kv = best / max(tokens * head_dim, 1)
    heads_k = shape[-3] if len(shape) >= 3 else 1
    if kv >= 1 and kv == int(kv):
        return int(kv)
    return heads_k


def is_causal(nodes: list[Node], unit: AttentionUnit) -> bool:
    """is_causal=True, or a mask built by tril/triu, by comparing position indices, or read
    from a square (.., T, T) buffer (nanoGPT's registered `bias`). A padding-only mask is not."""
    if unit.is_causal:
        return True
    if unit.mask is None:
        return False
    anc = _walk(nodes, [unit.mask], None, up=True)
    ops = {nodes[i].base for i in anc}
    if ops & CAUSAL_MASK_OPS:
        return True
    if ops & COMPARISON_OPS and "aten::arange" in ops:
        return True
    for i in anc:
        n = nodes[i]
        if n.placeholder == "buffer" and len(n.shape) >= 2 and n.shape[-1] == n.shape[-2] > 1:
            return True
    return False


def _split_in_out(nodes: list[Node], group: list[int], within: set[int]) -> tuple[list[int], list[int]]:
    """Linears fed by another linear of the group are 'out' (down/fc2), the others 'in'."""
    members = set(group)
    ins, outs = [], []
    for i in group:
        acts = [j for j in nodes[i].inputs if not nodes[j].param_src]
        anc = _walk(nodes, acts, within, up=True)
        (outs if anc & (members - {i}) else ins).append(i)
    return ins, outs


def _gated(nodes: list[Node], ins: list[int], outs: list[int], within: set[int]) -> bool:
    """Two parallel input projections (or two slices of a fused one) multiplied together."""
    if not ins or not outs:
        return False
    region = _walk(nodes, ins, within, up=False) & _walk(
        nodes, [j for o in outs for j in nodes[o].inputs], within, up=True)
    memo: dict[int, frozenset[int]] = {}

    def origin(i: int) -> frozenset[int]:
        if i not in region:
            return frozenset()
        if i not in memo:
            n = nodes[i]
            if i in ins or n.base in SLICE_OPS:
                memo[i] = frozenset({i})
            else:
                memo[i] = frozenset().union(*(origin(j) for j in n.inputs)) if n.inputs else frozenset()
        return memo[i]

    for i in sorted(region):
        n = nodes[i]
        operands = [j for j in n.inputs if nodes[j].is_float]
        if n.base == "aten::mul" and len(operands) == 2:
            a, b = origin(operands[0]), origin(operands[1])
            if a and b and not a & b:
                return True
    return False


def _rel(fqn: str, inst: str) -> str:
    return fqn[len(inst) + 1:] if inst and fqn.startswith(inst + ".") else fqn


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


def weight_of(node: Node, param_shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The weight a linear reads: its largest parameter with two or more dims."""
    cands = [p for p in node.params if len(param_shapes.get(p, ())) >= 2]
    return max(cands, key=lambda p: math.prod(param_shapes[p])) if cands else None


def _norm_kind(nodes: list[Node], owned: list[int]) -> str:
    ops = {nodes[i].base for i in owned if nodes[i].kind == "norm"}
    if ops & (LAYER_NORM_OPS | GROUP_NORM_OPS):
        return "layernorm"
    if ops & RMS_NORM_OPS:
        return "rmsnorm"
    # decomposed: LayerNorm subtracts the mean, RMSNorm does not
    if ops & VARIANCE_OPS or {"aten::sub", "aten::mean"} <= ops:
        return "layernorm"
    return "rmsnorm"


def _hidden(nodes: list[Node], owned: list[int], own: set[int], batch: int, seq: int) -> int:
    """Width of the residual stream entering the block: its widest (batch, seq, h) input."""
    widths = []
    for i in owned:
        for j in nodes[i].inputs:
            n = nodes[j]
            if j in own or not n.is_float or n.placeholder in ("param", "buffer"):
                continue
            s = n.shape
            if (len(s) == 3 and s[0] == batch and s[1] == seq) or (len(s) == 2 and s[0] == batch * seq):
                widths.append(s[-1])
    return max(widths, default=0)


def _weight_groups(nodes: list[Node], lin: list[int], inst: str,
                   param_shapes: dict[str, tuple[int, ...]]):
    """Linears grouped by weight, and numbered siblings (experts.0.w1, experts.1.w1, ...) of
    one shape merged: returns (key -> node indices, key -> weight FQN, [(name, keys)])."""
    groups: dict[str, list[int]] = {}
    weight: dict[str, str] = {}
    for i in lin:
        w = weight_of(nodes[i], param_shapes)
        key = _rel(w, inst).removesuffix(".weight") if w else nodes[i].name
        groups.setdefault(key, []).append(i)
        if w:
            weight[key] = w
    # the first numbered component inside the block is the list index (experts.<i>.w1)
    collapsed: dict[str, list[str]] = {}
    for key in groups:
        collapsed.setdefault(_INDEX.sub("*", key, count=1), []).append(key)
    members: list[tuple[str, list[str]]] = []
    for ck, keys in collapsed.items():
        shapes = {param_shapes.get(weight.get(k, ""), ()) for k in keys}
        if len(keys) > 1 and len(shapes) == 1:
            members.append((ck, keys))
        else:
            members.extend((k, [k]) for k in keys)
    return groups, weight, members


def _linear_infos(nodes: list[Node], lin: list[int], inst: str, tokens: int,
                  param_shapes: dict[str, tuple[int, ...]]) -> list[LinearInfo]:
    groups, weight, merged = _weight_groups(nodes, lin, inst, param_shapes)
    members: list[tuple[str, list[str]]] = []
    for name, keys in merged:
        if len({nodes[groups[k][0]].role for k in keys}) == 1:
            members.append((name, keys))
        else:
            members.extend((k, [k]) for k in keys)
    infos = []
    for name, keys in members:
        idx = [i for k in keys for i in groups[k]]
        first = nodes[idx[0]]
        wshape = param_shapes.get(weight.get(keys[0], ""), ())
        k_in = first.contract or (wshape[-1] if wshape else 0)
        stack = wshape[0] if len(wshape) == 3 else 1
        count = stack * len(keys)
        if wshape and k_in and math.prod(wshape) % (stack * k_in) == 0:
            out_f = math.prod(wshape) // (stack * k_in)
        else:
            out_f = first.shape[-1] if first.out else 0
        fwd = sum(nodes[i].fwd for i in idx)
        denom = 2.0 * k_in * out_f * count * tokens
        weights = {weight[k] for k in keys if k in weight}
        has_bias = any(p not in weights for i in idx for p in nodes[i].params)
        infos.append(LinearInfo(
            name=name, in_features=k_in, out_features=out_f, role=first.role or "other",
            count=count, tokens_per_token=fwd / denom if denom else 0.0, bias=has_bias))
    return infos


def analyse_block(nodes: list[Node], owned: list[int], units: list[AttentionUnit], *, inst: str,
                  batch: int, seq: int, param_shapes: dict[str, tuple[int, ...]]) -> dict:
    """Geometry, linear roles and MoE facts of one traced block instance.

    Returns the `BlockProfile` fields it derives plus `expert_params`; sets `Node.role` on the
    block's linears and `Node.kind = "router"` on the routing ops.
    """
    own = set(owned)
    tokens = batch * seq
    lin = [i for i in owned if nodes[i].kind == "linear"]
    role: dict[int, str] = {}
    out: dict = {}

    mine = [u for u in units if u.out in own]
    for u in mine:
        # every input of the attention (q, k, v and in-place writes into them)
        feeds = {j for i in u.nodes for j in nodes[i].inputs if j not in u.nodes}
        region = _exclusive_region(nodes, feeds, set(u.nodes), own)
        for i in lin:
            if i in region:
                role.setdefault(i, "attn_qkv")
        for i in _next_linears(nodes, u.out, own):
            role.setdefault(i, "attn_out")
    # a Q/K/V projection whose output reaches another one is a low-rank down-projection (MLA's
    # wq_a / wkv_a): the up-projections after it split by heads, it stays whole (attn_down). The
    # walk stops at attention, so a later attention's projections in the same block do not count
    qkv = [i for i in lin if role.get(i) == "attn_qkv"]
    for i in qkv:
        below = _walk(nodes, [i], own, up=False, stop=lambda n: n.kind == "attention")
        if any(j != i and j in below for j in qkv):
            role[i] = "attn_down"
    if mine:
        q_shape = nodes[mine[0].q].shape
        out["head_dim"] = q_shape[-1]
        v_width = nodes[mine[0].v].shape[-1]
        if v_width != q_shape[-1]:
            out["v_head_dim"] = v_width          # values narrower/wider than queries (MLA)
        out["heads"] = q_shape[-3] if len(q_shape) >= 3 else 1
        out["kv_heads"] = _kv_heads(nodes, mine[0].k, nodes[mine[0].k].shape[-1])
        out["causal"] = all(is_causal(nodes, u) for u in mine)

    # --- MoE: a top-k over the router's scores picks the experts
    topks = [i for i in owned if nodes[i].base == "aten::topk"]
    routed: list[int] = []
    experts = 0
    if topks:
        routers: set[int] = set()
        for t in topks:
            routers |= _linears_above(nodes, t, own)
        routers -= role.keys()
        for i in routers:
            role[i] = "router"
        experts = max((nodes[i].shape[-1] for i in routers), default=0)
        picks = [t for t in topks if nodes[t].inputs and nodes[nodes[t].inputs[0]].shape[-1] == experts]
        chosen = (picks or topks)[-1]
        out["topk"] = int(arg(nodes[chosen], 1, "k"))
        between = _walk(nodes, routers, own, up=False) & _walk(nodes, [chosen], own, up=True)
        for i in between - routers:
            if nodes[i].kind != "view":
                nodes[i].kind = "router"
        after = _walk(nodes, [chosen], own, up=False)
        for i in lin:
            if i in role:
                continue
            w = weight_of(nodes[i], param_shapes)
            shape = param_shapes.get(w, ()) if w else ()
            stacked = len(shape) == 3 and (experts == 0 or shape[0] == experts)
            if i in after or stacked:
                routed.append(i)
        # a ModuleList of E experts, each a module of its own (counted E times, run densely or not)
        groups, _, merged = _weight_groups(nodes, [i for i in lin if i not in role], inst, param_shapes)
        for _, keys in merged:
            if len(keys) > 1 and len(keys) == experts:
                routed.extend(i for k in keys for i in groups[k] if i not in routed)
        if not experts and routed:
            shapes = [param_shapes.get(weight_of(nodes[i], param_shapes) or "", ()) for i in routed]
            experts = max((s[0] for s in shapes if len(s) == 3), default=0)
        out["experts"] = experts

    rest = [i for i in lin if i not in role and i not in routed]
    if routed:
        e_in, e_out = _split_in_out(nodes, routed, own)
        role.update({i: "expert_in" for i in e_in} | {i: "expert_out" for i in e_out})
        s_in, s_out = _split_in_out(nodes, rest, own)
        role.update({i: "shared_in" for i in s_in} | {i: "shared_out" for i in s_out})
        out["gated"] = _gated(nodes, e_in, e_out, own)
    else:
        m_in, m_out = _split_in_out(nodes, rest, own)
        role.update({i: "mlp_in" for i in m_in} | {i: "mlp_out" for i in m_out})
        out["gated"] = _gated(nodes, m_in, m_out, own)
    for i, r in role.items():
        nodes[i].role = r

    infos = _linear_infos(nodes, lin, inst, tokens, param_shapes)
    out["linears"] = tuple(infos)
    out["ffn_hidden"] = sum(li.in_features for li in infos if li.role == "mlp_out")
    out["moe_ffn_hidden"] = max((li.in_features for li in infos if li.role == "expert_out"), default=0)
    out["shared_ffn_hidden"] = sum(li.in_features * li.count for li in infos if li.role == "shared_out")
    out["norm"] = _norm_kind(nodes, owned)
    out["hidden"] = _hidden(nodes, owned, own, batch, seq) or max(
        (li.in_features for li in infos if li.role in ("attn_qkv", "mlp_in", "router")), default=0)
    routed_params = {p for i in routed for p in nodes[i].params}
    out["expert_params"] = sum(math.prod(param_shapes[p]) for p in routed_params if p in param_shapes)
    return out
