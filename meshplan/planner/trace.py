"""Trace any single-device nn.Module into meshplan's graph IR and per-block profiles.

    profile = trace(model, seq_len=8192)            # model on the meta device, fake or real
    ops = trace_graph(model, seq_len=8192)          # the traced graph as a list of OpInfo

How (and why this way)
- `torch.export.export(strict=False)` on the model's own device: the meta device or
  FakeTensorMode, so no real memory is touched (real weights are fakified by export, never
  copied). `torch.fx.symbolic_trace` fails on transformers models, and FlopCounterMode on the
  meta device fails on their `.item()` calls (reference/cpu_platform.md §8).
- Repeated blocks are found from the module tree first (`blocks.find_block_containers`) and
  each list of blocks is swapped for one representative per unique structure, so a 126-layer
  model is traced with one layer (`blocks.shrunk`), then the names are mapped back.
- Each op gets shapes, dtype, forward/backward FLOPs (`flops.op_flops`), bytes, its owning
  module and the parameters it reads; blocks are then analysed by data flow
  (`blocks.analyse_block`).
- transformers MoE models default to a data-dependent loop over the experts that export
  cannot trace; for the duration of the trace their `config._experts_implementation` is set to
  the static-shape "grouped_mm" (and restored).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import linecache
import logging
import operator
import os
import re
import sys
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, redirect_stderr
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from meshplan.errors import ConfigError, MeshplanError, TraceError
from meshplan.planner.blocks import (
    AttentionUnit,
    BlockContainer,
    FqnMap,
    Node,
    Ref,
    analyse_block,
    arg,
    find_block_containers,
    join,
    shrunk,
    weight_of,
)
from meshplan.ir.fingerprint import fingerprint
from meshplan.planner.flops import (
    DISPATCH_OPS,
    VIEW_OPS,
    TensorSpec,
    aliases_input,
    contracted_dim,
    is_attention_op,
    is_matmul_like,
    op_base,
    op_flops,
    op_kind,
    writes_first_arg,
)
from meshplan.planner.fusions import find_fusions
from meshplan.ir.profile import BlockProfile, ModelProfile, OpInfo

__all__ = ["trace", "trace_graph"]

# Ops that produce no value the IR cares about (export's runtime assertions).
_SKIP_OPS = frozenset({
    "aten::_assert_tensor_metadata", "aten::_assert_scalar", "aten::_assert_async",
    "aten::sym_constrain_range", "aten::sym_constrain_range_for_size", "aten::_print",
})
# Implementations of transformers' experts whose shapes do not depend on the routing.
_STATIC_EXPERTS = ("grouped_mm", "batched_mm")
# Ops through which a parameter stays "the parameter" (casts, views, expert-row selection).
_PARAM_PASS = VIEW_OPS | {"getitem", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous",
                          "aten::index", "aten::index_select", "aten::type_as", "aten::t"}
_NON_DIFFERENTIABLE = frozenset({"aten::detach", "aten::argsort", "aten::argmax", "aten::argmin"})
_SOFTMAX = frozenset({"aten::softmax", "aten::_softmax", "aten::_safe_softmax"})
# Between q·kᵀ and softmax: scaling, soft-capping, masking, casts.
_SCORE_OPS = frozenset({"aten::mul", "aten::div", "aten::add", "aten::sub", "aten::masked_fill",
                        "aten::where", "aten::tanh", "aten::_to_copy", "aten::to", "aten::clone",
                        "aten::contiguous", "aten::type_as", "aten::masked_fill_", "aten::add_",
                        "aten::div_", "aten::mul_"})
# Between softmax and probs·v: casts and dropout.
_PROB_OPS = frozenset({"aten::_to_copy", "aten::to", "aten::type_as", "aten::dropout",
                       "aten::native_dropout", "getitem", "aten::mul", "aten::div", "aten::clone",
                       "aten::contiguous", "aten::masked_fill"})
_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB_DIR = os.path.dirname(os.__file__)


# --- inputs and model state ----------------------------------------------------------------

def _first_tensor(model: nn.Module) -> torch.Tensor | None:
    for t in model.parameters():
        return t
    for t in model.buffers():
        return t
    return None


def _fake_mode(model: nn.Module):
    from torch._subclasses.fake_tensor import FakeTensor

    t = _first_tensor(model)
    return t.fake_mode if isinstance(t, FakeTensor) else None


def _default_inputs(model: nn.Module, *, seq_len: int, batch: int, vocab: int | None,
                    example_inputs: tuple | None, example_kwargs: dict | None) -> tuple[tuple, dict]:
    kwargs = dict(example_kwargs or {})
    try:
        accepted = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        accepted = {}
    if "use_cache" in accepted and "use_cache" not in kwargs:
        kwargs["use_cache"] = False       # HF: no KV cache while training
    if example_inputs is not None:
        return tuple(example_inputs), kwargs
    if vocab is None and not any(isinstance(m, nn.Embedding) for m in model.modules()):
        raise TraceError(
            f"{type(model).__name__} has no nn.Embedding to take token ids from; pass "
            f"example_inputs=(tensor, ...) (meta or fake tensors) to trace it")
    t = _first_tensor(model)
    device = t.device if t is not None else torch.device("meta")
    fake = _fake_mode(model)
    with fake if fake is not None else ExitStack():
        # token 0 is valid for any vocabulary; the values never matter on meta/fake tensors
        ids = torch.zeros((batch, seq_len), dtype=torch.long, device=device)  # (B, T)
    return (ids,), kwargs


@contextmanager
def _static_experts(model: nn.Module) -> Iterator[None]:
    """Switch transformers' experts to a static-shape implementation, restore on exit."""
    configs = {}
    for m in [model, *model.modules()]:
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(type(cfg), "_experts_implementation"):
            configs[id(cfg)] = cfg
    saved = []
    try:
        for cfg in configs.values():
            current = cfg._experts_implementation
            if current not in _STATIC_EXPERTS:
                saved.append((cfg, current))
                cfg._experts_implementation = "grouped_mm"
        yield
    finally:
        for cfg, current in reversed(saved):
            cfg._experts_implementation = current


@contextmanager
def _train_mode(model: nn.Module) -> Iterator[None]:
    """Trace what training runs (dropout, routing noise); restore every module's mode."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.train()
        yield
    finally:
        for m, mode in modes:
            m.training = mode


# --- export and its errors -----------------------------------------------------------------

def _exceptions(e: BaseException) -> Iterator[BaseException]:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _translate(e: BaseException, model: nn.Module, fmap: FqnMap) -> TraceError:
    """A TraceError naming the module (original FQN) and the op or line that failed."""
    fqn_of = {id(m): name for name, m in model.named_modules()}
    module_fqn, module_cls, where = None, "", ""
    for exc in _exceptions(e):
        for frame, lineno in traceback.walk_tb(exc.__traceback__):
            obj = frame.f_locals.get("self")
            if isinstance(obj, nn.Module) and id(obj) in fqn_of:
                module_fqn, module_cls = fqn_of[id(obj)], type(obj).__name__
            fname = frame.f_code.co_filename
            # the last frame of user code (the model, transformers, ...) says where it failed
            if not fname.startswith((_TORCH_DIR, _STDLIB_DIR)) and "/meshplan/planner/" not in fname:
                where = f"{os.path.basename(fname)}:{lineno} in {frame.f_code.co_name}"
                src = _source_line(fname, lineno)
                if src:
                    where += f": `{src}`"
    text = " ".join(str(x) for x in _exceptions(e))
    op = re.search(r"Caused by: \([^)]* in (\w+)\)", text)
    op_text = f" (op `{op.group(1)}`)" if op else ""
    place = f"{module_cls} at {fmap.original(module_fqn)!r}" if module_fqn is not None else "the model"
    if module_fqn == "":
        place = f"{module_cls} (the root module)"
    dd = any(type(x).__name__ in ("GuardOnDataDependentSymNode", "DataDependentOutputException",
                                  "PendingUnbackedSymbolNotFound", "DynamicOutputShapeException")
             for x in _exceptions(e)) or "data-dependent" in text or "data dependent" in text
    if dd:
        advice = ("data-dependent control flow: a Python branch, loop or shape depends on tensor "
                  "values, which a trace without real data cannot know. Use static-shape dispatch "
                  "such as meshplan.models.grouped_mm (sort tokens by expert, one grouped matmul), "
                  "or for transformers models experts_implementation='grouped_mm'")
    elif isinstance(e, NotImplementedError) or "meta" in text and "kernel" in text:
        advice = ("an op without a meta/fake implementation: register one with "
                  "torch.library.register_fake for custom ops")
    else:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        advice = f"{type(e).__name__}: {first[:300]}"
    return TraceError(f"cannot trace {place}{op_text} [{where}]: {advice}")


def _source_line(fname: str, lineno: int) -> str:
    return linecache.getline(fname, lineno).strip()[:120]


@contextmanager
def _quiet_failures() -> Iterator[None]:
    """On failure torch.export prints the partial graph to stderr and logs a symbolic-shapes
    warning; the TraceError says what matters, so keep that noise out of the user's console
    (what was printed is passed through when export succeeds)."""
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    buffer = io.StringIO()
    failed = False
    shapes_log.setLevel(logging.ERROR)
    try:
        with redirect_stderr(buffer):
            yield
    except BaseException:
        failed = True
        raise
    finally:
        shapes_log.setLevel(level)
        if not failed and buffer.getvalue():
            sys.stderr.write(buffer.getvalue())


def _export(model: nn.Module, args: tuple, kwargs: dict, fmap: FqnMap):
    try:
        with _quiet_failures():
            return torch.export.export(model, args, kwargs, strict=False)
    except MeshplanError:
        raise
    except Exception as e:  # noqa: BLE001 - every export failure is translated, cause kept
        raise _translate(e, model, fmap) from e


# --- graph -> nodes ------------------------------------------------------------------------

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


def _build_nodes(ep, fmap: FqnMap, model_dtype: torch.dtype | None, dtype: torch.dtype) -> list[Node]:
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
        if base in _SKIP_OPS:
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
        rg = (grad_on and base not in _NON_DIFFERENTIABLE
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
                base in _PARAM_PASS or (len(tensor_inputs) == 1 and torch.Tag.pointwise in getattr(target, "tags", ()))):
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


# --- attention -----------------------------------------------------------------------------

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


def _find_attention(nodes: list[Node]) -> list[AttentionUnit]:
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
        elif n.base in _SOFTMAX and len(n.shape) >= 3:
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
        if c.base not in _SCORE_OPS:
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
        step = [u for u in users if nodes[u].base in _PROB_OPS and nodes[u].is_float]
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
    if nodes[kt].base in ("aten::transpose", "aten::permute", "aten::t", "aten::mT") and nodes[kt].inputs:
        k = nodes[kt].inputs[0]
    return AttentionUnit(nodes=frozenset(path) | {qk, pv, kt}, q=q, k=k, v=v, out=pv, mask=mask,
                         is_causal=False)


def _mark_dispatch(nodes: list[Node]) -> None:
    """Index/sort/scatter ops that depend on a router's top-k choice move tokens to experts."""
    dep = [False] * len(nodes)
    for n in nodes:
        dep[n.index] = n.base == "aten::topk" or any(dep[j] for j in n.inputs)
        if dep[n.index] and n.base in DISPATCH_OPS and n.kind not in ("linear", "view", "router"):
            n.kind = "moe_dispatch"


# --- public API ----------------------------------------------------------------------------

def _check(seq_len: int, batch: int, vocab: int | None, dtype: torch.dtype) -> None:
    for label, v in (("seq_len", seq_len), ("batch", batch)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{label} must be a positive int, got {v!r}")
    if vocab is not None and (not isinstance(vocab, int) or vocab < 1):
        raise ConfigError(f"vocab must be a positive int or None, got {vocab!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}")


def _model_dtype(model: nn.Module) -> torch.dtype | None:
    """The floating dtype holding most parameters (the one the model computes in)."""
    by_dtype: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.dtype.is_floating_point:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
    return max(by_dtype, key=by_dtype.get) if by_dtype else None


class _Traced:
    """The shallow trace: nodes, attention units, and which block each node belongs to."""

    def __init__(self, nodes: list[Node], units: list[AttentionUnit],
                 containers: tuple[BlockContainer, ...]):
        self.nodes, self.units, self.containers = nodes, units, containers
        # representative instance FQN -> (container, key)
        self.reps = {join(c.fqn, k): (c, k) for c in containers for k in c.representatives()}
        instances = {join(c.fqn, k) for c in containers for k in c.block_keys}
        self.owner: dict[int, str] = {}
        # ops of non-representative instances: only present when the model had to be traced
        # whole; they repeat a representative and are left out of the profile
        self.repeats: set[int] = set()
        for n in nodes:
            if n.placeholder:
                continue
            path = n.module
            while path:
                if path in self.reps:
                    self.owner[n.index] = path
                    break
                if path in instances:
                    self.repeats.add(n.index)
                    break
                path = path.rpartition(".")[0]


def _run(model: nn.Module, *, seq_len: int, batch: int, vocab: int | None, dtype: torch.dtype,
         example_inputs: tuple | None, example_kwargs: dict | None) -> _Traced:
    _check(seq_len, batch, vocab, dtype)
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace() takes an nn.Module, got {type(model).__name__}")
    containers = find_block_containers(model)
    args, kwargs = _default_inputs(model, seq_len=seq_len, batch=batch, vocab=vocab,
                                   example_inputs=example_inputs, example_kwargs=example_kwargs)
    model_dtype = _model_dtype(model)
    with _static_experts(model), _train_mode(model):
        try:
            with shrunk(model, containers) as fmap:
                ep = _export(model, args, kwargs, fmap)
                nodes = _build_nodes(ep, fmap, model_dtype, dtype)
        except TraceError as e:
            # A model that indexes its block list by absolute position (self.layers[i] for
            # i < num_layers) cannot run shortened: trace it whole (slower, still correct).
            if not containers or not any(isinstance(x, (IndexError, KeyError)) for x in _exceptions(e)):
                raise
            with shrunk(model, ()) as fmap:
                ep = _export(model, args, kwargs, fmap)
                nodes = _build_nodes(ep, fmap, model_dtype, dtype)
    units = _find_attention(nodes)
    for u in units:
        for i in u.nodes:
            if nodes[i].kind != "view":
                nodes[i].kind = "attention"
    _mark_dispatch(nodes)
    return _Traced(nodes, units, containers)


def _op_info(n: Node, nodes: list[Node], dtype: torch.dtype, model_dtype: torch.dtype | None) -> OpInfo:
    out_dtype = n.out[0].dtype if n.out else None
    if out_dtype is not None and out_dtype == model_dtype:
        out_dtype = dtype
    return OpInfo(
        name=n.name, target=str(n.target), kind=n.kind, module=n.module,
        input_shapes=tuple(nodes[j].shape for j in n.inputs),
        output_shapes=tuple(s.shape for s in n.out),
        dtype=str(out_dtype).removeprefix("torch.") if out_dtype is not None else "",
        fwd_flops=n.fwd, bwd_flops=n.bwd, bytes=n.bytes, params=n.params,
        inputs=tuple(nodes[j].name for j in n.inputs), role=n.role, scalars=_scalars(n))


def _scalars(n: Node) -> tuple[float, ...]:
    """Numeric constants passed to the op (positional, then keyword), e.g. a norm's eps."""
    vals = list(n.args) + list(n.kwargs.values())
    return tuple(float(v) for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool))


def trace_graph(model: nn.Module, *, seq_len: int, batch: int = 1, vocab: int | None = None,
                dtype: torch.dtype = torch.bfloat16, example_inputs: tuple | None = None,
                example_kwargs: dict | None = None) -> list[OpInfo]:
    """The traced graph as OpInfos in execution order (graph inputs left out).

    Repeated blocks appear once (their representative, named by its original FQN), exactly as
    `trace` analyses them; `trace(...).blocks[i].instances` lists where each one repeats.
    """
    t = _run(model, seq_len=seq_len, batch=batch, vocab=vocab, dtype=dtype,
             example_inputs=example_inputs, example_kwargs=example_kwargs)
    md = _model_dtype(model)
    for rep in t.reps:
        owned = [i for i, o in t.owner.items() if o == rep]
        if owned:
            _analyse(t, rep, owned, model, batch, seq_len)
    return [_op_info(n, t.nodes, dtype, md) for n in t.nodes
            if not n.placeholder and n.index not in t.repeats]


def _param_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}


def _analyse(t: _Traced, rep: str, owned: list[int], model: nn.Module, batch: int, seq: int) -> dict:
    try:
        return analyse_block(t.nodes, sorted(owned), t.units, inst=rep, batch=batch, seq=seq,
                             param_shapes=_param_shapes(model))
    except (IndexError, KeyError, ValueError, TypeError, ZeroDivisionError) as e:
        raise TraceError(
            f"cannot classify block {rep!r} ({type(e).__name__}: {e}); its ops do not match the "
            f"attention / MLP / MoE patterns meshplan knows. Please report the model") from e


def _numel(params) -> int:
    seen, total = set(), 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def trace(model: nn.Module, *, seq_len: int, batch: int = 1, vocab: int | None = None,
          dtype: torch.dtype = torch.bfloat16, example_inputs: tuple | None = None,
          example_kwargs: dict | None = None, name: str | None = None) -> ModelProfile:
    """Trace `model` without real memory and describe it for the cost model.

    The default input is `input_ids` (batch, seq_len) over `vocab` (default: the first
    nn.Embedding's size); pass `example_inputs` / `example_kwargs` (meta or fake tensors) for
    other signatures. `dtype` is the training precision: tensors in the model's own float dtype
    are counted at `dtype`'s size. Raises TraceError naming the module and op that cannot be
    traced or classified.
    """
    t = _run(model, seq_len=seq_len, batch=batch, vocab=vocab, dtype=dtype,
             example_inputs=example_inputs, example_kwargs=example_kwargs)
    nodes = t.nodes
    md = _model_dtype(model)
    named = dict(model.named_parameters(remove_duplicate=False))
    param_shapes = {k: tuple(p.shape) for k, p in named.items()}

    # --- blocks, one per representative that ran
    blocks: list[BlockProfile] = []
    block_of: dict[tuple[str, str], int] = {}          # (container fqn, signature) -> index
    first_op: dict[str, int] = {}
    for i, owner in t.owner.items():
        first_op[owner] = min(first_op.get(owner, i), i)
    containers = [c for c in t.containers
                  if any(join(c.fqn, k) in first_op for k in c.representatives())]
    containers.sort(key=lambda c: min(first_op.get(join(c.fqn, k), 1 << 62) for k in c.representatives()))
    for c in containers:
        for key in c.representatives():
            rep = join(c.fqn, key)
            owned = sorted(i for i, o in t.owner.items() if o == rep)
            facts = _analyse(t, rep, owned, model, batch, seq_len) if owned else {}
            expert_params = facts.pop("expert_params", 0)
            module = model.get_submodule(rep)
            sig = c.signature_of(key)
            block_of[(c.fqn, sig)] = len(blocks)
            blocks.append(BlockProfile(
                signature=sig, instances=c.instances(sig),
                params=_numel(module.parameters()), expert_params=expert_params,
                fwd_flops=sum(nodes[i].fwd for i in owned), bwd_flops=sum(nodes[i].bwd for i in owned),
                ops=tuple(_op_info(nodes[i], nodes, dtype, md) for i in owned),
                **{"hidden": 0, **facts}))
    layers = tuple(block_of[(c.fqn, c.signature_of(k))] for c in containers for k in c.block_keys)

    # --- ops outside the blocks
    outside = [n for n in nodes if not n.placeholder and n.index not in t.owner
               and n.index not in t.repeats]
    owned_all = [i for i, o in t.owner.items() if any(o == join(c.fqn, k) for c in containers
                                                       for k in c.representatives())]
    last = max(owned_all, default=-1)
    pre = [n for n in outside if n.index < last] if owned_all else outside
    post = [n for n in outside if n.index > last] if owned_all else []

    # --- embedding and head
    emb_nodes = [n for n in outside if n.kind == "embedding"]
    token = next((n for n in emb_nodes if any(nodes[j].placeholder == "input" for j in n.inputs)),
                 emb_nodes[0] if emb_nodes else None)
    emb_weights = {p for n in emb_nodes for p in n.params}
    embedding_params = _numel(named[p] for p in emb_weights if p in named)
    token_weight = weight_of(token, param_shapes) if token is not None else None
    if token_weight is None and token is not None and token.params:
        token_weight = token.params[0]
    vocab_size = vocab or (param_shapes[token_weight][0] if token_weight else 0)
    heads = [n for n in (post or outside) if n.kind == "linear" and n.shape and n.shape[-1] == vocab_size]
    head = heads[-1] if heads else None
    head_weight = weight_of(head, param_shapes) if head is not None else None
    tied = bool(head_weight and token_weight and named[head_weight] is named[token_weight])
    head_params = 0 if tied or head is None else _numel(named[p] for p in head.params if p in named)

    total = _numel(model.parameters())
    in_blocks = sum(b.params * b.count for b in blocks)
    hidden = (param_shapes[token_weight][-1] if token_weight and len(param_shapes[token_weight]) == 2
              else max((b.hidden for b in blocks), default=0))
    cfg = getattr(model, "config", None)
    cfg_name = getattr(cfg, "name", None) or getattr(cfg, "name_or_path", None)
    prof = ModelProfile(
        name=name or (cfg_name if isinstance(cfg_name, str) and cfg_name else type(model).__name__),
        fingerprint=fingerprint(model), seq_len=seq_len, vocab=vocab_size, hidden=hidden,
        dtype=str(dtype).removeprefix("torch."), embedding_params=embedding_params,
        head_params=head_params, tied_embeddings=tied,
        other_params=max(total - embedding_params - head_params - in_blocks, 0),
        blocks=tuple(blocks), layers=layers,
        pre_ops=tuple(_op_info(n, nodes, dtype, md) for n in pre),
        post_ops=tuple(_op_info(n, nodes, dtype, md) for n in post),
        embedding_fqn=token.module if token is not None else "",
        head_fqn=head.module if head is not None else "",
        pre_modules=_param_owners(pre), post_modules=_param_owners(post))
    return dataclasses.replace(prof, fusions=find_fusions(prof).applied)


def _param_owners(nodes) -> tuple[str, ...]:
    """Modules whose ops read parameters, first use first (a tied head counts as its own module)."""
    out: list[str] = []
    for n in nodes:
        if n.params and n.module and n.module not in out:
            out.append(n.module)
    return tuple(out)
