"""The sharding ILP of one block (`ShardingProblem`: solve, evaluate, price) and its pulp model.

Works on a `BlockAnalysis` (sharding_graph): layouts, strategies s of each op o with compute
c(o,s), state m(o,s) and gradient traffic u(o,s).

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
C is the collective on the TP group (tables.OpCostTable.reshard_s): R -> S/F/P free (local slice);
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
"""

from __future__ import annotations

import math
import time
from typing import Mapping

import pulp

from meshplan.errors import ConfigError, DoesNotFitError, LayoutError
from meshplan.planner.ilp.sharding_graph import BlockAnalysis, ShardOp, Strategy
from meshplan.planner.ilp.sharding_results import LAYOUT_LABELS, PLACEMENTS, BlockSharding, OpChoice, Reshard
from meshplan.planner.ilp.solver import has_solution, proved_optimal, resolve_solver, solve

__all__ = ["ShardingProblem", "collective", "conversion_time"]

_MS, _GB = 1e3, 1e9   # units the solver sees: seconds (1e-6) beside bytes (1e9) break tolerances


# ---- conversions -------------------------------------------------------------------------------

def collective(src: str, dst: str) -> str | None:
    """The collective turning a tensor held in `src` into `dst` ("" = local, None = impossible)."""
    if src == dst or src == "R":
        return ""
    if dst == "P":
        return None
    if src == "P":
        return "all_reduce" if dst == "R" else "reduce_scatter"
    return "all_gather" if dst == "R" else "all_to_all"


def conversion_time(src: str, dst: str, nbytes: float, a: BlockAnalysis) -> float | None:
    """Seconds to turn `nbytes` held in `src` into `dst` (0 when local, None when impossible)."""
    kind = collective(src, dst)
    if not kind:
        return kind if kind is None else 0.0
    # an all-to-all's size is each rank's send buffer: its 1/tp share of the tensor
    return a.costs.reshard_s(kind, nbytes / a.tp if kind == "all_to_all" else nbytes)


# ---- the problem -------------------------------------------------------------------------------

class ShardingProblem:
    """One block at one TP degree: `solve()` it, or `evaluate()` a (partial) assignment."""

    def __init__(self, analysis: BlockAnalysis, *, state_budget_bytes: float | None, state_slack: float,
                 solver: str, time_limit_s: float, io_layout: str | None = None):
        self.a, self.solver, self.time_limit_s = analysis, solver, time_limit_s
        self.io_layout = io_layout
        self.min_state = sum(min(s.state for s in o.strats) for o in analysis.ops)
        self.budget = (state_budget_bytes if state_budget_bytes is not None
                       else self.min_state * (1 + state_slack))
        first = analysis.tensors[analysis.inputs[0]]
        self.io_layouts = ["R"] + (["S"] if analysis.tp > 1 and analysis.allowed(first, "S") else [])

    def modules(self) -> dict[str, list[ShardOp]]:
        """Module -> the ops its placement comes from: its MoE unit, else its linears, else its
        attention, else the ops reading its parameters."""
        rank = {"unit": 0, "linear": 1, "attention": 2, "param": 3}
        groups: dict[str, list[ShardOp]] = {}
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
            if label not in PLACEMENTS and label not in LAYOUT_LABELS.values():
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

    def reshards(self, picks: Mapping[str, Strategy], io: str) -> list[Reshard]:
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
                kind = collective(src, dst)
                if kind:
                    out.append(Reshard(tensor=n, direction="forward" if side == "f" else "backward",
                                       src=src, dst=dst, collective=kind,
                                       seconds=conversion_time(src, dst, t.nbytes, self.a)))
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
                            if collective(src, dst) is not None:
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
            cost = conversion_time(src, dst, self.a.tensors[name].nbytes, self.a)
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
            io_layout=LAYOUT_LABELS[io], time_s=self.objective(),
            compute_s=float(pulp.value(self.compute) or 0.0) + a.fixed_compute,
            comm_s=float(pulp.value(self.comm) or 0.0), grad_sync_s=float(pulp.value(self.sync) or 0.0),
            state_bytes=sum(s.state for s in picks.values()), status=status,
            solver=self.solver_name, solve_s=solve_s,
            ops=tuple(OpChoice(name=o.name, module=o.module, strategy=picks[o.name].label,
                               sources=o.inputs, inputs=picks[o.name].ins, output=picks[o.name].out)
                      for o in a.ops),
            reshards=tuple(self.p.reshards(picks, io)))
