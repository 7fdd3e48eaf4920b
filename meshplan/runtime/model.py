"""`ParallelModel`: a model parallelised by a Plan (built by `meshplan.runtime.parallel.parallelize`).

It runs one training step's forward and backward over this rank's stages (gradient accumulation
over micro-batches, or the pipeline schedule), finalises gradients, clips by the global norm,
and gathers / loads full state dicts. Loss convention: see meshplan.runtime.parallel.
"""

from __future__ import annotations

import contextlib
from dataclasses import InitVar, dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from meshplan.errors import ConfigError
from meshplan.models.mtp import split_logits
from meshplan.runtime import context_parallel as _cp
from meshplan.runtime import pipeline as _pp
from meshplan.runtime.loss_parallel import VocabShard, vocab_parallel_cross_entropy
from meshplan.runtime.dims import ParallelDims
from meshplan.runtime.mesh import Meshes
from meshplan.runtime.packed_projections import from_tp_order, tp_order_params
from meshplan.runtime.moe_folding import reduce_expert_grads
from meshplan.runtime.mtp_parallel import split_targets, stacked_targets

__all__ = ["ParallelModel", "squared_norm", "IGNORE_INDEX"]

IGNORE_INDEX = -100


@dataclass
class ParallelModel:
    """A model parallelised by a Plan. Built by `parallelize`; see the module docstring."""

    plan: object
    dims: ParallelDims                      # degrees and DeviceMeshes (runtime/dims.py)
    stages: list[nn.Module]                 # this rank's stage modules (the model itself when pp == 1)
    specs: list[_pp.StageSpec]
    device: torch.device
    fsdp_units: list[nn.Module] = field(default_factory=list)
    loss_fn: object = None                  # (whole logits, labels) -> summed loss; default: cross entropy
    fused_head: object = None               # fused.FusedHead when the loss runs fused with the output layer
    vocab_shard: VocabShard | None = None   # this rank's vocab slice: the default loss runs vocab-parallel
    fused_modules: list[str] = field(default_factory=list)   # modules running meshplan's fused kernels here
    lean_modules: list[str] = field(default_factory=list)    # norms / SwiGLU on input-saving Functions (fused.py)
    kernels: dict[str, str] = field(default_factory=dict)    # plan's fused kernel -> what runs here and why
    data_parallel: str = "none"             # "fsdp" | "ddp" | "none" (see ddp.data_parallel_mode)
    ddp: list = field(default_factory=list)  # DistributedDataParallel wrappers of `stages` (data_parallel "ddp")
    autocast_dtype: torch.dtype | None = None   # mixed precision by autocast where FSDP does not cast
    async_tp: bool = False                  # TP collectives overlapped with matmuls (tp_comm_overlap, CUDA)
    compiled: list[str] = field(default_factory=list)   # blocks running torch.compile'd (runtime/compile.py)
    offload: list = field(default_factory=list)         # per local stage: offload.Offloader (bytes moved to host)
    tied: list[tuple[str, ...]] = field(default_factory=list)       # tied parameter names, canonical first
    tied_shapes: list = field(default_factory=list)                 # per tied set: local grad shape if it spans stages
    fp8: object = None                      # fp8.Fp8Swap: FP8 modules here and the backend running them
    precisions: dict[str, str] = field(default_factory=dict)    # module FQN -> precision it computes in
    expert_modules: list = field(default_factory=list)   # per local stage: its (folded) experts modules
    fp32_grads: list[str] = field(default_factory=list)   # modules whose gradients reduce in fp32 (fp32_grads.py)
    pipeline_stages: InitVar[list | None] = None    # torch PipelineStages of `stages` (pp > 1): the schedules' own
    # ---- step state, set through set_loss_scale / set_microbatches -------------------------------
    loss_scale: float = 1.0                 # fp16: backward runs on loss x loss_scale (train/loss_scale.py);
                                            #   the returned loss is unscaled, the gradients are not
    microbatches_override: int | None = None    # a batch-size schedule's count this step (None: the plan's)
    schedules: object | None = field(default=None, init=False)    # pipeline.ScheduleCache: one per count
    _step_loss_fn: object = field(default=None, init=False, repr=False)     # this step's normalised loss

    def __post_init__(self, pipeline_stages) -> None:
        if pipeline_stages:
            # one schedule per micro-batch count: a batch-size schedule changes the count between
            # steps; the schedules' loss is this step's normalised loss (the token count changes)
            # built on first use: torch builds a multi-stage schedule's whole action list (quadratic in
            # the steps for the zero-bubble ones), which a rank that is inspected but not run never needs
            _pp.check_schedule_name(self.plan.schedule, len(pipeline_stages))
            self.schedules = _pp.ScheduleCache(self.plan.schedule, pipeline_stages,
                                               loss_fn=lambda out, target: self._step_loss_fn(out, target))

    @property
    def schedule(self):
        """The pipeline schedule at the plan's micro-batch count (None without pipeline parallelism)."""
        return None if self.schedules is None else self.schedules.get(self.plan.num_microbatches)

    @property
    def mesh(self):
        """The root DeviceMesh (named axes pp, dp | dp_replicate+dp_shard, cp, tp)."""
        return self.dims.root

    @property
    def meshes(self) -> Meshes | None:
        return self.dims.meshes

    def set_loss_scale(self, scale: float) -> None:
        """fp16 loss scaling: the next steps' backward runs on loss x `scale`."""
        self.loss_scale = float(scale)

    def set_microbatches(self, count: int | None) -> None:
        """Micro-batches of the next steps (a batch-size schedule or ramp-up); None: the plan's."""
        self.microbatches_override = None if count in (None, self.plan.num_microbatches) else int(count)

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
        """Micro-batches per step: the plan's, or fewer while a batch-size schedule or ramp-up runs
        (the training loop sets `microbatches_override`; the layout, hence the micro-batch size,
        never changes; under PP `schedules` holds a pipeline schedule per count)."""
        return self.microbatches_override or self.plan.num_microbatches

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
        if self.mtp[0]:
            # each depth's targets shifted while the sequence is whole (before any CP split)
            y = stacked_targets(y, self.mtp[0])
        cp = self.plan.mesh.get("cp", 1)
        if cp > 1:
            # the position tables were reordered for sequences of exactly seq_len tokens
            if input_ids.shape[1] != self.plan.seq_len:
                raise ConfigError(f"with context parallelism (cp={cp}) every batch must hold sequences of "
                                  f"exactly the plan's seq_len={self.plan.seq_len} tokens, got "
                                  f"{input_ids.shape[1]}; pad them (labels -100 are skipped by the loss)")
            x = _cp.shard_sequence(x, cp, self._rank("cp"), dim=1)
            y = torch.cat([_cp.shard_sequence(t, cp, self._rank("cp"), dim=1)
                           for t in split_targets(y, self.mtp[0])], dim=1)
        return x.to(self.device), y.to(self.device)

    def _local_documents(self, document_ids: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
        """This rank's rows of the batch's document ids (packed documents; see Transformer.forward)."""
        if document_ids is None:
            return None
        if document_ids.shape != input_ids.shape:
            raise ConfigError(f"document_ids {tuple(document_ids.shape)} must have the shape of input_ids "
                              f"{tuple(input_ids.shape)}")
        cp = self.plan.mesh.get("cp", 1)
        if cp > 1:
            raise ConfigError(f"document masking is not supported with context parallelism (cp={cp}): the ring "
                              "attention computes plain causal attention over the whole sequence; train "
                              "without --document-mask, or re-plan with fixed={'cp': 1}")
        n = input_ids.shape[0] // self.dp
        r = self._rank("dp")
        return document_ids[r * n:(r + 1) * n].to(self.device)

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor,
                 document_ids: torch.Tensor | None = None) -> float:
        """The global mean loss of a batch (same tensors on every rank): forward only, without
        gradients, under the same layout and micro-batches as training (collective)."""
        x, y = self._local_batch(input_ids, labels)
        d = self._local_documents(document_ids, input_ids)
        denoms = self._denominators(labels, 1.0)

        def loss_fn(logits, target):
            return self._objective(logits, target, denoms)

        if self.schedules is None:
            m = self.num_microbatches
            xs, ys = (x.chunk(m), y.chunk(m)) if m > 1 else ((x,), (y,))
            ds = d.chunk(m) if d is not None and m > 1 else (d,) * len(xs)
            local = 0.0
            for xm, ym, dm in zip(xs, ys, ds):
                out = self.stages[0](xm) if dm is None else self.stages[0](xm, document_ids=dm)
                local += float(loss_fn(_pp.logits_of(out), ym))
        else:
            self._step_loss_fn = loss_fn
            losses: list[torch.Tensor] = []
            args = (x,) if self.holds_first_stage else ()
            kwargs = {"target": y, "losses": losses} if self.holds_last_stage else {}
            if d is not None:
                kwargs["document_ids"] = d
            schedule = self.schedules.for_step(self.num_microbatches)
            schedule.eval(*args, **kwargs)
            local = float(sum(float(l) for l in losses))
        return self._global_loss(local)

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                         document_ids: torch.Tensor | None = None) -> float:
        """Forward and backward over the global batch (same tensors on every rank); gradients are
        accumulated into the sharded parameters; returns the global mean loss on every rank.
        `document_ids` (B, T): packed documents, attention kept inside each (models that take it)."""
        x, y = self._local_batch(input_ids, labels)
        d = self._local_documents(document_ids, input_ids)
        # a power-of-two loss scale divides exactly: the unscaled loss is the same number
        denoms = self._denominators(labels, self.loss_scale)

        def loss_fn(logits, target):
            return self._objective(logits, target, denoms)

        if self.schedules is None:
            local = self._accumulate(x, y, loss_fn, d)
        else:
            local = self._pipeline_step(x, y, loss_fn, d)
        self._finalise_grads()
        local /= self.loss_scale
        return self._global_loss(local)

    def _global_loss(self, local: float) -> float:
        """The global loss from each rank's share: one rank per (dp, cp, last stage) contributes,
        so the world sum is the global sum (CP ranks hold disjoint tokens: each loss is a partial sum)."""
        if dist.get_world_size() == 1:
            return local
        contributes = self.holds_last_stage and self._rank("tp") == 0
        t = torch.tensor([local if contributes else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item())

    @property
    def mtp(self) -> tuple[int, float]:
        """(depths, loss weight) of the model's multi-token prediction (meshplan.models.mtp);
        (0, 0.0) without it."""
        cfg = getattr(self.stages[0], "config", None) if self.stages else None
        depth = getattr(cfg, "mtp_depth", 0)
        if not isinstance(depth, int) or depth <= 0:
            return 0, 0.0
        return depth, float(cfg.mtp_loss_weight)

    def _denominators(self, labels: torch.Tensor, loss_scale: float) -> list[float]:
        """The global counts each loss term is averaged over (divided by the loss scale): the main
        loss's labels != -100, then each MTP depth's (its targets are the labels shifted by k)."""
        counts = [int((labels != IGNORE_INDEX).sum())]
        counts += [int((labels[:, k:] != IGNORE_INDEX).sum()) for k in range(1, self.mtp[0] + 1)]
        return [float(max(c, 1)) / loss_scale for c in counts]

    def _objective(self, logits: torch.Tensor, target: torch.Tensor, denoms: list[float]) -> torch.Tensor:
        """This micro-batch's share of the global training loss: its summed cross entropy over the
        global label count; with multi-token prediction (training-mode logits), plus the loss
        weight over the depths times each depth's summed cross entropy over its own global count,
        so the step's loss is the single-device objective (models.mtp.mtp_causal_lm_loss) of the
        global batch. Every depth's loss runs through the same path as the main one
        (`_summed_loss`: fused head, vocabulary-parallel, or the user's loss_fn). With MTP `target`
        is `_local_batch`'s stacked targets: the labels, then each depth's (mtp_parallel.py)."""
        depth, weight = self.mtp
        if not depth:
            return self._summed_loss(logits, target) / denoms[0]
        targets = split_targets(target, depth)
        parts = split_logits(logits, depth, targets[0].shape[-1])
        loss = self._summed_loss(parts[0], targets[0]) / denoms[0]
        for k, z in enumerate(parts[1:], 1):
            loss = loss + weight / depth * (self._summed_loss(z, targets[k]) / denoms[k])
        return loss

    def _summed_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """This micro-batch's summed loss. A user's `loss_fn` gets whole logits (under TP the
        output layer gathers them); the default cross entropy runs fused with the output layer
        (`fused_head`, tp = 1), or on this rank's vocabulary slice of the logits under TP
        (`vocab_shard`: they were never gathered), or on whole logits."""
        if self.loss_fn is not None:
            return self.loss_fn(logits, target)
        if self.fused_head is not None:     # `logits` is the hidden state: the head runs in the loss
            return self.fused_head.loss(logits, target, ignore_index=IGNORE_INDEX)
        if self.vocab_shard is not None:
            return vocab_parallel_cross_entropy(logits, target, self.vocab_shard, ignore_index=IGNORE_INDEX)
        return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")

    def _accumulate(self, x, y, loss_fn, d=None) -> float:
        m = self.num_microbatches
        stage = self.stages[0]
        forward = self.ddp[0] if self.ddp else stage
        zero = self.plan.layout.zero
        total = 0.0
        ds = d.chunk(m) if d is not None and m > 1 else [d] * m
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
                out = forward(xm) if ds[i] is None else forward(xm, document_ids=ds[i])
                loss = loss_fn(_pp.logits_of(out), ym)
                aux = self._router_aux_loss(out, stage)
                if aux is not None:
                    loss = loss + aux
                loss.backward()
            total += float(loss.detach())
        return total

    def _router_aux_loss(self, out, stage: nn.Module) -> torch.Tensor | None:
        """transformers MoE models (Mixtral, Qwen2-MoE, ...) return their load-balancing loss as
        `aux_loss` when config.output_router_logits is set, and add router_aux_loss_coef times it to
        the loss only when called with labels, which the runtime does not pass (it computes the
        loss from the logits). Added here as each micro-batch's and data rank's share: the step's
        loss is then the mean of the model's own (loss + coef x aux) over the global batch.
        Its routing statistics are the micro-batch's own tokens (transformers' per-call loss), so
        only layouts that keep a micro-batch's tokens and layers whole on one rank apply it (no tp,
        cp or pp split); elsewhere `router_aux_loss_note` warns that the run goes without it."""
        aux = getattr(out, "aux_loss", None)
        if aux is None or not isinstance(aux, torch.Tensor):
            return None
        coef = float(getattr(getattr(stage, "config", None), "router_aux_loss_coef", 0.0) or 0.0)
        if not coef:
            return None
        L = self.plan.layout
        if _splits_microbatches(L):
            return None
        return coef * aux.float() / (self.num_microbatches * L.dp * L.cp) * self.loss_scale

    def _pipeline_step(self, x, y, loss_fn, d=None) -> float:
        self._step_loss_fn = loss_fn          # read by the schedule's loss function (see parallelize)
        losses: list[torch.Tensor] = []
        args = (x,) if self.holds_first_stage else ()
        kwargs = {"target": y, "losses": losses} if self.holds_last_stage else {}
        if d is not None:
            kwargs["document_ids"] = d          # every stage's blocks need it: passed on every rank
        schedule = self.schedules.for_step(self.num_microbatches) if self.schedules is not None else self.schedule
        schedule.step(*args, **kwargs)
        return float(sum(float(l.detach()) for l in losses))

    def _finalise_grads(self) -> None:
        """Sum partial gradients (weights replicated over TP but used on sequence shards), and the
        gradients of weights tied across pipeline stages (embedding and head: Megatron's
        embedding-group all-reduce)."""
        from torch.distributed.tensor import DTensor
        if self.data_parallel != "fsdp" and self.meshes is not None and self.meshes.folded:
            # no FSDP reduces the folded experts' gradients over edp (TP ranks saw other tokens)
            reduce_expert_grads(self.stages, self.expert_modules, self.meshes.expert_fsdp)
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
        norm = self.global_norm("grads")
        if max_norm is not None and max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

    def global_norm(self, of: str = "grads") -> float:
        """L2 norm of every parameter's gradient (`of="grads"`) or of the parameters themselves
        (`of="params"`) over every shard on every rank, as the single-device model's; a tied copy
        counts once. Collective: every rank calls it."""
        if of not in ("grads", "params"):
            raise ConfigError(f"global_norm of {of!r}: use 'grads' or 'params'")
        with torch.no_grad():
            tensors = [p.grad if of == "grads" else p.detach() for n, p in self.named_parameters()
                       if (of == "params" or p.grad is not None) and self._canonical(n) == n]
            sq = squared_norm(tensors, self.device)
            if self.plan.mesh.get("pp", 1) > 1:
                dist.all_reduce(sq, group=self.mesh["pp"].get_group())
        return float(sq.sqrt())

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

    def tp_orders(self) -> dict[str, tuple]:
        """{original FQN: (parts, tp, dim)} of this rank's parameters kept in TP order (packed
        projections, runtime/packed_projections.py): their gradients and optimizer state are too."""
        return {self._canonical(n): spec for st in self.stages for n, spec in tp_order_params(st).items()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """{original FQN: full gradient} on every rank (collective: all ranks must call), rows in the
        model's own order (packed projections are kept in TP order: runtime/packed_projections.py)."""
        orders = self.tp_orders()
        local = {}
        for n, p in self.named_parameters():
            if p.grad is None:
                continue
            name = self._canonical(n)
            g = self._full(p.grad)
            local[name] = from_tp_order(g, *orders[name]) if name in orders else g
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
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )
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
    world = []                          # sums whose sharded dimensions together span every rank
    for mesh, dims, local in groups.values():
        if _spans_world(mesh, dims):
            world.append(local)
            continue
        for d in dims:
            dist.all_reduce(local, group=mesh.get_group(d))
        plain += local
    if world:
        # one all-reduce for all of them (EP x DP: the experts' dp x ep shards and the dense dp
        # shards, 5 collectives before, each a blocking wait on every rank)
        both = torch.stack(world)
        dist.all_reduce(both)
        plain += both.sum()
    return plain


def _spans_world(mesh, dims: tuple[int, ...]) -> bool:
    """Whether reducing over `dims` of `mesh` reaches every rank of the world: this rank's slice of
    the mesh along them holds all the ranks (the same answer on every rank of a pp = 1 run; under
    PP each stage's meshes leave the other stages out)."""
    if not dims or not dist.is_initialized():
        return False
    coord = mesh.get_coordinate()
    if coord is None:
        return False
    index = tuple(slice(None) if i in dims else c for i, c in enumerate(coord))
    return mesh.mesh[index].numel() == dist.get_world_size()


def _state_keys(module: nn.Module) -> list[str]:
    return list(get_model_state_dict(module).keys())


def router_aux_loss_note(model: nn.Module, layout) -> str | None:
    """Why a transformers MoE model's own load-balancing loss will not be trained under `layout`
    (see ParallelModel._router_aux_loss), or None."""
    cfg = getattr(model, "config", None)
    if not (getattr(cfg, "output_router_logits", False) and getattr(cfg, "router_aux_loss_coef", 0.0)):
        return None
    split = _splits_microbatches(layout)
    if not split:
        return None
    return (f"the model's router load-balancing loss (output_router_logits=True, router_aux_loss_coef="
            f"{cfg.router_aux_loss_coef}) is added only when tp, cp and pp are 1; this plan has "
            f"{', '.join(split)}, so it trains without it (fix tp/cp/pp to 1 to keep it)")


def _splits_microbatches(layout) -> list[str]:
    """The degrees of `layout` that split a micro-batch's tokens or layers over ranks ("tp=2", ...)."""
    return [f"{k}={getattr(layout, k)}" for k in ("tp", "cp", "pp") if getattr(layout, k) > 1]
