"""Activation recomputation per block, as the Plan's `recompute` says.

- "full": each block's forward runs under non-reentrant `torch.utils.checkpoint`; only its
  input is kept and the whole block is recomputed in backward (Megatron's full recompute).
- "selective": selective activation checkpointing: the outputs of matrix multiplies are saved
  and everything else (attention core, softmax, norms, activations) is recomputed, which is
  where Korthikanti et al. (2022) find most activation memory for the least recompute FLOPs.
  Two matmul-adjacent tensors are not saved, as the cost model's "selective" does not charge
  them: the all-gathered (whole-sequence) input of the column-parallel linears under SP is
  gathered again from the recomputed sequence shard, and a row-parallel projection's partial
  sum (whole sequence, before its reduce-scatter / all-reduce) is not kept - the reduced output
  is. Recomputing the block then re-runs the attention output projection's GEMM (the MLP's
  down projection is past the last tensor backward needs, so early stopping skips it): about
  h^2 of a layer's GEMM work per token.
- "norm_act": Megatron-Core's `--recompute-granularity selective --recompute-modules layernorm
  moe_act`: the block's norms and the routed experts' activation (silu / gelu, and the SwiGLU
  product) are re-run in backward; every other tensor autograd saves is stored exactly as with
  no recompute. Dense MLPs and shared experts keep their activation (moe_act is experts only),
  as the cost model prices it (cost_models.layer.activation_bytes).
- N (int): full recompute of the first N blocks a pipeline rank holds (over its virtual
  stages, in execution order), none for the rest: `Layout.recompute_policy`, the same rule the
  cost model prices.

The block's `forward` is wrapped on the instance, so parameter FQNs do not change (checkpoint
wrappers that add a module level would rename every parameter).

Why "norm_act" is not a selective-checkpoint policy: a checkpoint policy stores the outputs of
every op it does not recompute, including ones autograd never needs (the attention and MLP
output projections feed only a residual add), so "recompute the norms, save the rest" would
store more than no recompute at all. Instead the block runs under a `saved_tensors_hooks` pair
and a dispatch mode that records the ops of each norm module call and of each expert
activation: a tensor those ops created that autograd saves (the norm output the QKV / FC1 /
router GEMMs keep for their weight gradient, the norm's rstd, the activation output FC2 keeps,
silu's intermediate) is packed as a handle to its region, and unpacking replays the region's
recorded ops on their inputs (the norm input, the gate / up GEMM outputs: tensors that no
recompute stores anyway). This is what Megatron's CheckpointWithoutOutput does for the same
modules. Replaying the same ops on the same inputs gives bit-identical values.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["NORM_ACT", "apply_recompute", "norm_modules", "local_tensor", "storage_key"]

NORM_ACT = "norm_act"

# ops whose outputs selective recompute keeps: matrix multiplies (their recompute is the costly
# part) and the TP collectives that reduce (recomputing them would repeat the communication).
# The all-gather of a sequence-parallel block's input is re-run instead: its input is the
# recomputed sequence shard, the same on every rank as in forward, and keeping its output would
# keep tp times the shard (Megatron gathers it again in backward, as the cost model charges)
_SAVE_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "linear")
_SAVE_CUSTOM_GEMMS = (("meshplan", "grouped_mm"), ("aten", "_grouped_mm"))
_SAVE_COLLECTIVES = ("reduce_scatter_tensor", "all_reduce", "all_to_all_single")
# the position of the activation operand of each saved aten matmul (addmm / baddbmm: after the bias)
_ACTIVATION_ARG = {"addmm": 1, "baddbmm": 1}


def _partial_sum(op, args) -> bool:
    """Whether a matmul contracts over a dimension sharded across TP ranks (a row-parallel
    projection): its output is this rank's partial sum, whole-sequence under SP, which is reduced
    straight away and never read by backward; the reduced output is what the block keeps. Told
    by the DTensor placements the eager policy sees; a compiled block's policy sees plain tensors,
    so there the partial sums stay saved."""
    name = op.overloadpacket.__name__
    i = _ACTIVATION_ARG.get(name, 0)
    x = args[i] if len(args) > i else None
    placements = getattr(x, "placements", None)
    if placements is None:
        return False
    last = x.ndim - 1
    return any(p.is_shard() and p.dim in (last, -1) for p in placements)


# the routed experts' activation ops "norm_act" re-runs (meshplan's fused Triton SwiGLU included);
# the SwiGLU product is the aten.mul that reads one of their outputs inside the experts module
_ACT_OPS = (("aten", "silu"), ("aten", "gelu"), ("meshplan_kernels", "swiglu"),
            ("meshplan_kernels", "swiglu_packed"))
_PRODUCT_OPS = (("aten", "mul"),)


def _selective_context():
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        create_selective_checkpoint_contexts,
    )
    save = {getattr(torch.ops.aten, n).default for n in _SAVE_OPS if hasattr(torch.ops.aten, n)}
    # the routed experts' GEMMs: a custom op (meshplan.models.grouped_mm) that the aten names above
    # miss; saved by name, or "selective" would re-run every expert GEMM in backward, which the
    # plan does not price (cost_models.flops.recompute_flops_per_step: attention only)
    import meshplan.models.grouped_mm  # noqa: F401  (registers meshplan::grouped_mm)
    save |= {op.default for ns, n in _SAVE_CUSTOM_GEMMS
             if (op := getattr(getattr(torch.ops, ns), n, None)) is not None}
    save |= {getattr(torch.ops._c10d_functional, n).default for n in _SAVE_COLLECTIVES
             if hasattr(torch.ops._c10d_functional, n)}

    gemms = {getattr(torch.ops.aten, n).default for n in _SAVE_OPS if hasattr(torch.ops.aten, n)}

    def policy(ctx, op, *args, **kwargs):
        if op in save and not (op in gemms and _partial_sum(op, args)):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def _wrap(block: nn.Module, selective: bool) -> None:
    from torch.utils.checkpoint import checkpoint
    inner = block.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        ctx = {"context_fn": _selective_context} if selective else {}
        return checkpoint(inner, *args, use_reentrant=False, **ctx, **kwargs)
    block.forward = forward


# ---- "norm_act" -------------------------------------------------------------------------------

def _op_key(func) -> tuple[str, str]:
    """(namespace, op name) of an OpOverload: aten.mul.Tensor -> ("aten", "mul")."""
    packet = func.overloadpacket
    return packet._qualified_op_name.split("::")[0], packet.__name__


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns memory: a DTensor's local shard, else the tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def storage_key(t: torch.Tensor) -> tuple[int, StorageWeakRef] | None:
    try:
        ref = StorageWeakRef(local_tensor(t).untyped_storage())
    except (RuntimeError, NotImplementedError):      # a tensor without storage (fake, sparse)
        return None
    return ref.cdata, ref


def norm_modules(block: nn.Module) -> list[nn.Module]:
    """The norms of a block, by structure (class names are never read): leaf modules whose
    parameters are all 1-D (a weight, maybe a bias): RMSNorm, LayerNorm, transformers' and
    meshplan's fused-kernel norms alike."""
    return [m for m in block.modules()
            if next(m.children(), None) is None and (ps := list(m.parameters(recurse=False)))
            and all(p.dim() == 1 for p in ps)]


def _expert_modules(block: nn.Module) -> list[nn.Module]:
    from meshplan.ir.routed_experts import is_routed_experts
    from meshplan.runtime.expert_parallel import _looks_grouped
    return [m for m in block.modules() if _looks_grouped(m) or is_routed_experts(m)]


@dataclass(frozen=True)
class _Ref:
    """A tensor one recorded op produced: output `leaf` (pytree order) of op `op` of `region`;
    `view` (size, stride, storage offset) when it is a view of that output made outside the region."""
    region: _Region
    op: int
    leaf: int
    view: tuple | None = None

    def resolve(self, outs: list[list] | None = None) -> torch.Tensor:
        t = outs[self.op][self.leaf] if outs is not None else self.region.value(self.op, self.leaf)
        return t if self.view is None else local_tensor(t).as_strided(*self.view)


@dataclass(eq=False)
class _Region:
    """The ops of one norm call or one expert activation, recorded for replay in backward."""
    ops: list[tuple[Any, list, Any]] = field(default_factory=list)   # (op, arg leaves, arg spec)
    pending: int = 0                                                  # handles not yet unpacked
    _values: list[list] | None = None

    def value(self, op: int, leaf: int) -> torch.Tensor:
        values = self._values if self._values is not None else self._replay()
        if self.pending > 0:            # kept until its last handle is read (release)
            self._values = values
        return values[op][leaf]

    def _replay(self) -> list[list]:
        outs: list[list] = []
        with torch.no_grad():
            for func, leaves, spec in self.ops:
                args = [x.resolve(outs if x.region is self else None) if isinstance(x, _Ref) else x
                        for x in leaves]
                a, k = tree_unflatten(args, spec)
                outs.append(tree_flatten(func(*a, **k))[0])
        return outs

    def release(self) -> None:
        self.pending -= 1
        if self.pending <= 0:           # every saved handle of this region has been read
            self._values = None


@dataclass(frozen=True)
class _Handle:
    """What autograd keeps instead of a norm / activation tensor: where to recompute it from and
    the view of that storage it saved."""
    ref: _Ref
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    spec: Any = None                    # a DTensor's spec (placements, mesh), else None


_ACTIVE = threading.local()             # the _Recorder of the block forward running on this thread


class _Recorder(TorchDispatchMode):
    """Records the norm and expert-activation ops of one block forward and packs the tensors
    they created (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm_depth = 0
        self.expert_depth = 0
        self.norm_region: _Region | None = None
        self.produced: dict[int, tuple[StorageWeakRef, _Ref]] = {}    # storage -> creating op
        self.versions: dict[int, int] = {}                              # storage -> version when recorded
        self.outputs = WeakTensorKeyDictionary()                        # recorded output -> _Ref
        self.acts: dict[int, tuple[StorageWeakRef, _Region]] = {}     # act outputs' storages

    # module hooks (installed once per block by apply_recompute) call these
    def enter_norm(self) -> None:
        if self.norm_depth == 0:
            self.norm_region = _Region()
        self.norm_depth += 1

    def exit_norm(self) -> None:
        self.norm_depth -= 1
        if self.norm_depth == 0:
            self.norm_region = None

    def _lookup(self, table: dict, t: torch.Tensor):
        key = storage_key(t)
        if key is None or key[0] not in table:
            return None
        ref, entry = table[key[0]]
        return None if ref.expired() else entry

    def _region_for(self, func, leaves: list) -> _Region | None:
        if self.norm_region is not None:
            return self.norm_region
        if self.expert_depth == 0:
            return None
        key = _op_key(func)
        if key in _ACT_OPS:
            return _Region()
        if key in _PRODUCT_OPS:
            for x in leaves:
                if isinstance(x, torch.Tensor) and (r := self._lookup(self.acts, x)) is not None:
                    return r
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        region = self._region_for(func, leaves)
        if region is None:
            return out
        self._check_replayable(func, args, kwargs)
        inputs = set()
        recorded = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                key = storage_key(x)
                if key is not None:
                    inputs.add(key[0])
                # a tensor an earlier recorded op made is referenced, not kept: that is the saving
                ref = self.outputs.get(x)
                if ref is None and (base := self._lookup(self.produced, x)) is not None:
                    loc = local_tensor(x)
                    ref = _Ref(base.region, base.op, base.leaf, (loc.size(), loc.stride(), loc.storage_offset()))
                x = ref if ref is not None else x
            recorded.append(x)
        i = len(region.ops)
        region.ops.append((func, recorded, spec))
        is_act = region is not self.norm_region
        for j, y in enumerate(tree_flatten(out)[0]):
            if isinstance(y, torch.Tensor):
                self.outputs[y] = _Ref(region, i, j)    # an in-place op's output: the latest writer
            key = storage_key(y) if isinstance(y, torch.Tensor) else None
            if key is None or key[0] in inputs or self._lookup(self.produced, y) is not None:
                continue                # a view of an input, or of an earlier recorded output
            self.produced[key[0]] = (key[1], _Ref(region, i, j))
            if is_act:
                self.acts[key[0]] = (key[1], region)
        for y in tree_flatten(out)[0]:     # in-place ops inside the region move the version on
            if isinstance(y, torch.Tensor) and (key := storage_key(y)) is not None and key[0] in self.produced:
                self.versions[key[0]] = local_tensor(y)._version
        return out

    def _check_replayable(self, func, args, kwargs) -> None:
        """A replay repeats the op in backward: it must draw no random numbers and write no tensor
        the region did not create (both would make the replay differ from the forward)."""
        from meshplan.errors import ConfigError
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise ConfigError(f"recompute 'norm_act': {func} inside a norm or the experts' activation draws random "
                              "numbers, which a replay in backward would not repeat; use recompute='selective' "
                              "or 'full' for this model")
        if not func._schema.is_mutable:
            return
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(v, torch.Tensor) and self._lookup(self.produced, v) is None:
                raise ConfigError(f"recompute 'norm_act': {func} inside a norm or the experts' activation writes "
                                  "into its input in place, which a replay in backward would repeat; use "
                                  "recompute='selective' or 'full' for this model")

    # saved_tensors_hooks
    def pack(self, t: torch.Tensor):
        ref = self._lookup(self.produced, t)
        if ref is None:
            return t
        if local_tensor(t)._version != self.versions.get(storage_key(t)[0]):
            return t                    # written in place after the region: a replay would not match
        ref.region.pending += 1
        loc = local_tensor(t)
        return _Handle(ref, loc.size(), loc.stride(), loc.storage_offset(),
                       t._spec if loc is not t else None)

    @staticmethod
    def unpack(h):
        if not isinstance(h, _Handle):
            return h
        base = local_tensor(h.ref.region.value(h.ref.op, h.ref.leaf))
        h.ref.region.release()
        v = base.as_strided(h.size, h.stride, h.offset)
        if h.spec is not None:
            from torch.distributed.tensor import DTensor
            v = DTensor(v, h.spec, requires_grad=False)
        return v


def _hook_modules(block: nn.Module) -> None:
    """Tell the active recorder when a norm or an experts module of `block` runs."""
    def pre(kind):
        def hook(_m, _args):
            rec = getattr(_ACTIVE, "rec", None)
            if rec is not None:
                rec.enter_norm() if kind == "norm" else setattr(rec, "expert_depth", rec.expert_depth + 1)
        return hook

    def post(kind):
        def hook(_m, _args, _out):
            rec = getattr(_ACTIVE, "rec", None)
            if rec is not None:
                rec.exit_norm() if kind == "norm" else setattr(rec, "expert_depth", rec.expert_depth - 1)
        return hook

    for kind, mods in (("norm", norm_modules(block)), ("experts", _expert_modules(block))):
        for m in mods:
            if getattr(m, "_meshplan_norm_act_hooked", False):
                continue
            m.register_forward_pre_hook(pre(kind))
            m.register_forward_hook(post(kind))
            m._meshplan_norm_act_hooked = True


def _wrap_norm_act(block: nn.Module) -> None:
    _hook_modules(block)
    inner = block.forward

    # the recorder is Python run op by op: a compiled block runs this forward eagerly (a graph
    # break) so that the policy the plan priced is the one that runs
    @torch.compiler.disable
    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():         # nothing is saved: nothing to recompute
            return inner(*args, **kwargs)
        rec = _Recorder()
        outer = getattr(_ACTIVE, "rec", None)
        _ACTIVE.rec = rec
        try:
            with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack), rec:
                return inner(*args, **kwargs)
        finally:
            _ACTIVE.rec = outer
    block.forward = forward


def apply_recompute(stage: nn.Module, blocks: list[str], layout, first_index: int = 0) -> list[str]:
    """Wrap the stage's blocks (FQNs in execution order) as `layout.recompute_policy` says;
    `first_index`: how many layers this pipeline rank's earlier virtual stages hold. Returns the
    FQNs wrapped."""
    chosen = []
    for k, fqn in enumerate(blocks):
        policy = layout.recompute_policy(first_index + k)
        if policy == NORM_ACT:
            _wrap_norm_act(stage.get_submodule(fqn))
            chosen.append(fqn)
        elif policy != "none":
            _wrap(stage.get_submodule(fqn), policy == "selective")
            chosen.append(fqn)
    return chosen
