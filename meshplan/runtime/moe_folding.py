"""MoE parallel folding (Megatron-Core): the MoE layers run on their own EP x ETP x EDP groups
over the same ranks as the dense layers' TP x CP x DP.

The meshes are runtime/mesh.py's (`Meshes.experts`: a pipeline rank's dp x cp x tp ranks,
regrouped as (edp, ep, etp), etp fastest). What each part of a MoE layer does:

- tokens: every dense rank dispatches its own tokens. Data- and context-parallel ranks hold
  different tokens already. Under tensor parallelism the MoE layer runs on this TP rank's
  sequence shard (`apply_moe_folding`): with sequence parallelism its input is the sequence-
  sharded residual stream (a DTensor Shard(1) on the tp mesh) and it returns one; without, the
  whole (replicated) input is cut to this rank's shard before routing and the routed output is
  all-gathered after (Megatron does the same), so in backward the input gradient is all-gathered
  and the output gradient, identical on every TP rank, is cut;
- router (and any other weight of the layer outside the experts that TP does not split):
  replicated over TP, a DTensor Replicate on the tp mesh used as a local tensor whose gradient is
  declared Partial: each TP rank saw other tokens, so the gradients are summed over TP (by FSDP's
  reduce, or by ParallelModel._finalise_grads without FSDP), as for norms under SP;
- shared experts, as the plan places them: tensor-parallel (colwise / rowwise, like a dense MLP)
  on the layer's input as it came, which needs the layer to offer `routed(x)` (the routed part
  alone, meshplan's MoE); or "replicate" (any layer, e.g. transformers' Qwen2-MoE, whose forward
  combines its shared expert, sigmoid-gated, with the routed experts itself): then they are
  weights like the router's, and the layer's whole forward runs on this rank's sequence shard,
  so each rank computes the shared expert for its tokens only (the work of a TP split, with
  whole weights) and its gradients are summed over TP;
- routed experts: split over (ep, etp) (expert_parallel.py) and data-parallel over edp; their
  gradients, reduced over edp by FSDP (or here, without FSDP), sum every token of every rank.

`tp_view(plan)` is the plan that tensor parallelism applies: the MoE layers' modules other than
the tensor-parallel shared experts are left out (routed experts and router are not TP's).
"""

from __future__ import annotations

import dataclasses
import types

import torch
from torch import nn

from meshplan.errors import LayoutError

__all__ = ["moe_layers", "tp_view", "apply_moe_folding", "etp_compute", "reduce_expert_grads"]

_TP_LABELS = ("colwise", "rowwise", "colwise_qkv", "colwise_gate_up")
_FOLD_ATTR = "_meshplan_fold"


def moe_layers(experts) -> list[str]:
    """The MoE layers: the modules holding the experts modules `experts` (their parents)."""
    return sorted({fqn.rpartition(".")[0] for fqn in experts})


def _inside(fqn: str, layers) -> bool:
    return any(fqn == m or fqn.startswith(m + ".") for m in layers)


def tp_view(plan, experts):
    """`plan` as tensor parallelism applies it: without the MoE layers' own modules (experts,
    router), keeping their tensor-parallel shared experts. `experts`: the experts modules' FQNs
    (expert_parallel.check_expert_parallel). The plan itself when tp == 1."""
    if plan.layout.tp == 1:
        return plan
    layers = moe_layers(experts)
    if not layers:
        return plan
    kept = {fqn: label for fqn, label in plan.placements.items()
            if not _inside(fqn, layers) or (label in _TP_LABELS and fqn not in layers)}
    return dataclasses.replace(plan, placements=kept)


def apply_moe_folding(stage: nn.Module, plan, tp_mesh, *, experts: list[str]) -> list[str]:
    """Run the MoE layers of `stage` (parents of `experts`, the experts modules' FQNs) on this TP
    rank's tokens (module docstring). Call after TP and EP, before recompute and FSDP. Returns
    the FQNs of the layers changed; a no-op at tp == 1."""
    from torch.distributed.tensor import DTensor, Replicate
    if tp_mesh.size() == 1:
        return []
    placements = plan.placements
    done = []
    for fqn in moe_layers(experts):
        layer = stage.get_submodule(fqn)
        expert_mods = {e.rpartition(".")[2] for e in experts if e.rpartition(".")[0] == fqn}
        tp_parts = sorted(m for m, label in placements.items() if label in _TP_LABELS and m.startswith(fqn + "."))
        if tp_parts and not callable(getattr(layer, "routed", None)):
            raise LayoutError(f"MoE layer {fqn} ({type(layer).__name__}) has tensor-parallel modules "
                              f"({', '.join(tp_parts[:3])}) next to its routed experts, but no routed(x) method "
                              "computing the routed experts alone; under tensor parallelism the routed part runs "
                              "on each TP rank's tokens; place those modules 'replicate' (they then run on the "
                              "rank's tokens too), re-plan with tp=1, or give the layer a routed(x) method")
        replicated = []
        for name, p in list(layer.named_parameters()):
            top = name.split(".")[0]
            if top in expert_mods or isinstance(p, DTensor):
                continue        # experts (expert_parallel.py) and TP-split modules
            holder = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
            leaf = name.rpartition(".")[2]
            dt = DTensor.from_local(p.detach(), tp_mesh, [Replicate()], run_check=False)
            holder.register_parameter(leaf, nn.Parameter(dt, requires_grad=p.requires_grad))
            replicated.append((holder, leaf))
        routed = layer.routed if tp_parts else layer.forward
        setattr(layer, _FOLD_ATTR, (tp_mesh, plan.sequence_parallel, replicated, routed, bool(tp_parts)))
        layer.forward = types.MethodType(_folded_forward, layer)
        done.append(fqn)
    return done


def _folded_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    tp_mesh, sequence, replicated, routed, shared = getattr(self, _FOLD_ATTR)
    if isinstance(x, DTensor):
        xs = x if tuple(x.placements) == (Shard(1),) else x.redistribute(tp_mesh, [Shard(1)])
    else:       # whole tokens on every TP rank: keep this rank's sequence shard
        xs = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(1)])
    saved = [(holder, leaf, holder._parameters[leaf]) for holder, leaf in replicated]
    try:
        for holder, leaf, p in saved:
            if isinstance(p, DTensor):
                # this rank's tokens only: the gradient is a partial sum over TP
                holder._parameters[leaf] = p.to_local(grad_placements=[Partial()])
        # contiguous: a batch's sequence shard is strided, and layers flatten it with view()
        out_local = routed(xs.to_local().contiguous())
    finally:
        for holder, leaf, p in saved:
            holder._parameters[leaf] = p
    out = DTensor.from_local(out_local, tp_mesh, [Shard(1)], run_check=False, shape=xs.shape, stride=xs.stride())
    if not sequence:
        # the residual stream is whole: so is the output (all-gather; backward cuts the gradient)
        out = out.redistribute(tp_mesh, [Replicate()])
        out = out if isinstance(x, DTensor) else out.to_local()
    if shared:
        out = out + self.shared_experts(x)
    return out


def reduce_expert_grads(stages, experts_by_stage: list[list[str]], edp_mesh) -> None:
    """Sum the experts' gradients over edp where no FSDP does (one data-parallel rank, experts
    replicated over TP ranks that saw other tokens)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    if edp_mesh is None or edp_mesh.size() == 1:
        return
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for stage, fqns in zip(stages, experts_by_stage) for fqn in fqns
             for p in stage.get_submodule(fqn).parameters() if p.grad is not None]
    # one all-reduce per dtype for all of them (each is a blocking wait on every edp rank)
    by_dtype: dict = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for gs in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in gs])
        dist.all_reduce(flat, group=edp_mesh.get_group())
        for g, part in zip(gs, flat.split([g.numel() for g in gs])):
            g.copy_(part.view_as(g))


def etp_compute(compute, etp_mesh):
    """`compute(x, counts)` for experts whose inner features are split over the ETP group: this
    rank's rows (sorted by local expert) are all-gathered over the group, regrouped by expert,
    computed on the local slices (a partial sum of each row's output), and reduce-scattered back
    to the rank they came from. Uneven row counts move by all-to-all (autograd-aware: backward
    is the reverse all-to-all, i.e. the all-gather's reduce-scatter and the other way round)."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    group, etp = etp_mesh.get_group(), etp_mesh.size()

    def run(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        n = counts.shape[0]
        mine = counts.to(torch.int64).contiguous()
        every = [torch.empty_like(mine) for _ in range(etp)]
        dist.all_gather(every, mine, group=group)
        cnt = torch.stack(every)                                            # (etp, n) by source
        sizes = cnt.sum(1).tolist()
        rows = x.shape[0]
        gathered = all_to_all_single_autograd(x.contiguous().repeat(etp, 1), sizes, [rows] * etp, group)
        # segment (j, e) -> key e * etp + j: grouped by local expert, source order inside
        seg_key = (torch.arange(n, device=x.device).repeat(etp) * etp
                   + torch.arange(etp, device=x.device).repeat_interleave(n))
        order = torch.argsort(torch.repeat_interleave(seg_key, cnt.flatten().to(x.device)), stable=True)
        y = compute(gathered.index_select(0, order), cnt.sum(0))           # partial sums
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=x.device)
        y = y.index_select(0, back).contiguous()
        parts = all_to_all_single_autograd(y, [rows] * etp, sizes, group)   # (etp * rows, h')
        return parts.view(etp, rows, -1).sum(0)
    return run
