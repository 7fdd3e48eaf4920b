"""Patterns over the whole traced graph, found before blocks are analysed.

- `find_attention(nodes)`: every attention as an `AttentionUnit` (q, k, v, output, mask,
  is_causal): an SDPA call, or softmax(q·kᵀ [*scale] [+mask]) [dropout] · v as nanoGPT or HF
  'eager' attention writes it.
- `mark_dispatch(nodes)`: index/sort/scatter ops that depend on a router's top-k choice become
  kind "moe_dispatch" (they move tokens to and from experts).
"""

from __future__ import annotations

from typing import Any

from meshplan.profiling.aten_ops import DISPATCH_OPS, KEY_TRANSPOSE_OPS, PROB_OPS, SCORE_OPS, SOFTMAX_OPS
from meshplan.profiling.op_costs import is_attention_op
from meshplan.profiling.trace_nodes import AttentionUnit, Node, Ref, arg

__all__ = ["find_attention", "mark_dispatch"]


def _operands(n: Node) -> tuple[int | None, int | None]:
    if n.base == "aten::einsum":
        ops = n.args[1] if len(n.args) > 1 else []
    elif n.base in ("aten::baddbmm", "aten::addmm"):
        ops = n.args[1:3]
    else:
        ops = n.args[:2]
    ids = [o.index if isinstance(o, Ref) else None for o in ops]
    return (ids + [None, None])[0], (ids + [None, None])[1]


def _named_arg(n: Node, name: str) -> Any:
    """An argument by its schema name, passed by position or keyword (None if absent)."""
    for pos, a in enumerate(getattr(n.target, "_schema").arguments):
        if a.name == name:
            return arg(n, pos, name)
    return None


def find_attention(nodes: list[Node]) -> list[AttentionUnit]:
    units = []
    for n in nodes:
        if n.kind == "attention" and is_attention_op(n.target):
            q, k, v = (a.index if isinstance(a, Ref) else None for a in n.args[:3])
            if None in (q, k, v):
                continue
            mask = _named_arg(n, "attn_mask") or _named_arg(n, "attn_bias")
            units.append(AttentionUnit(nodes=frozenset({n.index}), q=q, k=k, v=v, out=n.index,
                                       mask=mask.index if isinstance(mask, Ref) else None,
                                       is_causal=bool(_named_arg(n, "is_causal"))))
        elif n.base in SOFTMAX_OPS and len(n.shape) >= 3:
            unit = _eager_attention(nodes, n)
            if unit is not None:
                units.append(unit)
    return units


def _eager_attention(nodes: list[Node], softmax: Node) -> AttentionUnit | None:
    """softmax(q·kᵀ [*scale] [+mask]) [dropout] · v, as nanoGPT or HF 'eager' write it."""
    path, mask, qk = [softmax.index], None, None
    cur = softmax.inputs[0] if softmax.inputs else None
    for _ in range(10):
        if cur is None:
            return None
        c = nodes[cur]
        if c.kind == "matmul":
            qk = cur
            break
        if c.base not in SCORE_OPS:
            return None
        path.append(cur)
        main = [j for j in c.inputs if nodes[j].is_float and nodes[j].shape == c.shape]
        for j in c.inputs:
            if j not in main[:1] and nodes[j].out and len(nodes[j].shape) >= 2:
                mask = j
        cur = main[0] if main else None
    if qk is None:
        return None
    pv, cur = None, softmax.index
    for _ in range(6):
        users = nodes[cur].users
        nxt = [u for u in users if nodes[u].kind == "matmul" and _operands(nodes[u])[0] == cur]
        if nxt:
            pv = nxt[0]
            break
        step = [u for u in users if nodes[u].base in PROB_OPS and nodes[u].is_float]
        if not step:
            return None
        cur = step[0]
        path.append(cur)
    if pv is None:
        return None
    q, kt = _operands(nodes[qk])
    _, v = _operands(nodes[pv])
    if None in (q, kt, v):
        return None
    k = kt
    if nodes[kt].base in KEY_TRANSPOSE_OPS and nodes[kt].inputs:
        k = nodes[kt].inputs[0]
    return AttentionUnit(nodes=frozenset(path) | {qk, pv, kt}, q=q, k=k, v=v, out=pv, mask=mask,
                         is_causal=False)


def mark_dispatch(nodes: list[Node]) -> None:
    """Index/sort/scatter ops that depend on a router's top-k choice move tokens to experts."""
    dep = [False] * len(nodes)
    for n in nodes:
        dep[n.index] = n.base == "aten::topk" or any(dep[j] for j in n.inputs)
        if dep[n.index] and n.base in DISPATCH_OPS and n.kind not in ("linear", "view", "router"):
            n.kind = "moe_dispatch"
