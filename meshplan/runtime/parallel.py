"""`parallelize(model, plan) -> ParallelModel`: carry out a Plan on PyTorch's distributed engine.

The body is a recipe: checks, then `ParallelDims` (dims.py: the degrees and the DeviceMeshes),
then one step per technique in one fixed order, each a function of steps.py taking (stage part,
dims, job) and a no-op at degree 1:

    pipeline split -> fused kernels -> TP/SP -> CP -> EP / MoE folding -> FP8 -> recompute (+ offload)
    -> async TP / compile -> FSDP2 (or autocast) -> materialise -> DDP -> ParallelModel (+ schedule)

The run-time modes are a `ParallelOptions` (options.py); keyword overrides of its fields are the
shorthand (`parallelize(model, plan, compute_dtype=None)`).

EP (expert_parallel.py, moe_folding.py): MoE parallel folding (Megatron-Core). The routed experts
get their own mesh over the same ranks as the dense layers (mesh.py: dp x cp x tp regrouped as
edp x ep x etp), are sharded over ep (DTensors, Shard(0)) and, with etp > 1, each expert's inner
features over etp; tokens move by autograd-aware all-to-all. Under TP the MoE layers run on each
TP rank's own tokens (its sequence shard), so TP leaves their router and experts alone
(`tp_view`). FSDP then shards expert weights over `edp` and everything else over the dense dp
(x cp) mesh. Gradient norm, full tensors and DCP state need nothing special: expert gradients
are DTensors over (edp, ep[, etp]), so their sums and `full_tensor()` cover every expert once.

Data parallelism and precision (never slower than the PyTorch a user writes by hand):
zero 1-3 run through FSDP2 (fsdp.py; ZeRO-1/2 gather the weights once per step); zero=0 runs
as plain DDP (bucketed all-reduce overlapped with backward, summed by a comm hook) where
`ddp_runs`; one data-parallel rank has no wrapper at all and gets bf16 from `torch.autocast`
around each stage's forward (fp32 master weights and gradients), not from FSDP2 over a one-rank
mesh. Fused kernels run only where faster than eager on this device (fused.choose_kernels);
`ParallelModel.kernels` says what runs and why.

Everything it does is read from the Plan: mesh degrees, stage -> module FQNs, per-module
placements, recompute policy, ZeRO stage, schedule, micro-batch counts. It decides nothing.

Loss convention: `forward_backward` returns the mean cross entropy over every label != -100 of
the GLOBAL batch. Each micro-batch's loss is its summed cross entropy divided by the global
count of such labels (known on every rank, since every rank is handed the global batch), and
gradients are summed over micro-batches and data-parallel ranks, so the accumulated gradient is
exactly the single-device gradient of the global-batch mean, whatever dp, micro-batch count or
padding. With context parallelism (cp > 1) each CP rank holds a load-balanced share of every
sequence's tokens and labels (context_parallel.py): its summed loss is a partial sum, every CP
rank contributes it, and FSDP sums the partial gradients over dp x cp.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from meshplan.errors import ConfigError, LayoutError
from meshplan.ir.fingerprint import fingerprint
from meshplan.ir.precision import Precision
from meshplan.ir.support import ModelTraits, runtime_limits
from meshplan.runtime import fp8 as _fp8
from meshplan.runtime import pipeline as _pp
from meshplan.runtime import steps
from meshplan.runtime.ddp import ddp_runs
from meshplan.runtime.dims import ParallelDims
from meshplan.runtime.model import IGNORE_INDEX, ParallelModel, router_aux_loss_note
from meshplan.runtime.mtp_parallel import with_mtp_blocks
from meshplan.runtime.options import ParallelOptions

__all__ = ["parallelize", "ParallelModel", "ParallelOptions", "ParallelDims", "IGNORE_INDEX", "ddp_runs"]

# the steps after the pipeline split, in the order they apply to each stage this rank holds
RECIPE = (
    steps.fuse_kernels,         # fused kernels the plan lists (fused.py)
    steps.tensor_parallel,      # TP / SP (tensor_parallel.py, packed_projections.py)
    steps.context_parallel,     # CP (context_parallel.py), before recompute wraps the blocks
    steps.expert_parallel,      # EP over the experts' mesh, MoE on each TP rank's tokens (moe_folding.py)
    steps.float8,               # FP8 linears for Plan.fp8_modules (fp8.py)
    steps.recompute,            # activation recompute (recompute.py), host offload around it (offload.py)
    steps.compile_part,         # async TP / torch.compile per block (compile.py)
    steps.data_parallel,        # FSDP2 for zero 1-3 (fsdp.py), else autocast for mixed precision
    steps.materialize,          # a meta model's own shards allocated and initialised (materialize.py)
    steps.replicate,            # DDP for zero 0 (ddp.py): it needs real tensors
)


def _check(model: nn.Module, plan, world_size: int) -> None:
    """Refuse mismatches before any collective runs (every rank reaches the same verdict)."""
    stack = getattr(plan, "stack", "meshplan")
    if stack != "meshplan":
        raise ConfigError(f"this plan was made for the {stack} stack (its layouts and prices are that "
                          "framework's); run it there (meshplan plan --export ...), or re-plan for meshplan's "
                          "runtime (stack='meshplan', the default)")
    plan.check_matches(world_size=world_size)
    fp = fingerprint(model)
    if fp != plan.model_fingerprint:
        raise ConfigError(f"this plan was made for model {plan.model!r} (fingerprint {plan.model_fingerprint}) "
                          f"but this model's structure has fingerprint {fp}: the model changed since "
                          "planning (layers, shapes or dtypes); re-plan for this model")
    # the same declaration the planner's search reads (meshplan.ir.support): a plan made by
    # meshplan.plan never trips this; a hand-edited or older plan may
    mtp = getattr(getattr(model, "config", None), "mtp_depth", 0)
    limits = runtime_limits(plan.layout, ModelTraits(mtp=mtp) if isinstance(mtp, int) and mtp > 0 else None)
    if limits:
        raise LayoutError("the runtime cannot run this plan: " + "; ".join(limits)
                          + "; re-plan (meshplan.plan never returns such a layout)")
    if plan.precision == Precision.FP8:
        # the FP8 backends swap nn.Linear modules; anything else named would silently stay bf16
        # (a parameter of stacked experts) or fail on some rank later (a transposed Conv1D)
        modules = dict(model.named_modules())
        bad = [m for m in plan.fp8_modules if not isinstance(modules.get(m), nn.Linear)]
        if bad:
            raise ConfigError(f"this FP8 plan lists {len(bad)} module(s) that are not nn.Linear modules of this "
                              f"model (e.g. {', '.join(bad[:3])}); the FP8 backends swap nn.Linear only; "
                              "re-plan (meshplan.plan keeps other GEMMs in bf16)")


def whole_logits_note(layout, options: ParallelOptions) -> str | None:
    """What a user's loss function costs under tensor parallelism: the plan priced each TP rank's
    vocabulary slice of the logits (the default, vocabulary-parallel loss), a `loss_fn` gets whole
    logits on every rank."""
    if options.loss_fn is None or layout.tp <= 1:
        return None
    return (f"a custom loss_fn under tensor parallelism (tp={layout.tp}) gets whole logits on every TP rank: "
            f"the plan priced each rank's 1/{layout.tp} vocabulary slice, so the last pipeline stage holds up to "
            f"{layout.tp}x the planned logits memory (and their gradient); leave loss_fn unset to keep the "
            "vocabulary-parallel cross entropy the plan priced")


def parallelize(model: nn.Module, plan, options: ParallelOptions | None = None, **overrides) -> ParallelModel:
    """Apply `plan` to `model` inside an initialised default process group of the plan's size.

    `options`: how to run the plan (options.ParallelOptions, documented field by field; default:
    as priced); keyword `overrides` of its fields are the shorthand, e.g.
    `parallelize(model, plan, compute_dtype=None)`. Data parallelism (`ParallelModel.data_parallel`):
    FSDP2 for zero 1-3, DDP for zero=0 (where `ddp_runs`), nothing for one data-parallel rank, where
    mixed precision comes from autocast. Gradients are reduced in the layout's grad_dtype: "bf16" is
    FSDP2's reduce_dtype or DDP's bf16 all-reduce hook, whatever `compute_dtype` (ir.support refuses
    it where nothing reduces).
    """
    options = ParallelOptions.of(options, **overrides)
    if not dist.is_initialized():
        raise ConfigError("parallelize() needs an initialised process group: launch with torchrun "
                          "(meshplan launch) and call torch.distributed.init_process_group first")
    _check(model, plan, dist.get_world_size())
    plan = with_mtp_blocks(model, plan)     # the MTP depths' blocks run as the last layer (mtp_parallel.py)
    note = router_aux_loss_note(model, plan.layout)
    if note and dist.get_rank() == 0:
        warnings.warn("meshplan: " + note, stacklevel=2)
    note = whole_logits_note(plan.layout, options)
    if note and dist.get_rank() == 0:
        warnings.warn("meshplan: " + note, stacklevel=2)
    device = torch.device("cuda", torch.cuda.current_device()) if (
        torch.cuda.is_available() and dist.get_backend() == "nccl") else torch.device("cpu")
    specs = _pp.stage_specs(plan.stages)
    _pp.check_stage_coverage(model, plan.stages)
    _pp.check_stage_entries(model, specs)
    dims = ParallelDims.from_plan(plan)
    job = steps.Job.prepare(model, plan, dims, options, device)     # refusals before any collective
    dims = ParallelDims.build(plan, device.type)                    # the DeviceMeshes (collective)

    parts = steps.split_pipeline(model, dims, job)
    for part in parts:
        for step in RECIPE:
            step(part, dims, job)
    return _assemble(parts, dims, job)


def _assemble(parts: list[steps.Part], dims: ParallelDims, job: steps.Job) -> ParallelModel:
    """The ParallelModel over this rank's parts, with the pipeline schedule when there are stages."""
    modules = [p.module for p in parts]
    tied_shapes = steps.tied_local_shapes(modules, job.tied, dims)     # collective over pp (pp > 1)
    fp8 = _fp8.merge([p.fp8 for p in parts if p.fp8 is not None])
    precisions = _fp8.module_precisions(modules, job.compute_dtype, fp8)
    _fp8.log_precisions(precisions, job.plan)
    pipeline_stages = None
    if job.num_stages > 1:
        group = dims.pp_mesh.get_group()
        pipeline_stages = [_pp.pipeline_stage(p.module, p.spec, job.device, group) for p in parts]
    return ParallelModel(
        plan=job.plan, dims=dims, stages=modules, specs=[p.spec for p in parts], device=job.device,
        fsdp_units=[u for p in parts for u in p.fsdp_units], loss_fn=job.options.loss_fn, tied=job.tied,
        tied_shapes=tied_shapes,
        fused_head=_last(parts, "fused_head"), vocab_shard=_last(parts, "vocab_shard"),
        fused_modules=[m for p in parts for m in p.fused_modules], kernels=job.kernels,
        lean_modules=[m for p in parts for m in p.lean_modules],
        data_parallel=job.data_parallel, ddp=[p.ddp for p in parts if p.ddp is not None],
        autocast_dtype=None if job.data_parallel == "fsdp" else job.compute_dtype,
        async_tp=any(p.async_tp for p in parts), compiled=[b for p in parts for b in p.compiled],
        offload=[p.offloader for p in parts if p.offloader is not None],
        expert_modules=[p.experts for p in parts], fp32_grads=[m for p in parts for m in p.fp32_modules],
        fp8=fp8, precisions=precisions, pipeline_stages=pipeline_stages)


def _last(parts: list[steps.Part], name: str):
    """The last part's `name` that is set (the output layer's, held by the last local stage)."""
    return next((getattr(p, name) for p in reversed(parts) if getattr(p, name) is not None), None)
