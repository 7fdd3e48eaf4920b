"""What one aten op is and costs, from its fake/meta shapes: its IR kind (`op_kind`), whether it
aliases or writes its input, and its FLOPs forward and backward (`op_flops`).

The tracer calls these once per graph node. Shapes come from the node's fake value, so nothing
here touches real memory. The op families matched here are defined in `aten_ops`. (The cost
model's FLOPs of whole layers are another thing: meshplan.cost_models.flops.)

Conventions (shared with `meshplan.ir.profile`)
- A multiply-add counts 2 FLOPs. Only matrix products and attention are counted; elementwise
  ops, norms and reductions count 0 FLOPs (they are bandwidth-bound; the tracer records their
  bytes instead), as in Megatron-LM's model-FLOPs accounting (Narayanan et al., 2021, §5.1).
- Attention is counted in full (no causal halving), as torch's own flop registry does.
- Backward of a matrix product costs one forward-sized product per operand that needs a
  gradient (dX = dY·Wᵀ, dW = Xᵀ·dY), so 2x forward when both need one. Attention backward
  uses torch's own `sdpa_backward_flop_count` (it recomputes the scores: 2.5x forward).

Formulas come from `torch.utils.flop_counter.flop_registry` where torch has one; this module
adds the ops torch lacks: the composite ops that `torch.export` keeps whole (`linear`,
`matmul`, `einsum`, `scaled_dot_product_attention`), the CPU flash-attention kernels, and the
grouped (per-expert) matrix products of MoE layers.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import flop_counter as _fc

from meshplan.profiling.aten_ops import (
    ADDMM_OPS,
    ALIAS_CANDIDATE_OPS,
    ATTENTION_OPS,
    COPY_OPS,
    EMBEDDING_OPS,
    LOSS_OPS,
    MATMUL_OPS,
    NORM_OPS,
    REDUCTION_OPS,
    VIEW_OPS,
)

__all__ = [
    "TensorSpec",
    "op_base",
    "op_flops",
    "op_kind",
    "aliases_input",
    "writes_first_arg",
    "is_matmul_like",
    "is_grouped_mm",
    "is_attention_op",
    "contracted_dim",
    "register_flop_formulas",
]

aten = torch.ops.aten


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """Shape, dtype and grad-need of one tensor value in the graph."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    def __post_init__(self) -> None:
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative dim in shape {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _op_name(target: Any) -> str:
    """'aten::linear' style name of an OpOverload / OpOverloadPacket ('' for anything else)."""
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.name
    name = getattr(target, "_qualified_op_name", None)
    return name or ""


def op_base(target: Any) -> str:
    """Schema name without overload ('aten::linear'); the callable's name for anything else."""
    return _op_name(target) or getattr(target, "__name__", str(target))


def op_kind(target: Any, *, module_class: str = "", weighted: bool = False, aliases: bool = False) -> str:
    """The `profile.OP_KINDS` entry of one op, before the graph-level passes.

    `weighted`: an operand is a parameter (so a product is a "linear", not a "matmul");
    `aliases`: the op returns its input unchanged (a same-dtype cast, .contiguous() of a
    contiguous tensor); `module_class`: the owning module's class, which marks decomposed norms
    (HF's LlamaRMSNorm is pow/mean/rsqrt/mul). Attention patterns, routing and dispatch ops are
    recognised later from the graph.
    """
    b = "getitem" if target is operator.getitem else op_base(target)
    if is_attention_op(target):
        return "attention"
    if is_matmul_like(target):
        return "linear" if weighted else "matmul"
    if b in EMBEDDING_OPS:
        return "embedding"
    if b in NORM_OPS:
        return "norm"
    if b in LOSS_OPS:
        return "loss"
    if b == "aten::topk":
        return "router"
    if b == "getitem" or (b in VIEW_OPS and b not in ("aten::to", "aten::contiguous")) or aliases:
        return "view"
    if "norm" in module_class.lower():
        return "norm"
    if torch.Tag.pointwise in getattr(target, "tags", ()) or b in COPY_OPS:
        return "elementwise"
    if b in REDUCTION_OPS:
        return "reduction"
    return "other"


def aliases_input(target: Any, src: Any, out: Any) -> bool:
    """Casts to the same dtype and .contiguous()/.reshape() of a contiguous tensor move no data."""
    b = op_base(target)
    if b not in ALIAS_CANDIDATE_OPS:
        return False
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    if b in ("aten::contiguous", "aten::reshape"):
        return src.is_contiguous()
    return src.dtype == out.dtype and src.device == out.device


def writes_first_arg(target: Any) -> bool:
    """In-place ops (copy_, add_, index_put_, ...) write into their first argument."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    info = schema.arguments[0].alias_info
    return info is not None and info.is_write


def _packet(target: Any) -> Any:
    return getattr(target, "overloadpacket", target)


def is_grouped_mm(target: Any) -> bool:
    """aten._grouped_mm, transformers::grouped_mm_fallback, meshplan::grouped_mm and the like."""
    name = _op_name(target)
    return name.endswith("grouped_mm") or name.endswith("grouped_mm_fallback")


def is_matmul_like(target: Any) -> bool:
    return _op_name(target) in MATMUL_OPS or is_grouped_mm(target)


def is_attention_op(target: Any) -> bool:
    return _op_name(target) in ATTENTION_OPS


def _tensor_args(args: Sequence[Any]) -> list[TensorSpec]:
    return [a for a in args if isinstance(a, TensorSpec)]


def _einsum_flops(equation: str, operands: Sequence[TensorSpec]) -> float:
    """2 x product of every index size, for a two-operand contraction (0 for one operand)."""
    if len(operands) < 2:
        return 0.0
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for letters, spec in zip(lhs, operands):
        letters = letters.replace("...", "")
        # an ellipsis takes the leading dims; name them so they multiply once
        extra = len(spec.shape) - len(letters)
        for i in range(extra):
            sizes[f"_{i}"] = max(sizes.get(f"_{i}", 1), spec.shape[i])
        for ch, d in zip(letters, spec.shape[extra:]):
            sizes[ch] = max(sizes.get(ch, 1), d)
    return 2.0 * math.prod(sizes.values())


def contracted_dim(target: Any, args: Sequence[Any]) -> int:
    """Size K of the dimension a matrix product sums over (0 when unknown)."""
    name = _op_name(target)
    t = _tensor_args(args)
    if name == "aten::linear":
        return t[1].shape[-1]
    if name in ADDMM_OPS:
        return t[1].shape[-1]
    if name in ("aten::mm", "aten::bmm", "aten::matmul", "aten::_scaled_mm", "aten::mv", "aten::dot") \
            or is_grouped_mm(target):
        return t[0].shape[-1]
    return 0


def _matmul_fwd(target: Any, args: Sequence[Any], out: Sequence[TensorSpec]) -> float:
    name = _op_name(target)
    t = _tensor_args(args)
    if name == "aten::einsum":
        ops = args[1] if len(args) > 1 else []
        return _einsum_flops(args[0], [o for o in ops if isinstance(o, TensorSpec)])
    if is_grouped_mm(target):
        a, b = t[0].shape, t[1].shape
        # every row of `a` meets exactly one expert's (K, N) matrix; fake tensors hide the
        # offsets, so all rows are assumed routed (true for a dropless router)
        if len(a) == 2 and len(b) == 3:       # (S, K) x (E, K, N), or nn.Linear layout (E, N, K)
            n = b[2] if b[1] == a[1] else b[1]
            return 2.0 * a[0] * a[1] * n
        if len(a) == 3 and len(b) == 3:       # (E, M, K) x (E, K, N)
            return 2.0 * a[0] * a[1] * a[2] * b[2]
        if len(a) == 2 and len(b) == 2:       # (K, S) x (S, N) -> (E, K, N): weight grads
            return 2.0 * a[0] * a[1] * b[1]
        return -1.0  # a layout this module does not know: the caller reports it
    if not out:
        return 0.0
    k = contracted_dim(target, args)
    return 2.0 * out[0].numel * k


def _sdpa_shapes(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...]):
    """Pad q/k/v to (B, H, S, D) and broadcast singleton batch dims, as the kernels do.

    Grouped-query attention (fewer K/V heads) does the matmul work of K/V broadcast to every
    query head; older torch's sdpa_flop_count (2.11) asserts on unequal heads, so broadcast here."""
    def four(s: tuple[int, ...]) -> tuple[int, ...]:
        return (1,) * (4 - len(s)) + tuple(s) if len(s) < 4 else (math.prod(s[:-3]),) + tuple(s[-3:])
    q4, k4, v4 = four(q), four(k), four(v)
    b, h = max(q4[0], k4[0], v4[0]), q4[1]
    return (b,) + q4[1:], (b, h) + k4[2:], (b, h) + v4[2:]


def _attention_flops(tensors: Sequence[TensorSpec]) -> tuple[float, float]:
    q, k, v = tensors[:3]
    q4, k4, v4 = _sdpa_shapes(q.shape, k.shape, v.shape)
    fwd = float(_fc.sdpa_flop_count(q4, k4, v4))
    bwd = 0.0
    if q.requires_grad or k.requires_grad or v.requires_grad:
        grad_out = q4[:3] + (v4[3],)
        bwd = float(_fc.sdpa_backward_flop_count(grad_out, q4, k4, v4))
    return fwd, bwd


def _to_shapes(x: Any) -> Any:
    if isinstance(x, TensorSpec):
        return torch.Size(x.shape)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_shapes(i) for i in x)
    if isinstance(x, dict):
        return {k: _to_shapes(v) for k, v in x.items()}
    return x


def _grad_operands(target: Any, args: Sequence[Any]) -> int:
    """How many of a product's two operands need a gradient (each costs one forward in bwd)."""
    name = _op_name(target)
    if name == "aten::einsum":
        operands = [o for o in (args[1] if len(args) > 1 else []) if isinstance(o, TensorSpec)]
    elif name in ADDMM_OPS:
        operands = _tensor_args(args)[1:3]      # the added term is not a product operand
    else:
        operands = _tensor_args(args)[:2]
    return sum(1 for o in operands[:2] if o.requires_grad)


def op_flops(target: Any, args: Sequence[Any], kwargs: dict[str, Any],
             out: Sequence[TensorSpec]) -> tuple[float, float] | None:
    """(forward, backward) FLOPs of one op call, or None when no formula is known.

    `args`/`kwargs` hold `TensorSpec` where the op receives a tensor; `out` lists the specs of
    the op's tensor outputs. Ops that do no matrix products (elementwise, views, reductions)
    return (0, 0). None means a non-aten op (a custom op) for which neither torch's registry
    nor this module has a formula: the caller decides whether that matters.
    """
    if is_attention_op(target):
        named = [kwargs[n] for n in ("query", "key", "value") if isinstance(kwargs.get(n), TensorSpec)]
        return _attention_flops(_tensor_args(args) + named)
    formula: Callable[..., int] | None = _fc.flop_registry.get(_packet(target))
    if formula is not None:
        out_val = out[0] if len(out) == 1 else tuple(out)
        fwd = float(formula(*_to_shapes(list(args)), out_val=_to_shapes(out_val),
                            **_to_shapes(dict(kwargs))))
        return fwd, fwd * _grad_operands(target, args)
    if is_matmul_like(target):
        fwd = _matmul_fwd(target, args, out)
        if fwd < 0:
            return None
        return fwd, fwd * _grad_operands(target, args)
    name = _op_name(target)
    if name.startswith(("aten::", "prims::")) or not name:
        return 0.0, 0.0
    return None


# --- formulas torch's registry lacks -------------------------------------------------------

def _cpu_flash_fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return _fc.sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return _fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def register_flop_formulas() -> None:
    """Register the CPU flash-attention kernels in torch's flop registry (idempotent).

    Under FakeTensorMode on CPU, SDPA dispatches to these kernels, which torch 2.13's
    registry does not know, so FlopCounterMode silently drops attention FLOPs
    (measured in /work/shared/reference/cpu_platform.md §8). Registering them fixes
    FlopCounterMode for every caller, not only for the tracer.
    """
    pairs = (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_fwd),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_bwd),
    )
    for op_name, fn in pairs:
        packet = getattr(aten, op_name, None)
        if packet is not None and packet not in _fc.flop_registry:
            _fc.register_flop_formula(packet)(fn)


register_flop_formulas()
