"""Intra-block sharding ILP: choose how every op of a block is split over the TP group.

    sharding = shard_block(block, cluster, tp=8, tokens=8192)     # -> BlockSharding
    sharding.placements    # {"attention.wq": "colwise", ..., "attention_norm": "sequence"}
    problem = build_problem(block, cluster, tp=8, tokens=8192)
    problem.evaluate({"attention.wq": "replicate"})               # best cost with that fixed

It reads the traced op graph of one block (`BlockProfile.ops`, edges = `OpInfo.inputs`), so any
traceable model is handled, not only known classes: Megatron-LM's pattern (QKV and FC1
column-parallel, output and FC2 row-parallel, norms sequence-parallel) is an outcome, not an input.

Layouts. Every activation tensor t lives on the TP group in one layout l in L = {R, S, F, P}:
R replicated; S sharded on the token (sequence) dim; F sharded on the feature dim (hidden, or
heads after a head split); P partial sums awaiting a reduction. Which dim is "token" and which
"feature" is found by propagating labels from the block input (B, S, H) through each op's shapes
(a shard follows the major dim of a split or merge; transposes move it). Blocks are traced at
batch 1, so the token dim is the sequence dim. With `sp_allowed=False` no tensor is S and the
residual stream (tensors reached from the block input with no weight in between: norms, residual
adds) is never sharded at all, as in Megatron without --sequence-parallel.

Strategies. Op o has strategies s in St(o): a layout per activation input, an output layout, a
compute time c(o,s) (forward + backward, per GPU), the per-GPU training state m(o,s) of the
parameters it reads and their gradient traffic u(o,s). A linear with weight (n, k): replicate
(R -> R, full GEMMs), sequence (S -> S, 1/tp of the rows, weight replicated), colwise (R -> F,
n/tp) or rowwise (F -> P, k/tp); attention: replicate or heads (F -> F); norms R -> R or S -> S
(they reduce over the feature dim, so never F); element-wise ops keep their inputs' layout;
sum/mean over a sharded dim gives P; unknown ops are R -> R only. A routed-expert region (router
-> dispatch -> experts -> combine) is one unit on R or S tokens; its experts are labelled
"expert": the EP axis shards them, not this ILP.

Variables
    x[o,s] in {0,1}     op o uses strategy s
    b[l]   in {0,1}     layout of the block input (= output), l in {R, S}
    w[e,p,l] in [0,1]   edge e (tensor t -> one consumer): t is produced in p and read in l
    v[e,p,l] in [0,1]   the same for the gradient handed back along e (read in l, needed in p)
    y[t,p,l] in [0,1]   t is converted p -> l forward;  z[t,p,l]: its gradient l -> need(p)
with out(t,p) = sum of x[o,s] over the producer's strategies whose output is p (b[p] for the
input), r(e,l) = sum of x[c,s] over the consumer's strategies reading t in l, and rg(e,l) the
same for the gradient layout the consumer hands back: P when it reads R but its output is
sharded (a column-parallel linear's input), R when it reads P, else l. need(p) = R if p = P.

Objective (seconds per micro-batch of `tokens` tokens, forward + backward)
    min  sum x[o,s] (c(o,s) + u(o,s)) + sum y[t,p,l] C(p -> l, t) + sum z[t,p,l] C(l -> need(p), t)
C is the collective on the TP group (meshplan.cost_models.comm): R -> S/F/P free (local slice);
S, F -> R all-gather; S <-> F all-to-all; P -> R all-reduce; P -> S/F reduce-scatter; S, F -> P
impossible. u(o,s) is the all-reduce time of the per-GPU weight gradient divided by
`microbatches`: every replica of a weight reduces its gradient once a step (over DP, and over
TP too when the weight is replicated while its work is sharded), so replicated weights are not
free. Every Megatron collective, forward and backward, comes out of these rules.

Constraint families (one method of `_Model` each)
    one_strategy    sum_s x[o,s] = 1                                       every op o
    block_io        sum_l b[l] = 1; the next block is one more consumer of the output, reading
                    it in b's layout (it consumes this block's output as this block consumed its input)
    edge_marginals  sum_l w[e,p,l] = out(t,p),  sum_p w[e,p,l] = r(e,l)    (same for v with rg);
                    w[e,p,l] = 0 where p -> l is impossible
    charges         y[t,p,l] >= w[e,p,l], z[t,p,l] >= v[e,p,l] for every edge e of t: a
                    conversion is paid once per tensor and target layout, so Q, K and V share
                    one all-gather as in Megatron
    memory          sum x[o,s] m(o,s) <= M; M = `state_budget_bytes`, by default the smallest
                    reachable state times 1 + `state_slack`: TP exists to divide model state, so
                    time is minimised among near-minimal-memory assignments
The edge marginals are the local-polytope form: on transformer blocks the LP relaxation is
already integral, so HiGHS and CBC finish at the root. Activation memory is not modelled.

Results are cached per (block signature, tp, tokens, options, cluster fingerprint): repeated
blocks share one solution.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Mapping

import pulp

from meshplan.cost_models import constants as K
from meshplan.cost_models.comm import collective_time, group
from meshplan.cost_models.compute import attention_time, elementwise_time, gemm_time, matmul_rate
from meshplan.errors import ConfigError, DoesNotFitError, LayoutError, TraceError
from meshplan.ir.profile import BlockProfile, ModelProfile, OpInfo
from meshplan.planner.solver import has_solution, proved_optimal, resolve_solver, solve

__all__ = ["PLACEMENTS", "LAYOUTS", "OpChoice", "Reshard", "BlockSharding", "ShardingProblem",
           "build_problem", "shard_block", "shard_profile"]

LAYOUTS = ("R", "S", "F", "P")
# What the runtime applies per module: linears colwise / rowwise / replicate / sequence (tokens
# sharded, weight replicated); attention modules heads / replicate; norms sequence / replicate /
# feature (hidden-sharded, weight sliced); routed experts "expert" (sharded by the EP axis).
PLACEMENTS = ("colwise", "rowwise", "replicate", "sequence", "heads", "feature", "expert")
_LABEL = {"R": "replicate", "S": "sequence", "F": "feature", "P": "partial"}

# Default allowance over the smallest reachable per-GPU model state (see the memory family): lets
# small weights (norms, router, biases) stay replicated, but not a projection matrix.
DEFAULT_STATE_SLACK = 0.05
# Training state per parameter: bf16 weight + fp32 gradient + Adam master, m, v (constants.py).
STATE_BYTES_PER_PARAM = K.PARAM_BYTES + K.GRAD_BYTES + K.OPTIMIZER_BYTES
# A memory-bound op's backward reads the output gradient and the saved inputs and writes the
# input gradients: about twice its forward traffic (derived).
ELEMENTWISE_BWD_RATIO = 2.0
_CACHE_SIZE = 512
_MS, _GB = 1e3, 1e9   # units the solver sees: seconds (1e-6) beside bytes (1e9) break tolerances

_SDPA = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
         "_scaled_dot_product_flash_attention_for_cpu"}
_MATMUL = {"bmm", "matmul", "mm"}
_LINEAR = {"linear", "mm", "addmm", "matmul"}
_NORMS = {"layer_norm", "rms_norm", "native_layer_norm", "_fused_rms_norm"}
_ROW = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax", "cumsum",
        "cumprod", "sort", "argsort", "logcumsumexp"}      # along the last dim (args are not in the IR)
_SWAP = {"transpose", "t", "mT", "swapaxes", "swapdims", "adjoint"}
_PERMUTE = _SWAP | {"permute", "movedim"}
_VIEWS = _PERMUTE | {"to", "_to_copy", "clone", "contiguous", "type_as", "detach", "alias",
                     "dropout", "native_dropout", "lift_fresh_copy", "getitem", "expand",
                     "expand_as", "slice", "select", "narrow", "split", "chunk", "unbind",
                     "split_with_sizes", "view", "reshape", "_unsafe_view", "flatten", "unflatten",
                     "squeeze", "unsqueeze", "view_as"}
_CAT = {"cat", "concat", "concatenate", "stack"}
_SUMS = {"sum", "mean"}                                    # linear: a summed-away shard gives P
_REDUCE = _SUMS | {"amax", "amin", "max", "min", "var", "std", "var_mean", "prod", "logsumexp",
                   "linalg_vector_norm", "norm", "argmax", "argmin", "any", "all"}
_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


# ---- results -----------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class OpChoice:
    """The strategy chosen for one op: what it reads (and in which layout) and produces."""

    name: str
    module: str                   # relative to the block ("attention.wq")
    strategy: str                 # "colwise", "rowwise", "replicate", "sequence", "heads", ...
    sources: tuple[str, ...]      # activation inputs (op names, or the block input)
    inputs: tuple[str, ...]       # the layout each source is read in
    output: str                   # the layout produced

    def __post_init__(self) -> None:
        if self.output not in LAYOUTS or any(x not in LAYOUTS for x in self.inputs):
            raise ConfigError(f"op {self.name!r}: layouts must be among {LAYOUTS}")
        if len(self.sources) != len(self.inputs):
            raise ConfigError(f"op {self.name!r}: one input layout per source")


@dataclass(frozen=True, kw_only=True)
class Reshard:
    """One collective the assignment implies (forward, or the backward of a gradient)."""

    tensor: str
    direction: str                # "forward" | "backward"
    src: str
    dst: str
    collective: str               # all_gather, reduce_scatter, all_reduce, all_to_all
    seconds: float


@dataclass(frozen=True, kw_only=True)
class BlockSharding:
    """The ILP's answer for one unique block at one TP degree (treat the dict as read-only)."""

    signature: str
    tp: int
    tokens: int
    placements: dict[str, str]    # module FQN relative to the block -> one of PLACEMENTS
    io_layout: str                # block input and output: "replicate" | "sequence"
    time_s: float                 # compute + comm + gradient traffic, per micro-batch
    compute_s: float
    comm_s: float
    grad_sync_s: float
    state_bytes: float            # per-GPU parameter state of one block instance
    status: str                   # "optimal" | "feasible" (stopped at the time limit)
    solver: str
    solve_s: float
    ops: tuple[OpChoice, ...] = field(default=(), repr=False)
    reshards: tuple[Reshard, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.tokens < 1:
            raise ConfigError(f"tp and tokens must be >= 1, got tp={self.tp}, tokens={self.tokens}")
        bad = {m: p for m, p in self.placements.items() if p not in PLACEMENTS}
        if bad:
            raise ConfigError(f"unknown placements {bad}; known: {PLACEMENTS}")
        if self.io_layout not in ("replicate", "sequence"):
            raise ConfigError(f"io_layout must be 'replicate' or 'sequence', got {self.io_layout!r}")


# ---- shapes and dim labels ---------------------------------------------------------------------

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
    except Exception:   # not resolvable here: the op is treated as opaque (R -> R only)
        return False


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _reshape_map(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int]:
    """src dim -> dst dim under a contiguous reshape: dims group by equal products, and the first
    non-1 dim of a group maps to the group's first non-1 dim (a shard on the major dim survives a
    split or merge; one on a minor dim does not)."""
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
    """Candidate maps src dim -> dst dim consistent with the shapes (absent dims are dropped).
    Op arguments are not in the IR, so equal sizes can leave several candidates."""
    n, m = len(src), len(dst)
    if base in _SWAP and n == m:      # exactly two dims trade places
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
    if math.prod(src) == math.prod(dst) and src != dst:
        return [_reshape_map(src, dst)]
    if n == m:
        return [{d: d for d in range(n)}]
    cands = []
    if n < m:         # broadcast (right-aligned) or inserted dims (stack, unsqueeze + expand)
        if all(src[d] in (1, dst[d + m - n]) for d in range(n)):
            cands.append({d: d + m - n for d in range(n)})
        cands += [dict(enumerate(pos)) for pos in itertools.combinations(range(m), n)
                  if all(src[d] == dst[p] for d, p in enumerate(pos))]
    else:             # removed dims (select, reductions without keepdim)
        cands += [{d: e for e, d in enumerate(kept)} for kept in itertools.combinations(range(n), m)
                  if all(src[d] == dst[e] for e, d in enumerate(kept))]
    return cands


def _follow(dim: int | None, src: tuple[int, ...], dst: tuple[int, ...],
            cands: list[dict[int, int]]) -> int | None:
    """Where a label on src dim `dim` lands in dst: only if every candidate agrees and the dim
    keeps its size (or, through a reshape, heads its group)."""
    if dim is None or not cands:
        return None
    targets = {c.get(dim) for c in cands}
    if len(targets) != 1 or None in targets:
        return None
    e = targets.pop()
    reshaped = math.prod(src) == math.prod(dst) and len(cands) == 1 and src != dst
    return e if (reshaped or src[dim] == dst[e]) else None


def _reduced(dim: int | None, dst: tuple[int, ...], cands: list[dict[int, int]]) -> bool:
    """A label summed away: every candidate drops the dim or maps it to a size-1 dim."""
    return dim is not None and bool(cands) and all(c.get(dim) is None or dst[c[dim]] == 1 for c in cands)


# ---- the analysed graph ------------------------------------------------------------------------

@dataclass
class _Tensor:
    name: str
    shape: tuple[int, ...]
    nbytes: float                 # at `tokens`
    grad: bool                    # floating point: a gradient flows back
    tok: int | None = None        # dim holding tokens
    feat: int | None = None       # dim an F shard splits
    stream: bool = False          # residual stream: reached from the block input with no weight between


@dataclass
class _Strat:
    label: str                    # placement vocabulary, or the layout's name for plain ops
    ins: tuple[str, ...]          # layout read for each activation input
    out: str
    compute: float
    state: float = 0.0
    sync: float = 0.0
    grads: tuple[str, ...] = ()   # gradient layout handed back for each input


def _grad_layout(read: str, out: str) -> str:
    if read == "P":
        return "R"                # a partial's gradient is replicated
    if read == "R" and out != "R":
        return "P"                # each rank saw a slice of the work: partial input gradient
    return read


@dataclass
class _Op:
    name: str
    module: str                   # relative to the block
    inputs: tuple[str, ...]       # activation tensors read, deduplicated
    strats: list[_Strat]
    rep: str = ""                 # label source for its module: "unit"|"linear"|"attention"|"param"
    weight: float = 0.0           # parameters read
    extra: tuple[tuple[str, str], ...] = ()   # (module, label) set with it (a unit's experts)


class _Analysis:
    """Block ops -> activation tensors with dim labels, and strategies for every op."""

    def __init__(self, block: BlockProfile, cluster, *, tp: int, tokens: int, seq_len: int | None,
                 sp_allowed: bool, microbatches: int):
        self.block, self.cluster, self.tp, self.tokens = block, cluster, tp, tokens
        self.sp_allowed, self.microbatches = sp_allowed, microbatches
        self.group = group(cluster, tp, 1)      # TP is the innermost mesh axis: adjacent ranks
        ops = list(block.ops)
        self.by_name = {o.name: o for o in ops}
        self.prefix = next((i for i in block.instances
                            if any(o.module == i or o.module.startswith(i + ".") for o in ops)), "")
        self.out_name = ops[-1].name
        out_shape = tuple(ops[-1].output_shapes[0])
        self.params: dict[str, tuple[int, ...]] = {}
        self.consts: set[str] = set()
        self.inputs: list[str] = []            # the residual stream (usually one tensor)
        for o in ops:
            for name, shape in zip(o.inputs, o.input_shapes):
                if name in self.by_name:
                    continue
                if name.startswith("p_"):      # torch.export names parameter inputs p_<fqn>
                    self.params[name] = tuple(shape)
                elif tuple(shape) == out_shape and not name.startswith(("b_", "c_")):
                    if name not in self.inputs:
                        self.inputs.append(name)
                else:
                    self.consts.add(name)      # rotary tables, masks, buffers
        if not self.inputs:
            raise TraceError(
                f"block {block.instances[0] if block.instances else block.signature!r}: no input "
                f"has the block output's shape {out_shape}, so its residual stream cannot be "
                f"found; the sharding ILP needs a block whose output replaces its input")
        tok = next((d for d in range(len(out_shape) - 1) if out_shape[d] > 1), None)
        seq0 = out_shape[tok] if tok is not None else 1
        self.tokens0 = math.prod(out_shape) // max(1, out_shape[-1])
        self.scale = tokens / max(1, self.tokens0)
        self.attn_scale = self.scale * (seq_len or seq0) / seq0 * (0.5 if block.causal else 1.0)
        self.seq_ok = (seq_len or seq0) % tp == 0
        self.tensors: dict[str, _Tensor] = {
            n: _Tensor(n, out_shape, self._bytes(out_shape, ops[-1].dtype), True, tok,
                       len(out_shape) - 1, stream=True) for n in self.inputs}
        self.fixed_compute = 0.0
        self.ops: list[_Op] = []
        unit = self._moe_unit(ops)
        for o in ops:
            if unit and o.name in unit["members"]:
                if o.name == unit["out"]:
                    self._unit(o, unit)
                continue
            act = [n for n in dict.fromkeys(o.inputs) if n in self.tensors]
            if not act:                        # computed from constants and parameters only
                self.consts.add(o.name)
                if any(n in self.params for n in o.inputs):
                    self.params[o.name] = tuple(o.output_shapes[0]) if o.output_shapes else ()
                self.fixed_compute += self._pointwise_time(o)
                continue
            self._add(o, act)

    # -- helpers
    def rel(self, module: str) -> str:
        p = self.prefix
        if p and module.startswith(p + "."):
            return module[len(p) + 1:]
        return "" if module == p else module

    def _bytes(self, shape: tuple[int, ...], dtype: str) -> float:
        return math.prod(shape) * _ITEMSIZE.get(dtype, 2) * self.scale

    def _pointwise_time(self, o: OpInfo) -> float:
        bwd = ELEMENTWISE_BWD_RATIO if _is_float(o.dtype) else 0.0
        return elementwise_time(o.bytes * self.scale, self.cluster) * (1.0 + bwd)

    def _flop_time(self, o: OpInfo, share: float) -> float:
        """Matmul-like ops without a clean (m, n, k): roofline on the traced FLOPs."""
        kernels = 1 + (2 if o.bwd_flops > 0 else 0)
        return ((o.fwd_flops + o.bwd_flops) * self.scale * share / matmul_rate(self.cluster, False)
                + kernels * K.GEMM_FIXED_S)

    def _sync(self, params_per_gpu: float) -> float:
        return collective_time("all_reduce", params_per_gpu * K.GRAD_BYTES, self.group,
                               self.cluster) / self.microbatches

    def allowed(self, t: _Tensor, layout: str) -> bool:
        if layout in ("S", "F") and t.stream and not self.sp_allowed:
            return False   # without sequence parallelism the stream outside TP regions is whole
        if layout == "S":
            return (self.sp_allowed and self.seq_ok and t.tok is not None
                    and t.shape[t.tok] % self.tp == 0)
        if layout == "F":
            return t.feat is not None and t.shape[t.feat] % self.tp == 0
        return True

    def _tensor(self, o: OpInfo, tok: int | None, feat: int | None) -> _Tensor:
        shape = tuple(o.output_shapes[0]) if o.output_shapes else ()
        stream = o.kind != "linear" and any(self.tensors[n].stream for n in o.inputs if n in self.tensors)
        t = _Tensor(o.name, shape, self._bytes(shape, o.dtype), _is_float(o.dtype), tok, feat, stream)
        self.tensors[o.name] = t
        return t

    def _param_shapes(self, o: OpInfo) -> list[tuple[int, ...]]:
        return [self.params[n] for n in dict.fromkeys(o.inputs) if n in self.params]

    def _emit(self, o: OpInfo, act: list[str], strats: list[_Strat], rep: str = "",
              weight: float = 0.0) -> _Op:
        if self.tp == 1:   # on one GPU every layout is the same thing: keep one name for it
            strats = [s for s in strats if s.label == "replicate"] or strats[:1]
        for s in strats:
            s.grads = s.grads or tuple(_grad_layout(i, s.out) for i in s.ins)
        op = _Op(o.name, self.rel(o.module), tuple(act), strats, rep, weight)
        self.ops.append(op)
        return op

    # -- strategies by op category
    def _add(self, o: OpInfo, act: list[str]) -> None:
        base, pshapes = _base(o.target), self._param_shapes(o)
        if o.kind == "linear" and base in _LINEAR and len(act) == 1 and any(len(s) == 2 for s in pshapes):
            self._linear(o, act[0], pshapes)
        elif base in _SDPA and len(act) >= 3:
            self._sdpa(o, act)
        elif base in _MATMUL and len(act) == 2 and not pshapes:
            self._matmul(o, act)
        else:
            self._mapped(o, act, base, pshapes)

    def _linear(self, o: OpInfo, x_name: str, pshapes: list[tuple[int, ...]]) -> None:
        x, tp, c = self.tensors[x_name], self.tp, self.cluster
        k, n = x.shape[-1], o.output_shapes[0][-1]
        m = math.prod(x.shape) / k * self.scale
        tok = x.tok if x.tok is not None and x.tok < len(x.shape) - 1 else None
        out = self._tensor(o, tok, len(o.output_shapes[0]) - 1)
        total = sum(math.prod(s) for s in pshapes)
        bias = sum(math.prod(s) for s in pshapes if len(s) == 1)

        def strat(label: str, read: str, produce: str, mm: float, nn: float, kk: float,
                  per_gpu: float) -> _Strat:   # forward, data gradient, weight gradient GEMMs
            t = gemm_time(mm, nn, kk, c) + gemm_time(mm, kk, nn, c) + gemm_time(nn, kk, mm, c)
            return _Strat(label, (read,), produce, t, per_gpu * STATE_BYTES_PER_PARAM, self._sync(per_gpu))

        strats = [strat("replicate", "R", "R", m, n, k, total)]
        if tok is not None and self.allowed(x, "S") and self.allowed(out, "S"):
            strats.append(strat("sequence", "S", "S", m / tp, n, k, total))
        if tp > 1 and n % tp == 0:
            strats.append(strat("colwise", "R", "F", m, n / tp, k, total / tp))
        if tp > 1 and k % tp == 0 and x.feat == len(x.shape) - 1 and self.allowed(x, "F"):
            strats.append(strat("rowwise", "F", "P", m, n, k / tp, (total - bias) / tp + bias))
        self._emit(o, [x_name], strats, rep="linear", weight=total)

    def _sdpa(self, o: OpInfo, act: list[str]) -> None:
        q, k, v = (self.tensors[a] for a in act[:3])
        out = self._tensor(o, q.tok, q.feat)
        flops = o.fwd_flops * self.attn_scale
        full = (attention_time(flops, self.cluster, backward=False)
                + attention_time(flops, self.cluster, backward=True))
        rest = ("R",) * (len(act) - 3)     # masks and biases computed inside the block
        strats = [_Strat("replicate", ("R",) * len(act), "R", full)]
        if all(t.feat == len(t.shape) - 3 and self.allowed(t, "F") for t in (q, k, v)) \
                and self.allowed(out, "F"):
            strats.append(_Strat("heads", ("F", "F", "F") + rest, "F", full / self.tp))
        self._emit(o, act, strats, rep="attention")

    def _matmul(self, o: OpInfo, act: list[str]) -> None:
        """Activation x activation (eager attention, bmm): a (.., i, k) @ b (.., k, j)."""
        a, b = (self.tensors[n] for n in act)
        r = len(o.output_shapes[0])
        feat = a.feat + r - len(a.shape) if a.feat is not None and a.feat < len(a.shape) - 2 else None
        tok = r - 2 if a.tok == len(a.shape) - 2 else None
        out = self._tensor(o, tok, feat)
        strats = [_Strat("replicate", ("R", "R"), "R", self._flop_time(o, 1.0))]
        if feat is not None and b.feat == a.feat + len(b.shape) - len(a.shape) \
                and self.allowed(a, "F") and self.allowed(b, "F"):
            strats.append(_Strat("heads", ("F", "F"), "F", self._flop_time(o, 1 / self.tp)))
        if tok is not None and self.allowed(a, "S") and self.allowed(out, "S"):
            strats.append(_Strat("sequence", ("S", "R"), "S", self._flop_time(o, 1 / self.tp)))
        self._emit(o, act, strats, rep="attention")

    def _mapped(self, o: OpInfo, act: list[str], base: str, pshapes: list[tuple[int, ...]]) -> None:
        """Ops whose output dims follow their inputs': views, element-wise, norms, row-wise ops,
        concatenation, reductions. Any other op is opaque: R -> R only."""
        out_shape = tuple(o.output_shapes[0]) if o.output_shapes else ()
        view = o.kind == "view" or base in _VIEWS
        if view:          # further inputs (type_as's dtype source) are not read as data
            act = act[:1]
        known = view or _pointwise(o.target) or base in _NORMS | _ROW | _CAT | _REDUCE
        shapes = dict(zip(o.inputs, (tuple(s) for s in o.input_shapes)))
        where: dict[str, dict[str, int | None]] = {}
        for n in act:
            t, cands = self.tensors[n], _alignments(shapes[n], out_shape, base)
            where[n] = {"S": _follow(t.tok, t.shape, out_shape, cands),
                        "F": _follow(t.feat, t.shape, out_shape, cands),
                        "-S": _reduced(t.tok, out_shape, cands), "-F": _reduced(t.feat, out_shape, cands)}
        first = lambda lay: next((where[n][lay] for n in act if where[n][lay] is not None), None)
        out = self._tensor(o, first("S"), first("F"))
        cost = self._pointwise_time(o)
        total = sum(math.prod(s) for s in pshapes)
        strats = [_Strat("replicate", ("R",) * len(act), "R", cost,
                         total * STATE_BYTES_PER_PARAM, self._sync(total))]
        if known:
            strats += [s for lay in ("S", "F")
                       if (s := self._sharded(o, act, where, out, lay, base, pshapes, cost))]
            strats += self._partial(o, act, base, view, cost)
        self._emit(o, act, strats, rep="param" if pshapes else "", weight=total)

    def _sharded(self, o: OpInfo, act: list[str], where: dict, out: _Tensor, lay: str, base: str,
                 pshapes: list[tuple[int, ...]], cost: float) -> _Strat | None:
        """Work split along `lay`'s dim: inputs labelled there are read sharded, the others
        replicated (each rank reads its slice); a sum over the sharded dim yields P."""
        e = out.tok if lay == "S" else out.feat
        ins, reduced = [], False
        for n in act:
            t = self.tensors[n]
            if where[n][lay] is not None and where[n][lay] == e:
                ins.append(lay if self.allowed(t, lay) else "")
            elif where[n]["-" + lay] and base in _SUMS:
                ins.append(lay if self.allowed(t, lay) else "")
                reduced = True
            else:
                ins.append("R")
        if "" in ins or lay not in ins:
            return None
        if reduced:
            return _Strat(_LABEL[lay], tuple(ins), "P", cost / self.tp)
        if e is None or not self.allowed(out, lay):
            return None
        if base in _ROW and e == len(out.shape) - 1:
            return None
        if base in _NORMS and e >= len(out.shape) - max([len(s) for s in pshapes] or [1]):
            return None   # normalised over trailing dims as wide as the weight
        per_gpu = 0.0
        for s in pshapes:  # a parameter spanning the sharded dim is sliced, else replicated
            i = e - (len(out.shape) - len(s))
            per_gpu += math.prod(s) / (self.tp if 0 <= i < len(s) and s[i] == out.shape[e] else 1)
        return _Strat(_LABEL[lay], tuple(ins), lay, cost / self.tp,
                      per_gpu * STATE_BYTES_PER_PARAM, self._sync(per_gpu))

    def _partial(self, o: OpInfo, act: list[str], base: str, view: bool, cost: float) -> list[_Strat]:
        """Linear maps carry partial sums: views, sums, neg; cat / add / sub of partials only
        (scalar operands are not in the IR, so a one-tensor add may be `x + eps`: excluded);
        a product with one partial factor, a quotient with a partial numerator."""
        consts = self._param_shapes(o) or any(n in self.consts for n in o.inputs)
        if view or base in _SUMS or base == "neg" or (
                not consts and (base in _CAT or (base in ("add", "sub") and len(o.inputs) >= 2))):
            return [_Strat("partial", ("P",) * len(act), "P", cost)]
        factors = range(len(act)) if base == "mul" else range(min(1, len(act))) if base == "div" else ()
        return [_Strat("partial", tuple("P" if i == j else "R" for i in range(len(act))), "P", cost)
                for j in factors]

    # -- a routed-expert MoE region as one unit
    def _moe_unit(self, ops: list[OpInfo]) -> dict | None:
        """Ops between the router's input x and the combine (the first float op below the router
        with x's shape), when nothing inside is read outside."""
        router = next((o for o in ops if o.role == "router"), None)
        x = next((n for n in router.inputs if n not in self.params), None) if router else None
        if x is None:
            return None
        xshape = tuple(router.input_shapes[router.inputs.index(x)])
        users: dict[str, list[str]] = {}
        for o in ops:
            for n in o.inputs:
                users.setdefault(n, []).append(o.name)

        def closure(start: str, step) -> set[str]:
            seen, todo = set(), [start]
            while todo:
                n = todo.pop()
                if n not in seen and (n in self.by_name or n == start):
                    seen.add(n)
                    todo.extend(step(n))
            return seen

        below = closure(router.name, lambda n: users.get(n, []))
        combine = next((o for o in ops if o.name in below and o.output_shapes and _is_float(o.dtype)
                        and tuple(o.output_shapes[0]) == xshape), None)
        if combine is None:
            return None
        up = lambda n: self.by_name[n].inputs if n in self.by_name else ()
        members = closure(combine.name, up) - closure(x, up)

        def activation(m: str) -> bool:       # a value of the hidden width (not routing statistics)
            shapes = self.by_name[m].output_shapes if m in self.by_name else ()
            return bool(shapes) and bool(shapes[0]) and shapes[0][-1] == xshape[-1]
        # routing statistics (probabilities, counts: E wide) may leave the region for the
        # load-balancing losses and metrics; an activation leaving it means the region is not one unit
        if any(u not in members for m in members - {combine.name} if activation(m) for u in users.get(m, [])):
            return None   # an internal activation escapes: go op by op
        return {"members": members, "out": combine.name, "x": x, "router": router}

    def _unit(self, combine: OpInfo, unit: dict) -> None:
        members = [o for o in self.block.ops if o.name in unit["members"]]
        x = unit["x"]
        if x not in self.tensors:
            raise TraceError(f"MoE layer {self.rel(combine.module)!r}: its router reads {x!r}, "
                             f"which is not computed from the block input")
        xt = self.tensors[x]
        self._tensor(combine, xt.tok, xt.feat)
        act = [x] + list(dict.fromkeys(n for o in members for n in o.inputs
                                       if n in self.tensors and n != x and n not in unit["members"]))
        cost = sum(self._flop_time(o, 1.0) if o.kind == "linear" else self._pointwise_time(o)
                   for o in members)
        router = unit["router"]
        rp = sum(math.prod(self.params[n]) for n in router.inputs if n in self.params)
        state, sync = rp * STATE_BYTES_PER_PARAM, self._sync(rp)
        rest = ("R",) * (len(act) - 1)   # other activations entering the region: replicated
        strats = [_Strat("replicate", ("R",) + rest, "R", cost, state, sync)]
        if self.allowed(xt, "S"):
            strats.append(_Strat("sequence", ("S",) + rest, "S", cost / self.tp, state, sync))
        op = self._emit(combine, act, strats, rep="unit", weight=rp)
        op.module = self.rel(router.module)
        op.extra = tuple((m, "expert") for m in
                         sorted({self.rel(o.module) for o in members if o.role.startswith("expert")}))


# ---- conversions -------------------------------------------------------------------------------

def _collective(src: str, dst: str) -> str | None:
    """The collective turning a tensor held in `src` into `dst` ("" = local, None = impossible)."""
    if src == dst or src == "R":
        return ""
    if dst == "P":
        return None
    if src == "P":
        return "all_reduce" if dst == "R" else "reduce_scatter"
    return "all_gather" if dst == "R" else "all_to_all"


def _conversion(src: str, dst: str, nbytes: float, a: _Analysis) -> float | None:
    kind = _collective(src, dst)
    if not kind:
        return kind if kind is None else 0.0
    # an all-to-all's size is each rank's send buffer: its 1/tp share of the tensor
    return collective_time(kind, nbytes / a.tp if kind == "all_to_all" else nbytes, a.group, a.cluster)


# ---- the problem -------------------------------------------------------------------------------

class ShardingProblem:
    """One block at one TP degree: `solve()` it, or `evaluate()` a (partial) assignment."""

    def __init__(self, analysis: _Analysis, *, state_budget_bytes: float | None, state_slack: float,
                 solver: str, time_limit_s: float, io_layout: str | None = None):
        self.a, self.solver, self.time_limit_s = analysis, solver, time_limit_s
        self.io_layout = io_layout
        self.min_state = sum(min(s.state for s in o.strats) for o in analysis.ops)
        self.budget = (state_budget_bytes if state_budget_bytes is not None
                       else self.min_state * (1 + state_slack))
        first = analysis.tensors[analysis.inputs[0]]
        self.io_layouts = ["R"] + (["S"] if analysis.tp > 1 and analysis.allowed(first, "S") else [])

    def modules(self) -> dict[str, list[_Op]]:
        """Module -> the ops its placement comes from: its MoE unit, else its linears, else its
        attention, else the ops reading its parameters."""
        rank = {"unit": 0, "linear": 1, "attention": 2, "param": 3}
        groups: dict[str, list[_Op]] = {}
        for o in self.a.ops:
            if o.rep:
                groups.setdefault(o.module, []).append(o)
        return {m: [o for o in ops if rank[o.rep] == min(rank[p.rep] for p in ops)]
                for m, ops in groups.items()}

    def _fix(self, assignment: Mapping[str, str]) -> dict[str, set[int]]:
        """Op name -> allowed strategy indices, from module FQNs or op names."""
        mods, ops = self.modules(), {o.name: o for o in self.a.ops}
        experts = {m for o in self.a.ops for m, _ in o.extra}
        allowed: dict[str, set[int]] = {}
        for key, label in assignment.items():
            if key == "io" or (key in experts and label == "expert"):
                continue
            if label not in PLACEMENTS and label not in _LABEL.values():
                raise ConfigError(f"placement {label!r} for {key!r} is unknown; known: {PLACEMENTS}")
            targets = mods.get(key) or ([ops[key]] if key in ops else None)
            if targets is None:
                raise LayoutError(f"this block has no module or op {key!r} to place; its modules "
                                  f"are: {', '.join(sorted(mods | dict.fromkeys(experts)))}")
            for o in targets:
                ok = {i for i, s in enumerate(o.strats) if s.label == label}
                if not ok:
                    raise LayoutError(
                        f"{key!r} cannot be {label!r} at tp={self.a.tp}; possible: "
                        f"{', '.join(sorted({s.label for s in o.strats}))} (sharded sizes must "
                        f"divide by tp; sequence sharding needs sp_allowed)")
                allowed[o.name] = ok
        return allowed

    def solve(self) -> BlockSharding:
        t0 = time.perf_counter()
        if self.budget < self.min_state * (1 - 1e-9):
            raise DoesNotFitError(
                f"block {self.a.prefix or self.a.block.signature!r}: its weights need at least "
                f"{self.min_state / _GB:.3g} GB of training state per GPU at tp={self.a.tp}, "
                f"more than the {self.budget / _GB:.3g} GB budget; raise state_budget_bytes or tp")
        lay = {"replicate": "R", "sequence": "S"}.get(self.io_layout or "")
        if lay is not None and lay not in self.io_layouts:
            raise LayoutError(f"the block input cannot be sequence-sharded here (tp={self.a.tp}, or the "
                              f"sequence does not divide by tp)")
        model = _Model(self, {}, lay, memory=True)
        status = model.run()
        if status not in ("optimal", "feasible"):
            raise LayoutError(self._diagnose(status))
        return model.result(time.perf_counter() - t0, status)

    def evaluate(self, assignment: Mapping[str, str]) -> float:
        """Seconds of the best assignment agreeing with `assignment` (module FQN or op name ->
        placement; "io" -> "replicate" | "sequence" for the block's input and output), by the cost
        function `solve` minimises. Memory is not constrained: this prices, it does not judge."""
        io = assignment.get("io")
        if io not in (None, "replicate", "sequence"):
            raise ConfigError(f"io must be 'replicate' or 'sequence', got {io!r}")
        lay = {"replicate": "R", "sequence": "S"}.get(io)
        if lay is not None and lay not in self.io_layouts:
            raise LayoutError(f"the block input cannot be sequence-sharded here (sp_allowed=False, "
                              f"tp=1, or the sequence does not divide by tp={self.a.tp})")
        model = _Model(self, self._fix(assignment), lay, memory=False)
        status = model.run()
        if status not in ("optimal", "feasible"):
            raise LayoutError(f"no valid completion of {dict(assignment)} (solver: {status})")
        return model.objective()

    def cost_of(self, choices: Mapping[str, str], io: str) -> float:
        """Cost of a complete op-level assignment (op name -> strategy label, io "R" or "S"),
        computed directly without a solver: it checks the ILP's linearisation."""
        picks = {}
        for o in self.a.ops:
            picks[o.name] = next(s for s in o.strats if s.label == choices[o.name])
        total = sum(s.compute + s.sync for s in picks.values()) + self.a.fixed_compute
        return total + sum(r.seconds for r in self.reshards(picks, io))

    def reshards(self, picks: Mapping[str, _Strat], io: str) -> list[Reshard]:
        """The collectives an op-level assignment implies, each once per tensor and target."""
        produced = dict.fromkeys(self.a.inputs, io) | {n: s.out for n, s in picks.items()}
        reads: dict[str, set[tuple[str, str]]] = {self.a.out_name: {("f", io), ("b", io)}}
        for o in self.a.ops:
            for n, lay, g in zip(o.inputs, picks[o.name].ins, picks[o.name].grads):
                reads.setdefault(n, set()).update({("f", lay), ("b", g)})
        out = []
        for n, p in produced.items():
            t = self.a.tensors[n]
            for side, lay in sorted(reads.get(n, ())):
                if side == "b" and not t.grad:
                    continue
                src, dst = (p, lay) if side == "f" else (lay, "R" if p == "P" else p)
                kind = _collective(src, dst)
                if kind:
                    out.append(Reshard(tensor=n, direction="forward" if side == "f" else "backward",
                                       src=src, dst=dst, collective=kind,
                                       seconds=_conversion(src, dst, t.nbytes, self.a)))
                elif kind is None:
                    out.append(Reshard(tensor=n, direction="forward", src=src, dst=dst,
                                       collective="impossible", seconds=math.inf))
        return out

    def _diagnose(self, status: str) -> str:
        where = f"block {self.a.prefix or self.a.block.signature!r} at tp={self.a.tp}"
        if _Model(self, {}, None, memory=False).run() in ("optimal", "feasible"):
            return (f"{where}: no assignment keeps the weights within {self.budget / _GB:.3g} GB of "
                    f"training state per GPU (the smallest reachable is {self.min_state / _GB:.3g} GB); "
                    f"raise state_budget_bytes or state_slack")
        return f"{where}: the sharding ILP found no solution ({status}); please report the model"


class _Model:
    """The pulp model of a ShardingProblem, one method per constraint family."""

    def __init__(self, problem: ShardingProblem, fixed: Mapping[str, set[int]], io: str | None,
                 memory: bool):
        self.p, self.a = problem, problem.a
        self.lp = pulp.LpProblem("block_sharding", pulp.LpMinimize)
        self.x = {(o.name, i): pulp.LpVariable(f"x_{j}_{i}", cat="Binary")
                  for j, o in enumerate(self.a.ops) for i in range(len(o.strats))}
        self.b = {lay: pulp.LpVariable(f"b_{lay}", cat="Binary") for lay in problem.io_layouts}
        self.produced = {n: {lay: [v] for lay, v in self.b.items()} for n in self.a.inputs}
        for o in self.a.ops:
            for i, s in enumerate(o.strats):
                self.produced.setdefault(o.name, {}).setdefault(s.out, []).append(self.x[o.name, i])
        self.compute = pulp.lpSum(self.x[o.name, i] * s.compute for o in self.a.ops
                                  for i, s in enumerate(o.strats))
        self.sync = pulp.lpSum(self.x[o.name, i] * s.sync for o in self.a.ops
                               for i, s in enumerate(o.strats))
        self.one_strategy(fixed)
        self.block_io(io)
        self.comm = self.charges(self.edge_marginals())
        if memory:
            self.memory()
        self.lp += (self.compute + self.sync + self.comm) * _MS

    def one_strategy(self, fixed: Mapping[str, set[int]]) -> None:
        for j, o in enumerate(self.a.ops):
            ok = fixed.get(o.name, set(range(len(o.strats))))
            self.lp += pulp.lpSum(self.x[o.name, i] for i in ok) == 1, f"one_strategy_{j}"
            for i in set(range(len(o.strats))) - ok:
                self.lp += self.x[o.name, i] == 0, f"fixed_{j}_{i}"

    def block_io(self, io: str | None) -> None:
        self.lp += pulp.lpSum(self.b.values()) == 1, "block_io"
        if io is not None:
            self.lp += self.b[io] == 1, "block_io_fixed"

    def edge_marginals(self) -> list[tuple[str, str, str, str, pulp.LpVariable]]:
        """w/v per edge with the producer's and the consumer's choices as marginals; returns
        (tensor, side, produced, read, variable) for the charges."""
        edges: dict[str, dict[str, dict[tuple[str, str], list]]] = {}
        for o in self.a.ops:
            for i, s in enumerate(o.strats):
                for n, lay, g in zip(o.inputs, s.ins, s.grads):
                    e = edges.setdefault(n, {}).setdefault(o.name, {})
                    e.setdefault(("f", lay), []).append(self.x[o.name, i])
                    e.setdefault(("b", g), []).append(self.x[o.name, i])
        nxt = edges.setdefault(self.a.out_name, {}).setdefault("<next block>", {})
        for lay, v in self.b.items():
            nxt[("f", lay)], nxt[("b", lay)] = [v], [v]
        joint = []
        for name, consumers in edges.items():
            t = self.a.tensors[name]
            for want in consumers.values():
                for side in ("f", "b") if t.grad else ("f",):
                    lays = [lay for sd, lay in want if sd == side]
                    w = {}
                    for p in self.produced[name]:
                        for lay in lays:
                            src, dst = (p, lay) if side == "f" else (lay, "R" if p == "P" else p)
                            if _collective(src, dst) is not None:
                                w[p, lay] = pulp.LpVariable(f"w_{len(joint)}", lowBound=0, upBound=1)
                                joint.append((name, side, p, lay, w[p, lay]))
                    for p, outs in self.produced[name].items():
                        self.lp += pulp.lpSum(w[p, lay] for lay in lays if (p, lay) in w) == pulp.lpSum(outs)
                    for lay in lays:
                        self.lp += pulp.lpSum(w[p, lay] for p in self.produced[name] if (p, lay) in w) \
                            == pulp.lpSum(want[side, lay])
        return joint

    def charges(self, joint: list) -> pulp.LpAffineExpression:
        charged: dict[tuple[str, str, str, str], pulp.LpVariable] = {}
        terms = []
        for name, side, p, lay, w in joint:
            src, dst = (p, lay) if side == "f" else (lay, "R" if p == "P" else p)
            cost = _conversion(src, dst, self.a.tensors[name].nbytes, self.a)
            if not cost:
                continue
            key = (name, side, p, lay)
            if key not in charged:
                charged[key] = pulp.LpVariable(f"{'y' if side == 'f' else 'z'}_{len(charged)}", 0, 1)
                terms.append(cost * charged[key])
            self.lp += charged[key] >= w
        return pulp.lpSum(terms)

    def memory(self) -> None:
        if self.p.min_state > 0 and math.isfinite(self.p.budget):
            self.lp += pulp.lpSum(self.x[o.name, i] * (s.state / _GB) for o in self.a.ops
                                  for i, s in enumerate(o.strats)) <= self.p.budget / _GB * (1 + 1e-9), "memory"

    def run(self) -> str:
        self.solver_name = resolve_solver(self.p.solver)
        status = solve(self.lp, time_limit_s=self.p.time_limit_s, solver=self.solver_name)
        if proved_optimal(self.lp):
            return "optimal"
        return "feasible" if has_solution(self.lp) else status

    def objective(self) -> float:
        return float(pulp.value(self.lp.objective)) / _MS + self.a.fixed_compute

    def result(self, solve_s: float, status: str) -> BlockSharding:
        a = self.a
        picks = {o.name: o.strats[max(range(len(o.strats)), key=lambda i: self.x[o.name, i].value() or 0)]
                 for o in a.ops}
        placements: dict[str, str] = {}
        for module, ops in self.p.modules().items():
            best = max(ops, key=lambda o: o.weight)
            label = picks[best.name].label
            placements[module] = label if label in PLACEMENTS else "replicate"
            placements.update(dict(best.extra))
        io = max(self.b, key=lambda lay: self.b[lay].value() or 0)
        return BlockSharding(
            signature=a.block.signature, tp=a.tp, tokens=a.tokens, placements=placements,
            io_layout=_LABEL[io], time_s=self.objective(),
            compute_s=float(pulp.value(self.compute) or 0.0) + a.fixed_compute,
            comm_s=float(pulp.value(self.comm) or 0.0), grad_sync_s=float(pulp.value(self.sync) or 0.0),
            state_bytes=sum(s.state for s in picks.values()), status=status,
            solver=self.solver_name, solve_s=solve_s,
            ops=tuple(OpChoice(name=o.name, module=o.module, strategy=picks[o.name].label,
                               sources=o.inputs, inputs=picks[o.name].ins, output=picks[o.name].out)
                      for o in a.ops),
            reshards=tuple(self.p.reshards(picks, io)))


# ---- entry points ------------------------------------------------------------------------------

def build_problem(block: BlockProfile, cluster, *, tp: int, tokens: int, seq_len: int | None = None,
                  sp_allowed: bool = True, microbatches: int = 1,
                  state_budget_bytes: float | None = None, state_slack: float = DEFAULT_STATE_SLACK,
                  solver: str = "auto", time_limit_s: float = 5.0,
                  io_layout: str | None = None) -> ShardingProblem:
    """The sharding problem of one block (see the module docstring).

    tokens: tokens per micro-batch (mbs x seq_len). seq_len: for attention's quadratic cost and
    the divisibility of sequence shards (default: the length the block was traced at).
    microbatches: micro-batches per optimizer step, over which weight-gradient traffic is spread.
    state_budget_bytes: cap on one instance's per-GPU parameter state (default: see memory).
    solver: "auto" (HiGHS if installed), "highs" or "cbc".
    io_layout: force the block's input/output layout ("sequence" when the layout says sp;
    "replicate"); None lets the ILP choose.
    """
    if not isinstance(block, BlockProfile):
        raise ConfigError(f"expected a BlockProfile (from meshplan.planner.trace), got {type(block).__name__}")
    for label, v in (("tp", tp), ("tokens", tokens), ("microbatches", microbatches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{label} must be a positive int, got {v!r}")
    if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1):
        raise ConfigError(f"seq_len must be a positive int or None, got {seq_len!r}")
    if not (time_limit_s > 0) or not (state_slack >= 0):
        raise ConfigError(f"time_limit_s must be > 0 and state_slack >= 0, got {time_limit_s!r}, "
                          f"{state_slack!r}")
    if state_budget_bytes is not None and not (state_budget_bytes >= 0):
        raise ConfigError(f"state_budget_bytes must be >= 0 bytes, got {state_budget_bytes!r}")
    if not block.ops:
        raise TraceError(f"block {block.signature} has no traced ops (an analytic profile?); trace "
                         f"the model with meshplan.planner.trace.trace to shard its blocks")
    resolve_solver(solver)   # an unknown or missing solver fails here, before any work
    analysis = _Analysis(block, cluster, tp=tp, tokens=tokens, seq_len=seq_len,
                         sp_allowed=sp_allowed, microbatches=microbatches)
    if io_layout not in (None, "replicate", "sequence"):
        raise ConfigError(f"io_layout must be 'replicate', 'sequence' or None, got {io_layout!r}")
    return ShardingProblem(analysis, state_budget_bytes=state_budget_bytes, state_slack=state_slack,
                           solver=solver, time_limit_s=time_limit_s, io_layout=io_layout)


_CACHE: OrderedDict[tuple, BlockSharding] = OrderedDict()


def shard_block(block: BlockProfile, cluster, *, tp: int, tokens: int, sp_allowed: bool = True,
                time_limit_s: float = 5.0, **options) -> BlockSharding:
    """Solve the sharding ILP of one unique block (cached; `options` as in `build_problem`)."""
    key = (block.signature, tuple((o.name, o.input_shapes) for o in block.ops[:1]), len(block.ops),
           tp, tokens, sp_allowed, time_limit_s, tuple(sorted(options.items())), cluster.fingerprint())
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
