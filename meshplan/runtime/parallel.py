"""`parallelize(model, plan) -> ParallelModel`: carry out a Plan on PyTorch's distributed engine.

One fixed order, each step a no-op at degree 1 (DESIGN.md):

    checks -> DeviceMesh -> pipeline split -> fused kernels -> TP/SP -> CP -> EP -> recompute -> FSDP/ZeRO -> schedule

EP (expert_parallel.py): routed experts sharded over the EP group (DTensors, Shard(0) over the
"ep" axis), tokens moved by autograd-aware all-to-all; FSDP then shards expert weights over
`edp` and everything else over the whole dp mesh. Gradient norm, full tensors and DCP state
need nothing special: expert gradients are DTensors over (edp, ep), so their sums and
`full_tensor()` cover every expert exactly once.

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

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshplan.errors import ConfigError, LayoutError
from meshplan.runtime import context_parallel as _cp
from meshplan.runtime import expert_parallel as _ep
from meshplan.runtime import fsdp as _fsdp
from meshplan.runtime import pipeline as _pp
from meshplan.runtime.fused import apply_fused_kernels
from meshplan.runtime.recompute import apply_recompute
from meshplan.runtime.tensor_parallel import apply_tensor_parallel, block_signatures, sequence_parallel

__all__ = ["parallelize", "ParallelModel", "IGNORE_INDEX"]

IGNORE_INDEX = -100
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16, "fp32": None}


def _check(model: nn.Module, plan, world_size: int) -> None:
    """Refuse mismatches before any collective runs (every rank reaches the same verdict)."""
    from meshplan.planner.blocks import fingerprint
    plan.check_matches(world_size=world_size)
    fp = fingerprint(model)
    if fp != plan.model_fingerprint:
        raise ConfigError(f"this plan was made for model {plan.model!r} (fingerprint {plan.model_fingerprint}) "
                          f"but this model's structure has fingerprint {fp}: the model changed since "
                          "planning (layers, shapes or dtypes); re-plan for this model")
    lay = plan.layout_obj
    if lay.ep > 1 and (lay.etp > 1 or lay.tp > 1 or lay.cp > 1 or _hsdp(plan)):
        raise LayoutError(f"the runtime runs expert parallelism (ep={lay.ep}) with experts folded over the "
                          f"data-parallel ranks only: it needs tp=1, cp=1, etp=1 and no HSDP (plan has tp={lay.tp}, "
                          f"cp={lay.cp}, etp={lay.etp}, fsdp_shard={lay.fsdp_shard}); re-plan with "
                          "fixed={'tp': 1, 'cp': 1, 'etp': 1} or with ep=1")


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


def _hsdp(plan) -> bool:
    lay = plan.layout_obj
    return bool(lay.zero == 3 and lay.fsdp_shard and lay.fsdp_shard < plan.mesh.get("dp", 1))


@dataclass(frozen=True)
class Meshes:
    """The plan's DeviceMesh and the sub-meshes each step of `parallelize` works on.

    Rank order is Megatron's tp-cp-ep-dp-pp (fastest first). With expert parallelism the
    data-parallel ranks are split as (edp, ep), ep fastest, so an EP group is `ep` consecutive
    data-parallel ranks and expert weights are data-parallel (FSDP) over `edp`.
    """

    root: object                # named axes: pp, dp | dp_replicate+dp_shard | edp+ep, cp, tp
    dp: object                  # data-parallel ranks, 1-D (None with HSDP: two axes)
    fsdp: object                # where FSDP shards dense weights: dp (x cp), 2-D (replicate, shard) for HSDP
    ep: object = None           # the expert-parallel group (ep > 1)
    expert_fsdp: object = None  # where FSDP shards expert weights under EP: edp


def _flatten(mesh, dims: tuple[str, ...], name: str):
    # the flattened mesh is book-kept here (slicing flattened names from the root is deprecated)
    return mesh[dims]._flatten(name)


def _build_mesh(plan, device_type: str) -> Meshes:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    lay = plan.layout_obj
    dp, cp, tp, pp = (plan.mesh.get(a, 1) for a in ("dp", "cp", "tp", "pp"))
    if _hsdp(plan):
        root = init_device_mesh(device_type, (pp, dp // lay.fsdp_shard, lay.fsdp_shard, cp, tp),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
        if cp == 1:
            return Meshes(root=root, dp=None, fsdp=root["dp_replicate", "dp_shard"])
        _flatten(root, ("dp_shard", "cp"), "dp_shard_cp")
        with warnings.catch_warnings():     # HSDP over (replicate, shard x cp) needs the 2-D slice
            warnings.simplefilter("ignore", UserWarning)
            return Meshes(root=root, dp=None, fsdp=root["dp_replicate", "dp_shard_cp"])
    if lay.ep > 1:
        root = init_device_mesh(device_type, (pp, dp // lay.ep, lay.ep, cp, tp),
                                mesh_dim_names=("pp", "edp", "ep", "cp", "tp"))
        dp_mesh = _flatten(root, ("edp", "ep"), "dp")
        return Meshes(root=root, dp=dp_mesh, fsdp=dp_mesh, ep=root["ep"], expert_fsdp=root["edp"])
    root = init_device_mesh(device_type, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    # with CP, each CP rank's gradients are partial sums over its part of the sequence: FSDP
    # shards and reduces over dp x cp together (Megatron's data-parallel-with-CP group)
    fsdp = root["dp"] if cp == 1 else _flatten(root, ("dp", "cp"), "dp_cp")
    return Meshes(root=root, dp=root["dp"], fsdp=fsdp)


def _owned_blocks(spec: _pp.StageSpec, signatures: dict[str, str]) -> list[str]:
    return [m for m in spec.owned if m in signatures]


@dataclass
class ParallelModel:
    """A model parallelised by a Plan. Built by `parallelize`; see the module docstring."""

    plan: object
    mesh: object                            # the root DeviceMesh (named axes; see Meshes)
    stages: list[nn.Module]                 # this rank's stage modules (the model itself when pp == 1)
    specs: list[_pp.StageSpec]
    device: torch.device
    schedule: object | None = None
    fsdp_units: list[nn.Module] = field(default_factory=list)
    loss_fn: object = None                  # (logits, labels) -> summed loss; default: cross entropy
    fused_head: object = None               # fused.FusedHead when the loss runs fused with the output layer
    fused_modules: list[str] = field(default_factory=list)   # modules running meshplan's fused kernels here
    _step_loss_fn: object = None            # this step's normalised loss (the global token count changes)
    tied: list[tuple[str, ...]] = field(default_factory=list)       # tied parameter names, canonical first
    tied_shapes: list = field(default_factory=list)                 # per tied set: local grad shape if it spans stages
    meshes: Meshes | None = None

    # ---- coordinates -----------------------------------------------------------------
    def _rank(self, axis: str) -> int:
        if axis == "dp" and self.meshes is not None and self.meshes.dp is not None:
            return self.meshes.dp.get_local_rank()
        if axis == "dp" and "dp_replicate" in self.mesh.mesh_dim_names:
            r, s = self.mesh["dp_replicate"].get_local_rank(), self.mesh["dp_shard"].get_local_rank()
            return r * self.mesh["dp_shard"].size() + s
        return self.mesh[axis].get_local_rank()

    @property
    def dp(self) -> int:
        return self.plan.mesh.get("dp", 1)

    @property
    def holds_last_stage(self) -> bool:
        return any(s.is_last for s in self.specs)

    @property
    def holds_first_stage(self) -> bool:
        return any(s.is_first for s in self.specs)

    # ---- training ----------------------------------------------------------------------
    def parameters(self):
        for st in self.stages:
            yield from st.parameters()

    def named_parameters(self):
        for st in self.stages:
            yield from st.named_parameters()

    def train(self, mode: bool = True) -> "ParallelModel":
        for st in self.stages:
            st.train(mode)
        return self

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def _local_batch(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B = input_ids.shape[0]
        m = self.plan.num_microbatches
        if input_ids.shape != labels.shape:
            raise ConfigError(f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must have "
                              "the same shape (batch, seq_len)")
        if B % (self.dp * m):
            raise ConfigError(f"global batch of {B} sequences does not split over dp={self.dp} ranks x "
                              f"{m} micro-batches; use a multiple of {self.dp * m} (the plan's is "
                              f"{self.plan.global_batch})")
        if input_ids.shape[1] > self.plan.seq_len:
            raise ConfigError(f"sequences of {input_ids.shape[1]} tokens are longer than the plan's "
                              f"seq_len={self.plan.seq_len}; re-plan for longer sequences")
        r, n = self._rank("dp"), B // self.dp
        x, y = input_ids[r * n:(r + 1) * n], labels[r * n:(r + 1) * n]
        cp = self.plan.mesh.get("cp", 1)
        if cp > 1:
            # the position tables were reordered for sequences of exactly seq_len tokens
            if input_ids.shape[1] != self.plan.seq_len:
                raise ConfigError(f"with context parallelism (cp={cp}) every batch must hold sequences of "
                                  f"exactly the plan's seq_len={self.plan.seq_len} tokens, got "
                                  f"{input_ids.shape[1]}; pad them (labels -100 are skipped by the loss)")
            x, y = (_cp.shard_sequence(t, cp, self._rank("cp"), dim=1) for t in (x, y))
        return x.to(self.device), y.to(self.device)

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """Forward and backward over the global batch (same tensors on every rank); gradients are
        accumulated into the sharded parameters; returns the global mean loss on every rank."""
        x, y = self._local_batch(input_ids, labels)
        n_valid = int((labels != IGNORE_INDEX).sum())
        denom = float(max(n_valid, 1))

        def loss_fn(logits, target):
            return self._summed_loss(logits, target) / denom

        if self.schedule is None:
            local = self._accumulate(x, y, loss_fn)
        else:
            local = self._pipeline_step(x, y, loss_fn)
        self._finalise_grads()
        # one rank per (dp, cp, last stage) contributes, so the world sum is the global sum (CP
        # ranks hold disjoint tokens: each loss is a partial sum)
        contributes = self.holds_last_stage and self._rank("tp") == 0
        t = torch.tensor([local if contributes else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item())

    def _summed_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(logits, target)
        if self.fused_head is not None:     # `logits` is the hidden state: the head runs in the loss
            return self.fused_head.loss(logits, target, ignore_index=IGNORE_INDEX)
        return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")

    def _accumulate(self, x, y, loss_fn) -> float:
        m = self.plan.num_microbatches
        stage = self.stages[0]
        sync_every = self.plan.layout_obj.zero >= 2
        total = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(m), y.chunk(m))):
            last = i == m - 1
            if self.fsdp_units and not sync_every:
                # ZeRO-0/1: accumulate whole gradients locally, reduce-scatter once at the end
                stage.set_requires_gradient_sync(last, recurse=True)
            loss = loss_fn(_pp.logits_of(stage(xm)), ym)
            loss.backward()
            total += float(loss.detach())
        return total

    def _pipeline_step(self, x, y, loss_fn) -> float:
        self._step_loss_fn = loss_fn          # read by the schedule's loss function (see parallelize)
        losses: list[torch.Tensor] = []
        args = (x,) if self.holds_first_stage else ()
        kwargs = {"target": y, "losses": losses} if self.holds_last_stage else {}
        self.schedule.step(*args, **kwargs)
        return float(sum(float(l.detach()) for l in losses))

    def _finalise_grads(self) -> None:
        """Sum partial gradients (weights replicated over TP but used on sequence shards), and the
        gradients of weights tied across pipeline stages (embedding and head: Megatron's
        embedding-group all-reduce)."""
        from torch.distributed.tensor import DTensor
        for p in self.parameters():
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
                # e.g. Partial grads of replicated norm weights used on sequence shards, or of a
                # vocabulary-parallel embedding: reduce into the parameter's own layout
                p.grad = g.redistribute(p.device_mesh, p.placements)
        for names, shape in zip(self.tied, self.tied_shapes):
            if shape is None:
                continue
            held = [p for st in self.stages for n, p in st.named_parameters(remove_duplicate=False) if n in names]
            held = list({id(p): p for p in held}.values())
            local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in held]
            total = sum(local[1:], local[0].clone()) if local else torch.zeros(shape, device=self.device)
            dist.all_reduce(total, group=self.mesh["pp"].get_group())
            for t in local:
                t.copy_(total)

    def clip_grad_norm(self, max_norm: float | None) -> float:
        """Global gradient norm over every shard on every rank; scales gradients to `max_norm`
        (None: measure only). Collective: every rank calls it."""
        grads = [p.grad for n, p in self.named_parameters()
                 if p.grad is not None and self._canonical(n) == n]   # a tied copy counts once
        sq = squared_norm(grads, self.device)
        if self.plan.mesh.get("pp", 1) > 1:
            dist.all_reduce(sq, group=self.mesh["pp"].get_group())
        norm = float(sq.sqrt())
        if max_norm is not None and max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

    def _canonical(self, name: str) -> str:
        for names in self.tied:
            if name in names:
                return names[0]
        return name

    # ---- inspection and checkpoints --------------------------------------------------------
    def _gather_across_stages(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.plan.mesh.get("pp", 1) == 1:
            return local
        parts: list = [None] * self.mesh["pp"].size()
        dist.all_gather_object(parts, local, group=self.mesh["pp"].get_group())
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            out.update(part)
        return out

    @staticmethod
    def _full(t) -> torch.Tensor:
        from torch.distributed.tensor import DTensor
        t = t.full_tensor() if isinstance(t, DTensor) else t
        return t.detach().cpu()

    def full_grads(self) -> dict[str, torch.Tensor]:
        """{original FQN: full gradient} on every rank (collective: all ranks must call)."""
        local = {self._canonical(n): self._full(p.grad) for n, p in self.named_parameters() if p.grad is not None}
        return self._gather_across_stages(local)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{original FQN: full tensor} of parameters and persistent buffers (collective)."""
        local = {}
        for st in self.stages:
            for n, t in st.state_dict().items():
                local[n] = self._full(t)
        return self._gather_across_stages(local)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Sharded state (DTensors / local tensors) keyed by original FQN, for torch.distributed.checkpoint."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        out: dict[str, torch.Tensor] = {}
        for st in self.stages:
            out.update(get_model_state_dict(st))
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        for st in self.stages:
            keys = _state_keys(st)
            missing = [k for k in keys if k not in state]
            if missing:
                raise ConfigError(f"checkpoint has no entry for {missing[:3]}: it was saved from another model")
            set_model_state_dict(st, {k: state[k] for k in keys}, options=StateDictOptions(strict=True))


def squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of `grads` over every shard of this pipeline rank (float64 scalar, the same
    on every rank that calls it). Collective over each mesh the DTensor gradients live on.

    Squares are summed locally per (mesh, sharded dimensions) group and reduced once per group and
    dimension, instead of one collective per parameter (`full_tensor()` on each sum): on gloo a
    collective costs ~1-2 ms, which made clipping ~90 ms a step for a 40-parameter model.
    Replicated dimensions hold the same values everywhere and are not summed over.
    """
    from torch.distributed.tensor import DTensor
    plain = torch.zeros((), dtype=torch.float64, device=device)
    groups: dict[tuple, list] = {}      # (mesh id, sharded dims) -> [mesh, dims, local sum]
    for g in grads:
        if not isinstance(g, DTensor):
            plain += g.float().pow(2).sum().double()
        elif any(pl.is_partial() for pl in g.placements):
            # pending sums (not expected after _finalise_grads): let DTensor reduce them
            plain += g.float().pow(2).sum().full_tensor().double()
        else:
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            entry = groups.setdefault((id(g.device_mesh), dims), [g.device_mesh, dims, plain.new_zeros(())])
            entry[2] += g.to_local().float().pow(2).sum().double()
    for mesh, dims, local in groups.values():
        for d in dims:
            dist.all_reduce(local, group=mesh.get_group(d))
        plain += local
    return plain


def _state_keys(module: nn.Module) -> list[str]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    return list(get_model_state_dict(module).keys())


def parallelize(model: nn.Module, plan, *, compute_dtype: torch.dtype | None | str = "plan",
                overlap: bool = True, loss_fn=None, fused_kernels: bool = True) -> ParallelModel:
    """Apply `plan` to `model` inside an initialised default process group of the plan's size.

    `compute_dtype`: "plan" (default) takes the plan's precision (bf16 parameters and compute,
    fp32 master weights and gradient reduction); `None` or torch.float32 runs everything in the
    model's own dtype (what numerical-equivalence tests use). `loss_fn(logits, labels)` must
    return the SUM over tokens (default: cross entropy ignoring -100); with a `loss_fn` the
    output layer keeps its eager form (the fused linear + cross-entropy computes the default loss).
    `fused_kernels`: swap in the kernels the plan lists (Plan.fused_kernels; False keeps every
    module eager). Which implementation runs is meshplan.kernels.set_backend's choice: Triton
    on GPUs (or under TRITON_INTERPRET=1), the plain-PyTorch reference otherwise.
    """
    if not dist.is_initialized():
        raise ConfigError("parallelize() needs an initialised process group: launch with torchrun "
                          "(meshplan launch) and call torch.distributed.init_process_group first")
    world = dist.get_world_size()
    _check(model, plan, world)
    lay = plan.layout_obj
    device = torch.device("cuda", torch.cuda.current_device()) if (
        torch.cuda.is_available() and dist.get_backend() == "nccl") else torch.device("cpu")
    if compute_dtype == "plan":
        compute_dtype = _DTYPES.get(plan.precision, torch.bfloat16)
    if compute_dtype == torch.float32:
        compute_dtype = None
    signatures = block_signatures(model)
    specs = _pp.stage_specs(plan.stages)
    _pp.check_stage_coverage(model, plan.stages)
    _pp.check_stage_entries(model, specs)
    tied = _tied_parameters(model)
    expert_params = _ep.expert_labelled_params(plan.placements, signatures) if lay.ep > 1 else set()
    if lay.ep > 1:      # refuse unsplittable experts before any collective
        _ep.check_expert_parallel(model, lay.ep, expert_params)
    meshes = _build_mesh(plan, device.type)
    mesh = meshes.root

    pp = plan.mesh["pp"]
    mine = _pp.stages_of_rank(mesh["pp"].get_local_rank(), pp, len(specs), plan.schedule)
    local_specs = [specs[i] for i in mine]
    stages = []
    fused_head, fused_modules = None, []
    for spec in local_specs:
        # 1. pipeline split (the model itself when there is one stage)
        # (a later stage runs the model's forward on token ids of the LOCAL length: seq_len / cp)
        stage = model if len(specs) == 1 else _pp.build_stage_module(
            model, spec, seq_len=plan.seq_len // plan.mesh.get("cp", 1), copy_model=True)
        if next(iter(stage.parameters())).device.type == "meta":
            raise ConfigError("the model is on the meta device: materialise it (to_empty + init) before "
                              "parallelize, or build it on the CPU")
        stage.to(device)
        if fused_kernels and plan.fused_kernels:                                    # 1b. fused kernels
            swapped = apply_fused_kernels(stage, plan.fused_kernels, signatures, fuse_loss=loss_fn is None)
            fused_head = swapped.head or fused_head
            fused_modules += swapped.modules
        stages.append(stage)
    units: list[nn.Module] = []
    use_fsdp = plan.mesh.get("dp", 1) * plan.mesh.get("cp", 1) > 1 or compute_dtype is not None
    for spec, stage in zip(local_specs, stages):
        blocks = _owned_blocks(spec, signatures)
        apply_tensor_parallel(stage, plan.placements, signatures, mesh["tp"])      # 2. TP / SP
        _retie(stage, tied)
        if len(specs) > 1 and mesh["tp"].size() > 1 and sequence_parallel(plan.placements):
            # the sequence-sharded residual stream crosses stages as local shards
            stage.__dict__["_meshplan_wrap_input"] = _sequence_dtensor(mesh["tp"])
        if plan.mesh.get("cp", 1) > 1:                                              # 2b. CP
            # before recompute wraps the blocks, so a block recomputed in backward runs the ring too
            _cp.apply_context_parallel(stage, group=mesh["cp"].get_group(), seq_len=plan.seq_len, blocks=blocks)
        experts = (_ep.apply_expert_parallel(stage, meshes.ep, labelled=expert_params)   # 2c. EP
                   if lay.ep > 1 else [])
        apply_recompute(stage, blocks, plan.recompute)                              # 3. recompute
        if use_fsdp:                                                                # 4. FSDP / ZeRO
            units += _fsdp.apply_fsdp(stage, blocks, meshes.fsdp, zero=lay.zero,
                                      reshard_after_forward=lay.reshard_after_forward,
                                      param_dtype=compute_dtype, overlap=overlap,
                                      experts=experts, expert_mesh=meshes.expert_fsdp)
    pm = ParallelModel(plan=plan, mesh=mesh, stages=stages, specs=local_specs, device=device,
                       fsdp_units=units, loss_fn=loss_fn, tied=tied, fused_head=fused_head,
                       fused_modules=fused_modules, meshes=meshes,
                       tied_shapes=_tied_local_shapes(stages, tied, mesh) if pp > 1 else [None] * len(tied))
    if len(specs) > 1:                                                              # 5. schedule
        from torch.distributed.pipelining import PipelineStage
        group = mesh["pp"].get_group()
        pstages = [PipelineStage(st, spec.index, spec.num_stages, device, group=group)
                   for spec, st in zip(local_specs, stages)]
        pm.schedule = _pp.pipeline_schedule(plan.schedule, pstages, n_microbatches=plan.num_microbatches,
                                            loss_fn=lambda out, target: pm._step_loss_fn(out, target))
    return pm
