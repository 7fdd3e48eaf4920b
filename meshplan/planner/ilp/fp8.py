"""FP8 placement: which linear layers run their GEMMs in FP8.

FP8 GEMMs run at up to twice the BF16 rate but pay for quantising their inputs and for scaling
bookkeeping (the cost model prices both: `cost_models.tables.LinearCostTable`), so small GEMMs
gain nothing. FP8 also moves memory: Transformer Engine keeps an FP8 copy of each weight for the
whole step (+1 byte per parameter, LinearCosts.weight_cache_bytes), while a GEMM input saved for
backward in FP8 takes 1 byte per element instead of 2 (LinearCostTable.stored_input, as
cost_models.layer.activation_bytes keeps them). By default the first and last blocks, the output
layer and MoE routers stay in BF16 (the numerically sensitive ends of the network, as in NVIDIA's
and torchtitan's FP8 recipes), as do GEMMs whose dimensions FP8 kernels cannot take or that are
not faster in FP8. Users can force modules in or out.

The ILP
-------
Data: candidates i (one linear of one layer instance, or the output layer) with time gain
g_i = t_i(BF16) - t_i(FP8) per step, weight-cache cost w_i and, on pipeline rank r(i), a memory
budget B_r (the room left on that GPU; negative when it does not fit yet). Readers of one stored
input (q, k and v read the attention norm's output; gate and up read the MLP norm's output) form
an input group G whose saving A_G (half of that stored input) is realised only when every reader
runs in FP8: with one BF16 reader the BF16 copy must be kept anyway.

Variables
  x_i in {0, 1}   module i runs in FP8
  y_G in {0, 1}   every reader of input G runs in FP8 (G's saving counts)

Objective
  maximise sum_i g_i x_i

Constraint families (one method each in `_Fp8Model`)
  fixed     x_i = 1 for forced-in modules; x_i = 0 for forced-out, default-excluded (unless
            forced in) and those gaining no more than min_gain_s
  group     y_G <= x_i for every reader i of G
  memory    for every rank r: sum_{i on r} w_i x_i - sum_{G on r} A_G y_G <= B_r

Grouping. A 126-layer model has ~900 candidates, but layers of one block on one rank are
identical. Input groups (or lone modules) with the same members' numbers, rank and fixed state form
a class of n units; per class the model has one integer X_cj in {0..n} per member position j and
one Y_c <= X_cj, instead of n binaries each. Decoding switches member j on in the first X_cj units
of the class, so exactly min_j X_cj >= Y_c units have all readers in FP8: the grouped model is
exact (its memory is never below the truth, and the reported memory is recomputed per module).

Infeasibility. When the memory family has no solution, the same model minimises each rank's
memory change instead and the error names the rank, its budget, the forced-in modules that
cost memory there and what FP8 could save at most.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import pulp

from meshplan.cost_models.tables import GEMMS_PER_PASS, LinearCostTable
from meshplan.ir.estimate import GB
from meshplan.ir.layout import Layout, split_layers
from meshplan.errors import ConfigError, DoesNotFitError, LayoutError
from meshplan.planner.ilp.solver import has_solution, proved_optimal, resolve_solver, solve
from meshplan.profiling.traits import packing

__all__ = ["Fp8Candidate", "Fp8Choice", "fp8_candidates", "choose_fp8", "forced_sets", "DEFAULT_EXCLUSIONS", "fp8_layer_modules"]

DEFAULT_EXCLUSIONS = ("router", "output layer", "first block", "last block", "dims not multiples of 16",
                      "too small to gain", "packed projection under TP")
# FP8 GEMM kernels need both GEMM dimensions of the weight to be multiples of 16 (Transformer
# Engine's assert_dim_for_fp8_exec; cuBLASLt FP8 layout rules; torchao float8 checks the same).
FP8_DIM_MULTIPLE = 16
# Two time gains closer than this are equal (float noise in sums of per-GEMM seconds).
_GAIN_EPS = 1e-15


@dataclass(frozen=True, kw_only=True)
class Fp8Candidate:
    """One linear that could run in FP8, with its per-step cost on its GPU."""

    module: str                      # FQN, e.g. "layers.3.attention.wq"
    bf16_time_s: float               # its GEMMs per training step (all micro-batches), BF16
    fp8_time_s: float                # the same in FP8, casts and scaling included
    memory_delta_gb: float           # + when FP8 costs memory (weight cache), - when it saves (activations)
    default_excluded: str | None = None   # why it stays BF16 unless forced in (DEFAULT_EXCLUSIONS), or None
    stage: int = 0                   # pipeline rank holding the module (memory budgets are per rank)
    input_group: str = ""            # modules reading the same stored input; its saving needs them all in FP8
    activation_saved_gb: float = 0.0  # this module's share of that saving (>= 0, already in memory_delta_gb)

    def __post_init__(self) -> None:
        if not isinstance(self.module, str) or not self.module:
            raise ConfigError("an Fp8Candidate needs a non-empty module name")
        for name in ("bf16_time_s", "fp8_time_s", "activation_saved_gb"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"Fp8Candidate {self.module!r}: {name} must be a finite number >= 0, got {v!r}")
        v = self.memory_delta_gb
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"Fp8Candidate {self.module!r}: memory_delta_gb must be finite, got {v!r}")
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage < 0:
            raise ConfigError(f"Fp8Candidate {self.module!r}: stage must be a pipeline rank >= 0, got {self.stage!r}")

    @property
    def gain_s(self) -> float:
        return self.bf16_time_s - self.fp8_time_s

    @property
    def weight_cache_gb(self) -> float:
        """The memory change that does not depend on the input group: memory_delta_gb + own saving share."""
        return self.memory_delta_gb + self.activation_saved_gb


@dataclass(frozen=True, kw_only=True)
class Fp8Choice:
    modules: frozenset[str]          # modules that run in FP8
    time_saved_s: float              # per step, summed over the chosen modules
    memory_delta_gb: float           # the largest per-GPU change over pipeline ranks
    reasons: dict[str, str] = field(default_factory=dict)   # every candidate -> why FP8 / why BF16
    memory_delta_by_stage: tuple[float, ...] = ()
    solver: str = ""
    solve_time_s: float = 0.0

    def __post_init__(self) -> None:
        missing = sorted(m for m in self.modules if m not in self.reasons)
        if missing:
            raise ConfigError(f"Fp8Choice: no reason recorded for {missing[:3]}")


# ---- candidates from the cost model ---------------------------------------------------------------
def _policy(layout: Layout, index_in_rank: int) -> str:
    rc = layout.recompute
    if isinstance(rc, str):
        return rc
    return "full" if index_in_rank < rc else "none"


def fp8_candidates(profile, cluster, layout, *, seq_len: int, global_batch: int | None = None,
                   stack=None) -> list[Fp8Candidate]:
    """One candidate per linear of every layer instance, plus the output layer.

    Times are per training step: (forward + 2 backward GEMMs [+ a recomputed forward]) x the
    micro-batches per step, global_batch / (dp * mbs); without global_batch, pp micro-batches
    (the fewest that fill the pipeline; only the scale of the gains depends on it). Memory is per
    GPU on the module's pipeline rank, activations times the micro-batches the schedule keeps in
    flight there. `stack` (None: the reference) decides how the FP8 casts run: eager torchao's
    unfused passes cost more than many linears gain (cost_models.compute.fp8_eager).
    """
    gpu = cluster.gpu
    if not gpu.fp8_tflops:
        raise ConfigError(f"{gpu.name} has no FP8 matrix units, so no module can run in FP8; "
                          "use precision='bf16' or an FP8 GPU (H100, H200, B200, MI300X, L40S)")
    L = Layout.coerce(layout)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError(f"seq_len={seq_len!r}: must be a positive integer")
    if global_batch is None:
        m = L.pp
    else:
        if global_batch < 1 or global_batch % (L.dp * L.mbs):
            raise LayoutError(f"global_batch {global_batch} is not a positive multiple of dp*mbs = {L.dp}*{L.mbs}")
        m = global_batch // (L.dp * L.mbs)
    nl = profile.num_layers
    if L.stages > nl:
        raise LayoutError(f"pp*vp = {L.stages} stages but the model has only {nl} layers; use pp*vp <= {nl}")
    stage_layers = L.stage_layers if L.stage_layers is not None else split_layers(nl, L.stages)
    if len(stage_layers) != L.stages or sum(stage_layers) != nl:
        raise LayoutError(f"stage_layers {stage_layers} must give pp*vp = {L.stages} counts summing to {nl} layers")
    rank_of, index_in_rank = [0] * nl, [0] * nl
    seen = [0] * L.pp
    start = 0
    for s, n in enumerate(stage_layers):
        for i in range(start, start + n):
            rank_of[i] = s % L.pp
            index_in_rank[i] = seen[s % L.pp]
            seen[s % L.pp] += 1
        start += n

    # the cost model's prices of every linear in BF16 and FP8 (one table, memoised per block)
    table = LinearCostTable(profile, cluster, L, seq_len=seq_len, stack=stack)
    flight = table.in_flight(m)
    occurrence: dict[int, int] = {}
    out: list[Fp8Candidate] = []
    for i, bi in enumerate(profile.layers):
        b = profile.blocks[bi]
        inst = b.instances[occurrence.get(bi, 0)]
        occurrence[bi] = occurrence.get(bi, 0) + 1
        r, policy = rank_of[i], _policy(L, index_in_rank[i])
        passes = m * (GEMMS_PER_PASS + (1 if policy == "full" else 0))
        groups: dict[str, list[int]] = {}
        for li in b.linears:
            lc = table.linear(bi, li)
            tb, tf = lc.bf16_s, lc.fp8_s
            ok_dims = (lc.n % FP8_DIM_MULTIPLE == 0 and lc.k % FP8_DIM_MULTIPLE == 0)
            # Transformer Engine casts each weight to FP8 once per step (then reuses the cache)
            cast = lc.weight_cast_s
            group, per_token = table.stored_input(li.role, b, policy)
            saved_gb = 0.5 * per_token * table.tokens * flight[r] / GB    # FP8 stores 1 byte instead of 2
            # a packed QKV / gate-up projection under TP runs its own per-part forward
            # (runtime/packed_projections.py), which an FP8 linear would replace
            reason = ("router" if li.role == "router" else
                      "packed projection under TP" if L.tp > 1 and packing(b, li) else
                      "first block" if i == 0 else
                      "last block" if i == nl - 1 else "dims not multiples of 16" if not ok_dims else
                      "too small to gain" if tf * passes + cast >= tb * passes else None)
            out.append(Fp8Candidate(module=f"{inst}.{li.name}", bf16_time_s=tb * passes, fp8_time_s=tf * passes + cast,
                                    memory_delta_gb=lc.weight_cache_bytes / GB - saved_gb,
                                    default_excluded=reason, stage=r,
                                    input_group=f"{inst}:{group}" if group else "",
                                    activation_saved_gb=saved_gb))
            if group:
                groups.setdefault(group, []).append(len(out) - 1)
        # a shared input's saving is split evenly over its readers (exact when all run in FP8)
        for members in groups.values():
            share = out[members[0]].activation_saved_gb / len(members)   # each reader saw the whole input
            for j in members:
                cand = out[j]
                out[j] = Fp8Candidate(module=cand.module, bf16_time_s=cand.bf16_time_s, fp8_time_s=cand.fp8_time_s,
                                      memory_delta_gb=cand.weight_cache_gb - share,
                                      default_excluded=cand.default_excluded, stage=cand.stage,
                                      input_group=cand.input_group, activation_saved_gb=share)
    out.append(_head_candidate(profile, table, m, flight))
    return out


def _head_candidate(profile, table: LinearCostTable, m: int, flight: list[float]) -> Fp8Candidate:
    L, head = table.layout, table.head()
    tb = head.bf16_s * GEMMS_PER_PASS * m
    tf = head.fp8_s * GEMMS_PER_PASS * m
    # its input (the final norm's output, gathered over SP) is saved for backward
    saved = 0.5 * table.head_input_bytes_per_token * table.tokens * flight[L.pp - 1] / GB
    return Fp8Candidate(module=profile.head_fqn or "output", bf16_time_s=tb,
                        fp8_time_s=tf + head.weight_cast_s,
                        memory_delta_gb=head.weight_cache_bytes / GB - saved,
                        default_excluded="output layer", stage=L.pp - 1, activation_saved_gb=saved)


def fp8_layer_modules(profile, force_in: Sequence[str] = (), force_out: Sequence[str] = ()) -> frozenset | None:
    """The FP8 set the search prices before the placement ILP runs, at the cost model's layer
    granularity (a layer's GEMMs are FP8 when any of its linears is: cost_models.ranks.layer_fp8_flags):
    every layer but the first and last block (DEFAULT_EXCLUSIONS), plus a layer with a forced-in
    linear, less a layer whose linears are all forced out. So the search ranks FP8 candidates at the
    price the plan then reports for the ILP's choice, not at "every layer FP8": ranked at that
    cheaper price, a layout could win the search on a step time its plan (fewer FP8 layers) does
    not reach.
    None: every layer is FP8, which is what estimate(precision="fp8") prices without a module set."""
    per_layer: list[list[str]] = []
    seen: dict[int, int] = {}
    for bi in profile.layers:
        b = profile.blocks[bi]
        inst = b.instances[seen.get(bi, 0)] if b.instances else f"layers.{len(per_layer)}"
        seen[bi] = seen.get(bi, 0) + 1
        per_layer.append([f"{inst}.{li.name}" for li in b.linears])
    names = [n for mods in per_layer for n in mods]

    def claims(patterns) -> dict[str, bool]:
        out: dict[str, bool] = {}
        for p in ((patterns,) if isinstance(patterns, str) else patterns):
            for n in ({p} if p in known else set(fnmatch.filter(names, p))):
                out[n] = out.get(n, False) or n == p
        return out

    known = set(names)
    fin_m, fout_m = claims(force_in), claims(force_out)
    fin = {n for n in fin_m if not (n in fout_m and fout_m[n] and not fin_m[n])}
    fout = {n for n in fout_m if n not in fin}
    last = len(per_layer) - 1
    chosen: set[str] = set()
    for i, mods in enumerate(per_layer):
        if i in (0, last):
            chosen.update(n for n in mods if n in fin)
        elif any(n not in fout for n in mods):
            chosen.update(n for n in mods if n not in fout)
    if all(any(n in chosen for n in mods) for mods in per_layer if mods):
        return None
    return frozenset(chosen)


# ---- the ILP --------------------------------------------------------------------------------------
@dataclass
class _Class:
    """Identical units (input groups or lone modules): members[u][j] is candidate index."""

    stage: int
    members: list[list[int]]          # per unit, candidate indices ordered by member signature
    fixed: list[int | None]           # per member position: 1 forced in, 0 fixed out, None free
    gain: list[float]                 # per member position
    cache: list[float]                # per member position: weight-cache GB
    saving: float                     # GB saved per unit when all its members run in FP8
    grouped: bool                     # a real input group (its saving needs every member)


def _match(patterns: Sequence[str], names: list[str], what: str) -> dict[str, bool]:
    """module -> whether it was named exactly (True) or only matched by a glob pattern (False)."""
    if isinstance(patterns, str):
        patterns = (patterns,)
    known = set(names)
    out: dict[str, bool] = {}
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ConfigError(f"{what}: module names must be non-empty strings, got {p!r}")
        hit = {p} if p in known else set(fnmatch.filter(names, p))
        if not hit:
            close = difflib.get_close_matches(p, names, n=3)
            raise ConfigError(f"{what} entry {p!r} matches no FP8 candidate module"
                              + (f"; did you mean {', '.join(close)}?" if close else
                                 f"; candidates look like {', '.join(names[:3])} (glob patterns work: "
                                 f"'layers.*.feed_forward.*')"))
        for n in hit:
            out[n] = out.get(n, False) or n == p
    return out


def _classes(cands: Sequence[Fp8Candidate], fixed: list[int | None]) -> list[_Class]:
    units: dict[tuple[int, str], list[int]] = {}
    for i, cnd in enumerate(cands):
        key = (cnd.stage, cnd.input_group) if cnd.input_group else (cnd.stage, f"\0{i}")
        units.setdefault(key, []).append(i)
    by_sig: dict[tuple, _Class] = {}
    for (stage, gname), idx in units.items():
        sig_of = {i: (cands[i].gain_s, cands[i].weight_cache_gb, cands[i].activation_saved_gb, fixed[i])
                  for i in idx}
        idx = sorted(idx, key=lambda i: (sig_of[i][3] is None, sig_of[i][3] or 0) + sig_of[i][:3])
        grouped = not gname.startswith("\0")
        sig = (stage, grouped, tuple(sig_of[i] for i in idx))
        if sig not in by_sig:
            by_sig[sig] = _Class(stage=stage, members=[], fixed=[fixed[i] for i in idx],
                                 gain=[cands[i].gain_s for i in idx], cache=[cands[i].weight_cache_gb for i in idx],
                                 saving=sum(cands[i].activation_saved_gb for i in idx), grouped=grouped)
        by_sig[sig].members.append(idx)
    return list(by_sig.values())


class _Fp8Model:
    """The grouped formulation; one method per constraint family."""

    def __init__(self, classes: list[_Class], sense: int, name: str):
        self.classes = classes
        self.prob = pulp.LpProblem(name, sense)
        self.X: dict[tuple[int, int], object] = {}
        self.Y: dict[int, object] = {}
        for ci, cl in enumerate(classes):
            n = len(cl.members)
            for j, fx in enumerate(cl.fixed):
                self.X[ci, j] = (n * fx if fx is not None else
                                 pulp.LpVariable(f"x_{ci}_{j}", 0, n, cat="Binary" if n == 1 else "Integer"))
            if cl.grouped and len(cl.fixed) > 1 and cl.saving > 0:
                self.Y[ci] = pulp.LpVariable(f"y_{ci}", 0, n, cat="Binary" if n == 1 else "Integer")
            else:   # a lone reader: the saving follows its own choice
                self.Y[ci] = self.X[ci, 0] if cl.saving > 0 else 0

    def gain(self):
        return pulp.lpSum(g * self.X[ci, j] for ci, cl in enumerate(self.classes) for j, g in enumerate(cl.gain))

    def stage_memory(self, stage: int):
        return pulp.lpSum([c * self.X[ci, j] for ci, cl in enumerate(self.classes) if cl.stage == stage
                           for j, c in enumerate(cl.cache)]
                          + [-cl.saving * self.Y[ci] for ci, cl in enumerate(self.classes) if cl.stage == stage])

    def stages(self) -> list[int]:
        return sorted({cl.stage for cl in self.classes})

    # ---- constraint families (fixed choices are constants in X) ----
    def add_group(self) -> None:
        for ci, y in self.Y.items():
            if isinstance(y, pulp.LpVariable):
                for j in range(len(self.classes[ci].fixed)):
                    self.prob += y <= self.X[ci, j], f"group_{ci}_{j}"

    def add_memory(self, budgets: dict[int, float]) -> None:
        for s in self.stages():
            if s in budgets:
                self.prob += self.stage_memory(s) <= budgets[s], f"memory_stage_{s}"

    def chosen(self) -> list[int]:
        out = []
        for ci, cl in enumerate(self.classes):
            for j in range(len(cl.fixed)):
                x = self.X[ci, j]
                take = int(round(pulp.value(x))) if isinstance(x, pulp.LpVariable) else int(x)
                out.extend(cl.members[u][j] for u in range(take))
        return out


def _budgets(memory_budget_gb, stages: set[int]) -> dict[int, float]:
    if memory_budget_gb is None:
        return {}
    if isinstance(memory_budget_gb, (int, float)) and not isinstance(memory_budget_gb, bool):
        if not math.isfinite(memory_budget_gb):
            raise ConfigError(f"memory_budget_gb={memory_budget_gb!r}: must be finite (or None for no limit)")
        return {s: float(memory_budget_gb) for s in stages}
    try:
        vals = [float(v) for v in memory_budget_gb]
    except (TypeError, ValueError):
        raise ConfigError(f"memory_budget_gb must be a number, one per pipeline rank, or None; "
                          f"got {memory_budget_gb!r}") from None
    if stages and max(stages) >= len(vals):
        raise ConfigError(f"memory_budget_gb has {len(vals)} entries but candidates sit on pipeline rank "
                          f"{max(stages)}; give one budget per rank")
    return {s: vals[s] for s in stages}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if abs(seconds) >= 1e-3 else f"{seconds * 1e6:.1f} us"


def forced_sets(names: list[str], force_in: Sequence[str] = (),
                force_out: Sequence[str] = ()) -> tuple[set[str], set[str]]:
    """(forced in, forced out): the candidate modules each list claims, by name or glob pattern;
    where both claim a module an exact name beats a pattern ("layers.*.w2" out, "layers.7.w2" in),
    and equal claims are refused."""
    fin_m = _match(force_in, names, "force_in")
    fout_m = _match(force_out, names, "force_out")
    clash = sorted(n for n in set(fin_m) & set(fout_m) if fin_m[n] == fout_m[n])
    if clash:
        how = "name" if fin_m[clash[0]] else "pattern"
        raise ConfigError(f"{clash[0]} is both forced in and forced out of FP8 (by {how} in both lists); keep it "
                          "in one list or name it exactly in the one that should win")
    fin = {n for n in fin_m if not (n in fout_m and fout_m[n])}
    return fin, {n for n in fout_m if n not in fin}


def choose_fp8(candidates: Sequence[Fp8Candidate], *, memory_budget_gb: float | Sequence[float] | None,
               force_in: Sequence[str] = (), force_out: Sequence[str] = (), min_gain_s: float = 0.0,
               time_limit_s: float = 5.0, solver: str = "auto") -> Fp8Choice:
    """Pick the FP8 modules that save the most step time within each rank's memory budget.

    memory_budget_gb: GB each GPU may still grow by (negative: FP8 must save that much), one value
        for every pipeline rank or one per rank; None for no memory limit.
    force_in / force_out: module names or glob patterns ("layers.*.attention.*"); where both lists
        claim a module, an exact name beats a pattern.
    min_gain_s: a module must save more than this per step to be chosen (unless forced in).
    Raises DoesNotFitError when no choice fits a budget, naming the rank and the forced modules.
    """
    cands = list(candidates)
    names = [c.module for c in cands]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"FP8 candidates repeat module names: {dup[:5]}")
    if isinstance(min_gain_s, bool) or not isinstance(min_gain_s, (int, float)) or not math.isfinite(min_gain_s):
        raise ConfigError(f"min_gain_s={min_gain_s!r}: must be a finite number of seconds")
    fin, fout = forced_sets(names, force_in, force_out)
    groups: dict[str, set[int]] = {}
    for c in cands:
        if c.input_group:
            groups.setdefault(c.input_group, set()).add(c.stage)
    split = sorted(g for g, st in groups.items() if len(st) > 1)
    if split:
        raise ConfigError(f"input group {split[0]!r} spans pipeline ranks {sorted(groups[split[0]])}; "
                          "readers of one stored input live on one rank")
    budgets = _budgets(memory_budget_gb, {c.stage for c in cands})
    name = resolve_solver(solver)
    t0 = time.perf_counter()

    fixed: list[int | None] = []
    reasons: dict[str, str] = {}
    for c in cands:
        if c.module in fin:
            fixed.append(1)
        elif c.module in fout:
            fixed.append(0)
            reasons[c.module] = "BF16: forced out by the user"
        elif c.default_excluded:
            fixed.append(0)
            reasons[c.module] = f"BF16: {c.default_excluded} (kept in BF16 by default; force it in to change that)"
        elif c.gain_s <= min_gain_s + _GAIN_EPS:
            fixed.append(0)
            reasons[c.module] = (f"BF16: FP8 is not faster ({_ms(-c.gain_s)} slower per step)" if c.gain_s <= 0 else
                                 f"BF16: FP8 saves only {_ms(c.gain_s)} per step, not more than "
                                 f"min_gain_s={_ms(min_gain_s)}")
        else:
            fixed.append(None)

    classes = _classes(cands, fixed)
    model = _Fp8Model(classes, pulp.LpMaximize, "fp8")
    model.prob += model.gain()
    model.add_group()
    model.add_memory(budgets)
    status = solve(model.prob, time_limit_s=time_limit_s, solver=name)
    if status == "Infeasible" or not has_solution(model.prob):
        _explain(cands, classes, budgets, fin, name, time_limit_s, status)
    chosen = set(model.chosen())
    label = name if proved_optimal(model.prob) else f"{name} (time limit)"

    # exact memory per rank from the decoded choice (groups count only when every reader is FP8)
    by_stage: dict[int, float] = {s: 0.0 for s in {c.stage for c in cands}}
    for i in chosen:
        by_stage[cands[i].stage] += cands[i].weight_cache_gb
    members: dict[str, list[int]] = {}
    for i, c in enumerate(cands):
        members.setdefault(c.input_group or f"\0{i}", []).append(i)
    for idx in members.values():
        if all(i in chosen for i in idx):
            by_stage[cands[idx[0]].stage] -= sum(cands[i].activation_saved_gb for i in idx)
    for i, c in enumerate(cands):
        if i in chosen:
            how = "forced in by the user" if c.module in fin else "chosen"
            effect = f"saves {_ms(c.gain_s)} per step" if c.gain_s >= 0 else f"costs {_ms(-c.gain_s)} per step"
            reasons[c.module] = f"FP8: {how}, {effect} ({c.weight_cache_gb:+.3f} GB weight cache)"
        elif c.module not in reasons:
            b = budgets.get(c.stage)
            reasons[c.module] = (
                f"BF16: not chosen before the solver's time limit (FP8 would save {_ms(c.gain_s)})" if b is None else
                f"BF16: the {b:.2f} GB memory budget of pipeline rank {c.stage} is spent on modules that save "
                f"more time per GB (FP8 would save {_ms(c.gain_s)}, {c.memory_delta_gb:+.3f} GB)")
    n_stages = max(by_stage) + 1 if by_stage else 0
    per_stage = tuple(by_stage.get(s, 0.0) for s in range(n_stages))
    return Fp8Choice(modules=frozenset(cands[i].module for i in chosen),
                     time_saved_s=math.fsum(cands[i].gain_s for i in chosen),
                     memory_delta_gb=max(per_stage) if per_stage else 0.0, reasons=reasons,
                     memory_delta_by_stage=per_stage, solver=label, solve_time_s=time.perf_counter() - t0)


def _explain(cands, classes, budgets, fin, solver, time_limit_s, status) -> None:
    """Minimise every rank's memory change (ranks are independent) and name a rank that cannot fit."""
    model = _Fp8Model(classes, pulp.LpMinimize, "fp8_min_memory")
    model.prob += pulp.lpSum(model.stage_memory(s) for s in model.stages())
    model.add_group()
    solve(model.prob, time_limit_s=time_limit_s, solver=solver)
    if not has_solution(model.prob):
        raise DoesNotFitError(f"the FP8 placement ILP found no choice within time_limit_s={time_limit_s} "
                              f"(solver status {status!r}); raise time_limit_s")
    for s in model.stages():
        least = pulp.value(model.stage_memory(s))
        least = float(least) if least is not None else 0.0
        if s in budgets and least > budgets[s] + 1e-9:
            forced = [c for c in cands if c.stage == s and c.module in fin and c.weight_cache_gb > 0]
            forced.sort(key=lambda c: -c.weight_cache_gb)
            budget = budgets[s]
            if forced:
                names = ", ".join(f"{c.module} ({c.weight_cache_gb:+.3f} GB)" for c in forced[:5])
                more = f" and {len(forced) - 5} more" if len(forced) > 5 else ""
                raise DoesNotFitError(
                    f"forcing FP8 on {names}{more} needs at least {least:+.2f} GB on pipeline rank {s}, more than "
                    f"its memory budget of {budget:.2f} GB: force fewer modules in, or free memory "
                    f"(recompute, a larger tp or pp)")
            raise DoesNotFitError(
                f"pipeline rank {s} must shed {-budget:.2f} GB but FP8 on every eligible module there changes its "
                f"memory by {least:+.2f} GB at best: use recompute, a larger tp or pp, or force more modules into FP8")
    raise DoesNotFitError(f"the FP8 placement ILP reported {status!r} although every rank can meet its budget; "
                          "raise time_limit_s")
