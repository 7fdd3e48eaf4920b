"""`parallelize(model, plan) -> ParallelModel`: carry out a Plan on PyTorch's distributed engine.

One fixed order, each step a no-op at degree 1 (DESIGN.md):

    checks -> DeviceMesh -> pipeline split -> fused kernels -> TP/SP -> CP -> EP -> FP8 -> recompute -> FSDP/ZeRO
    -> schedule

EP (expert_parallel.py): routed experts sharded over the EP group (DTensors, Shard(0) over the
"ep" axis), tokens moved by autograd-aware all-to-all; FSDP then shards expert weights over
`edp` and everything else over the whole dp mesh. Gradient norm, full tensors and DCP state
need nothing special: expert gradients are DTensors over (edp, ep), so their sums and
`full_tensor()` cover every expert exactly once.

Data parallelism and precision (issue #17: never slower than the PyTorch a user writes by hand):
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

import contextlib
import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshplan.errors import ConfigError, LayoutError
from meshplan.ir.support import runtime_limits
from meshplan.runtime import context_parallel as _cp
from meshplan.runtime import expert_parallel as _ep
from meshplan.runtime import fp8 as _fp8
from meshplan.runtime import fsdp as _fsdp
from meshplan.runtime import materialize as _mat
from meshplan.runtime import pipeline as _pp
from meshplan.runtime.fused import apply_fused_kernels, choose_kernels
from meshplan.ir.fingerprint import fingerprint
from meshplan.runtime.recompute import apply_recompute
from meshplan.runtime.tensor_parallel import apply_tensor_parallel, enable_async_tp

__all__ = ["parallelize", "ParallelModel", "IGNORE_INDEX"]

IGNORE_INDEX = -100
# "fp8": the plan's fp8_modules run FP8 GEMMs (runtime/fp8.py), every other module bf16
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16, "fp32": None}


def _check(model: nn.Module, plan, world_size: int) -> None:
    """Refuse mismatches before any collective runs (every rank reaches the same verdict)."""
    plan.check_matches(world_size=world_size)
    fp = fingerprint(model)
    if fp != plan.model_fingerprint:
        raise ConfigError(f"this plan was made for model {plan.model!r} (fingerprint {plan.model_fingerprint}) "
                          f"but this model's structure has fingerprint {fp}: the model changed since "
                          "planning (layers, shapes or dtypes); re-plan for this model")
    # the same declaration the planner's search reads (meshplan.ir.support): a plan made by
    # meshplan.plan never trips this; a hand-edited or older plan may
    limits = runtime_limits(plan.layout)
    if limits:
        raise LayoutError("the runtime cannot run this plan: " + "; ".join(limits)
                          + "; re-plan (meshplan.plan never returns such a layout)")


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
    lay = plan.layout
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
    lay = plan.layout
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


def ddp_runs(layout) -> bool:
    """Whether the runtime runs this layout's data parallelism as plain DDP (zero=0): replicated
    fp32 weights, one bucketed all-reduce of the gradients overlapped with backward. DDP keeps
    plain tensors, so it runs without TP, PP, CP and EP; zero=0 with any of those runs through
    FSDP2 as ZeRO-1 (less memory than planned, never more). The planner offers zero=0 only here."""
    return layout.zero == 0 and layout.dp > 1 and layout.tp == 1 and layout.pp == 1 and layout.cp == 1 \
        and layout.ep == 1


def _data_parallel_mode(plan) -> str:
    """"ddp", "fsdp" or "none" (one data-parallel rank: no wrapper at all, not FSDP over a one-rank
    mesh, whose hooks, copies and sharded optimizer cost ~30 ms a step on CPU for nothing)."""
    lay = plan.layout
    if plan.mesh.get("dp", 1) * plan.mesh.get("cp", 1) == 1:
        return "none"
    return "ddp" if ddp_runs(lay) else "fsdp"


def _sum_allreduce_hook(group, bucket):
    """DDP communication hook: SUM the bucket over the group (DDP's default averages; the loss is
    already divided by the global token count, so the sum is the global-batch mean gradient)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _wrap_ddp(stage: nn.Module, group, device: torch.device) -> nn.Module:
    import warnings

    from torch.nn.parallel import DistributedDataParallel
    with warnings.catch_warnings():     # broadcast_buffers=False: buffers are derived (rope tables), never synced
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(stage, process_group=group, broadcast_buffers=False,
                                      gradient_as_bucket_view=True,
                                      device_ids=[device.index] if device.type == "cuda" else None)
    ddp.register_comm_hook(group, _sum_allreduce_hook)
    return ddp


def _autocast_forward(stage: nn.Module, dtype: torch.dtype, device_type: str) -> None:
    """Mixed precision without FSDP: the stage's forward runs under autocast (bf16 matmuls, fp32
    master weights, gradients and reductions), as a user writes it by hand. Only the forward:
    backward ops follow the dtypes autocast chose for their forward ops."""
    import functools
    inner = stage.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return inner(*args, **kwargs)
    stage.forward = forward


def _owned_blocks(spec: _pp.StageSpec, blocks: tuple[str, ...]) -> list[str]:
    return [m for m in spec.owned if m in blocks]


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
    kernels: dict[str, str] = field(default_factory=dict)    # plan's fused kernel -> what runs here and why
    data_parallel: str = "none"             # "fsdp" | "ddp" | "none" (see _data_parallel_mode)
    ddp: list = field(default_factory=list)  # DistributedDataParallel wrappers of `stages` (data_parallel "ddp")
    autocast_dtype: torch.dtype | None = None   # mixed precision by autocast where FSDP does not cast
    async_tp: bool = False                  # TP collectives overlapped with matmuls (tp_comm_overlap, CUDA)
    _step_loss_fn: object = None            # this step's normalised loss (the global token count changes)
    tied: list[tuple[str, ...]] = field(default_factory=list)       # tied parameter names, canonical first
    tied_shapes: list = field(default_factory=list)                 # per tied set: local grad shape if it spans stages
    meshes: Meshes | None = None
    fp8: object = None                      # fp8.Fp8Swap: FP8 modules here and the backend running them
    precisions: dict[str, str] = field(default_factory=dict)    # module FQN -> precision it computes in

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

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step: the plan's, or fewer while a batch-size ramp-up runs (train.py
        sets `microbatches_override`; the layout, hence the micro-batch size, never changes)."""
        return getattr(self, "microbatches_override", None) or self.plan.num_microbatches

    def _local_batch(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B = input_ids.shape[0]
        m = self.num_microbatches
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
        if dist.get_world_size() == 1:
            return local
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
        m = self.num_microbatches
        stage = self.stages[0]
        forward = self.ddp[0] if self.ddp else stage
        zero = self.plan.layout.zero
        total = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(m), y.chunk(m))) if m > 1 else enumerate([(x, y)]):
            last = i == m - 1
            if self.fsdp_units and zero < 3 and m > 1:
                # ZeRO-1/2 keep the gathered weights from the first micro-batch's forward to the last
                # one's backward: one all-gather per step, as the cost model prices it
                stage.set_reshard_after_backward(last, recurse=True)
                if zero < 2:
                    # ZeRO-0/1: accumulate whole gradients locally, reduce-scatter once at the end
                    stage.set_requires_gradient_sync(last, recurse=True)
            sync = self.ddp[0].no_sync() if self.ddp and not last else contextlib.nullcontext()
            with sync:
                loss = loss_fn(_pp.logits_of(forward(xm)), ym)
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
                overlap: bool = True, loss_fn=None, fused_kernels: bool | str = "auto", fp8: bool = True,
                fp8_backend: str = "auto", fp8_recipe: str = "tensorwise",
                materialize: bool = True) -> ParallelModel:
    """Apply `plan` to `model` inside an initialised default process group of the plan's size.

    `compute_dtype`: "plan" (default) takes the plan's precision (bf16 parameters and compute,
    fp32 master weights and gradient reduction); `None` or torch.float32 runs everything in the
    model's own dtype (what numerical-equivalence tests use). `loss_fn(logits, labels)` must
    return the SUM over tokens (default: cross entropy ignoring -100); with a `loss_fn` the
    output layer keeps its eager form (the fused linear + cross-entropy computes the default loss).
    `fused_kernels`: "auto" (default) swaps in the kernels the plan lists (Plan.fused_kernels)
    that are faster than eager with this device's backend (fused.FASTER_THAN_EAGER: Triton on
    CUDA; on CPU none - the reference fallbacks are slower); True swaps every listed kernel
    (correctness tests), False none. `ParallelModel.kernels` records what runs and why. Which
    implementation runs is meshplan.kernels.set_backend's choice: Triton on GPUs (or under
    TRITON_INTERPRET=1), the plain-PyTorch reference otherwise.
    Data parallelism (`ParallelModel.data_parallel`): FSDP2 for zero 1-3, DDP for zero=0 (where
    `ddp_runs`), nothing for one data-parallel rank; mixed precision then comes from autocast.
    `fp8`: for an FP8 plan, swap exactly Plan.fp8_modules for FP8 linears (runtime/fp8.py) with
    `fp8_backend` ("auto": Transformer Engine on CUDA when installed, else torchao; "torchao", "te")
    and `fp8_recipe` ("tensorwise", "rowwise", "delayed"); False is the explicit override that runs
    the plan in `compute_dtype` instead. A missing backend fails here, before any collective.
    """
    if not dist.is_initialized():
        raise ConfigError("parallelize() needs an initialised process group: launch with torchrun "
                          "(meshplan launch) and call torch.distributed.init_process_group first")
    world = dist.get_world_size()
    _check(model, plan, world)
    lay = plan.layout
    device = torch.device("cuda", torch.cuda.current_device()) if (
        torch.cuda.is_available() and dist.get_backend() == "nccl") else torch.device("cpu")
    if compute_dtype == "plan":
        compute_dtype = _DTYPES.get(plan.precision, torch.bfloat16)
    if compute_dtype == torch.float32:
        compute_dtype = None
    run_fp8 = fp8 and plan.precision == "fp8" and bool(plan.fp8_modules)
    if run_fp8:     # a missing package fails before any collective, naming what to install
        _fp8.resolve_backend(fp8_backend, device)
    specs = _pp.stage_specs(plan.stages)
    _pp.check_stage_coverage(model, plan.stages)
    _pp.check_stage_entries(model, specs)
    tied = _tied_parameters(model)
    expert_params = _ep.expert_labelled_params(plan.placements) if lay.ep > 1 else set()
    if lay.ep > 1:      # refuse unsplittable experts before any collective
        _ep.check_expert_parallel(model, lay.ep, expert_params)
    meshes = _build_mesh(plan, device.type)
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
            swapped = apply_fused_kernels(stage, run_kernels, fuse_loss=loss_fn is None)
            fused_head = swapped.head or fused_head
            fused_modules += swapped.modules
        stages.append(stage)
    units: list[nn.Module] = []
    dp_mode = _data_parallel_mode(plan)     # FSDP2 / DDP / none (autocast gives mixed precision)
    use_fsdp = dp_mode == "fsdp"
    ddps: list[nn.Module] = []
    async_tp = False
    swaps: list = []
    for spec, stage in zip(local_specs, stages):
        blocks = _owned_blocks(spec, plan.blocks)
        apply_tensor_parallel(stage, plan, mesh["tp"])                              # 2. TP / SP
        _retie(stage, tied)
        if len(specs) > 1 and mesh["tp"].size() > 1 and plan.sequence_parallel:
            # the sequence-sharded residual stream crosses stages as local shards
            stage.__dict__["_meshplan_wrap_input"] = _sequence_dtensor(mesh["tp"])
        if plan.mesh.get("cp", 1) > 1:                                              # 2b. CP
            # before recompute wraps the blocks, so a block recomputed in backward runs the ring too
            _cp.apply_context_parallel(stage, group=mesh["cp"].get_group(), seq_len=plan.seq_len, blocks=blocks)
        experts = (_ep.apply_expert_parallel(stage, meshes.ep, labelled=expert_params)   # 2c. EP
                   if lay.ep > 1 else [])
        if run_fp8:                                                                 # 2d. FP8
            swaps.append(_fp8.apply_fp8(stage, plan.fp8_modules, backend=fp8_backend, recipe=fp8_recipe,
                                        device=device, tp=lay.tp,
                                        fsdp_float8_all_gather=use_fsdp and lay.zero == 3))
        apply_recompute(stage, blocks, plan.recompute)                              # 3. recompute
        if lay.tp_comm_overlap:                                                     # 3b. async TP
            async_tp = enable_async_tp(stage, blocks, mesh["tp"]) or async_tp
        if use_fsdp:                                                                # 4. FSDP / ZeRO
            units += _fsdp.apply_fsdp(stage, blocks, meshes.fsdp, zero=lay.zero,
                                      reshard_after_forward=lay.reshard_after_forward,
                                      param_dtype=compute_dtype, overlap=overlap,
                                      experts=experts, expert_mesh=meshes.expert_fsdp,
                                      one_unit_below_zero3=device.type == "cpu")
        elif compute_dtype is not None:
            _autocast_forward(stage, compute_dtype, device.type)
            if fused_head is not None:
                fused_head.compute_dtype = compute_dtype
        if deferred and materialize:                                                # 4b. materialise
            # materialize=False leaves a meta model sharded but unallocated: the fake-world
            # contract tests count each rank's shards against the cost model without memory
            _mat.materialize([stage], reference, device, rng_state=rng_start)
        if dp_mode == "ddp" and (materialize or not deferred):     # DDP checks real tensors
            ddps.append(_wrap_ddp(stage, meshes.fsdp.get_group(), device))
    pm = ParallelModel(plan=plan, mesh=mesh, stages=stages, specs=local_specs, device=device,
                       fsdp_units=units, loss_fn=loss_fn, tied=tied, fused_head=fused_head,
                       fused_modules=fused_modules, meshes=meshes, kernels=kernels, data_parallel=dp_mode,
                       ddp=ddps, autocast_dtype=None if use_fsdp else compute_dtype, async_tp=async_tp,
                       tied_shapes=_tied_local_shapes(stages, tied, mesh) if pp > 1 else [None] * len(tied))
    pm.fp8 = _fp8.merge(swaps)
    pm.precisions = _fp8.module_precisions(stages, compute_dtype, pm.fp8)
    _fp8.log_precisions(pm.precisions, plan)
    if len(specs) > 1:                                                              # 5. schedule
        from torch.distributed.pipelining import PipelineStage
        group = mesh["pp"].get_group()
        pstages = [PipelineStage(st, spec.index, spec.num_stages, device, group=group)
                   for spec, st in zip(local_specs, stages)]
        pm.schedule = _pp.pipeline_schedule(plan.schedule, pstages, n_microbatches=plan.num_microbatches,
                                            loss_fn=lambda out, target: pm._step_loss_fn(out, target))
    return pm
