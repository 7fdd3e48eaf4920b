"""`parallelize(model, plan) -> ParallelModel`: carry out a Plan on PyTorch's distributed engine.

One fixed order, each step a no-op at degree 1 (DESIGN.md):

    checks -> DeviceMesh -> pipeline split -> fused kernels -> TP/SP -> CP -> EP -> FP8 -> recompute -> offload
    -> FSDP/ZeRO -> schedule

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

import copy
import warnings

import torch
import torch.distributed as dist
from torch import nn

from meshplan.errors import ConfigError, LayoutError
from meshplan.ir.fingerprint import fingerprint
from meshplan.ir.support import ModelTraits, runtime_limits
from meshplan.runtime import context_parallel as _cp
from meshplan.runtime import expert_parallel as _ep
from meshplan.runtime import fp8 as _fp8
from meshplan.runtime import fp32_grads as _f32
from meshplan.runtime import fsdp as _fsdp
from meshplan.runtime import materialize as _mat
from meshplan.runtime import moe_folding as _fold
from meshplan.runtime import offload as _offload
from meshplan.runtime import pipeline as _pp
from meshplan.runtime.compile import compile_blocks, compile_wanted
from meshplan.runtime.ddp import (
    autocast_forward,
    data_parallel_mode,
    ddp_runs,
    wrap_ddp,
)
from meshplan.runtime.fused import apply_fused_kernels, choose_kernels
from meshplan.runtime.mesh import build_mesh, folds_experts
from meshplan.runtime.model import IGNORE_INDEX, ParallelModel, router_aux_loss_note
from meshplan.runtime.recompute import apply_recompute
from meshplan.runtime.tensor_parallel import apply_tensor_parallel, enable_async_tp

__all__ = ["parallelize", "ParallelModel", "IGNORE_INDEX", "ddp_runs"]
# "fp8": the plan's fp8_modules run FP8 GEMMs (runtime/fp8.py), every other module bf16
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16, "fp32": None}


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
    if plan.precision == "fp8":
        # the FP8 backends swap nn.Linear modules; anything else named would silently stay bf16
        # (a parameter of stacked experts) or fail on some rank later (a transposed Conv1D)
        modules = dict(model.named_modules())
        bad = [m for m in plan.fp8_modules if not isinstance(modules.get(m), nn.Linear)]
        if bad:
            raise ConfigError(f"this FP8 plan lists {len(bad)} module(s) that are not nn.Linear modules of this "
                              f"model (e.g. {', '.join(bad[:3])}); the FP8 backends swap nn.Linear only; "
                              "re-plan (meshplan.plan keeps other GEMMs in bf16)")


def _tied_parameters(model: nn.Module) -> list[tuple[str, ...]]:
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [tuple(v) for v in by_id.values() if len(v) > 1]


def _sequence_dtensor(tp_mesh):
    from torch.distributed.tensor import DTensor, Shard
    return lambda t: DTensor.from_local(t, tp_mesh, [Shard(1)], run_check=False)


def _retie(stage: nn.Module, tied: list[tuple[str, ...]]) -> None:
    """Tie again what sharding untied (each module's weight was replaced by its own DTensor)."""
    from torch.distributed.tensor import DTensor
    for names in tied:
        present = [n for n in names if _has_param(stage, n)]
        if len(present) < 2:
            continue
        first = stage.get_parameter(present[0])
        for n in present[1:]:
            other = stage.get_parameter(n)
            if other is first:
                continue
            if isinstance(first, DTensor) != isinstance(other, DTensor) or (
                    isinstance(first, DTensor) and first.placements != other.placements):
                raise LayoutError(f"tied parameters {present[0]} and {n} are sharded differently by the plan; "
                                  "untie them in the model or re-plan with tp=1")
            mod_name, _, leaf = n.rpartition(".")
            setattr(stage.get_submodule(mod_name), leaf, first)


def _has_param(module: nn.Module, name: str) -> bool:
    try:
        module.get_parameter(name)
        return True
    except AttributeError:
        return False


def _tied_local_shapes(stages: list[nn.Module], tied, mesh) -> list:
    """For each tied set spanning pipeline ranks, the local shape of its gradient (None if the
    set lives on one pipeline rank). Ranks holding no copy learn the shape from those that do, so
    every pipeline rank can join the all-reduce (the mesh's own pp group: no new groups, whose
    creation order ranks would have to agree on)."""
    from torch.distributed.tensor import DTensor
    out = []
    pp_group = mesh["pp"].get_group()
    for names in tied:
        mine = None
        for st in stages:
            for n, p in st.named_parameters(remove_duplicate=False):
                if n in names:
                    mine = tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
        counts: list = [None] * mesh["pp"].size()
        dist.all_gather_object(counts, mine, group=pp_group)
        holders = [c for c in counts if c is not None]
        out.append(holders[0] if len(holders) > 1 else None)
    return out


def _owned_blocks(spec: _pp.StageSpec, blocks: tuple[str, ...]) -> list[str]:
    return [m for m in spec.owned if m in blocks]


def parallelize(model: nn.Module, plan, *, compute_dtype: torch.dtype | None | str = "plan",
                overlap: bool = True, loss_fn=None, fused_kernels: bool | str = "auto", fp8: bool = True,
                fp8_backend: str = "auto", fp8_recipe: str | None = None,
                materialize: bool = True, compile: bool | str = "auto",
                fp32_grads: tuple[str, ...] | str = ()) -> ParallelModel:
    """Apply `plan` to `model` inside an initialised default process group of the plan's size.

    `compute_dtype`: "plan" (default) takes the plan's precision (bf16 parameters and compute,
    fp32 master weights, gradients reduced in the layout's grad_dtype); `None` or torch.float32 computes in the
    model's own dtype (what numerical-equivalence tests use). `loss_fn(logits, labels)` must
    return the SUM over tokens (default: cross entropy ignoring -100); with a `loss_fn` the
    output layer keeps its eager form (the fused linear + cross-entropy computes the default loss)
    and, under TP, the loss gets whole logits: the output layer all-gathers them over the
    vocabulary, so every TP rank holds the full (tokens x vocab) logits and their gradient. The
    default loss instead runs on each rank's vocabulary slice (runtime/loss_parallel.py), as
    the cost model prices it.
    `fused_kernels`: "auto" (default) swaps in the kernels the plan lists (Plan.fused_kernels)
    that are faster than eager with this device's backend (fused.FASTER_THAN_EAGER: Triton on
    CUDA; on CPU none - the reference fallbacks are slower); True swaps every listed kernel
    (correctness tests), False none. `ParallelModel.kernels` records what runs and why. Which
    implementation runs is meshplan.kernels.set_backend's choice: Triton on GPUs (or under
    TRITON_INTERPRET=1), the plain-PyTorch reference otherwise.
    Data parallelism (`ParallelModel.data_parallel`): FSDP2 for zero 1-3, DDP for zero=0 (where
    `ddp_runs`), nothing for one data-parallel rank; mixed precision then comes from autocast.
    Gradients are reduced in the layout's grad_dtype: "bf16" is FSDP2's reduce_dtype or DDP's bf16
    all-reduce hook, whatever `compute_dtype` (ir.support refuses it where nothing reduces).
    `fp8`: for an FP8 plan, swap exactly Plan.fp8_modules for FP8 linears (runtime/fp8.py) with
    `fp8_backend` ("auto": Transformer Engine on CUDA when installed and tp == 1, else torchao; "torchao", "te")
    and `fp8_recipe` (None: the plan's Layout.fp8_recipe; "tensorwise", "rowwise", or TE's "delayed");
    False is the explicit override that runs
    the plan in `compute_dtype` instead. A missing backend fails here, before any collective.
    `compile`: torch.compile each block (runtime/compile.py): "auto" on CUDA, True, or False.
    `fp32_grads`: parameter-name patterns ("router,norm") whose gradients reduce in fp32 under a
    grad_dtype "bf16" layout (runtime/fp32_grads.py); `ParallelModel.fp32_grads` lists the modules.
    """
    if not dist.is_initialized():
        raise ConfigError("parallelize() needs an initialised process group: launch with torchrun "
                          "(meshplan launch) and call torch.distributed.init_process_group first")
    world = dist.get_world_size()
    _check(model, plan, world)
    lay = plan.layout
    note = router_aux_loss_note(model, lay)
    if note and dist.get_rank() == 0:
        warnings.warn("meshplan: " + note, stacklevel=2)
    device = torch.device("cuda", torch.cuda.current_device()) if (
        torch.cuda.is_available() and dist.get_backend() == "nccl") else torch.device("cpu")
    if compute_dtype == "plan":
        compute_dtype = _DTYPES.get(plan.precision, torch.bfloat16)
    if compute_dtype == torch.float32:
        compute_dtype = None
    run_fp8 = fp8 and plan.precision == "fp8" and bool(plan.fp8_modules)
    if run_fp8:     # a missing package fails before any collective, naming what to install
        _fp8.resolve_backend(fp8_backend, device, tp=lay.tp, recipe=fp8_recipe or lay.fp8_recipe)
    specs = _pp.stage_specs(plan.stages)
    _pp.check_stage_coverage(model, plan.stages)
    _pp.check_stage_entries(model, specs)
    tied = _tied_parameters(model)
    folded = folds_experts(plan)         # experts on their own (edp, ep, etp) mesh (mesh.py)
    expert_params = _ep.expert_labelled_params(plan.placements) if folded else set()
    # refuse unsplittable experts before any collective
    expert_fqns = _ep.check_expert_parallel(model, lay.ep, expert_params) if folded else []
    tp_plan = _fold.tp_view(plan, expert_fqns)      # a MoE layer's router and experts are not TP's
    meshes = build_mesh(plan, device.type)
    mesh = meshes.root
    # deferred initialisation (runtime/materialize.py): an unsharded meta copy to replay the
    # single-device initialisation from, and the random state that initialisation starts from
    deferred = _mat.is_meta(model)
    reference = copy.deepcopy(model) if deferred else None
    rng_start = torch.get_rng_state() if deferred else None

    pp = plan.mesh["pp"]
    mine = _pp.stages_of_rank(mesh["pp"].get_local_rank(), pp, len(specs), plan.schedule)
    local_specs = [specs[i] for i in mine]
    stages = []
    fused_head, fused_modules = None, []
    run_kernels, kernels = choose_kernels(plan.fused_kernels, device.type, fused_kernels)
    tp_size = mesh["tp"].size()
    # the fused linear + cross-entropy needs the whole vocabulary on one rank (its kernel turns
    # each chunk's logits into loss and gradient with a local softmax normaliser); under TP the
    # default loss runs vocabulary-parallel instead (loss_parallel.py). The planner never lists
    # it for tp > 1; a hand-written plan that does gets the eager head.
    fuse_loss = loss_fn is None and tp_size == 1
    if loss_fn is None and tp_size > 1 and any(k.kernel == "linear_cross_entropy" for k in run_kernels):
        kernels["linear_cross_entropy"] = f"eager (tp={tp_size}: vocabulary-parallel cross entropy)"
    for spec in local_specs:
        # 1. pipeline split (the model itself when there is one stage)
        # (a later stage runs the model's forward on token ids of the LOCAL length: seq_len / cp)
        stage = model if len(specs) == 1 else _pp.build_stage_module(
            model, spec, seq_len=plan.seq_len // plan.mesh.get("cp", 1), copy_model=True)
        if deferred:        # a meta model: shard first, allocate only this rank's shards (step 4b)
            _mat.materialize_buffers(stage, device)
        else:
            stage.to(device)
        if run_kernels:                                                              # 1b. fused kernels
            swapped = apply_fused_kernels(stage, run_kernels, fuse_loss=fuse_loss)
            fused_head = swapped.head or fused_head
            fused_modules += swapped.modules
        stages.append(stage)
    units: list[nn.Module] = []
    dp_mode = data_parallel_mode(plan)     # FSDP2 / DDP / none (autocast gives mixed precision)
    use_fsdp = dp_mode == "fsdp"
    ddps: list[nn.Module] = []
    async_tp = False
    swaps: list = []
    compile_on, compiled = compile_wanted(compile, device.type, lay.schedule, lay.pp), []
    expert_modules: list[list[str]] = []
    fp32_patterns = _f32.parse_patterns(fp32_grads)
    keep_fp32: list[list[str]] = []         # per local stage: modules whose gradients reduce in fp32
    vocab_shard = None      # set on the ranks holding the output layer when it stays vocab-sharded
    layers_before = 0       # layers of this pipeline rank in earlier virtual stages (recompute counts per rank)
    offloaders: list = []   # runtime/offload.py, one per local stage (Layout.offload_activations)
    for spec, stage in zip(local_specs, stages):
        blocks = _owned_blocks(spec, plan.blocks)
        # the default loss runs on the vocabulary slices: the output layer keeps its logits sharded
        shard = apply_tensor_parallel(stage, tp_plan, mesh["tp"], shard_vocab=loss_fn is None)   # 2. TP / SP
        vocab_shard = shard if shard is not None else vocab_shard
        _retie(stage, tied)
        if len(specs) > 1 and mesh["tp"].size() > 1 and plan.sequence_parallel:
            # the sequence-sharded residual stream crosses stages as local shards
            stage.__dict__["_meshplan_wrap_input"] = _sequence_dtensor(mesh["tp"])
        if plan.mesh.get("cp", 1) > 1:                                              # 2b. CP
            # before recompute wraps the blocks, so a block recomputed in backward runs the ring too
            _cp.apply_context_parallel(stage, group=mesh["cp"].get_group(), seq_len=plan.seq_len, blocks=blocks)
        experts = (_ep.apply_expert_parallel(stage, meshes.ep, labelled=expert_params,    # 2c. EP
                                             expert_mesh=meshes.experts) if folded else [])
        _fold.apply_moe_folding(stage, plan, mesh["tp"], experts=experts)         # (MoE on TP ranks' tokens)
        expert_modules.append(experts)
        if run_fp8:                                                                 # 2d. FP8
            swaps.append(_fp8.apply_fp8(stage, plan.fp8_modules, backend=fp8_backend,
                                        recipe=fp8_recipe or lay.fp8_recipe,
                                        device=device, tp=lay.tp,
                                        fsdp_float8_all_gather=use_fsdp and lay.zero == 3))
        apply_recompute(stage, blocks, lay, first_index=layers_before)             # 3. recompute
        layers_before += len(blocks)
        if lay.offload_activations:                                                 # 3a. offload
            # around the recompute wrapper: what the policy keeps is what moves to host memory
            offloaders.append(_offload.apply_offload(stage, blocks, device))
        if lay.tp_comm_overlap:                                                     # 3b. async TP
            async_tp = enable_async_tp(stage, blocks, mesh["tp"]) or async_tp
        if compile_on and not async_tp and not lay.offload_activations:             # 3c. compile
            compiled += compile_blocks(stage, blocks)          # (async TP compiled them already;
            # offloaded blocks run eagerly: their saved-tensor hooks are Python around each save)
        keep_fp32.append(_f32.fp32_grad_modules(stage, fp32_patterns, exclude=experts)
                         if fp32_patterns and lay.grad_dtype == "bf16" and dp_mode != "none" else [])
        if use_fsdp:                                                                # 4. FSDP / ZeRO
            units += _fsdp.apply_fsdp(stage, blocks, meshes.fsdp, zero=lay.zero,
                                      reshard_after_forward=lay.reshard_after_forward,
                                      param_dtype=compute_dtype, overlap=overlap,
                                      experts=experts, expert_mesh=meshes.expert_fsdp,
                                      one_unit_below_zero3=device.type == "cpu",
                                      reduce_dtype=torch.bfloat16 if lay.grad_dtype == "bf16" else None,
                                      fp32_modules=keep_fp32[-1])
        elif compute_dtype is not None:
            autocast_forward(stage, compute_dtype, device.type)
            if fused_head is not None:
                fused_head.compute_dtype = compute_dtype
        if deferred and materialize:                                                # 4b. materialise
            # materialize=False leaves a meta model sharded but unallocated: the fake-world
            # contract tests count each rank's shards against the cost model without memory
            _mat.materialize([stage], reference, device, rng_state=rng_start)
        if dp_mode == "ddp" and (materialize or not deferred):     # DDP checks real tensors
            ignore = [f"{fqn}.{n}" for fqn in experts for n, _ in stage.get_submodule(fqn).named_parameters()]
            ddps.append(wrap_ddp(stage, meshes.fsdp.get_group(), device, ignore=ignore, grad_dtype=lay.grad_dtype,
                                 fp32_params=_f32.matching_params(stage, fp32_patterns)))
    pm = ParallelModel(plan=plan, mesh=mesh, stages=stages, specs=local_specs, device=device,
                       fsdp_units=units, loss_fn=loss_fn, tied=tied, fused_head=fused_head,
                       vocab_shard=vocab_shard,
                       fused_modules=fused_modules, meshes=meshes, kernels=kernels, data_parallel=dp_mode,
                       ddp=ddps, autocast_dtype=None if use_fsdp else compute_dtype, async_tp=async_tp,
                       tied_shapes=_tied_local_shapes(stages, tied, mesh) if pp > 1 else [None] * len(tied))
    pm.compiled = compiled
    pm.offload = offloaders                 # bytes each stage moved to host: Offloader.bytes_offloaded
    pm.expert_modules = expert_modules
    pm.fp32_grads = [m for stage_mods in keep_fp32 for m in stage_mods]
    pm.fp8 = _fp8.merge(swaps)
    pm.precisions = _fp8.module_precisions(stages, compute_dtype, pm.fp8)
    _fp8.log_precisions(pm.precisions, plan)
    if len(specs) > 1:                                                              # 5. schedule
        from torch.distributed.pipelining import PipelineStage
        group = mesh["pp"].get_group()
        pstages = [PipelineStage(st, spec.index, spec.num_stages, device, group=group)
                   for spec, st in zip(local_specs, stages)]
        # one schedule per micro-batch count: a batch-size schedule changes the count between steps
        pm.schedules = _pp.ScheduleCache(plan.schedule, pstages,
                                         loss_fn=lambda out, target: pm._step_loss_fn(out, target))
        pm.schedule = pm.schedules.get(plan.num_microbatches)
    return pm
