"""The sharding ILP's view of one block: activation tensors with dim labels, and the strategies
of every op (`BlockAnalysis`).

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshplan.cost_models.tables import STATE_BYTES_PER_PARAM, OpCostTable
from meshplan.errors import TraceError
from meshplan.ir.profile import BlockProfile, OpInfo
from meshplan.profiling.aten_ops import (
    CONCAT_OPS,
    DIM_REDUCING_OPS,
    LAYER_NORM_OPS,
    RMS_NORM_OPS,
    ROW_OPS,
    SDPA_OPS,
    SHARD_LINEAR_OPS,
    SHARD_MATMUL_OPS,
    SHARD_VIEW_OPS,
    SUM_OPS,
    bare,
)
from meshplan.planner.ilp.sharding_labels import alignments, follow, is_float, is_pointwise, reduced, target_name
from meshplan.planner.ilp.sharding_results import LAYOUT_LABELS

__all__ = ["BlockAnalysis", "Strategy", "ShardOp", "STATE_BYTES_PER_PARAM"]

# STATE_BYTES_PER_PARAM (cost_models.tables): training state per parameter, bf16 weight + fp32
# gradient + Adam master, m, v.
# A memory-bound op's backward reads the output gradient and the saved inputs and writes the
# input gradients: about twice its forward traffic (derived).
ELEMENTWISE_BWD_RATIO = 2.0

# IR targets are compared by bare name ("mul"): these are aten_ops' sets without the namespace.
_SDPA = bare(SDPA_OPS)
_MATMUL = bare(SHARD_MATMUL_OPS)
_LINEAR = bare(SHARD_LINEAR_OPS)
_NORMS = bare(LAYER_NORM_OPS | RMS_NORM_OPS)
_ROW = bare(ROW_OPS)                 # along the last dim (args are not in the IR)
_VIEWS = bare(SHARD_VIEW_OPS)
_CAT = bare(CONCAT_OPS)
_SUMS = bare(SUM_OPS)                # linear: a summed-away shard gives P
_REDUCE = bare(DIM_REDUCING_OPS)
_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


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
class Strategy:
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
class ShardOp:
    name: str
    module: str                   # relative to the block
    inputs: tuple[str, ...]       # activation tensors read, deduplicated
    strats: list[Strategy]
    rep: str = ""                 # label source for its module: "unit"|"linear"|"attention"|"param"
    weight: float = 0.0           # parameters read
    extra: tuple[tuple[str, str], ...] = ()   # (module, label) set with it (a unit's experts)


class BlockAnalysis:
    """Block ops -> activation tensors with dim labels, and strategies for every op."""

    def __init__(self, block: BlockProfile, cluster, *, tp: int, tokens: int, seq_len: int | None,
                 sp_allowed: bool, microbatches: int):
        self.block, self.cluster, self.tp, self.tokens = block, cluster, tp, tokens
        self.sp_allowed, self.microbatches = sp_allowed, microbatches
        # the cost model's prices of ops and reshardings on the TP group (TP is the innermost mesh
        # axis: adjacent ranks)
        self.costs = OpCostTable(cluster, tp=tp, microbatches=microbatches)
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
        self.ops: list[ShardOp] = []
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
        bwd = ELEMENTWISE_BWD_RATIO if is_float(o.dtype) else 0.0
        return self.costs.elementwise_s(o.bytes * self.scale) * (1.0 + bwd)

    def _flop_time(self, o: OpInfo, share: float) -> float:
        """Matmul-like ops without a clean (m, n, k): roofline on the traced FLOPs."""
        kernels = 1 + (2 if o.bwd_flops > 0 else 0)
        return self.costs.roofline_s((o.fwd_flops + o.bwd_flops) * self.scale * share, kernels)

    def _sync(self, params_per_gpu: float) -> float:
        return self.costs.grad_sync_s(params_per_gpu)

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
        t = _Tensor(o.name, shape, self._bytes(shape, o.dtype), is_float(o.dtype), tok, feat, stream)
        self.tensors[o.name] = t
        return t

    def _param_shapes(self, o: OpInfo) -> list[tuple[int, ...]]:
        return [self.params[n] for n in dict.fromkeys(o.inputs) if n in self.params]

    def _emit(self, o: OpInfo, act: list[str], strats: list[Strategy], rep: str = "",
              weight: float = 0.0) -> ShardOp:
        if self.tp == 1:   # on one GPU every layout is the same thing: keep one name for it
            strats = [s for s in strats if s.label == "replicate"] or strats[:1]
        for s in strats:
            s.grads = s.grads or tuple(_grad_layout(i, s.out) for i in s.ins)
        op = ShardOp(o.name, self.rel(o.module), tuple(act), strats, rep, weight)
        self.ops.append(op)
        return op

    # -- strategies by op category
    def _add(self, o: OpInfo, act: list[str]) -> None:
        base, pshapes = target_name(o.target), self._param_shapes(o)
        if o.kind == "linear" and base in _LINEAR and len(act) == 1 and any(len(s) == 2 for s in pshapes):
            self._linear(o, act[0], pshapes)
        elif base in _SDPA and len(act) >= 3:
            self._sdpa(o, act)
        elif base in _MATMUL and len(act) == 2 and not pshapes:
            self._matmul(o, act)
        else:
            self._mapped(o, act, base, pshapes)

    def _linear(self, o: OpInfo, x_name: str, pshapes: list[tuple[int, ...]]) -> None:
        x, tp = self.tensors[x_name], self.tp
        k, n = x.shape[-1], o.output_shapes[0][-1]
        m = math.prod(x.shape) / k * self.scale
        tok = x.tok if x.tok is not None and x.tok < len(x.shape) - 1 else None
        out = self._tensor(o, tok, len(o.output_shapes[0]) - 1)
        total = sum(math.prod(s) for s in pshapes)
        bias = sum(math.prod(s) for s in pshapes if len(s) == 1)

        def strat(label: str, read: str, produce: str, mm: float, nn: float, kk: float,
                  per_gpu: float) -> Strategy:   # forward, data gradient, weight gradient GEMMs
            return Strategy(label, (read,), produce, self.costs.linear_s(mm, nn, kk),
                            per_gpu * STATE_BYTES_PER_PARAM, self._sync(per_gpu))

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
        full = self.costs.attention_s(flops)
        rest = ("R",) * (len(act) - 3)     # masks and biases computed inside the block
        strats = [Strategy("replicate", ("R",) * len(act), "R", full)]
        if all(t.feat == len(t.shape) - 3 and self.allowed(t, "F") for t in (q, k, v)) \
                and self.allowed(out, "F"):
            strats.append(Strategy("heads", ("F", "F", "F") + rest, "F", full / self.tp))
        self._emit(o, act, strats, rep="attention")

    def _matmul(self, o: OpInfo, act: list[str]) -> None:
        """Activation x activation (eager attention, bmm): a (.., i, k) @ b (.., k, j)."""
        a, b = (self.tensors[n] for n in act)
        r = len(o.output_shapes[0])
        feat = a.feat + r - len(a.shape) if a.feat is not None and a.feat < len(a.shape) - 2 else None
        tok = r - 2 if a.tok == len(a.shape) - 2 else None
        out = self._tensor(o, tok, feat)
        strats = [Strategy("replicate", ("R", "R"), "R", self._flop_time(o, 1.0))]
        if feat is not None and b.feat == a.feat + len(b.shape) - len(a.shape) \
                and self.allowed(a, "F") and self.allowed(b, "F"):
            strats.append(Strategy("heads", ("F", "F"), "F", self._flop_time(o, 1 / self.tp)))
        if tok is not None and self.allowed(a, "S") and self.allowed(out, "S"):
            strats.append(Strategy("sequence", ("S", "R"), "S", self._flop_time(o, 1 / self.tp)))
        self._emit(o, act, strats, rep="attention")

    def _mapped(self, o: OpInfo, act: list[str], base: str, pshapes: list[tuple[int, ...]]) -> None:
        """Ops whose output dims follow their inputs': views, element-wise, norms, row-wise ops,
        concatenation, reductions. Any other op is opaque: R -> R only."""
        out_shape = tuple(o.output_shapes[0]) if o.output_shapes else ()
        view = o.kind == "view" or base in _VIEWS
        if view:          # further inputs (type_as's dtype source) are not read as data
            act = act[:1]
        known = view or is_pointwise(o.target) or base in _NORMS | _ROW | _CAT | _REDUCE
        shapes = dict(zip(o.inputs, (tuple(s) for s in o.input_shapes)))
        where: dict[str, dict[str, int | None]] = {}
        for n in act:
            t, cands = self.tensors[n], alignments(shapes[n], out_shape, base)
            where[n] = {"S": follow(t.tok, t.shape, out_shape, cands),
                        "F": follow(t.feat, t.shape, out_shape, cands),
                        "-S": reduced(t.tok, out_shape, cands), "-F": reduced(t.feat, out_shape, cands)}
        first = lambda lay: next((where[n][lay] for n in act if where[n][lay] is not None), None)
        out = self._tensor(o, first("S"), first("F"))
        cost = self._pointwise_time(o)
        total = sum(math.prod(s) for s in pshapes)
        strats = [Strategy("replicate", ("R",) * len(act), "R", cost,
                         total * STATE_BYTES_PER_PARAM, self._sync(total))]
        if known:
            strats += [s for lay in ("S", "F")
                       if (s := self._sharded(o, act, where, out, lay, base, pshapes, cost))]
            strats += self._partial(o, act, base, view, cost)
        self._emit(o, act, strats, rep="param" if pshapes else "", weight=total)

    def _sharded(self, o: OpInfo, act: list[str], where: dict, out: _Tensor, lay: str, base: str,
                 pshapes: list[tuple[int, ...]], cost: float) -> Strategy | None:
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
            return Strategy(LAYOUT_LABELS[lay], tuple(ins), "P", cost / self.tp)
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
        return Strategy(LAYOUT_LABELS[lay], tuple(ins), lay, cost / self.tp,
                      per_gpu * STATE_BYTES_PER_PARAM, self._sync(per_gpu))

    def _partial(self, o: OpInfo, act: list[str], base: str, view: bool, cost: float) -> list[Strategy]:
        """Linear maps carry partial sums: views, sums, neg; cat / add / sub of partials only
        (scalar operands are not in the IR, so a one-tensor add may be `x + eps`: excluded);
        a product with one partial factor, a quotient with a partial numerator."""
        consts = self._param_shapes(o) or any(n in self.consts for n in o.inputs)
        if view or base in _SUMS or base == "neg" or (
                not consts and (base in _CAT or (base in ("add", "sub") and len(o.inputs) >= 2))):
            return [Strategy("partial", ("P",) * len(act), "P", cost)]
        factors = range(len(act)) if base == "mul" else range(min(1, len(act))) if base == "div" else ()
        return [Strategy("partial", tuple("P" if i == j else "R" for i in range(len(act))), "P", cost)
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
        combine = next((o for o in ops if o.name in below and o.output_shapes and is_float(o.dtype)
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
        strats = [Strategy("replicate", ("R",) + rest, "R", cost, state, sync)]
        if self.allowed(xt, "S"):
            strats.append(Strategy("sequence", ("S",) + rest, "S", cost / self.tp, state, sync))
        op = self._emit(combine, act, strats, rep="unit", weight=rp)
        op.module = self.rel(router.module)
        op.extra = tuple((m, "expert") for m in
                         sorted({self.rel(o.module) for o in members if o.role.startswith("expert")}))
