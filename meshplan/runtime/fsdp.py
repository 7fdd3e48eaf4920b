"""Data parallelism and ZeRO with FSDP2 (`fully_shard`), as the Plan's layout says.

Each block the stage owns is its own FSDP unit (one all-gather / reduce-scatter per block), then
the stage root takes what is left (embedding, final norm, head). How the plan's ZeRO stage maps:

| layout                     | FSDP2 setting                                                    |
|----------------------------|------------------------------------------------------------------|
| zero=3                     | reshard_after_forward as planned (True: ZeRO-3; False: ZeRO-2-like memory) |
| zero=3, fsdp_shard < dp    | HSDP: 2-D mesh (replicate, shard); shard over fsdp_shard ranks   |
| zero=2                     | reshard_after_forward=False, gradients reduce-scattered per micro-batch |
| zero=1                     | reshard_after_forward=False, gradients accumulated unsharded and reduce-scattered once per step (see parallel.py) |
| zero=0                     | DDP (parallel.py) where `ddp_runs` (also with EP: experts reduced apart); else as zero=1 |

ZeRO-1/2 gather the weights once per step: `ParallelModel` keeps them gathered after every
micro-batch's backward but the last (`set_reshard_after_backward`).

Between steps the weights are always sharded (FSDP2 has no "keep unsharded" mode), so zero<3
uses a little less memory than planned, never more.

Overlap (FSDP2's own streams / async work): the next unit's all-gather is issued before the
current unit's forward finishes (implicit forward prefetch); in backward the previous unit's
all-gather is prefetched and each unit's gradient reduce-scatter runs while earlier units
compute their backward. `overlap=False` turns explicit prefetching off (units unshard on
demand), which the tests use to check that results do not depend on it.

Gradients are reduced in fp32, or in bf16 when the layout says grad_dtype="bf16"
(MixedPrecisionPolicy.reduce_dtype), and summed across data-parallel ranks (divide factor 1): the loss is already divided
by the global token count, so the sum is the global-batch mean gradient.

Expert parallelism (MoE parallel folding, moe_folding.py): expert modules (parameters DTensors,
Shard(0) over the "ep" axis, and over "etp" with expert tensor parallelism; plain tensors at
ep = etp = 1) are units of their own over the expert-data-parallel axis `edp`, sharded before
the blocks so the block units (over the dense dp x cp mesh) skip their parameters. FSDP2 treats
the EP axis as it treats TP: parameters become DTensors over (edp, ep[, etp]), gradients are
reduce-scattered over edp only (each EP rank's experts already hold the gradient of every token
its EP group routed to them, brought back by the dispatch all-to-all). edp spans the TP ranks
too, which route their own tokens under folding.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["apply_fsdp"]


def apply_fsdp(stage: nn.Module, blocks: list[str], dp_mesh, *, zero: int, reshard_after_forward: bool,
               param_dtype: torch.dtype | None, overlap: bool = True, experts: list[str] = (),
               expert_mesh=None, one_unit_below_zero3: bool = False,
               reduce_dtype: torch.dtype | None = None, fp32_modules: list[str] = ()) -> list[nn.Module]:
    """Shard `stage` over `dp_mesh`; returns the FSDP units, expert modules first, then blocks,
    root last.

    `one_unit_below_zero3`: for zero 1/2, one unit per stage instead of one per block (where
    communication does not overlap compute - gloo reduces on the cores that compute - per-block
    units only add per-collective latency; with overlap, per-block reduce-scatters hide behind
    backward).
    `experts`: FQNs of expert-parallel modules (parameters already DTensors over the EP axis),
    sharded over `expert_mesh` (the edp axis) as units of their own before the blocks, so that
    the block units over `dp_mesh` leave their parameters alone.
    `reduce_dtype`: the gradient reduction's dtype (the layout's grad_dtype: torch.bfloat16 for
    "bf16", whatever `param_dtype` is); None reduces in fp32 (or in the parameters' own dtype when
    there is no `param_dtype`).
    `fp32_modules`: FQNs of modules whose gradients reduce in fp32 whatever `reduce_dtype` is
    (fp32_grads.py): units of their own, sharded before the blocks (a block among them is its
    own unit anyway and just gets the fp32 policy).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if reduce_dtype is None:
        reduce_dtype = torch.float32 if param_dtype else None
    # bf16 reduce: the unsharded gradients (and ZeRO-1's accumulation across micro-batches) stay
    # bf16 and are reduce-scattered in bf16, the bytes the cost model prices for grad_dtype "bf16";
    # FSDP2 casts the reduced shard back to the fp32 parameter's dtype for the optimizer
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard = bool(reshard_after_forward) if zero == 3 else False
    mp32 = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    fp32_set = set(fp32_modules)
    expert_units = []
    for fqn in experts:
        module = stage.get_submodule(fqn)
        fully_shard(module, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=mp,
                    shard_placement_fn=_expert_shard_dim(expert_mesh.size()))
        expert_units.append(module)
    for fqn in fp32_modules:
        if fqn not in blocks or (zero < 3 and one_unit_below_zero3):
            # nested in a block (or the root): the outer unit then skips these parameters
            fully_shard(stage.get_submodule(fqn), mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp32)
            expert_units.append(stage.get_submodule(fqn))
    units = []
    if zero < 3 and one_unit_below_zero3:
        # ZeRO-1/2 keep whole weights from the first forward to the last backward of a step: one
        # unit (the stage) gathers them once and reduce-scatters the gradients once, the single
        # all-gather + reduce-scatter the cost model prices, instead of one pair per block
        blocks = []
    for fqn in blocks:
        block = stage.get_submodule(fqn)
        policy = mp32 if fqn in fp32_set else mp
        if param_dtype is not None:
            # FSDP2 would cast every floating input of the block to param_dtype: the rotary tables
            # too, a bf16 copy of cos and sin per block that the block's rotary keeps for backward
            # (tp-independent, 256 bytes a token a layer at head dim 128) and rounds the angles
            # to bf16. Only the hidden state is cast; the tables stay the model's fp32 buffers.
            policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=policy.reduce_dtype,
                                          cast_forward_inputs=False)
            block.register_forward_pre_hook(functools.partial(_cast_hidden, param_dtype), with_kwargs=True)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
        units.append(block)
    # the root's parameters are used again first thing in backward (head): keep them gathered
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
    units.append(stage)
    for u in expert_units + units:
        # SUM, not AVG: gloo has no pre-multiplied sums, and the loss is already normalised
        u.set_gradient_divide_factor(1.0)
        u.set_force_sum_reduction_for_comms(True)
    if overlap:
        # explicit prefetch one unit ahead in both directions, on top of FSDP2's implicit prefetch
        for i, u in enumerate(units[:-1]):
            if i + 1 < len(units) - 1:
                u.set_modules_to_forward_prefetch([units[i + 1]])
            if i > 0:
                u.set_modules_to_backward_prefetch([units[i - 1]])
    # expert units stay out of the explicit prefetch chain: they are nested in the block units,
    # whose pre-forward comes first, and FSDP2's implicit prefetch handles them
    return expert_units + units


def _cast_hidden(dtype: torch.dtype, _module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a block unit: its hidden state (the first positional argument, or
    transformers' `hidden_states`) in the compute dtype, as FSDP2 would cast it."""
    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t
    if args:
        return (cast(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": cast(kwargs["hidden_states"])}
    return None


def _expert_shard_dim(n: int):
    """FSDP's shard dim for an expert weight over `n` edp ranks: dim 0 (the experts) when this
    rank's experts split evenly over them, else the first dim that does (else the largest). With
    fewer local experts than edp ranks (8 experts, ep=8, edp=8), dim 0 would leave whole experts
    on one rank and nothing on the others."""
    from torch.distributed.tensor import DTensor, Shard

    def place(p):
        shape = (p.to_local() if isinstance(p, DTensor) else p).shape
        dims = range(len(shape))
        return Shard(next((d for d in dims if shape[d] % n == 0), max(dims, key=lambda d: shape[d])))
    return place
