"""Pipeline split: turn the user's single-device model into the pipeline stages a Plan names.

The Plan lists, per virtual stage, the FQNs of the modules that stage owns (embedding, blocks,
final norm, head). A stage is a copy of the user's model in which every module owned by ANOTHER
stage is replaced by a parameter-free stub, and whose `forward` is rebound so that

- the first stage takes `input_ids` and runs the model up to its last block;
- a later stage takes the hidden states received from the previous stage and injects them as
  the input of its first owned block (a forward pre-hook), while the stubbed embedding in front
  produces zeros of the right shape that are then discarded;
- every stage returns what the model's forward returns with the stubs in place: stubbed blocks,
  norm and head pass their first argument through, so a non-last stage returns its last
  block's output and the last stage returns the logits.

Multi-token prediction (meshplan.models.mtp) runs on the last stage but reads the embeddings of
the input tokens shifted by 1..D, which only the first stage can look up: the first stage
returns them after its hidden state, every later stage receives them and hands them on, and on
the last one they replace the stubbed embedding's output where the model looks them up. Their
gradients flow back the same way to the first stage's embedding (no second copy of it).

This keeps the user's forward (position ids, masks, rotary tables computed on the fly, HF output
objects) untouched and the module types intact, so TP and FSDP apply to a stage exactly as to
the whole model, and parameter FQNs stay the original ones (checkpoints and `full_state_dict`
need no renaming). The model must be "embedding -> blocks -> head" in execution order, which is
what the planner's stage lists describe; anything else is refused with the module named.

Which virtual stage runs where: stage s runs on pipeline rank s % pp, except for the zero-bubble
V schedule (`zbv`), whose two chunks per rank run in a V: rank r holds stages r and 2*pp-1-r.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass

import torch
from torch import nn

from meshplan.errors import LayoutError

__all__ = ["StageSpec", "stage_specs", "build_stage_module", "stages_of_rank", "logits_of",
           "pipeline_schedule", "check_schedule_name", "ScheduleCache", "pipeline_stage"]


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    index: int                    # virtual stage index (model order)
    num_stages: int
    owned: tuple[str, ...]        # module FQNs this stage runs
    foreign: tuple[str, ...]      # module FQNs other stages run (stubbed here)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def stages_of_rank(pp_rank: int, pp: int, num_stages: int, schedule: str) -> list[int]:
    """Virtual stage indices held by one pipeline rank, in ascending order."""
    if schedule == "zbv":
        return sorted({pp_rank, 2 * pp - 1 - pp_rank})
    return [s for s in range(num_stages) if s % pp == pp_rank]


def stage_specs(stages: tuple[tuple[str, ...], ...]) -> list[StageSpec]:
    every = [m for s in stages for m in s]
    if len(set(every)) != len(every):
        dup = sorted({m for m in every if every.count(m) > 1})
        raise LayoutError(f"the plan puts modules {dup} in more than one pipeline stage; re-plan")
    return [StageSpec(index=i, num_stages=len(stages), owned=tuple(s),
                      foreign=tuple(m for m in every if m not in s)) for i, s in enumerate(stages)]


def check_stage_entries(model: nn.Module, specs) -> None:
    """Every stage after the first must start with a block (it receives the hidden state there).
    Checked on every rank for every stage before any collective: a rank that found this out only
    while building its own stage would leave the others waiting in the next collective."""
    for spec in specs:
        if not spec.is_first and not any(_is_block_fqn(model, m) for m in spec.owned):
            raise LayoutError(f"pipeline stage {spec.index} owns no block ({list(spec.owned)}); every "
                              "stage after the first must start with a block; re-plan with fewer "
                              "pipeline stages (pp x vp at most the number of layers)")


def check_stage_coverage(model: nn.Module, stages: tuple[tuple[str, ...], ...]) -> None:
    """Every parameter must belong to exactly one stage's modules (else it would be lost or doubled)."""
    listed = [m for s in stages for m in s]
    names = dict(model.named_modules())
    missing_mod = [m for m in listed if m not in names]
    if missing_mod:
        raise LayoutError(f"the plan's pipeline stages name modules {missing_mod[:5]} that this model "
                          "does not have; was the plan made for another model? re-plan")
    for pname, _ in model.named_parameters():
        if not any(pname.startswith(m + ".") for m in listed):
            raise LayoutError(f"parameter {pname!r} belongs to no pipeline stage of the plan; the "
                              "planner could not place it (is it used outside the embedding -> blocks "
                              "-> head chain?); re-plan, or run with pp=1")


# ---- stubs ----------------------------------------------------------------------------------
class _ZeroEmbedding(nn.Module):
    """Stands in for an embedding owned by an earlier stage: zeros of the embedding's shape."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.dim, dtype=self.dtype, device=ids.device)


class _NoDepths(nn.Module):
    """Stands in for the multi-token-prediction modules another stage owns: no extra depths."""

    def forward(self, *args, **kwargs) -> list:
        return []


class _PassThrough(nn.Module):
    """Stands in for a block / norm / head another stage owns: returns its input unchanged."""

    def forward(self, *args, **kwargs):
        if args:
            return args[0]
        if "hidden_states" in kwargs:
            return kwargs["hidden_states"]
        return next(iter(kwargs.values()))


def _replace(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, leaf = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new) if not isinstance(parent, (nn.ModuleList, nn.Sequential)) \
        else parent.__setitem__(int(leaf), new)


def logits_of(out) -> torch.Tensor:
    """The tensor a language model's forward returns: a tensor, an HF output's logits, or a tuple's first."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise LayoutError(f"the model's forward returned {type(out).__name__}; meshplan needs the logits "
                      "(a tensor, an object with .logits, or a tuple starting with them)")


def build_stage_module(model: nn.Module, spec: StageSpec, *, seq_len: int, copy_model: bool) -> nn.Module:
    """The stage's module: a (deep) copy of `model` with foreign modules stubbed and forward rebound."""
    stage = copy.deepcopy(model) if copy_model else model
    first_block = next((m for m in spec.owned if _is_block_fqn(stage, m)), None)
    depth = _mtp_depth(stage)
    for fqn in spec.foreign:
        old = stage.get_submodule(fqn)
        if isinstance(old, nn.Embedding):
            _replace(stage, fqn, _ZeroEmbedding(old.embedding_dim, old.weight.dtype))
        elif depth and fqn == "mtp":
            _replace(stage, fqn, _NoDepths())
        else:
            _replace(stage, fqn, _PassThrough())
    if depth:
        # the token embedding (real on the first stage, a stub elsewhere) hands the shifted
        # tokens' embeddings from the first stage to the last (module docstring); its hook is
        # registered at the first forward (_stage_forward), after the ones tensor parallelism adds,
        # so that it carries the lookups as the model sees them (all-reduced, or sequence shards)
        emb = stage.get_submodule("tok_embeddings")
        emb.__dict__["_meshplan_root"] = stage
        stage.__dict__["_meshplan_carry"] = emb      # not setattr: that would register a child
    if not spec.is_first:
        if first_block is None:
            raise LayoutError(f"pipeline stage {spec.index} owns no block ({list(spec.owned)}); every "
                              "stage after the first must start with a block; re-plan")
        entry = stage.get_submodule(first_block)
        entry.register_forward_pre_hook(_inject_received, with_kwargs=True, prepend=True)
        # plain __dict__ entry: setattr would register the root as a child module (a cycle)
        entry.__dict__["_meshplan_root"] = stage
    stage._meshplan_stage = spec
    stage._meshplan_seq_len = seq_len
    stage._meshplan_received = None
    stage._meshplan_mtp = depth
    stage._meshplan_mtp_in, stage._meshplan_mtp_out, stage._meshplan_lookups = [], [], 0
    stage.forward = types.MethodType(_stage_forward, stage)
    return stage


def _is_block_fqn(model: nn.Module, fqn: str) -> bool:
    m = model.get_submodule(fqn)
    return bool(m._modules) and any(True for _ in m.parameters())


def _inject_received(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook on a stage's first block: its input is the activation received from the previous stage."""
    root = module._meshplan_root
    hidden = root._meshplan_received
    if hidden is None:
        return None
    root._meshplan_received = None
    wrap = root.__dict__.get("_meshplan_wrap_input")
    if wrap is not None:
        hidden = wrap(hidden)
    if args:
        return (hidden,) + tuple(args[1:]), kwargs
    key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
    return args, {**kwargs, key: hidden}


def _mtp_depth(model: nn.Module) -> int:
    """Multi-token-prediction depths of a meshplan model (0 for any other model)."""
    depth = getattr(getattr(model, "config", None), "mtp_depth", 0)
    ok = isinstance(depth, int) and depth > 0 and isinstance(model._modules.get("mtp"), nn.Module) \
        and isinstance(model._modules.get("tok_embeddings"), nn.Module)
    return depth if ok else 0


def _carry_mtp_embeddings(module: nn.Module, args: tuple, out: torch.Tensor):
    """Forward hook on the token embedding of a stage of a model with MTP. The model looks up the
    input tokens, then the tokens shifted by 1..D (Transformer.forward): those D outputs are kept
    to be sent on, and on a stage after the first (a stub embedding) replaced by the received ones."""
    root = module.__dict__["_meshplan_root"]
    i = root._meshplan_lookups
    root._meshplan_lookups += 1
    if i == 0:
        return None
    if root._meshplan_mtp_in:
        received = root._meshplan_mtp_in[i - 1]
        out = received.view_as(received)    # a graph node: its gradient flows back to the sender
    root._meshplan_mtp_out.append(out)
    return out


def _stage_forward(self: nn.Module, x: torch.Tensor, *carried: torch.Tensor, **kwargs):
    # kwargs (document_ids of packed documents) reach every stage: the schedule splits them per
    # micro-batch on each rank, as it splits the first stage's input_ids; `carried`: the shifted
    # tokens' embeddings of multi-token prediction, from the stage before (module docstring)
    spec: StageSpec = self._meshplan_stage
    self._meshplan_mtp_in, self._meshplan_mtp_out, self._meshplan_lookups = list(carried), [], 0
    emb = self.__dict__.pop("_meshplan_carry", None)
    if emb is not None:
        emb.register_forward_hook(_carry_mtp_embeddings)
    if spec.is_first:
        ids = x
    else:
        # the user's forward still runs from the top (positions, masks, rotary tables need the
        # token shape), on zeros; the received activation replaces the first owned block's input
        ids = torch.zeros(x.shape[0], self._meshplan_seq_len, dtype=torch.long, device=x.device)
        self._meshplan_received = x
    out = logits_of(type(self).forward(self, ids, **kwargs))
    if self._meshplan_received is not None:
        raise LayoutError("pipeline stage input was never consumed: the model did not call the stage's "
                          "first block; the model's forward does not follow the traced block order")
    # activations cross stages as plain local tensors (p2p sends tensors); see _inject_received
    out = _sendable(out)
    if self._meshplan_mtp and not spec.is_last:
        # in eval mode the model looks up no shifted tokens: zeros keep the stages' message shapes;
        # under SP the lookups are sequence-sharded DTensors, sent as their local shards (the
        # receiving stage's MTP norms take a plain tensor as this rank's shard)
        sent = [_sendable(t) for t in self._meshplan_mtp_out[:self._meshplan_mtp]]
        sent += [torch.zeros_like(out) for _ in range(self._meshplan_mtp - len(sent))]
        return (out, *sent)
    return out


_MULTI_STAGE = ("interleaved", "zb", "zbv")
_SINGLE_STAGE = ("1f1b", "gpipe")


def check_schedule_name(name: str, n_stages: int) -> None:
    """Raise LayoutError where the runtime cannot run schedule `name` over `n_stages` local stages."""
    if name in _SINGLE_STAGE and n_stages != 1:
        raise LayoutError(f"schedule {name!r} runs one stage per rank, but this rank holds {n_stages}")
    if name not in _SINGLE_STAGE + _MULTI_STAGE:
        raise LayoutError(f"pipeline schedule {name!r} is not supported by the runtime; use one of "
                          f"{sorted(_SINGLE_STAGE) + sorted(_MULTI_STAGE)}")


def _sendable(t):
    """`t` as the plain tensor a pipeline send reads. A DTensor's `to_local()` right after a
    redistribution (SP's reduce-scatter of a vocabulary-parallel lookup) is an AsyncCollectiveTensor
    whose collective may still be writing it: torch's p2p send reads the buffer without waiting, so
    the next stage could receive what was there before. Any non-view op waits for it; clone keeps the
    autograd graph the stage's backward runs through."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.clone() if isinstance(t, AsyncCollectiveTensor) else t


def pipeline_stage(module: nn.Module, spec: StageSpec, device, group):
    """torch.distributed.pipelining's PipelineStage for `module`, whose shape inference runs the stage
    on zeros. torch (2.13) infers each stage's input and output metadata at the first step by running
    the stage's forward and backward once on tensors it makes from the previous stage's metadata:
    uninitialised memory (`TensorMeta.to_tensor`, `_PipelineStageBase._to_tensor`). Whatever bits are
    there reach the kernels, and on CPU the Triton interpreter raises where a NaN meets a max (the MoE
    router's top-k: "All-NaN slice encountered"), so a step failed at random. Zeros give every kernel
    defined input; only the shapes are used."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import _TensorMeta      # (a DTensor meta is one too)

    class _Stage(PipelineStage):
        def _to_tensor(self, arg):
            t = super()._to_tensor(arg)
            if isinstance(arg, _TensorMeta) and (t.is_floating_point() or t.is_complex()):
                with torch.no_grad():
                    (t.to_local() if hasattr(t, "to_local") else t).zero_()
            return t

    return _Stage(module, spec.index, spec.num_stages, device, group=group)


def pipeline_schedule(name: str, stages: list, *, n_microbatches: int, loss_fn):
    """The torch.distributed.pipelining schedule for a plan's schedule name.

    `scale_grads=False`: the loss function already divides by the global token count, so the
    accumulated gradients are those of the global-batch mean (see parallel.py).
    """
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )
    check_schedule_name(name, len(stages))
    multi = {"interleaved": ScheduleInterleaved1F1B, "zb": ScheduleInterleavedZeroBubble,
             "zbv": ScheduleZBVZeroBubble}
    single = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
    if name in multi:
        return multi[name](stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return single[name](stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


class ScheduleCache:
    """One pipeline schedule per micro-batch count, built on first use over the same stages.

    A batch-size schedule changes the number of micro-batches between steps while the stages
    (and the micro-batch shape) stay. torch's stages size their receive buffers for the count the
    last schedule initialised them with (`PipelineStage.chunks`), so a cached schedule whose
    count differs from the stages' is marked uninitialised before it runs: it then re-runs the
    stages' set-up (a metadata exchange between neighbouring ranks, the same step on every rank).
    """

    def __init__(self, name: str, stages: list, *, loss_fn) -> None:
        self.name, self.stages, self.loss_fn = name, stages, loss_fn
        self._built: dict[int, object] = {}

    def get(self, n_microbatches: int):
        """The schedule for `n_microbatches` (ValueError/LayoutError when the schedule cannot run it)."""
        if n_microbatches not in self._built:
            self._built[n_microbatches] = pipeline_schedule(self.name, self.stages, n_microbatches=n_microbatches,
                                                            loss_fn=self.loss_fn)
        return self._built[n_microbatches]

    def for_step(self, n_microbatches: int):
        """The schedule to run now with `n_microbatches`, its stages ready for that count."""
        schedule = self.get(n_microbatches)
        if any(getattr(st, "chunks", None) not in (None, n_microbatches) for st in self.stages):
            # private flags of torch.distributed.pipelining (2.13): single- and multi-stage schedules
            for flag in ("_stage_forward_initialized", "_stage_backward_initialized",
                         "_stages_forward_initialized", "_stages_backward_initialized"):
                if hasattr(schedule, flag):
                    setattr(schedule, flag, False)
        return schedule
