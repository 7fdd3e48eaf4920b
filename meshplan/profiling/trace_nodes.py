"""The traced graph as `Node`s: what the tracer builds from torch.export's graph and every later
pass (trace_patterns, block_analysis) reads.

`build_nodes(ep, fmap, ...)` walks the exported graph in order and makes one `Node` per value:
shapes and dtype, the owning module (original FQN), the parameters it reads (through views and
casts), whether a gradient flows, forward/backward FLOPs (`op_costs.op_flops`), the IR kind
(`op_costs.op_kind`) and the bytes it moves. In-place writes make the writer an input of every
later reader of the written tensor. Nodes are in topological order; `Node.inputs` and
`Node.users` are the edges.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from meshplan.errors import TraceError
from meshplan.profiling.aten_ops import NON_DIFFERENTIABLE_OPS, PARAM_PASS_OPS, SKIP_OPS, VIEW_OPS
from meshplan.profiling.blocks import FqnMap
from meshplan.profiling.op_costs import (
    TensorSpec,
    aliases_input,
    contracted_dim,
    is_matmul_like,
    op_base,
    op_flops,
    op_kind,
    writes_first_arg,
)

__all__ = ["Ref", "Node", "AttentionUnit", "arg", "build_nodes"]


@dataclass(frozen=True)
class Ref:
    """An argument that is the output of node `index` (a node's args keep Refs, not fx nodes)."""

    index: int


@dataclass(eq=False)
class Node:
    """One value-producing node of the traced graph (mutable while the tracer annotates it)."""

    index: int
    name: str
    target: object                 # the OpOverload (or "placeholder" / "getitem" / HOP)
    base: str                      # schema name without overload: "aten::linear", "getitem"
    module: str                    # owning module FQN in the ORIGINAL model
    module_class: str
    args: tuple                    # positional args, fx nodes replaced by Ref
    kwargs: dict
    inputs: list[int]              # distinct producer indices, in argument order
    out: list[TensorSpec]          # specs of the tensor outputs
    kind: str = "other"
    placeholder: str = ""          # "param" | "buffer" | "input" for graph inputs, else ""
    param_src: frozenset[str] = frozenset()   # this value is a view/cast/slice of these params
    params: tuple[str, ...] = ()   # parameters this op reads
    requires_grad: bool = False
    fwd: float = 0.0
    bwd: float = 0.0
    bytes: float = 0.0
    role: str = ""
    contract: int = 0              # K of a matrix product (its in_features for a linear)
    users: list[int] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.out[0].shape if self.out else ()

    @property
    def is_float(self) -> bool:
        return bool(self.out) and self.out[0].dtype.is_floating_point


@dataclass(frozen=True, kw_only=True)
class AttentionUnit:
    """One attention: an SDPA call or an eager softmax(q kᵀ) v pattern."""

    nodes: frozenset[int]
    q: int
    k: int
    v: int
    out: int
    mask: int | None
    is_causal: bool


def arg(node: Node, pos: int, name: str, default: object = None) -> object:
    """A node's argument by position or keyword."""
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


# --- exported graph -> nodes --------------------------------------------------------------

def _specs(val: Any, requires_grad: bool = False) -> list[TensorSpec]:
    leaves = pytree.tree_leaves(val)
    return [TensorSpec(shape=tuple(int(d) for d in t.shape), dtype=t.dtype,
                       requires_grad=requires_grad and t.dtype.is_floating_point)
            for t in leaves if isinstance(t, torch.Tensor)]


def _module_of(fx_node: torch.fx.Node, fmap: FqnMap) -> tuple[str, str]:
    stack = fx_node.meta.get("nn_module_stack")
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    cls_name = cls.rsplit(".", 1)[-1] if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    return fmap.original(path), cls_name


def _subgraph_flops(gm: torch.fx.GraphModule, grad: bool) -> tuple[float, float]:
    """FLOPs of a higher-order op's body (e.g. HF's rotary under no_grad)."""
    fwd = bwd = 0.0
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        to_spec = lambda x: (_specs(x.meta.get("val"), grad) or [None])[0] if isinstance(x, torch.fx.Node) else x
        args = pytree.tree_map(to_spec, n.args)
        kwargs = pytree.tree_map(to_spec, n.kwargs)
        f = op_flops(n.target, args, kwargs, _specs(n.meta.get("val")))
        if f:
            fwd, bwd = fwd + f[0], bwd + f[1]
    return fwd, bwd


def _aliases(target: Any, fx_node: torch.fx.Node) -> bool:
    src = fx_node.args[0] if fx_node.args else None
    return aliases_input(target, src.meta.get("val") if isinstance(src, torch.fx.Node) else None,
                         fx_node.meta.get("val"))


def build_nodes(ep, fmap: FqnMap, model_dtype: torch.dtype | None, dtype: torch.dtype) -> list[Node]:
    sig = ep.graph_signature
    params, buffers = sig.inputs_to_parameters, sig.inputs_to_buffers
    nodes: list[Node] = []
    index: dict[torch.fx.Node, int] = {}
    root: list[int] = []                 # the tensor each node's output is a view of
    mutated: dict[int, int] = {}         # root -> last node that wrote into it in place
    grad_on = True

    def ref(x: Any) -> Any:
        return Ref(index[x]) if isinstance(x, torch.fx.Node) and x in index else (
            None if isinstance(x, torch.fx.Node) else x)

    def spec(x: Any) -> Any:
        if isinstance(x, Ref):
            n = nodes[x.index]
            return n.out[0] if n.out else None
        return x

    for fx_node in ep.graph.nodes:
        val = fx_node.meta.get("val")
        if fx_node.op == "placeholder":
            if not isinstance(val, torch.Tensor):
                continue
            name = fx_node.target
            kind, src, rg = "input", frozenset(), False
            if name in params:
                kind, src, rg = "param", frozenset({fmap.original(params[name])}), val.requires_grad
            elif name in buffers:
                kind = "buffer"
            root.append(len(nodes))
            n = Node(index=len(nodes), name=fx_node.name, target="placeholder", base="placeholder",
                     module="", module_class="", args=(), kwargs={}, inputs=[],
                     out=_specs(val, rg), placeholder=kind, param_src=src, requires_grad=rg,
                     kind="view")
            index[fx_node] = n.index
            nodes.append(n)
            continue
        if fx_node.op != "call_function":
            continue
        target = fx_node.target
        if target is torch._C._set_grad_enabled:
            grad_on = bool(fx_node.args[0])
            continue
        is_hop = isinstance(target, torch._ops.HigherOrderOperator)
        if not (target is operator.getitem or is_hop or isinstance(target, torch._ops.OpOverload)):
            continue                       # symbolic-int arithmetic and other Python calls
        base = "getitem" if target is operator.getitem else op_base(target)
        if base in SKIP_OPS:
            continue
        out = _specs(val)
        if not out:
            continue
        args = pytree.tree_map(ref, fx_node.args)
        kwargs = pytree.tree_map(ref, dict(fx_node.kwargs))
        inputs = list(dict.fromkeys(r.index for r in pytree.tree_leaves((args, kwargs)) if isinstance(r, Ref)))
        # an in-place write into a tensor (or a view of it) is an input of every later reader,
        # e.g. HF DeepSeek's key_states = new_empty(...); key_states[..., :d].copy_(k_nope)
        writes = [mutated[root[j]] for j in inputs if root[j] in mutated]
        inputs = list(dict.fromkeys(inputs + writes))
        module, module_class = _module_of(fx_node, fmap)
        rg = (grad_on and base not in NON_DIFFERENTIABLE_OPS
              and any(nodes[j].requires_grad for j in inputs))
        out = [TensorSpec(shape=s.shape, dtype=s.dtype, requires_grad=rg and s.dtype.is_floating_point)
               for s in out]
        n = Node(index=len(nodes), name=fx_node.name, target=target, base=base, module=module,
                 module_class=module_class, args=args, kwargs=kwargs, inputs=inputs, out=out,
                 requires_grad=bool(out) and out[0].requires_grad)
        n.params = tuple(sorted({p for j in inputs for p in nodes[j].param_src}))
        first = next((nodes[j] for j in inputs), None)
        tensor_inputs = [j for j in inputs if nodes[j].out]
        if first is not None and first.param_src and (
                base in PARAM_PASS_OPS or (len(tensor_inputs) == 1 and torch.Tag.pointwise in getattr(target, "tags", ()))):
            n.param_src = first.param_src
        if target is operator.getitem:
            parent = nodes[args[0].index] if isinstance(args[0], Ref) else None
            n.param_src = parent.param_src if parent is not None else frozenset()
        elif is_hop:
            sub = next((getattr(ep.graph_module, a.target) for a in fx_node.args
                        if isinstance(a, torch.fx.Node) and a.op == "get_attr"), None)
            grad = bool(fx_node.args[0]) if "set_grad_enabled" in str(target) else grad_on
            n.fwd, n.bwd = _subgraph_flops(sub, grad) if sub is not None else (0.0, 0.0)
            if not grad:
                n.bwd = 0.0
        else:
            s_args = pytree.tree_map(spec, args)
            s_kwargs = pytree.tree_map(spec, kwargs)
            flops = op_flops(target, s_args, s_kwargs, out)
            if flops is None:
                if any(len(nodes[j].shape) >= 2 and nodes[j].param_src for j in inputs):
                    raise TraceError(
                        f"no FLOP formula for op {target} in module {module or '<root>'!r}: it reads "
                        f"weights {list(n.params)}, so it probably multiplies matrices. Register one "
                        f"with torch.utils.flop_counter.register_flop_formula(torch.ops.<ns>.<op>)")
                flops = (0.0, 0.0)
            n.fwd, n.bwd = flops
            if is_matmul_like(target):
                n.contract = contracted_dim(target, s_args if op_base(target) != "aten::einsum" else [])
        weighted = any(nodes[j].param_src and len(nodes[j].shape) >= 2 for j in inputs)
        n.kind = "other" if is_hop else op_kind(target, module_class=module_class, weighted=weighted,
                                                 aliases=_aliases(target, fx_node))
        index[fx_node] = n.index
        first_ref = args[0] if args and isinstance(args[0], Ref) else None
        root.append(root[first_ref.index] if first_ref is not None and (
            base in VIEW_OPS or base == "getitem" or writes_first_arg(target)) else n.index)
        if first_ref is not None and writes_first_arg(target):
            mutated[root[first_ref.index]] = n.index
        for j in inputs:
            nodes[j].users.append(n.index)
        nodes.append(n)

    def itemsize(s: TensorSpec) -> int:
        # The model may be built in fp32 while the plan is for bf16: tensors in the model's own
        # float dtype count at the planned dtype; explicit up-casts (fp32 norms) keep theirs.
        return dtype.itemsize if s.dtype == model_dtype else s.dtype.itemsize

    for n in nodes:
        if n.placeholder or n.kind == "view":
            continue
        read = sum(nodes[j].out[0].numel * itemsize(nodes[j].out[0]) for j in n.inputs if nodes[j].out)
        n.bytes = float(read + sum(s.numel * itemsize(s) for s in n.out))
    return nodes
