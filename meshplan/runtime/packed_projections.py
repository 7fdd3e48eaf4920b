"""Tensor parallelism for packed projections and transposed-weight linears.

A packed projection is one linear whose output features are several projections side by side:
a fused QKV projection (rows [q; k; v], label "colwise_qkv") or a fused SwiGLU input projection
(rows [gate; up], label "colwise_gate_up"). Splitting its rows into tp contiguous blocks would
give a rank some of q and some of k; instead each TP rank holds its slice of every part, in
order: rank r holds [q_r; k_r; v_r] (its query heads, and the key/value heads they read) or
[gate_r; up_r]. The user's forward then slices its local output exactly as it slices the whole
one, with local sizes (the attention's head counts are divided by tp: label "heads").

How the weight is laid out as a DTensor: its rows (Conv1D: columns) are put in *TP order*
(rank 0's [q_0; k_0; v_0], then rank 1's, ...) and sharded Shard(0) (Conv1D: Shard(1)), so
DTensor sees a plain column-parallel weight: gradient norms, the optimizer and FSDP2 (which
composes its own sharding with a TP Shard) need nothing else. No DTensor placement describes
"the r-th chunk of every part" in general: `_StridedShard` does for parts of equal size, but not
for grouped-query attention (q wider than k and v), and FSDP2 composes its dp sharding with a
TP `_StridedShard` wrongly (torch 2.13: the global view of the 2-D parameter is scrambled).

The global view of such a parameter is therefore a permutation of the user's tensor:
- the module's `state_dict` gives it back in the user's order (a whole tensor; its load hook
  takes the user's whole tensor back to this rank's shard), so `full_state_dict` and model
  checkpoints hold the user's layout;
- gradients (`p.grad`) and optimizer state stay in TP order: `from_tp_order(t, *spec)` with
  `tp_order_params(model)[fqn]` turns a gathered one back. The module records its parameters'
  specs (not the parameters: FSDP replaces them).

transformers' GPT-2 `Conv1D` keeps its weight transposed, (in, out) (`is_conv1d`): column
parallel splits its dim 1, row parallel its dim 0. Both styles here compute on local tensors
(column parallel: input gradient reduced as a Partial, Megatron's "f"; row parallel: the
partial output reduced through DTensor, all-reduce or, under sequence parallelism,
reduce-scatter onto the sequence shard, then the bias added once).
"""

from __future__ import annotations

import torch
from torch import nn

from meshplan.errors import LayoutError
from meshplan.ir.tp_locality import KV_HEAD_ATTRS, Q_HEAD_ATTRS, head_count, is_conv1d, out_dim

__all__ = [
    "PACKED_LABELS",
    "ColwiseLocal",
    "RowwiseConv1D",
    "from_tp_order",
    "is_conv1d",
    "packed_parts",
    "qkv_parts",
    "to_tp_order",
    "tp_order",
    "tp_order_params",
]

# label -> what the rows hold
PACKED_LABELS = {"colwise_qkv": "q|k|v", "colwise_gate_up": "gate|up"}
def qkv_parts(attention: nn.Module, out_features: int, fqn: str) -> tuple[int, int, int]:
    """(q, k, v) widths of a fused QKV projection with `out_features` outputs, from the head
    counts of the attention module that reads it (before they are made local)."""
    heads = head_count(attention, Q_HEAD_ATTRS)
    kv = head_count(attention, KV_HEAD_ATTRS) or heads
    if not heads or out_features % (heads + 2 * kv):
        raise LayoutError(f"{fqn}: cannot tell how its {out_features} outputs split into q, k and v: its "
                          f"attention module keeps no head counts the runtime reads ({', '.join(Q_HEAD_ATTRS)}; "
                          f"{', '.join(KV_HEAD_ATTRS)}), or they do not divide it; re-plan with tp=1")
    hd = out_features // (heads + 2 * kv)
    return heads * hd, kv * hd, kv * hd


def packed_parts(label: str, module: nn.Module, fqn: str, attention: nn.Module | None) -> tuple[int, ...]:
    n = module.weight.shape[out_dim(module)]
    if label == "colwise_gate_up":
        if n % 2:
            raise LayoutError(f"{fqn}: a fused gate/up projection needs an even width, not {n}")
        return (n // 2, n // 2)
    if attention is None:
        raise LayoutError(f"{fqn} is labelled {label!r} but its block has no attention module labelled "
                          "'heads' to read the head counts from; re-plan")
    return qkv_parts(attention, n, fqn)


def tp_order(parts: tuple[int, ...], tp: int) -> torch.Tensor:
    """Row index that puts rank 0's slice of every part first, then rank 1's, ..."""
    for p in parts:
        if p % tp:
            raise LayoutError(f"packed projection parts {parts} are not divisible by tp={tp}")
    starts = [sum(parts[:i]) for i in range(len(parts))]
    idx = [torch.arange(s + r * (p // tp), s + (r + 1) * (p // tp)) for r in range(tp)
           for s, p in zip(starts, parts)]
    return torch.cat(idx)


def to_tp_order(t: torch.Tensor, parts: tuple[int, ...], tp: int, dim: int = 0) -> torch.Tensor:
    return t.index_select(dim, tp_order(parts, tp).to(t.device))


def from_tp_order(t: torch.Tensor, parts: tuple[int, ...], tp: int, dim: int = 0) -> torch.Tensor:
    return t.index_select(dim, torch.argsort(tp_order(parts, tp)).to(t.device))


_TP_ORDER = "_meshplan_tp_order"      # module attribute: {param name: (parts, tp, dim)}


def tp_order_params(root: nn.Module) -> dict[str, tuple[tuple[int, ...], int, int]]:
    """{parameter FQN: (parts, tp, dim)} of the parameters of `root` kept in TP order."""
    out = {}
    for fqn, mod in root.named_modules():
        for name, spec in mod.__dict__.get(_TP_ORDER, {}).items():
            out[f"{fqn}.{name}" if fqn else name] = spec
    return out


def _shard(t: torch.Tensor, mesh, dim: int, parts: tuple[int, ...] | None) -> tuple[nn.Parameter, tuple | None]:
    """One parameter of a column-parallel projection as a DTensor (see the module docstring),
    and its TP-order spec (None when its global view is the user's tensor)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    tp = mesh.size()
    if parts is None or len(parts) == 1:
        return nn.Parameter(distribute_tensor(t, mesh, [Shard(dim)]), requires_grad=t.requires_grad), None
    p = nn.Parameter(distribute_tensor(to_tp_order(t.detach(), parts, tp, dim), mesh, [Shard(dim)]),
                     requires_grad=t.requires_grad)
    return p, (tuple(parts), tp, dim)


def _tp_order_state_hooks(module: nn.Module) -> None:
    """state_dict in the user's row order (a whole tensor); load takes it back to the shard."""
    def save(mod, state, prefix, _meta):
        for name, spec in mod.__dict__[_TP_ORDER].items():
            p = getattr(mod, name)
            if prefix + name in state:
                state[prefix + name] = from_tp_order(p.detach().full_tensor(), *spec)

    def load(mod, state, prefix, *_args):
        from torch.distributed.tensor import DTensor, distribute_tensor
        for name, spec in mod.__dict__[_TP_ORDER].items():
            p, key = getattr(mod, name), prefix + name
            if key not in state:
                continue
            t = state[key]
            whole = t.full_tensor() if isinstance(t, DTensor) else t
            state[key] = distribute_tensor(to_tp_order(whole.to(p.dtype), *spec), p.device_mesh, p.placements)
    module._register_state_dict_hook(save)
    module._register_load_state_dict_pre_hook(load, with_module=True)


def _local_input(x, mesh):
    """The whole activation as a local tensor whose gradient is a partial sum over the TP group
    (each rank's slice of the weight contributes a part): reduced where it joins a whole tensor."""
    from torch.distributed.tensor import DTensor, Partial, Replicate
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    elif not all(p.is_replicate() for p in x.placements):
        x = x.redistribute(mesh, [Replicate()])
    return x.to_local(grad_placements=[Partial()])


class ColwiseLocal:
    """Column parallelism for a packed projection (`parts`: the output widths of its parts) or a
    Conv1D (parts None): this rank's output features, as a local tensor."""

    def __init__(self, parts: tuple[int, ...] | None = None):
        self.parts = parts

    def apply(self, module: nn.Module, mesh) -> None:
        conv = is_conv1d(module)
        dim = 1 if conv else 0
        specs = {}
        for name, d in (("weight", dim), ("bias", 0)):
            if getattr(module, name, None) is None:
                continue
            param, spec = _shard(getattr(module, name), mesh, d, self.parts)
            module.register_parameter(name, param)
            if spec is not None:
                specs[name] = spec
        if specs:
            module.__dict__[_TP_ORDER] = specs
            _tp_order_state_hooks(module)

        def forward(x, *args, **kwargs):
            xl = _local_input(x, mesh)
            w = module.weight.to_local()
            b = module.bias.to_local() if getattr(module, "bias", None) is not None else None
            if conv:
                flat = xl.reshape(-1, xl.shape[-1])
                y = flat @ w if b is None else torch.addmm(b, flat, w)
                return y.view(*xl.shape[:-1], w.shape[-1])
            return nn.functional.linear(xl, w, b)
        module.forward = forward


class RowwiseConv1D:
    """Row parallelism for a Conv1D: weight rows (its input features) split, bias replicated;
    the output is all-reduced, or reduce-scattered onto the sequence shard under SP (then it
    stays a DTensor, as RowwiseParallel's does)."""

    def __init__(self, sequence: bool):
        self.sequence = sequence

    def apply(self, module: nn.Module, mesh) -> None:
        from torch.distributed.tensor import (
            DTensor,
            Replicate,
            Shard,
            distribute_tensor,
        )
        module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, mesh, [Shard(0)])))
        if getattr(module, "bias", None) is not None:
            module.register_parameter("bias", nn.Parameter(distribute_tensor(module.bias, mesh, [Replicate()])))
        sequence = self.sequence

        def forward(x, *args, **kwargs):
            if isinstance(x, DTensor):
                x = x.redistribute(mesh, [Shard(x.dim() - 1)])
            else:
                x = DTensor.from_local(x, mesh, [Shard(x.dim() - 1)], run_check=False)
            lead = x.shape[:-1]
            y = torch.mm(x.reshape(-1, x.shape[-1]), module.weight)          # Partial
            y = y.view(*lead, y.shape[-1]).redistribute(mesh, [Shard(1) if sequence else Replicate()])
            if getattr(module, "bias", None) is not None:
                y = y + module.bias
            return y if sequence else y.to_local()
        module.forward = forward
