"""Expert parallelism (EP): routed experts sharded over the EP group, tokens moved by all-to-all.

Which modules are expert modules (the matching rule). A module is handled as a grouped-experts
module when

  1. the plan labels one of its own parameters "expert" (the planner's classification of the
     routed-expert FLOPs; `parallelize` always passes these labels), or, when no labels are
     given, it looks like one by structure: two or more parameters of its own, all 3-D with
     the same leading size E >= 2 (one slice per expert);
  2. and it honours the contract meshplan's `GroupedExperts` is written to: every parameter is
     its own (no child module holds parameters), all are 3-D with the same leading size E (the
     expert dim), and `forward(x, counts)` takes exactly two inputs, `x` (M, h) the token copies
     sorted by expert and `counts` (E,) the rows per expert, and returns (M, h') row-aligned with
     `x`, where each row depends only on that row and its expert's weight slices.

Rule 2 is what makes rows movable: any subset of rows, regrouped by expert, can be computed
with only the slices of the experts they need. transformers-style experts (Mixtral, Qwen2-MoE:
`gate_up_proj` (E, 2f, h), `down_proj` (E, h, f), `act_fn`, forward(hidden_states, top_k_index,
top_k_weights) routing inside) are recognised by that structure and adapted (runtime/hf_experts.py:
their forward sorts the token copies by expert and runs them through the dispatch below). Any
other module matched by rule 1 that breaks rule 2 is refused with a LayoutError naming it. The
runtime never reads class names.

What `apply_expert_parallel` does to each expert module (E experts, group of `ep` ranks, this
rank j of the group; rank j keeps experts j*E/ep .. (j+1)*E/ep - 1, a contiguous block):

  - each parameter becomes a DTensor over the EP mesh with placement Shard(0), local part the
    rank's E/ep expert slices (cut locally, no communication: every rank starts from the same
    weights, as FSDP assumes too). `full_tensor()` gives all E experts under the original FQN
    and DCP stores global offsets, so checkpoints reshard between ep sizes;
  - forward(x, counts) becomes, with x (M, h) sorted by global expert and counts (E,):
      a. all-to-all of the counts: recv[s, e] = rows rank s sends to local expert e;
      b. all-to-all of the rows with uneven split sizes (rows for the experts each rank owns);
         they arrive grouped by source rank, then expert;
      c. stable regroup by local expert (source order kept inside an expert);
      d. the module's own forward on the local weight slices and local counts;
      e. the inverse regroup and the all-to-all back (split sizes swapped).
    Both all-to-alls are autograd-aware (functional collectives' `all_to_all_single_autograd`,
    what `torch.distributed.nn.functional.all_to_all_single` now forwards to): backward sends
    each row's gradient back along the same path with the split sizes swapped. Dropless: every copy is
    computed, whatever the imbalance (no capacity factor).

The EP group comes from the experts' own mesh (runtime/mesh.py, MoE parallel folding): the
dense layers' dp x cp x tp ranks regrouped as (edp, ep, etp), so an EP group may span data-,
context- and tensor-parallel ranks, each dispatching its own tokens (moe_folding.py). With
etp > 1 each expert's inner features are split further over the ETP group (`etp_split`, or
hf_experts.ETP_SPLIT for transformers-style experts) and
moe_folding.etp_compute gathers the rows over it and reduce-scatters the partial outputs.

Under FSDP the expert parameters are then sharded over the expert-data-parallel axis (`edp`,
see mesh.Meshes and fsdp.apply_fsdp): FSDP2 takes the EP DTensors as it takes TP ones, and
their gradients, reduced over edp, are DTensors over (edp, ep[, etp]) whose norm and full
tensors cover every expert exactly once.
"""

from __future__ import annotations

import inspect
import types

import torch
from torch import nn

from meshplan.errors import LayoutError
from meshplan.ir.routed_experts import is_routed_experts
from meshplan.runtime.hf_experts import ETP_PARTS, ETP_SPLIT, wrap_routed_experts
from meshplan.runtime.packed_projections import _TP_ORDER, _tp_order_state_hooks, to_tp_order

__all__ = ["find_expert_modules", "check_expert_parallel", "apply_expert_parallel", "expert_labelled_params",
           "ep_dispatch", "MoEBalancer", "balance_group", "summarize_routing"]

_EP_ATTR = "_meshplan_ep"      # set on wrapped modules: (ep mesh, local expert count, etp mesh | None)


# ---- matching ------------------------------------------------------------------------------

def expert_labelled_params(placements: dict[str, str]) -> set[str]:
    """FQNs (in the unsplit model) the plan labels "expert": experts modules or their parameters."""
    return {fqn for fqn, label in placements.items() if label == "expert"}


def _own_params(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters(recurse=False) if p is not None}


def _looks_grouped(module: nn.Module) -> bool:
    own = _own_params(module)
    if len(own) < 2 or any(p.dim() != 3 for p in own.values()):
        return False
    return len({p.shape[0] for p in own.values()}) == 1 and next(iter(own.values())).shape[0] >= 2


def _forward_inputs(module: nn.Module) -> list[inspect.Parameter] | None:
    fwd = getattr(module, "__meshplan_orig_forward__", None) or module.forward
    try:
        sig = inspect.signature(fwd)
    except (TypeError, ValueError):
        return None
    return [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            and p.default is p.empty]


def _contract_problem(module: nn.Module) -> str | None:
    """Why `module` cannot run under EP, or None if it honours the contract (module docstring)."""
    own = _own_params(module)
    child = [f"{c}.{n}" for c, sub in module.named_children() for n, _ in sub.named_parameters()]
    if child:
        return f"its expert weights live in child modules ({', '.join(child[:3])}), not as stacked 3-D tensors"
    if is_routed_experts(module):       # transformers-style experts: adapted (hf_experts.py)
        return None
    shapes = {n: tuple(p.shape) for n, p in own.items()}
    if not own or any(len(s) != 3 for s in shapes.values()) or len({s[0] for s in shapes.values()}) != 1:
        return f"its parameters {shapes} are not 3-D tensors stacked over one expert dim"
    inputs = _forward_inputs(module)
    if inputs is None or len(inputs) != 2:
        names = "?" if inputs is None else ", ".join(p.name for p in inputs)
        return (f"its forward takes ({names}); expert parallelism needs forward(x, counts) with the "
                "token copies sorted by expert and the rows per expert, so that rows can be moved "
                "between ranks (the model routes inside the expert module instead)")
    return None


def find_expert_modules(model: nn.Module, labelled: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """FQNs of the grouped-experts modules of `model` (see the module docstring's rule).

    Raises LayoutError for a module that holds expert weights (by the plan's labels or by
    structure) but does not honour the contract.
    """
    found = []
    for fqn, module in model.named_modules():
        mine = {f"{fqn}.{n}" if fqn else n for n in _own_params(module)}
        # with labels, the plan alone says which modules are experts (a module that merely looks
        # like one, e.g. stacked per-head weights, is left alone); a labelled parameter in a
        # child module makes that child the candidate, checked when the walk reaches it
        if not ((fqn in labelled or mine & labelled) if labelled else _looks_grouped(module)):
            continue
        problem = _contract_problem(module) if getattr(module, _EP_ATTR, None) is None else None
        if problem:
            raise LayoutError(f"module {fqn or '<root>'} ({type(module).__name__}) holds routed experts but "
                              f"cannot be expert-parallel: {problem}. Re-plan with ep=1 "
                              "(mp.plan(..., fixed={'ep': 1})), or give the MoE a GroupedExperts-style "
                              "experts module (meshplan.models.GroupedExperts)")
        found.append(fqn)
    return found


def check_expert_parallel(model: nn.Module, ep: int, labelled: set[str] | frozenset[str] = frozenset(), *,
                          require: bool = True) -> list[str]:
    """Refuse, before any collective, a model whose experts cannot be split over `ep` ranks.

    `require`: a model with no expert module at all is refused too (False for a pipeline stage,
    which may hold only dense blocks).
    """
    fqns = find_expert_modules(model, labelled)
    if require and ep > 1 and not fqns:
        raise LayoutError(f"the plan has ep={ep} but the model has no routed-experts module (stacked 3-D "
                          "expert weights with forward(x, counts)); re-plan with ep=1")
    for fqn in fqns:
        e = _num_experts(model.get_submodule(fqn))
        if e % ep:
            divisors = [d for d in range(1, e + 1) if e % d == 0]
            raise LayoutError(f"{fqn} has {e} experts, which do not split evenly over ep={ep} ranks; "
                              f"use ep in {divisors}")
    return fqns


def _num_experts(module: nn.Module) -> int:
    return next(iter(_own_params(module).values())).shape[0]


# ---- dispatch ------------------------------------------------------------------------------

def ep_dispatch(x: torch.Tensor, counts: torch.Tensor, compute, *, group, ep: int) -> torch.Tensor:
    """Run `compute(x_local, local_counts)` on this rank's experts for every rank's rows.

    x (M, h) sorted by global expert, counts (E,) -> (M, h'); collective over `group` (ep ranks,
    this rank owning experts rank*E/ep ...). See the module docstring, steps a-e.
    """
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    n_local = counts.shape[0] // ep
    send = counts.to(torch.int64).contiguous()                         # (E,) = (ep, n_local) by owner
    recv = torch.empty_like(send)                                      # (ep * n_local,) by source
    dist.all_to_all_single(recv, send, group=group)
    send_split = send.view(ep, n_local).sum(1).tolist()                # rows to each owner
    recv_counts = recv.view(ep, n_local)                               # (source, local expert)
    recv_split = recv_counts.sum(1).tolist()                           # rows from each source
    rows = sum(recv_split)
    received = all_to_all_single_autograd(x.contiguous(), recv_split, send_split, group)   # (R, h)
    # segment (s, e) of the received rows goes to position e * ep + s: grouped by local expert,
    # source order inside (the stable sort keeps each source's row order)
    seg_key = (torch.arange(n_local, device=x.device).repeat(ep) * ep
               + torch.arange(ep, device=x.device).repeat_interleave(n_local))          # (ep*n_local,)
    row_key = torch.repeat_interleave(seg_key, recv.to(x.device))      # (R,)
    order = torch.argsort(row_key, stable=True)                        # (R,) received row per local row
    y_local = compute(received.index_select(0, order), recv_counts.sum(0))   # (R, h')
    back = torch.empty_like(order)
    back[order] = torch.arange(rows, device=x.device)                  # inverse permutation
    y = y_local.index_select(0, back)                                  # (R, h') by (source, expert)
    return all_to_all_single_autograd(y.contiguous(), send_split, recv_split, group)   # (M, h')


def _local_compute(module: nn.Module, orig_forward):
    """compute(x, counts) running the module's own forward on the local slices of its weights."""
    from torch.distributed.tensor import DTensor

    def compute(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        saved = dict(module._parameters)
        try:
            for n, p in saved.items():
                if isinstance(p, DTensor):
                    # the differentiable local view: gradients flow back into the DTensor parameter
                    module._parameters[n] = p.to_local()
            return orig_forward(x, counts)
        finally:
            module._parameters.update(saved)
    return compute


def _ep_forward(self: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    mesh, n_local, etp_mesh = getattr(self, _EP_ATTR)
    ep = mesh.size()
    compute = _local_compute(self, self.__meshplan_orig_forward__)
    if x.device.type == "meta" or _is_fake(x):
        # shape inference (pipeline stages, tracing): no communication, local experts' shapes
        return compute(x, counts.new_zeros(n_local))
    if counts.shape[0] != n_local * ep:
        raise LayoutError(f"an expert-parallel module got counts for {counts.shape[0]} experts; it was "
                          f"split as {n_local} experts on each of ep={ep} ranks")
    if etp_mesh is not None:        # each expert's inner features split over the ETP group
        from meshplan.runtime.moe_folding import etp_compute
        compute = etp_compute(compute, etp_mesh)
    if ep == 1:
        return compute(x, counts)
    return ep_dispatch(x, counts, compute, group=mesh.get_group(), ep=ep)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(t)


def apply_expert_parallel(stage: nn.Module, ep_mesh, *, labelled: set[str] | frozenset[str] = frozenset(),
                          expert_mesh=None) -> list[str]:
    """Shard the routed experts of `stage` over `ep_mesh` (1-D) and route tokens to them.

    `labelled`: FQNs the plan labels "expert" (see `expert_labelled_params`). `expert_mesh`:
    the experts' (edp, ep, etp) mesh (runtime/mesh.py); with etp > 1 each expert's weights are
    split further over etp along the dims the module declares in `etp_split` (parameter name ->
    dim: its inner features; meshplan's GroupedExperts; transformers-style experts:
    hf_experts.ETP_SPLIT, gate|up kept in ETP order), which makes forward's output a partial sum
    over the ETP group (moe_folding.etp_compute sums it).
    Returns the FQNs of the expert modules (original FQNs), for FSDP over the edp axis (at
    ep = etp = 1 the modules are left as they are: folded experts replicated over the ranks).
    """
    from torch.distributed.tensor import DTensor, Shard
    ep = ep_mesh.size()
    etp = expert_mesh["etp"].size() if expert_mesh is not None else 1
    fqns = check_expert_parallel(stage, ep, labelled, require=False)
    if ep == 1 and etp == 1:
        return fqns
    rank = ep_mesh.get_local_rank()
    etp_rank = expert_mesh["etp"].get_local_rank() if etp > 1 else 0
    mesh = expert_mesh["ep", "etp"] if etp > 1 else ep_mesh
    for fqn in fqns:
        module = stage.get_submodule(fqn)
        n_local = _num_experts(module) // ep
        dims = _etp_dims(fqn, module, etp) if etp > 1 else {}
        orders = {}
        for name, p in _own_params(module).items():
            local = p.detach()[rank * n_local:(rank + 1) * n_local]      # (E/ep, ...)
            placements = [Shard(0)]
            if etp > 1:
                d, parts = dims[name]
                if len(parts) > 1:
                    # a packed dim (gate rows, then up rows): this rank's slice of every part
                    local = to_tp_order(local, parts, etp, d)
                    orders[name] = (parts, etp, d)
                width = p.shape[d] // etp
                local = local.narrow(d, etp_rank * width, width)
                placements.append(Shard(d))
            # the global shape and (contiguous) strides given, not inferred: a size-1 local expert
            # dim keeps whatever stride the cut left, which scaled by the mesh gives a global
            # view FSDP2 refuses as non-contiguous
            dt = DTensor.from_local(local.clone(memory_format=torch.contiguous_format), mesh, placements,
                                    run_check=False, shape=p.shape, stride=_contiguous_strides(p.shape))
            module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
        if orders:      # the global view is in ETP order; state_dict gives the user's order
            module.__dict__[_TP_ORDER] = orders
            _tp_order_state_hooks(module)
        routed = is_routed_experts(module)
        setattr(module, _EP_ATTR, (ep_mesh, n_local, expert_mesh["etp"] if etp > 1 else None))
        if routed:      # forward(hidden_states, top_k_index, top_k_weights): sort, dispatch, combine
            wrap_routed_experts(module)
        else:
            module.__meshplan_orig_forward__ = module.forward
            module.forward = types.MethodType(_ep_forward, module)
    return fqns


def _contiguous_strides(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (row-major)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _etp_dims(fqn: str, module: nn.Module, etp: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """{parameter: (dim split over etp, its equal parts)} as the module declares it (`etp_split`,
    meshplan's GroupedExperts; transformers-style experts: hf_experts.ETP_SPLIT, the gate|up dim
    holding two parts), checked."""
    own = _own_params(module)
    routed = is_routed_experts(module)
    dims = ETP_SPLIT if routed else getattr(module, "etp_split", None)
    if not isinstance(dims, dict) or set(own) - set(dims):
        raise LayoutError(f"{fqn} ({type(module).__name__}) does not declare how its weights split over "
                          f"expert tensor parallelism (an `etp_split` dict: parameter -> inner-feature dim, "
                          f"as meshplan's GroupedExperts has); re-plan with etp=1")
    out = {}
    for name, p in own.items():
        d = dims[name]
        n = ETP_PARTS.get(name, 1) if routed else 1
        if not 0 < d < p.dim() or p.shape[d] % (n * etp):
            raise LayoutError(f"{fqn}.{name} {tuple(p.shape)}: dim {d} (inner width {p.shape[d] // n}) does not "
                              f"split over etp={etp}; use an etp that divides the experts' inner width")
        out[name] = (d, (p.shape[d] // n,) * n)
    return out


# ---- load balancing across ranks and micro-batches -----------------------------------------

def balance_group(pm):
    """The process group of the ranks that hold other tokens of the same MoE layers (dp x cp of
    this pipeline stage, x tp when the experts are folded), or None when this rank is alone.
    Collective the first time (a flattened mesh under HSDP creates a group): every rank calls it
    in the same order."""
    meshes = getattr(pm, "meshes", None)
    if meshes is not None and meshes.fold is not None:
        # folded experts: every rank of dp x cp x tp routes its own tokens
        return meshes.fold.get_group() if meshes.fold.size() > 1 else None
    if meshes is None:
        mesh = pm.mesh
        return mesh["dp"].get_group() if "dp" in mesh.mesh_dim_names and mesh["dp"].size() > 1 else None
    fsdp = meshes.fsdp
    if fsdp.ndim == 1:
        return fsdp.get_group() if fsdp.size() > 1 else None
    dims = tuple(d for d in ("dp_replicate", "dp_shard", "cp") if d in pm.mesh.mesh_dim_names)
    flat = pm.mesh[dims]._flatten("moe_balance")
    return flat.get_group() if flat.size() > 1 else None


def _routing_layers(stages) -> list[tuple[str, nn.Module]]:
    # routed MoE layers by what they offer, not by class: routing statistics and a window
    return [(fqn, m) for st in stages for fqn, m in st.named_modules()
            if hasattr(m, "step_stats") and hasattr(m, "window") and hasattr(m, "balance_group")]


class MoEBalancer:
    """Global MoE load balancing for a ParallelModel: each routed layer's statistics are
    all-reduced over the dp x cp ranks of its stage and accumulated over the step's micro-batches
    (the global auxiliary loss, Megatron-Core's `global_aux_loss`), and after the optimizer step
    the aux-loss-free expert bias (DeepSeek-V3) moves by `rate * sign(mean load - load)` from the
    step's global counts, the same on every rank.

        balancer = MoEBalancer(pm)                  # collective (may build a group)
        balancer.begin_step()                       # before forward_backward
        ... forward_backward, clip, optimizer step ...
        stats = balancer.finish_step()              # bias update; global stats (collective over pp)
    """

    def __init__(self, pm, num_microbatches: int | None = None):
        self.pm = pm
        self.layers = _routing_layers(pm.stages)
        self.anywhere = self._any_anywhere()
        self.group = balance_group(pm) if self.anywhere else None
        for _, m in self.layers:
            m.balance_group = self.group
        self.set_microbatches(num_microbatches or pm.plan.num_microbatches)
        _mark_probes(getattr(pm, "schedule", None), [m for _, m in self.layers])

    def _any_anywhere(self) -> bool:
        # under PP a stage may hold only dense blocks, but every rank must agree on building groups
        import torch.distributed as dist
        flag = torch.tensor([1.0 if self.layers else 0.0])
        dist.all_reduce(flag)
        return bool(flag.item())

    @property
    def active(self) -> bool:
        # every rank when any stage routes: finish_step gathers the statistics over pp, so a
        # pipeline stage without routed layers (tiny-moe's dense layer 0 alone at pp=4) must join
        # that gather too; were it left out, the routed stages would wait in it while that stage's
        # next step waits on its p2p sends to them (a deadlock until the collective timeout)
        return self.anywhere

    def set_microbatches(self, m: int) -> None:
        """Micro-batches per step (changes with a batch-size ramp-up)."""
        for _, layer in self.layers:
            layer.num_microbatches = int(m)

    def begin_step(self) -> None:
        for _, m in self.layers:
            m.window.reset()

    def finish_step(self, *, update_bias: bool = True) -> dict:
        """Update the expert biases, then return this step's statistics over every routed layer of
        the model: {"layers": {fqn: stats}, "imbalance": max over layers of max/mean tokens per
        expert, "imbalance_mean", "aux_loss" and "z_loss" (mean over layers), "dropped"} (empty
        when the model has no routed layer). Collective over the pipeline ranks when pp > 1."""
        import torch.distributed as dist
        from meshplan.models.moe import flush_windows
        flush_windows([m for _, m in self.layers])    # one all-reduce for all the layers
        if update_bias:
            for _, m in self.layers:
                if m.bias_update:
                    m.update_expert_bias()
        layers = {fqn: m.step_stats() for fqn, m in self.layers}
        layers = {k: v for k, v in layers.items() if v}
        pp = self.pm.plan.mesh.get("pp", 1)
        if pp > 1:
            parts: list = [None] * pp
            dist.all_gather_object(parts, layers, group=self.pm.mesh["pp"].get_group())
            layers = {k: v for part in parts for k, v in part.items()}
        return summarize_routing(layers)


def _mark_probes(schedule, layers: list[nn.Module]) -> None:
    """torch.distributed.pipelining infers a stage's shapes by running it once on a real (first
    stage) or materialised micro-batch before the schedule's first step; the routed layers must
    not count that run in the step's statistics. Wraps the stages' metadata inference (private
    API of torch 2.13; without it nothing is wrapped) to mark the layers as probing meanwhile."""
    if schedule is None or not layers:
        return
    stages = getattr(schedule, "_stages", None) or [s for s in [getattr(schedule, "_stage", None)] if s]
    for stage in stages:
        infer = getattr(stage, "_forward_metadata_inference", None)
        if infer is None:
            continue

        def probing(*args, _infer=infer, **kwargs):
            for m in layers:
                m.probing = True
            try:
                return _infer(*args, **kwargs)
            finally:
                for m in layers:
                    m.probing = False
        stage._forward_metadata_inference = probing


def summarize_routing(layers: dict[str, dict]) -> dict:
    """Per-layer routing statistics -> the step's summary (see MoEBalancer.finish_step)."""
    if not layers:
        return {}
    n = len(layers)
    copies = [sum(s["tokens_per_expert"]) for s in layers.values()]
    dropped = sum(s["dropped"] * c for s, c in zip(layers.values(), copies)) / max(sum(copies), 1)
    return {"layers": layers,
            "imbalance": max(s["imbalance"] for s in layers.values()),
            "imbalance_mean": sum(s["imbalance"] for s in layers.values()) / n,
            "aux_loss": sum(s["aux_loss"] for s in layers.values()) / n,
            "z_loss": sum(s["z_loss"] for s in layers.values()) / n,
            "dropped": dropped}
