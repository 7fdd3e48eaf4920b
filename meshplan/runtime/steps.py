"""The steps of `parallelize`'s recipe (parallel.py), one function per technique.

Each step takes a `Part` (one pipeline stage's module held by this rank, and what earlier steps
did to it), the run's `ParallelDims` (degrees and meshes) and the `Job` (the plan, the options
resolved against it, and the facts about the whole model every step reads), and changes the part
in place. A step is a no-op where its degree is 1 or its option is off, so the recipe is the same
list of calls for every plan.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from meshplan.errors import LayoutError
from meshplan.ir.precision import Precision
from meshplan.runtime import context_parallel as _cp
from meshplan.runtime import expert_parallel as _ep
from meshplan.runtime import fp8 as _fp8
from meshplan.runtime import fp32_grads as _f32
from meshplan.runtime import fsdp as _fsdp
from meshplan.runtime import materialize as _mat
from meshplan.runtime import moe_folding as _fold
from meshplan.runtime import mtp_parallel as _mtp
from meshplan.runtime import offload as _offload
from meshplan.runtime import pipeline as _pp
from meshplan.runtime.compile import compile_blocks, compile_wanted
from meshplan.runtime.ddp import autocast_forward, cast_embeddings, data_parallel_mode, wrap_ddp
from meshplan.runtime.dims import ParallelDims
from meshplan.runtime.fused import apply_fused_kernels, apply_lean_elementwise, choose_kernels
from meshplan.runtime.options import ParallelOptions
from meshplan.runtime.recompute import apply_recompute
from meshplan.runtime.tensor_parallel import apply_tensor_parallel, enable_async_tp

__all__ = ["Job", "Part", "split_pipeline", "fuse_kernels", "tensor_parallel", "context_parallel",
           "expert_parallel", "float8", "recompute", "compile_part", "data_parallel", "materialize",
           "replicate", "tied_local_shapes"]

# "fp8": the plan's fp8_modules run FP8 GEMMs (runtime/fp8.py), every other module bf16
_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16, Precision.FP8: torch.bfloat16,
           Precision.FP32: None}


@dataclass(frozen=True)
class Job:
    """The plan, the options resolved against it and this device, and the whole-model facts the
    steps read (each computed once, before any step changes the model)."""

    plan: object
    options: ParallelOptions
    device: torch.device
    compute_dtype: torch.dtype | None       # None: the model's own dtype
    run_fp8: bool                           # the plan's fp8_modules become FP8 linears
    fp8_recipe: str
    data_parallel: str                      # "fsdp" | "ddp" | "none" (ddp.data_parallel_mode)
    compile: bool
    fp32_patterns: tuple[str, ...]
    tied: list[tuple[str, ...]]             # tied parameter names, canonical first
    expert_params: frozenset[str]           # parameters the plan labels "expert" (folded experts)
    tp_plan: object                         # the plan as TP sees it (a MoE layer's router and experts left out)
    kernels_to_run: list                    # fused-kernel entries swapped in here (fused.choose_kernels)
    kernels: dict[str, str]                 # fused kernel -> what runs here and why
    fuse_loss: bool                         # the fused linear + cross-entropy may replace the output layer
    num_stages: int
    reference: nn.Module | None = None      # deferred initialisation: the unsharded meta model
    rng_start: torch.Tensor | None = None   # ... and the random state its initialisation starts from

    @property
    def deferred(self) -> bool:
        return self.reference is not None

    @classmethod
    def prepare(cls, model: nn.Module, plan, dims: ParallelDims, options: ParallelOptions,
                device: torch.device) -> Job:
        lay = plan.layout
        dtype = options.compute_dtype
        if dtype == "plan":
            dtype = _DTYPES.get(plan.precision, torch.bfloat16)
        if dtype == torch.float32:
            dtype = None
        run_fp8 = options.fp8 and plan.precision == Precision.FP8 and bool(plan.fp8_modules)
        recipe = options.fp8_recipe or lay.fp8_recipe
        if run_fp8:     # a missing package fails before any collective, naming what to install
            _fp8.resolve_backend(options.fp8_backend, device, tp=lay.tp, recipe=recipe)
        expert_params = frozenset(_ep.expert_labelled_params(plan.placements)) if dims.folded else frozenset()
        # refuse unsplittable experts before any collective
        expert_fqns = _ep.check_expert_parallel(model, lay.ep, set(expert_params)) if dims.folded else []
        run_kernels, kernels = choose_kernels(plan.fused_kernels, device.type, options.fused_kernels)
        # the fused linear + cross-entropy needs the whole vocabulary on one rank (its kernel turns
        # each chunk's logits into loss and gradient with a local softmax normaliser); under TP the
        # default loss runs vocabulary-parallel instead (loss_parallel.py). The planner never lists
        # it for tp > 1; a hand-written plan that does gets the eager head.
        if options.loss_fn is None and dims.tp > 1 and any(k.kernel == "linear_cross_entropy" for k in run_kernels):
            kernels["linear_cross_entropy"] = f"eager (tp={dims.tp}: vocabulary-parallel cross entropy)"
        deferred = _mat.is_meta(model)
        return cls(plan=plan, options=options, device=device, compute_dtype=dtype, run_fp8=run_fp8,
                   fp8_recipe=recipe, data_parallel=data_parallel_mode(plan),
                   compile=compile_wanted(options.compile, device.type, lay.schedule, lay.pp),
                   fp32_patterns=_f32.parse_patterns(options.fp32_grads), tied=_tied_parameters(model),
                   expert_params=expert_params, tp_plan=_fold.tp_view(plan, expert_fqns),
                   kernels_to_run=run_kernels, kernels=kernels, fuse_loss=options.loss_fn is None and dims.tp == 1,
                   num_stages=len(plan.stages),
                   # deferred initialisation (runtime/materialize.py): an unsharded meta copy to
                   # replay the single-device initialisation from, and the random state it starts from
                   reference=copy.deepcopy(model) if deferred else None,
                   rng_start=torch.get_rng_state() if deferred else None)


@dataclass
class Part:
    """One pipeline stage this rank holds (the model itself when there is one stage), and what the
    steps did to it."""

    module: nn.Module
    spec: _pp.StageSpec
    blocks: list[str]                       # the plan's blocks in this stage, in order
    layers_before: int = 0                  # layers of this pipeline rank in earlier virtual stages
    fused_head: object = None
    fused_modules: list[str] = field(default_factory=list)
    lean_modules: list[str] = field(default_factory=list)   # norms / SwiGLU on input-saving Functions (fused.py)
    vocab_shard: object = None              # set when the output layer stays vocabulary-sharded
    experts: list[str] = field(default_factory=list)    # folded experts modules
    fp8: object = None                      # fp8.Fp8Swap
    offloader: object = None                # offload.Offloader (Layout.offload_activations)
    async_tp: bool = False
    compiled: list[str] = field(default_factory=list)
    fp32_modules: list[str] = field(default_factory=list)   # modules whose gradients reduce in fp32
    fsdp_units: list[nn.Module] = field(default_factory=list)
    ddp: nn.Module | None = None


# ---- 1. pipeline split ---------------------------------------------------------------------------
def split_pipeline(model: nn.Module, dims: ParallelDims, job: Job) -> list[Part]:
    """This rank's stages of the plan's split (the model itself when there is one stage), each on
    its device: a meta model keeps its parameters on meta (step 10 allocates only the shards)."""
    plan = job.plan
    specs = _pp.stage_specs(plan.stages)
    mine = _pp.stages_of_rank(dims.pp_mesh.get_local_rank(), dims.pp, len(specs), plan.schedule)
    parts, layers = [], 0
    for spec in (specs[i] for i in mine):
        # a later stage runs the model's forward on token ids of the LOCAL length: seq_len / cp
        stage = model if len(specs) == 1 else _pp.build_stage_module(
            model, spec, seq_len=plan.seq_len // dims.cp, copy_model=True)
        if job.deferred:
            _mat.materialize_buffers(stage, job.device)
        else:
            stage.to(job.device)
        # the MTP depths' blocks are inside the module "mtp", which the last stage owns (mtp_parallel.py)
        blocks = [m for m in spec.owned if m in plan.blocks] + _mtp.owned_mtp_blocks(plan.blocks, spec.owned)
        parts.append(Part(module=stage, spec=spec, blocks=blocks, layers_before=layers))
        layers += len(_mtp.main_blocks(blocks))     # recompute counts layers per pipeline rank
    return parts


# ---- 2. fused kernels ----------------------------------------------------------------------------
def fuse_kernels(part: Part, dims: ParallelDims, job: Job) -> None:
    if job.kernels_to_run:
        swapped = apply_fused_kernels(part.module, job.kernels_to_run, fuse_loss=job.fuse_loss)
        part.fused_head, part.fused_modules = swapped.head, list(swapped.modules)
    # the norms and SwiGLU no kernel replaced keep only their inputs for backward, as the kernels do
    part.lean_modules = apply_lean_elementwise(part.module, job.plan.fused_kernels, part.fused_modules,
                                               device_type=job.device.type, mode=job.options.fused_kernels)


# ---- 3. TP / SP ----------------------------------------------------------------------------------
def tensor_parallel(part: Part, dims: ParallelDims, job: Job) -> None:
    stage = part.module
    # the default loss runs on the vocabulary slices: the output layer keeps its logits sharded
    part.vocab_shard = apply_tensor_parallel(stage, job.tp_plan, dims.tp_mesh, shard_vocab=job.options.loss_fn is None)
    _retie(stage, job.tied)
    if job.num_stages > 1 and dims.tp > 1 and job.plan.sequence_parallel:
        # the sequence-sharded residual stream crosses stages as local shards
        stage.__dict__["_meshplan_wrap_input"] = _sequence_dtensor(dims.tp_mesh)


# ---- 4. CP ---------------------------------------------------------------------------------------
def context_parallel(part: Part, dims: ParallelDims, job: Job) -> None:
    # before recompute wraps the blocks, so a block recomputed in backward runs the ring too
    if dims.cp > 1:
        _cp.apply_context_parallel(part.module, group=dims.cp_mesh.get_group(), seq_len=job.plan.seq_len,
                                   blocks=part.blocks)


# ---- 5. EP and MoE folding -----------------------------------------------------------------------
def expert_parallel(part: Part, dims: ParallelDims, job: Job) -> None:
    if dims.folded:
        part.experts = _ep.apply_expert_parallel(part.module, dims.ep_mesh, labelled=set(job.expert_params),
                                                 expert_mesh=dims.expert_mesh)
    # a MoE layer runs on each TP rank's own tokens
    _fold.apply_moe_folding(part.module, job.plan, dims.tp_mesh, experts=part.experts)


# ---- 6. FP8 --------------------------------------------------------------------------------------
def float8(part: Part, dims: ParallelDims, job: Job) -> None:
    if not job.run_fp8:
        return
    lay = job.plan.layout
    part.fp8 = _fp8.apply_fp8(part.module, job.plan.fp8_modules, backend=job.options.fp8_backend,
                              recipe=job.fp8_recipe, device=job.device, tp=lay.tp,
                              fsdp_float8_all_gather=job.data_parallel == "fsdp" and lay.zero == 3)


# ---- 7. recompute and activation offload ---------------------------------------------------------
def recompute(part: Part, dims: ParallelDims, job: Job) -> None:
    lay = job.plan.layout
    # the main stack's blocks: the MTP depths' run as priced, without recompute (mtp_parallel.py)
    blocks = _mtp.main_blocks(part.blocks)
    apply_recompute(part.module, blocks, lay, first_index=part.layers_before)
    if lay.offload_activations:
        # around the recompute wrapper: what the policy keeps is what moves to host memory
        part.offloader = _offload.apply_offload(part.module, blocks, job.device)


# ---- 8. async TP and torch.compile ---------------------------------------------------------------
def compile_part(part: Part, dims: ParallelDims, job: Job) -> None:
    lay = job.plan.layout
    if lay.tp_comm_overlap:
        part.async_tp = enable_async_tp(part.module, part.blocks, dims.tp_mesh)
    # async TP compiled the blocks already; offloaded blocks run eagerly (their saved-tensor hooks
    # are Python around each save)
    if job.compile and not part.async_tp and not lay.offload_activations:
        part.compiled = compile_blocks(part.module, part.blocks)


# ---- 9. FSDP2 (or autocast where nothing shards) -------------------------------------------------
def data_parallel(part: Part, dims: ParallelDims, job: Job) -> None:
    lay = job.plan.layout
    if job.fp32_patterns and lay.grad_dtype == "bf16" and job.data_parallel != "none":
        part.fp32_modules = _f32.fp32_grad_modules(part.module, job.fp32_patterns, exclude=part.experts)
    if job.data_parallel == "fsdp":
        part.fsdp_units = _fsdp.apply_fsdp(
            part.module, part.blocks, dims.fsdp_mesh, zero=lay.zero, reshard_after_forward=lay.reshard_after_forward,
            param_dtype=job.compute_dtype, overlap=job.options.overlap, experts=part.experts,
            expert_mesh=dims.expert_fsdp_mesh, one_unit_below_zero3=job.device.type == "cpu",
            reduce_dtype=torch.bfloat16 if lay.grad_dtype == "bf16" else None, fp32_modules=part.fp32_modules)
    elif job.compute_dtype is not None:
        autocast_forward(part.module, job.compute_dtype, job.device.type)
        cast_embeddings(part.module, job.compute_dtype)
        if part.fused_head is not None:
            part.fused_head.compute_dtype = job.compute_dtype


# ---- 10. materialise -----------------------------------------------------------------------------
def materialize(part: Part, dims: ParallelDims, job: Job) -> None:
    """A meta model's shards allocated and initialised as the single-device model's (after
    sharding, so a rank allocates only its own). `materialize=False` leaves them on meta."""
    if job.deferred and job.options.materialize:
        _mat.materialize([part.module], job.reference, job.device, rng_state=job.rng_start)


# ---- 11. DDP (after materialise: DDP broadcasts and checks real tensors) --------------------------
def replicate(part: Part, dims: ParallelDims, job: Job) -> None:
    if job.data_parallel != "ddp" or (job.deferred and not job.options.materialize):
        return
    stage = part.module
    ignore = [f"{fqn}.{n}" for fqn in part.experts for n, _ in stage.get_submodule(fqn).named_parameters()]
    part.ddp = wrap_ddp(stage, dims.fsdp_mesh.get_group(), job.device, ignore=ignore,
                        grad_dtype=job.plan.layout.grad_dtype,
                        fp32_params=_f32.matching_params(stage, job.fp32_patterns))


# ---- helpers -------------------------------------------------------------------------------------
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


def tied_local_shapes(stages: list[nn.Module], tied, dims: ParallelDims) -> list:
    """For each tied set spanning pipeline ranks, the local shape of its gradient (None if the
    set lives on one pipeline rank). Ranks holding no copy learn the shape from those that do, so
    every pipeline rank can join the all-reduce (the mesh's own pp group: no new groups, whose
    creation order ranks would have to agree on)."""
    from torch.distributed.tensor import DTensor
    if dims.pp == 1:
        return [None] * len(tied)
    out = []
    pp_group = dims.pp_mesh.get_group()
    for names in tied:
        mine = None
        for st in stages:
            for n, p in st.named_parameters(remove_duplicate=False):
                if n in names:
                    mine = tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
        counts: list = [None] * dims.pp
        dist.all_gather_object(counts, mine, group=pp_group)
        holders = [c for c in counts if c is not None]
        out.append(holders[0] if len(holders) > 1 else None)
    return out
