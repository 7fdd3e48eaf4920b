"""Intra-block sharding ILP: choose how every op of a block is split over the TP group.

    sharding = shard_block(block, cluster, tp=8, tokens=8192)   # BlockSharding
    sharding.placements          # {"attention.wq": "colwise", ..., "attention_norm": "sequence"}
    problem = build_problem(block, cluster, tp=8, tokens=8192)
    problem.evaluate({"attention.wq": "replicate"})             # best cost with that choice fixed

It works on the traced op graph of one block (`BlockProfile.ops`, edges = `OpInfo.inputs`), so
any traceable model is handled, not only known classes; Megatron-LM's pattern (QKV and FC1
column-parallel, output and FC2 row-parallel, norms sequence-parallel) is an outcome, not an input.

Layouts. Each activation tensor t is held on the TP group in one layout
    R  replicated              S  sharded on the token (sequence) dim
    F  sharded on the feature dim (hidden, or heads after a head split)
    P  partial sums awaiting a reduction
Which dim is "token" and which "feature" is found by propagating labels from the block input
(B, S, H) through every op's shapes (views split / merge / permute dims; a shard follows the
major dim of a split). The block is traced at batch 1, so the token dim is the sequence dim.

Strategies. Op o has strategies s in St(o), each a layout for every activation input, an output
layout, a compute time c(o,s) (fwd + bwd, per GPU), the per-GPU state bytes m(o,s) of the
parameters it reads and a gradient-traffic time u(o,s). For example a linear with weight (n, k):
replicate (R -> R, full GEMMs), sequence (S -> S, m/tp rows, weight replicated), colwise
(R -> F, n/tp), rowwise (F -> P, k/tp); scaled-dot-product attention: R -> R or heads (F -> F);
norms R -> R or S -> S (they reduce over the feature dim, so never F); element-wise ops keep
the layout of their inputs; unknown ops only R -> R. A routed-expert MoE region (router ->
dispatch -> experts -> combine) is one unit with R or S tokens; its experts are labelled
"expert" and sharded by the EP axis, not here.

Variables (all binary or driven to {0,1} by the objective)
    x[o,s]      op o uses strategy s                                         (binary)
    a[t,l]      tensor t is materialised in layout l for some consumer      (continuous [0,1])
    g[t,l]      some consumer hands back t's gradient in layout l            (continuous [0,1])
    y[t,p,l]    t is produced in p and converted to l, forward               (continuous [0,1])
    z[t,p,l]    t's gradient arrives in l and is converted for producer p    (continuous [0,1])
    b[l]        the block's input (and output) layout, l in {R, S}           (binary)
where out(t,p) = sum of x[o,s] over the producer's strategies with output p (b[p] for the input).

Objective (seconds per micro-batch of `tokens` tokens, forward + backward)
    min  sum x[o,s] (c(o,s) + u(o,s))  +  sum y[t,p,l] C(p->l, t)  +  sum z[t,p,l] C(l->need(p), t)
C is the resharding collective on the TP group (meshplan.cost_models.comm): R->S, R->F, R->P
free (local slice / scale); S->R, F->R all-gather; S<->F all-to-all; P->R all-reduce; P->S,
P->F reduce-scatter; S,F->P impossible. need(p) = R if p = P (a partial's gradient is
replicated), else p. A consumer reading t in layout l returns a gradient in layout P if l = R
and the consumer's output is sharded (a column-parallel linear's input), R if l = P, else l;
every backward all-reduce / reduce-scatter / all-gather of Megatron comes out of this rule.
u(o,s) = all-reduce time of the per-GPU gradient bytes of o's parameters / `microbatches`: the
once-per-step reduction every replica of a weight takes part in (the DP group, and the TP group
too when a weight is replicated while its work is sharded), so replicated weights are not free.

Constraint families (one method of `_Model` each)
    one_strategy     sum_s x[o,s] = 1                                  for every op o
    consumption      a[t,l] >= x[o,s]   when strategy s of o reads t in l;
                     a[out,l] >= b[l]   (the next block reads this block's output like its input)
    gradients        g[t,l] >= x[o,s]   when s hands back t's gradient in l;  g[out,l] >= b[l]
    conversion       y[t,p,l] >= out(t,p) + a[t,l] - 1,   z[t,p,l] >= out(t,p) + g[t,l] - 1,
                     out(t,p) + a[t,l] <= 1 where p -> l is impossible
    block_io         sum_l b[l] = 1       (input and output share one layout: the next block
                                           consumes this one's output; S = sequence parallel)
    memory           sum x[o,s] m(o,s) <= M   (M: `state_budget_bytes`, default the smallest
                     reachable state times 1 + `state_slack`: TP exists to divide model state,
                     so the ILP minimises time only among near-minimal-memory assignments)
Resharding a tensor is charged once per target layout, not per consumer edge, so Q, K and V
share one all-gather as in Megatron. Activation memory is not modelled.

Results are cached per (block signature, tp, tokens, seq_len, options, cluster fingerprint):
repeated blocks share one solution.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType
from typing import Mapping

import pulp

from meshplan.cost_models import constants as K
from meshplan.cost_models.comm import collective_time, group
from meshplan.cost_models.compute import attention_time, elementwise_time, gemm_time, matmul_rate
from meshplan.errors import ConfigError, DoesNotFitError, LayoutError, TraceError
from meshplan.planner.profile import BlockProfile, ModelProfile, OpInfo
from meshplan.planner.solver import has_solution, proved_optimal, resolve_solver, solve

__all__ = ["PLACEMENTS", "OpChoice", "BlockSharding", "ShardingProblem", "build_problem",
           "shard_block", "shard_profile"]

LAYOUTS = ("R", "S", "F", "P")
# What the runtime applies per module: linears colwise / rowwise / replicate / sequence (tokens
# sharded, weight replicated); attention modules heads / replicate; norms sequence / replicate /
# feature (hidden-sharded, weight sliced); routed experts "expert" (sharded by the EP axis).
PLACEMENTS = ("colwise", "rowwise", "replicate", "sequence", "heads", "feature", "expert")
_LABEL_OF_LAYOUT = {"R": "replicate", "S": "sequence", "F": "feature", "P": "partial"}

# Default allowance over the smallest reachable per-GPU model state (see the memory family):
# lets small weights (norms, router, biases) stay replicated but not a projection matrix.
DEFAULT_STATE_SLACK = 0.05
# Bytes of training state per parameter: bf16 weight + fp32 grad + Adam master/m/v (constants.py).
STATE_BYTES_PER_PARAM = K.PARAM_BYTES + K.GRAD_BYTES + K.OPTIMIZER_BYTES
# Backward of a memory-bound op reads the output gradient and saved inputs and writes the input
# gradients: about twice the forward's traffic (derived, as in cost_models/layer.py).
ELEMENTWISE_BWD_RATIO = 2.0
_CACHE_SIZE = 512
_MS, _GB = 1e3, 1e9          # units the solver sees

_SDPA = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
         "_scaled_dot_product_flash_attention_for_cpu", "flex_attention"}
_MATMUL = {"bmm", "matmul", "mm"}
_LINEAR = {"linear", "mm", "addmm", "matmul"}
_NORMS = {"layer_norm", "rms_norm", "native_layer_norm", "_fused_rms_norm"}
_ROW = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax", "cumsum",
        "cumprod", "sort", "argsort", "logcumsumexp"}          # along the last dim (assumed)
_SWAP = {"transpose", "t", "mT", "swapaxes", "swapdims", "adjoint"}
_PERMUTE = _SWAP | {"permute", "movedim"}
_IDENTITY = {"to", "_to_copy", "clone", "contiguous", "type_as", "detach", "alias", "dropout",
             "native_dropout", "lift_fresh_copy", "getitem", "expand", "expand_as", "slice",
             "select", "narrow", "split", "chunk", "unbind", "split_with_sizes", "view", "reshape",
             "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as"}
_CAT = {"cat", "concat", "concatenate", "stack"}
_SUMS = {"sum", "mean"}                                      # linear: a sharded dim gives P
_LINEAR_PW = {"add", "sub", "neg"}                           # P in -> P out when all inputs P
_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


# ---- public results ------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class OpChoice:
    """The strategy chosen for one op (for debugging and for the runtime's redistributions)."""

    name: str
    module: str                 # relative to the block ("attention.wq")
    strategy: str               # "colwise", "rowwise", "replicate", "sequence", "heads", ...
    inputs: tuple[str, ...]     # layout read of each activation input
    output: str                 # layout produced: R, S, F or P

    def __post_init__(self) -> None:
        if self.output not in LAYOUTS or any(x not in LAYOUTS for x in self.inputs):
            raise ConfigError(f"op {self.name!r}: layouts must be among {LAYOUTS}")


@dataclass(frozen=True, kw_only=True)
class BlockSharding:
    """The ILP's answer for one unique block at one TP degree."""

    signature: str
    tp: int
    tokens: int
    placements: Mapping[str, str]     # module FQN relative to the block -> one of PLACEMENTS
    io_layout: str                    # block input/output: "replicate" or "sequence"
    time_s: float                     # compute + comm + gradient traffic, per micro-batch
    compute_s: float
    comm_s: float
    grad_sync_s: float
    state_bytes: float                # per-GPU parameter state of one instance
    status: str                       # "optimal" | "feasible" (stopped at the time limit)
    solver: str
    solve_s: float
    ops: tuple[OpChoice, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.tokens < 1:
            raise ConfigError(f"tp and tokens must be >= 1, got tp={self.tp}, tokens={self.tokens}")
        bad = {m: p for m, p in self.placements.items() if p not in PLACEMENTS}
        if bad:
            raise ConfigError(f"unknown placements {bad}; known: {PLACEMENTS}")
        if self.io_layout not in ("replicate", "sequence"):
            raise ConfigError(f"io_layout must be 'replicate' or 'sequence', got {self.io_layout!r}")
        object.__setattr__(self, "placements", MappingProxyType(dict(self.placements)))


# ---- shapes and dim labels -------------------------------------------------------------------

def _base(target: str) -> str:
    if "getitem" in target:
        return "getitem"
    parts = target.split(".")
    return parts[1] if len(parts) >= 2 else target


@lru_cache(maxsize=None)
def _pointwise(target: str) -> bool:
    parts = target.split(".")
    if len(parts) != 3:
        return False
    try:
        import torch
        op = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
        return torch.Tag.pointwise in op.tags
    except Exception:   # an op torch does not know here: treat as opaque
        return False


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _reshape_map(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int]:
    """src dim -> dst dim under a contiguous reshape: dims are grouped by equal products and the
    first non-1 dim of a group maps to the group's first non-1 dim (a shard on the major dim
    survives a split or merge; one on a minor dim does not)."""
    out: dict[int, int] = {}
    i = j = 0
    while True:
        while i < len(src) and src[i] == 1:
            i += 1
        while j < len(dst) and dst[j] == 1:
            j += 1
        if i >= len(src) or j >= len(dst):
            return out
        first_i, first_j, pi, pj = i, j, src[i], dst[j]
        while pi != pj:
            if pi < pj:
                i += 1
                if i >= len(src):
                    return out
                pi *= src[i]
            else:
                j += 1
                if j >= len(dst):
                    return out
                pj *= dst[j]
        out[first_i] = first_j
        i, j = i + 1, j + 1


def _alignments(src: tuple[int, ...], dst: tuple[int, ...], base: str) -> list[dict[int, int]]:
    """Candidate maps src dim -> dst dim consistent with the shapes (dims left out are dropped).
    Op arguments are not in the IR, so equal sizes can leave several candidates."""
    n, m = len(src), len(dst)
    if base in _SWAP and n == m:      # exactly two dims trade places (or none, if equal sizes)
        swaps = []
        for i, j in itertools.combinations(range(n), 2):
            perm = list(range(n))
            perm[i], perm[j] = j, i
            if all(src[a] == dst[b] for a, b in enumerate(perm)):
                swaps.append(dict(enumerate(perm)))
        return swaps
    if base in _PERMUTE and n == m:
        return [dict(enumerate(p)) for p in itertools.permutations(range(n))
                if all(src[a] == dst[b] for a, b in enumerate(p))]
    if _numel(src) == _numel(dst) and src != dst:
        return [_reshape_map(src, dst)]
    if n == m:
        return [{d: d for d in range(n)}]
    cands = []
    if n < m:       # broadcast (right-aligned) or inserted dims
        off = m - n
        if all(src[d] in (1, dst[d + off]) for d in range(n)):
            cands.append({d: d + off for d in range(n)})
        for pos in itertools.combinations(range(m), n):
            if all(src[d] == dst[p] for d, p in enumerate(pos)):
                cands.append(dict(enumerate(pos)))
    else:           # removed dims (select, reductions without keepdim)
        for kept in itertools.combinations(range(n), m):
            if all(src[d] == dst[e] for e, d in enumerate(kept)):
                cands.append({d: e for e, d in enumerate(kept)})
    return cands


def _follow(dim: int | None, src: tuple[int, ...], dst: tuple[int, ...],
            cands: list[dict[int, int]]) -> int | None:
    """Where a label on src dim `dim` lands in dst: only if every candidate agrees and the dim
    keeps its size (or, through a reshape, is the major dim of its group)."""
    if dim is None or not cands:
        return None
    targets = {c.get(dim) for c in cands}
    if len(targets) != 1 or None in targets:
        return None
    e = targets.pop()
    reshaped = _numel(src) == _numel(dst) and len(cands) == 1 and src != dst
    return e if (reshaped or src[dim] == dst[e]) else None


# ---- the analysed graph ----------------------------------------------------------------------

@dataclass
class _Tensor:
    name: str
    shape: tuple[int, ...]
    nbytes: float                 # at `tokens`
    grad: bool                    # floating point: carries a gradient
    tok: int | None = None
    feat: int | None = None


@dataclass
class _Strat:
    label: str                    # placement vocabulary (or layout name for plain ops)
    ins: tuple[str, ...]          # layout of each activation input
    out: str
    compute: float
    state: float = 0.0
    sync: float = 0.0
    grads: tuple[str, ...] = ()   # gradient layout handed back for each input


def _grad_layout(read: str, out: str) -> str:
    if read == "P":
        return "R"
    if read == "R" and out in ("S", "F"):
        return "P"
    return read


@dataclass
class _Op:
    name: str
    module: str                   # relative
    inputs: tuple[str, ...]       # activation tensors read (deduplicated, in order)
    strats: list[_Strat]
    rep: str = ""                 # "linear" | "attention" | "param" | "unit" | "": module label source
    extra_modules: tuple[tuple[str, str], ...] = ()   # (module, fixed label), for MoE units
    state_weight: float = 0.0     # parameters read (for choosing a module's label source)


class _Analysis:
    """Block ops -> activation tensors with dim labels and per-op strategies."""

    def __init__(self, block: BlockProfile, cluster, *, tp: int, tokens: int, seq_len: int | None,
                 sp_allowed: bool, microbatches: int):
        self.block, self.cluster, self.tp, self.tokens = block, cluster, tp, tokens
        self.sp_allowed, self.microbatches = sp_allowed, microbatches
        self.group = group(cluster, tp, 1)      # TP is the innermost mesh axis: consecutive ranks
        ops = list(block.ops)
        self.by_name = {o.name: o for o in ops}
        self.prefix = self._prefix(ops)
        self.out_name = ops[-1].name
        out_shape = ops[-1].output_shapes[0]
        self.params: dict[str, tuple[int, ...]] = {}
        self.consts: set[str] = set()
        self.inputs: list[str] = []
        shapes: dict[str, tuple[int, ...]] = {}
        for o in ops:
            for name, shape in zip(o.inputs, o.input_shapes):
                if name in self.by_name:
                    continue
                shapes[name] = shape
                if name.startswith("p_"):
                    self.params[name] = shape
                elif tuple(shape) == tuple(out_shape) and name not in self.inputs and not name.startswith(("b_", "c_")):
                    self.inputs.append(name)
                else:
                    self.consts.add(name)
        if not self.inputs:
            raise TraceError(
                f"block {block.signature} ({block.instances[0] if block.instances else '?'}): no "
                f"input has the block output's shape {tuple(out_shape)}, so its residual stream "
                f"cannot be found; the sharding ILP needs a block whose output replaces its input")
        in_shape = tuple(shapes[self.inputs[0]])
        tok = next((d for d in range(len(in_shape) - 1) if in_shape[d] > 1), None)
        self.seq0 = in_shape[tok] if tok is not None else 1
        self.tokens0 = _numel(in_shape) // max(1, in_shape[-1])
        self.scale = tokens / max(1, self.tokens0)
        self.attn_scale = self.scale * (seq_len or self.seq0) / self.seq0 * (0.5 if block.causal else 1.0)
        self.seq_ok = (seq_len or self.seq0) % tp == 0
        self.tensors: dict[str, _Tensor] = {}
        for name in self.inputs:
            self.tensors[name] = _Tensor(name, in_shape, self._bytes(in_shape, "bfloat16"), True,
                                         tok=tok, feat=len(in_shape) - 1)
        self.fixed_compute = 0.0
        self.ops: list[_Op] = []
        unit = self._moe_unit(ops)
        for o in ops:
            if unit and o.name in unit["members"]:
                if o.name == unit["out"]:
                    self._add_unit(o, unit)
                continue
            act = [n for n in dict.fromkeys(o.inputs) if n in self.tensors]
            if not act:                                 # built from constants / parameters only
                self.consts.add(o.name)
                if any(n in self.params for n in o.inputs):
                    self.params[o.name] = o.output_shapes[0] if o.output_shapes else ()
                self.fixed_compute += self._pointwise_time(o)
                continue
            self._add(o, act)

    # -- helpers
    def _prefix(self, ops: list[OpInfo]) -> str:
        for inst in self.block.instances:
            if any(o.module == inst or o.module.startswith(inst + ".") for o in ops):
                return inst
        return ""

    def rel(self, module: str) -> str:
        p = self.prefix
        if p and module.startswith(p + "."):
            return module[len(p) + 1:]
        return "" if module == p else module

    def _bytes(self, shape: tuple[int, ...], dtype: str) -> float:
        return _numel(shape) * _ITEMSIZE.get(dtype, 2) * self.scale

    def _pointwise_time(self, o: OpInfo) -> float:
        bwd = 1.0 + (ELEMENTWISE_BWD_RATIO if o.dtype.startswith(("float", "bfloat")) else 0.0)
        return elementwise_time(o.bytes * self.scale, self.cluster) * bwd

    def _flop_time(self, o: OpInfo, share: float) -> float:
        """A matmul-like op without a clean (m, n, k): roofline on its traced FLOPs."""
        rate = matmul_rate(self.cluster, fp8=False)
        kernels = 1 + (2 if o.bwd_flops > 0 else 0)
        return (o.fwd_flops + o.bwd_flops) * self.scale * share / rate + kernels * K.GEMM_FIXED_S

    def _sync(self, grad_params: float) -> float:
        return collective_time("all_reduce", grad_params * K.GRAD_BYTES, self.group,
                               self.cluster) / self.microbatches

    def _allowed(self, t: _Tensor, layout: str) -> bool:
        if layout == "S":
            return (self.sp_allowed and self.seq_ok and t.tok is not None
                    and t.shape[t.tok] % self.tp == 0)
        if layout == "F":
            return t.feat is not None and t.shape[t.feat] % self.tp == 0
        return True

    def _new_tensor(self, o: OpInfo, tok: int | None, feat: int | None) -> _Tensor:
        shape = tuple(o.output_shapes[0]) if o.output_shapes else ()
        t = _Tensor(o.name, shape, self._bytes(shape, o.dtype),
                    o.dtype.startswith(("float", "bfloat")), tok=tok, feat=feat)
        self.tensors[o.name] = t
        return t

    def _param_numels(self, o: OpInfo) -> list[tuple[int, ...]]:
        return [tuple(self.params[n]) for n in dict.fromkeys(o.inputs) if n in self.params]

    def _emit(self, o: OpInfo, act: list[str], strats: list[_Strat], rep: str = "",
              weight: float = 0.0) -> None:
        if self.tp == 1:   # every layout is the same thing on one GPU: keep one name for it
            strats = [s for s in strats if s.label == "replicate"] or strats[:1]
        for s in strats:
            if not s.grads:
                s.grads = tuple(_grad_layout(i, s.out) for i in s.ins)
        self.ops.append(_Op(o.name, self.rel(o.module), tuple(act), strats, rep, state_weight=weight))

    # -- per-category strategies
    def _add(self, o: OpInfo, act: list[str]) -> None:
        base = _base(o.target)
        pshapes = self._param_numels(o)
        weights = [s for s in pshapes if len(s) == 2]
        if o.kind == "linear" and base in _LINEAR and len(act) == 1 and weights:
            return self._linear(o, act[0], pshapes)
        if base in _SDPA and len(act) >= 3:
            return self._sdpa(o, act)
        if base in _MATMUL and len(act) == 2 and not pshapes:
            return self._matmul(o, act)
        return self._mapped(o, act, base, pshapes)

    def _linear(self, o: OpInfo, x_name: str, pshapes: list[tuple[int, ...]]) -> None:
        x = self.tensors[x_name]
        k = x.shape[-1]
        n = o.output_shapes[0][-1]
        m = _numel(x.shape) / k * self.scale
        tp = self.tp
        tok = x.tok if x.tok is not None and x.tok < len(x.shape) - 1 else None
        out = self._new_tensor(o, tok, len(o.output_shapes[0]) - 1)
        n_params = sum(_numel(s) for s in pshapes)
        bias = sum(_numel(s) for s in pshapes if len(s) == 1)

        def t(mm: float, nn: float, kk: float) -> float:   # fwd + dgrad + wgrad
            c = self.cluster
            return gemm_time(mm, nn, kk, c) + gemm_time(mm, kk, nn, c) + gemm_time(nn, kk, mm, c)

        def strat(label: str, ins: str, outl: str, time_s: float, params_per_gpu: float) -> _Strat:
            return _Strat(label, (ins,), outl, time_s, params_per_gpu * STATE_BYTES_PER_PARAM,
                          self._sync(params_per_gpu))

        strats = [strat("replicate", "R", "R", t(m, n, k), n_params)]
        if self._allowed(x, "S") and tok is not None and self._allowed(out, "S"):
            strats.append(strat("sequence", "S", "S", t(m / tp, n, k), n_params))
        if tp > 1 and n % tp == 0:
            strats.append(strat("colwise", "R", "F", t(m, n / tp, k), n_params / tp))
        if tp > 1 and k % tp == 0 and x.feat == len(x.shape) - 1 and self._allowed(x, "F"):
            strats.append(strat("rowwise", "F", "P", t(m, n, k / tp), (n_params - bias) / tp + bias))
        self._emit(o, [x_name], strats, rep="linear", weight=n_params)

    def _sdpa(self, o: OpInfo, act: list[str]) -> None:
        q, k, v = (self.tensors[a] for a in act[:3])
        out = self._new_tensor(o, q.tok, q.feat)
        full = (attention_time(o.fwd_flops * self.attn_scale, self.cluster, backward=False)
                + attention_time(o.fwd_flops * self.attn_scale, self.cluster, backward=True))
        extra = ("R",) * (len(act) - 3)
        strats = [_Strat("replicate", ("R",) * len(act), "R", full)]
        heads = [len(t.shape) - 3 for t in (q, k, v)]
        if all(t.feat == h and h >= 0 and self._allowed(t, "F") for t, h in zip((q, k, v), heads)) \
                and self._allowed(out, "F"):
            strats.append(_Strat("heads", ("F", "F", "F") + extra, "F", full / self.tp))
        self._emit(o, act, strats, rep="attention")

    def _matmul(self, o: OpInfo, act: list[str]) -> None:
        """Activation x activation (eager attention, bmm): a (.., i, k) @ b (.., k, j)."""
        a, b = (self.tensors[n] for n in act)
        r = len(o.output_shapes[0])
        feat = a.feat if a.feat is not None and a.feat < len(a.shape) - 2 else None
        feat = feat + (r - len(a.shape)) if feat is not None else None
        tok = r - 2 if a.tok == len(a.shape) - 2 else None
        out = self._new_tensor(o, tok, feat)
        full = self._flop_time(o, 1.0)
        strats = [_Strat("replicate", ("R", "R"), "R", full)]
        if feat is not None and self._allowed(a, "F") and b.feat == a.feat + len(b.shape) - len(a.shape) \
                and self._allowed(b, "F"):
            strats.append(_Strat("heads", ("F", "F"), "F", self._flop_time(o, 1 / self.tp)))
        if tok is not None and self._allowed(a, "S") and self._allowed(out, "S"):
            strats.append(_Strat("sequence", ("S", "R"), "S", self._flop_time(o, 1 / self.tp)))
        self._emit(o, act, strats, rep="attention")

    def _mapped(self, o: OpInfo, act: list[str], base: str, pshapes: list[tuple[int, ...]]) -> None:
        """Ops whose output dims follow their inputs' dims: views, element-wise, norms, row ops,
        concatenation, reductions. Anything else is opaque: R -> R only."""
        out_shape = tuple(o.output_shapes[0]) if o.output_shapes else ()
        pw = _pointwise(o.target)
        view_like = o.kind == "view" or base in _IDENTITY or base in _PERMUTE
        known = view_like or pw or base in _NORMS or base in _ROW or base in _CAT or base in _SUMS
        if view_like:       # other inputs (type_as's dtype source) are not read as data
            act = act[:1]
        data = act
        shapes = {n: tuple(s) for n, s in zip(o.inputs, o.input_shapes)}
        maps = {n: _alignments(shapes[n], out_shape, base) for n in data}
        where: dict[str, dict[str, int | None]] = {}
        for n in data:
            t = self.tensors[n]
            where[n] = {"S": _follow(t.tok, t.shape, out_shape, maps[n]),
                        "F": _follow(t.feat, t.shape, out_shape, maps[n])}
        first = lambda lay: next((where[n][lay] for n in data if where[n][lay] is not None), None)
        out = self._new_tensor(o, first("S"), first("F"))
        cost = self._pointwise_time(o)
        n_params = sum(_numel(s) for s in pshapes)
        full = _Strat("replicate", ("R",) * len(act), "R", cost, n_params * STATE_BYTES_PER_PARAM,
                      self._sync(n_params))
        strats = [full]
        if known:
            for lay in ("S", "F"):
                s = self._sharded(o, act, data, where, out, lay, base, pshapes, cost, maps)
                if s is not None:
                    strats.append(s)
            strats.extend(self._partial(o, act, data, base, cost))
        self._emit(o, act, strats, rep="param" if pshapes else "", weight=n_params)

    def _sharded(self, o, act, data, where, out, lay, base, pshapes, cost, maps) -> _Strat | None:
        e = out.tok if lay == "S" else out.feat
        reduced_any = False
        ins = []
        for n in act:
            if n not in data:
                ins.append("R")
                continue
            t = self.tensors[n]
            label = t.tok if lay == "S" else t.feat
            if where[n][lay] is not None and where[n][lay] == e:
                ins.append(lay if self._allowed(t, lay) else "")
            elif label is not None and where[n][lay] is None and base in _SUMS and \
                    _numel(t.shape) > _numel(out.shape) and self._allowed(t, lay):
                ins.append(lay)               # the sharded dim is summed away: partial result
                reduced_any = True
            else:
                ins.append("R")
        if "" in ins or lay not in ins:
            return None
        if reduced_any:
            return _Strat(_LABEL_OF_LAYOUT[lay], tuple(ins), "P", cost / self.tp)
        if e is None or not self._allowed(out, lay):
            return None
        last = len(out.shape) - 1
        if base in _ROW and e == last:
            return None
        if base in _NORMS and e >= len(out.shape) - max([len(s) for s in pshapes] or [1]):
            return None
        if base not in _SUMS and not (o.kind == "view" or base in _IDENTITY or base in _PERMUTE
                                      or _pointwise(o.target) or base in _NORMS or base in _ROW
                                      or base in _CAT):
            return None
        per_gpu = 0.0
        for s in pshapes:   # a parameter aligned with the sharded dim is sliced, else replicated
            off = len(out.shape) - len(s)
            sliced = 0 <= e - off < len(s) and s[e - off] == out.shape[e]
            per_gpu += _numel(s) / (self.tp if sliced else 1)
        return _Strat(_LABEL_OF_LAYOUT[lay], tuple(ins), lay, cost / self.tp,
                      per_gpu * STATE_BYTES_PER_PARAM, self._sync(per_gpu))

    def _partial(self, o, act, data, base, cost) -> list[_Strat]:
        """Linear ops pass partial sums through: views, cat, sums, add/sub/neg of partials only,
        and a product with one partial factor (the others replicated or constant)."""
        view_like = o.kind == "view" or base in _IDENTITY or base in _PERMUTE
        if view_like or base in _SUMS:
            return [_Strat("partial", tuple("P" if n in data else "R" for n in act), "P", cost)]
        consts = self._param_numels(o) or any(n in self.consts for n in o.inputs)
        if (base in _LINEAR_PW or base in _CAT) and not consts:
            return [_Strat("partial", ("P",) * len(act), "P", cost)]
        if base == "mul":
            return [_Strat("partial", tuple("P" if i == j else "R" for i in range(len(act))), "P", cost)
                    for j in range(len(act))]
        return []

    # -- routed-expert MoE region as one unit
    def _moe_unit(self, ops: list[OpInfo]) -> dict | None:
        router = next((o for o in ops if o.role == "router"), None)
        if router is None:
            return None
        x = next((n for n in router.inputs if n not in self.params), None)
        xshape = next((tuple(s) for n, s in zip(router.inputs, router.input_shapes) if n == x), None)
        index = {o.name: i for i, o in enumerate(ops)}
        users: dict[str, list[str]] = {}
        for o in ops:
            for n in o.inputs:
                users.setdefault(n, []).append(o.name)
        below, stack = set(), [router.name]
        while stack:
            n = stack.pop()
            if n not in below:
                below.add(n)
                stack.extend(users.get(n, []))
        combine = next((o for o in ops if o.name in below and o.output_shapes
                        and tuple(o.output_shapes[0]) == xshape and o.dtype.startswith(("float", "bfloat"))), None)
        if combine is None or x is None:
            return None

        def ancestors(name: str) -> set[str]:
            seen, st = set(), [name]
            while st:
                n = st.pop()
                if n in seen or n not in self.by_name:
                    continue
                seen.add(n)
                st.extend(self.by_name[n].inputs)
            return seen

        members = ancestors(combine.name) - ancestors(x)
        if any(u not in members for m in members - {combine.name} for u in users.get(m, [])):
            return None       # something inside escapes the unit (aux losses, ...): treat op by op
        if any(index[m] < index.get(x, -1) for m in members):
            return None
        return {"members": members, "out": combine.name, "x": x, "router": router}

    def _add_unit(self, combine: OpInfo, unit: dict) -> None:
        members = [self.by_name[m] for m in sorted(unit["members"], key=list(self.by_name).index)]
        x = unit["x"]
        if x not in self.tensors:
            raise TraceError(f"MoE layer {self.rel(combine.module)!r}: its router reads {x!r}, "
                             f"which is not computed from the block input")
        xt = self.tensors[x]
        self._new_tensor(combine, xt.tok, xt.feat)
        others = [n for o in members for n in o.inputs
                  if n in self.tensors and n != x and n not in unit["members"]]
        act = [x] + list(dict.fromkeys(others))
        cost = sum(self._flop_time(o, 1.0) if o.kind == "linear" else self._pointwise_time(o)
                   for o in members)
        router_params = [tuple(s) for n, s in zip(unit["router"].inputs, unit["router"].input_shapes)
                         if n in self.params]
        rp = sum(_numel(s) for s in router_params)
        state, sync = rp * STATE_BYTES_PER_PARAM, self._sync(rp)
        rest = ("R",) * (len(act) - 1)
        strats = [_Strat("replicate", ("R",) + rest, "R", cost, state, sync)]
        if self._allowed(xt, "S"):
            strats.append(_Strat("sequence", ("S",) + rest, "S", cost / self.tp, state, sync))
        experts = sorted({self.rel(o.module) for o in members if o.role.startswith("expert")})
        self._emit(combine, act, strats, rep="unit", weight=rp)
        self.ops[-1].module = self.rel(unit["router"].module)
        self.ops[-1].extra_modules = tuple((m, "expert") for m in experts)


# ---- conversions -------------------------------------------------------------------------------

def _conversion(src: str, dst: str, nbytes: float, a: _Analysis) -> float | None:
    """Seconds to turn a tensor held in `src` into `dst` on the TP group (None: impossible)."""
    if src == dst or src == "R":
        return 0.0
    if dst == "P":
        return None
    g, c = a.group, a.cluster
    if src == "P":
        return collective_time("all_reduce" if dst == "R" else "reduce_scatter", nbytes, g, c)
    if dst == "R":
        return collective_time("all_gather", nbytes, g, c)
    return collective_time("all_to_all", nbytes / a.tp, g, c)


# ---- the ILP ----------------------------------------------------------------------------------

class ShardingProblem:
    """One block at one TP degree: `solve()` it, or `evaluate()` a (partial) assignment."""

    def __init__(self, analysis: _Analysis, *, state_budget_bytes: float | None, state_slack: float,
                 solver: str, time_limit_s: float):
        self.a = analysis
        self.solver, self.time_limit_s = solver, time_limit_s
        self.min_state = sum(min(s.state for s in o.strats) for o in analysis.ops)
        self.budget = (state_budget_bytes if state_budget_bytes is not None
                       else self.min_state * (1 + state_slack))
        first = analysis.tensors[analysis.inputs[0]]
        self.io_layouts = ["R"] + (["S"] if analysis.tp > 1 and analysis._allowed(first, "S") else [])

    # -- module labels
    def modules(self) -> dict[str, list[_Op]]:
        """Module -> the ops its placement label comes from (linears, attention, param readers)."""
        groups: dict[str, list[_Op]] = {}
        for o in self.a.ops:
            if o.rep:
                groups.setdefault(o.module, []).append(o)
        rank = {"unit": 0, "linear": 1, "attention": 2, "param": 3}
        return {m: [o for o in ops if rank[o.rep] == min(rank[x.rep] for x in ops)]
                for m, ops in groups.items()}

    def _fix(self, assignment: Mapping[str, str]) -> dict[str, set[int]]:
        """Op name -> allowed strategy indices, from module or op names."""
        mods = self.modules()
        ops = {o.name: o for o in self.a.ops}
        allowed: dict[str, set[int]] = {}
        for key, label in assignment.items():
            if key == "io":
                continue
            if label not in PLACEMENTS and label not in _LABEL_OF_LAYOUT.values():
                raise ConfigError(f"placement {label!r} for {key!r} is unknown; known: {PLACEMENTS}")
            targets = mods.get(key) or ([ops[key]] if key in ops else None)
            if targets is None:
                expert = [m for o in self.a.ops for m, lab in o.extra_modules if m == key]
                if expert and label == "expert":
                    continue
                raise LayoutError(f"block {self.a.block.signature} has no module or op {key!r} with a "
                                  f"placement; its modules are: {', '.join(sorted(mods))}")
            for o in targets:
                ok = {i for i, s in enumerate(o.strats) if s.label == label}
                if not ok:
                    raise LayoutError(
                        f"{key!r} cannot be {label!r} at tp={self.a.tp}: "
                        f"possible here: {', '.join(sorted({s.label for s in o.strats}))} "
                        f"(sizes must divide by tp, and sequence sharding needs sp_allowed)")
                allowed[o.name] = ok
        return allowed

    # -- model
    def _model(self, fixed: Mapping[str, set[int]], io: str | None, memory: bool) -> _Model:
        return _Model(self, fixed, io, memory)

    def solve(self) -> BlockSharding:
        t0 = time.perf_counter()
        if self.budget < self.min_state * (1 - 1e-9):
            raise DoesNotFitError(
                f"block {self.a.block.signature}: its weights need at least "
                f"{self.min_state / 1e9:.3g} GB of training state per GPU at tp={self.a.tp}, more "
                f"than the {self.budget / 1e9:.3g} GB budget; raise state_budget_bytes or tp")
        model = self._model({}, None, memory=True)
        status = model.run()
        if status not in ("optimal", "feasible"):
            raise LayoutError(self._diagnose(status))
        return model.result(time.perf_counter() - t0, status)

    def evaluate(self, assignment: Mapping[str, str]) -> float:
        """Seconds of the best assignment that agrees with `assignment` (module FQN or op name ->
        placement; key "io" -> "replicate" | "sequence" for the block input/output), by the
        same cost function as `solve`. Memory is not constrained: this prices, it does not judge."""
        io = assignment.get("io")
        if io is not None and io not in ("replicate", "sequence"):
            raise ConfigError(f"io must be 'replicate' or 'sequence', got {io!r}")
        lay = {"replicate": "R", "sequence": "S", None: None}[io]
        if lay is not None and lay not in self.io_layouts:
            raise LayoutError(f"the block input cannot be sequence-sharded here (sp_allowed=False, "
                              f"or the sequence does not divide by tp={self.a.tp})")
        model = self._model(self._fix(assignment), lay, memory=False)
        status = model.run()
        if status not in ("optimal", "feasible"):
            raise LayoutError(f"no valid completion of {dict(assignment)} (solver: {status})")
        return model.objective()

    def cost_of(self, choices: Mapping[str, str], io: str) -> float:
        """Exact cost of a complete op-level assignment (op name -> strategy label, io layout
        R or S), computed directly, without the solver: checks the ILP's linearisation."""
        pick = {}
        for o in self.a.ops:
            idx = [i for i, s in enumerate(o.strats) if s.label == choices[o.name]]
            pick[o.name] = o.strats[idx[0]]
        total = sum(s.compute + s.sync for s in pick.values()) + self.a.fixed_compute
        produced = {n: io for n in self.a.inputs}
        produced.update({o.name: pick[o.name].out for o in self.a.ops})
        reads: dict[str, set[str]] = {self.a.out_name: {io}}
        grads: dict[str, set[str]] = {self.a.out_name: {io}}
        for o in self.a.ops:
            s = pick[o.name]
            for n, lay, g in zip(o.inputs, s.ins, s.grads):
                reads.setdefault(n, set()).add(lay)
                grads.setdefault(n, set()).add(g)
        for n, p in produced.items():
            t = self.a.tensors[n]
            for lay in reads.get(n, ()):
                c = _conversion(p, lay, t.nbytes, self.a)
                total += math.inf if c is None else c
            need = "R" if p == "P" else p
            for g in grads.get(n, ()) if t.grad else ():
                c = _conversion(g, need, t.nbytes, self.a)
                total += math.inf if c is None else c
        return total

    def _diagnose(self, status: str) -> str:
        where = f"block {self.a.block.signature} at tp={self.a.tp}"
        free = self._model({}, None, memory=False)
        if free.run() in ("optimal", "feasible"):
            return (f"{where}: no assignment keeps the weights within {self.budget / 1e9:.3g} GB of "
                    f"training state per GPU (the smallest reachable is {self.min_state / 1e9:.3g} GB); "
                    f"raise state_budget_bytes or state_slack")
        return f"{where}: the sharding ILP found no solution ({status}); please report the model"


class _Model:
    """The pulp model of one ShardingProblem, one method per constraint family."""

    def __init__(self, problem: ShardingProblem, fixed: Mapping[str, set[int]], io: str | None,
                 memory: bool):
        self.p, self.a = problem, problem.a
        self.lp = pulp.LpProblem("block_sharding", pulp.LpMinimize)
        self.x = {(o.name, i): pulp.LpVariable(f"x_{j}_{i}", cat="Binary")
                  for j, o in enumerate(self.a.ops) for i in range(len(o.strats))}
        self.b = {lay: pulp.LpVariable(f"b_{lay}", cat="Binary") for lay in problem.io_layouts}
        self.compute = pulp.lpSum(self.x[o.name, i] * s.compute for o in self.a.ops
                                  for i, s in enumerate(o.strats))
        self.sync = pulp.lpSum(self.x[o.name, i] * s.sync for o in self.a.ops
                               for i, s in enumerate(o.strats))
        self.comm_terms: list = []
        self.one_strategy(fixed)
        self.block_io(io)
        self.conversion(self.consumption())
        if memory:
            self.memory()
        self.comm = pulp.lpSum(self.comm_terms)
        # the solver sees milliseconds and gigabytes: seconds (1e-6) next to bytes (1e9) in one
        # matrix make its tolerances meaningless
        self.lp += (self.compute + self.sync + self.comm) * _MS

    def produced(self, name: str) -> dict[str, list]:
        if name in self.a.inputs:
            return {lay: [v] for lay, v in self.b.items()}
        op = next(o for o in self.a.ops if o.name == name)
        out: dict[str, list] = {}
        for i, s in enumerate(op.strats):
            out.setdefault(s.out, []).append(self.x[name, i])
        return out

    def one_strategy(self, fixed: Mapping[str, set[int]]) -> None:
        for o in self.a.ops:
            ok = fixed.get(o.name)
            self.lp += pulp.lpSum(self.x[o.name, i] for i in range(len(o.strats))
                                  if ok is None or i in ok) == 1, f"one_strategy_{o.name}"
            if ok is not None:
                for i in set(range(len(o.strats))) - ok:
                    self.lp += self.x[o.name, i] == 0

    def block_io(self, io: str | None) -> None:
        self.lp += pulp.lpSum(self.b.values()) == 1, "block_io"
        if io is not None:
            self.lp += self.b[io] == 1, "block_io_fixed"

    def consumption(self) -> dict:
        """r[e,l]: the layout in which consumer e (an op, or the next block) reads each tensor."""
        reads: dict[str, dict[str, dict[str, list]]] = {}
        for o in self.a.ops:
            for i, s in enumerate(o.strats):
                for n, lay, g in zip(o.inputs, s.ins, s.grads):
                    e = reads.setdefault(n, {}).setdefault(o.name, {})
                    e.setdefault(("f", lay), []).append(self.x[o.name, i])
                    e.setdefault(("b", g), []).append(self.x[o.name, i])
        nxt = reads.setdefault(self.a.out_name, {}).setdefault("<next block>", {})
        for lay, v in self.b.items():   # the next block reads the output as this block's input
            nxt.setdefault(("f", lay), []).append(v)
            nxt.setdefault(("b", lay), []).append(v)
        return reads

    def conversion(self, reads: dict) -> None:
        """Per edge, a joint distribution w[e,p,l] over (produced, read) layouts whose marginals
        are the producer's and the consumer's choices; y[t,p,l] >= w[e,p,l] charges each
        conversion once per tensor and target layout, however many consumers share it."""
        k = 0
        for name, edges in reads.items():
            t = self.a.tensors[name]
            produced = {p: pulp.lpSum(v) for p, v in self.produced(name).items()}
            charged: dict[tuple[str, str, str], pulp.LpVariable] = {}
            for e, want in edges.items():
                for side in ("f", "b"):
                    if side == "b" and not t.grad:
                        continue
                    lays = [lay for (sd, lay) in want if sd == side]
                    w = {}
                    for p in produced:
                        for lay in lays:
                            src, dst = (p, lay) if side == "f" else (lay, "R" if p == "P" else p)
                            cost = _conversion(src, dst, t.nbytes, self.a)
                            if cost is None:
                                continue
                            k += 1
                            w[p, lay] = v = pulp.LpVariable(f"w_{k}", lowBound=0, upBound=1)
                            if cost > 0:
                                key = (side, p, lay)
                                if key not in charged:
                                    charged[key] = pulp.LpVariable(f"y_{k}", lowBound=0, upBound=1)
                                    self.comm_terms.append(cost * charged[key])
                                self.lp += charged[key] >= v
                    for p, out in produced.items():
                        self.lp += pulp.lpSum(w[p, lay] for lay in lays if (p, lay) in w) == out
                    for lay in lays:
                        self.lp += pulp.lpSum(w[p, lay] for p in produced if (p, lay) in w) == \
                            pulp.lpSum(want[side, lay])

    def memory(self) -> None:
        if self.p.min_state > 0:
            self.lp += pulp.lpSum(self.x[o.name, i] * (s.state / _GB) for o in self.a.ops
                                  for i, s in enumerate(o.strats)) <= self.p.budget / _GB * (1 + 1e-9), "memory"

    # -- solve and read back
    def run(self) -> str:
        self.solver_name = resolve_solver(self.p.solver)
        status = solve(self.lp, time_limit_s=self.p.time_limit_s, solver=self.solver_name)
        if proved_optimal(self.lp):
            return "optimal"
        return "feasible" if has_solution(self.lp) else status

    def objective(self) -> float:
        return float(pulp.value(self.lp.objective)) / _MS + self.a.fixed_compute

    def choice(self, o: _Op) -> _Strat:
        best = max(range(len(o.strats)), key=lambda i: self.x[o.name, i].value() or 0.0)
        return o.strats[best]

    def result(self, solve_s: float, status: str) -> BlockSharding:
        a = self.a
        picks = {o.name: self.choice(o) for o in a.ops}
        placements: dict[str, str] = {}
        for module, ops in self.p.modules().items():
            best = max(ops, key=lambda o: o.state_weight)
            s = picks[best.name]
            placements[module] = s.label if s.label in PLACEMENTS else "replicate"
            for m, label in best.extra_modules:
                placements[m] = label
        io = max(self.b, key=lambda lay: self.b[lay].value() or 0.0)
        ops = tuple(OpChoice(name=o.name, module=o.module, strategy=picks[o.name].label,
                             inputs=picks[o.name].ins, output=picks[o.name].out) for o in a.ops)
        state = sum(picks[o.name].state for o in a.ops)
        return BlockSharding(
            signature=a.block.signature, tp=a.tp, tokens=a.tokens,
            placements=placements, io_layout="sequence" if io == "S" else "replicate",
            time_s=self.objective(), compute_s=float(pulp.value(self.compute) or 0.0) + a.fixed_compute,
            comm_s=float(pulp.value(self.comm) or 0.0), grad_sync_s=float(pulp.value(self.sync) or 0.0),
            state_bytes=state, status=status, solver=self.solver_name, solve_s=solve_s, ops=ops)


# ---- entry points ------------------------------------------------------------------------------

def _check(block: BlockProfile, tp: int, tokens: int, seq_len: int | None, microbatches: int,
           time_limit_s: float, state_slack: float) -> None:
    if not isinstance(block, BlockProfile):
        raise ConfigError(f"shard_block takes a BlockProfile (from meshplan.planner.trace), got "
                          f"{type(block).__name__}")
    for label, v in (("tp", tp), ("tokens", tokens), ("microbatches", microbatches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{label} must be a positive int, got {v!r}")
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise ConfigError(f"seq_len must be a positive int or None, got {seq_len!r}")
    if not (time_limit_s > 0):
        raise ConfigError(f"time_limit_s must be positive, got {time_limit_s!r}")
    if not (state_slack >= 0):
        raise ConfigError(f"state_slack must be >= 0, got {state_slack!r}")
    if not block.ops:
        raise TraceError(f"block {block.signature} has no traced ops (an analytic profile?); trace "
                         f"the model with meshplan.planner.trace.trace to shard its blocks")


def build_problem(block: BlockProfile, cluster, *, tp: int, tokens: int, seq_len: int | None = None,
                  sp_allowed: bool = True, microbatches: int = 1,
                  state_budget_bytes: float | None = None, state_slack: float = DEFAULT_STATE_SLACK,
                  solver: str = "auto", time_limit_s: float = 5.0) -> ShardingProblem:
    """The sharding problem of one block instance (see the module docstring).

    tokens: tokens per micro-batch (mbs x seq_len); seq_len: sequence length for attention's
    quadratic cost and for sequence-shard divisibility (default: the length the block was traced
    at); microbatches: micro-batches per optimizer step (weight-gradient traffic is amortised
    over them); state_budget_bytes: per-GPU parameter-state cap for one block instance.
    """
    _check(block, tp, tokens, seq_len, microbatches, time_limit_s, state_slack)
    analysis = _Analysis(block, cluster, tp=tp, tokens=tokens, seq_len=seq_len,
                         sp_allowed=sp_allowed, microbatches=microbatches)
    return ShardingProblem(analysis, state_budget_bytes=state_budget_bytes, state_slack=state_slack,
                           solver=solver, time_limit_s=time_limit_s)


_CACHE: OrderedDict[tuple, BlockSharding] = OrderedDict()


def shard_block(block: BlockProfile, cluster, *, tp: int, tokens: int, sp_allowed: bool = True,
                time_limit_s: float = 5.0, **options) -> BlockSharding:
    """Solve the sharding ILP for one unique block (cached; `options` as in `build_problem`)."""
    key = (block.signature, len(block.ops), block.ops[0].input_shapes if block.ops else (), tp,
           tokens, sp_allowed, tuple(sorted(options.items())), cluster.fingerprint())
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    result = build_problem(block, cluster, tp=tp, tokens=tokens, sp_allowed=sp_allowed,
                           time_limit_s=time_limit_s, **options).solve()
    _CACHE[key] = result
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return result


def shard_profile(profile: ModelProfile, cluster, *, tp: int, tokens: int,
                  **options) -> dict[str, BlockSharding]:
    """One BlockSharding per unique block of `profile`, keyed by block signature."""
    if not isinstance(profile, ModelProfile):
        raise ConfigError(f"shard_profile takes a ModelProfile, got {type(profile).__name__}")
    options.setdefault("seq_len", profile.seq_len)
    return {b.signature: shard_block(b, cluster, tp=tp, tokens=tokens, **options)
            for b in profile.blocks}
