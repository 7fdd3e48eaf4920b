"""How sure a prediction is: an uncertainty band on every `Estimate`, from validation errors.

Each component of a step (`Estimate.time_s`) is driven by one mechanism of the cost model; each
mechanism has been checked against measured runs (benchmarks/validate_published.py,
leave-one-source-out) or, where no published run exercises it, against published runs
held out of the table (measured through the public API). A component's time is taken as uncertain by a relative error X_k, and components are
combined as independent errors:

    sigma_step = sqrt( sum_k (X_k * t_k)^2 ),      band = sigma_step / T_step

X_k are mean absolute errors (not standard deviations): the band reads "predictions of this kind
have been off by about this much on runs they were not fitted to". A collective the model hides
partly under compute adds X_HIDDEN times its hidden time (`hidden`) to its component's term, in
quadrature: whether an overlap hides what the model says is the least certain part of pricing it.

Comparing two layouts of the same job, most of the model's error is shared (the same GEMM rates,
the same NCCL model): what separates them is the error in the components where they DIFFER, plus a
residual for everything else (`gain_band`). When the gain of the best layout over a simpler,
better-validated one is inside that band, the planner keeps the simpler one (`prefer_simpler`).
A risk on the upper side only (`Estimate.uncertainty_high`: a MoE router nothing balances) is
judged at its worst: a layout whose gain does not survive its own worst case is not "faster".

Derivation of the constants (validate_published as of 2026-11-24; its current results file is
benchmarks/results/validate_published-2026-11-28.txt,
"LOSO error by mechanism"): for rows leaning on mechanism k, the held-out error beyond the dense
rows' error, sqrt(MAPE_k^2 - MAPE_dense^2), divided by the mean share of the step the mechanism's
component takes in those rows, is the relative error of that component.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from meshplan.ir.gpu_arch import gpu_generation
from meshplan.ir.layout import PER_TENSOR_FP8_RECIPES, Layout
from meshplan.ir.precision import Precision

__all__ = ["step_uncertainty", "hidden", "X_HIDDEN", "band_coverage", "gain_band", "plan_regimes", "extrapolation", "memory_pressure", "memory_pressed",
           "moe_host_risk", "MOE_HOST_NOTE_FRAC", "X_MOE_HOST",
           "MEMORY_PRESSURE_FRAC", "REGIME_LORO", "complexity", "prefer_simpler", "regime_of", "COMPONENT_ERROR",
           "worst_ep_load", "routed_expert_s", "imbalance_risk", "upper_risk", "worst_case_gain", "risk_clause",
           "worst_case_words"]

# ---- validated mechanisms (leave-one-source-out, validate_published as of 2026-11-27) ---------
# Dense TP x PP x DP with the distributed optimizer (Megatron SC'21, Megatron-Core README,
# Korthikanti, NeMo, BLOOM, MT-NLG rows): LOSO MAPE of the 37 rows tagged "dense" (6.2%; 9.5% on
# 2026-11-24), each fold re-fitted from a neutral start. Applies to compute, optimizer and fixed overhead.
E_DENSE = 0.062                                                              # measured (LOSO)
# Exposed TP communication: validated inside the same dense rows (TP 1-8 in one NVLink domain); no
# row separates it from compute, so it gets the error of the collective model's bandwidth factors
# (ASTRA-sim's analytical NCCL ring on HGX-H100: 10-21% geomean, cost_models.md §10), doubled for
# the overlap that hides or exposes it (estimate).
X_TP = 0.3                                                                   # estimate
# Pipeline bubble + p2p: the three "pipeline scaling series" of validate_published (same model
# and layout, dp varied) give the fill/drain overhead measured vs predicted: 11.1 vs 13.7 (SC'21
# 175B), 28.6 vs 17.9 (SC'21 530B, interleaved as Table 1 ran it), 68.6 vs 35.5 (MT-NLG 530B):
# |error| 19%, 60%, 93% of the predicted, mean 57% (validate_published, 2026-11-27).
X_PP = 0.57                                                                  # measured (series)
# Data-parallel gradient/parameter collectives (ZeRO-1, overlapped): LOSO cannot separate their
# error from dense (their exposed share is ~1%); the collective-model error as for TP (estimate).
X_DP = 0.3                                                                   # estimate
# ZeRO-3 / FSDP per-micro-batch gathers (MosaicML rows, Megatron-FSDP ModelZoo row): LOSO MAPE
# 7.0% vs dense 5.8% at 4% of the step in 'dp' (2026-11-28): an excess of 1.2 points on a 4%
# share is inside X_DP; the DeepSpeed ZeRO-3 rows
# (not modelled, 94% LOSO) show how wrong a different ZeRO-3 stack can be, so kept at X_DP.
X_FSDP = 0.3                                                                 # estimate
# Context parallelism, ring over NVLink at <= 8k tokens (NeMo Llama 3 8B/70B cp2 rows): LOSO MAPE
# 4.5%, below dense; the ring's exposed share is ~0 there, so the component error is not resolved.
X_CP = 0.5                                                                   # estimate
# Expert all-to-all inside a node (Megatron-MoE-ModelZoo Mixtral / Qwen3 rows): LOSO MAPE 6.7%
# (below dense) at 8.5% of the step in 'ep', max 19%: (0.19 - 0.095) / 0.3 of the step in the
# worst row's all-to-all ~ 0.3.
X_EP = 0.3                                                                   # derived (LOSO max)
# FP8 GEMMs, tensorwise / blockwise on Hopper (NeMo FP8 and ModelZoo FP8-blockwise rows, LOSO
# MAPE 7.1%): applies to the compute component of FP8 runs, on top of E_DENSE. Our own H100
# measurement (gpu_suite 2026-11-24, 1.2B Llama: torchao tensorwise + compile 0.140 s, rowwise +
# compile 0.171 s, one model predicted 0.188 s for both) shows FP8 recipes 20% apart at one size.
X_FP8 = 0.15                                                                 # measured range

# Communication the model hides under compute (TP overlap, the DP / FSDP prefetch and bucketing, the
# expert all-to-all overlap, the CP ring under attention): how much really hides is what the
# validation pins least. The Model Zoo's Qwen3-235B expert-overlap A/B saved 10.7% of the step where
# the model hides 24% (0.55 of the hidden time wrong); the fitted share of TP communication that
# userbuffers hide moves 0.95 -> 0.53 when Megatron-Core's rows are held out (0.44); their mean
# (measured). Taken on the hidden seconds, with each component's own error on what shows.
X_HIDDEN = 0.5                                                               # measured (A/B, folds)

# ---- regimes no published row in data/published_runs.csv exercises -------------------------
# A held-out set of published runs (88 runs never used for fitting, measured through the public API): CP at
# 128k tokens predicted less than half the measured throughput (the CP + attention component off by
# ~100%); MoE at Qwen3 / DeepSeek-V3 scale (EP across nodes) ~33% step error with ~30-40% of the step
# in the all-to-all (=> ~1.0 on the component); FP8 recipes other than tensorwise ~25-35%.
CP_VALIDATED_MAX_SEQ = 8192          # longest sequence of a validated CP row (NeMo Llama 3, cp2)
CP_VALIDATED_MIN_TOKENS = 4096       # fewest tokens per CP rank in a validated row (8k over cp2)
# Zero-bubble schedules: no published run in the data uses one, so the bubble they claim to remove
# is unvalidated: its whole time is taken as uncertain (judgement until a measured ZB row exists).
X_ZB = 1.0                                                                   # estimate
X_CP_LONG = 1.0                                                              # measured (held-out runs)
X_EP_CROSS_NODE = 1.0                                                        # measured (held-out runs)
# Residual error between two layouts of one job outside the components they differ in (kernel
# shapes, launch gaps): the dense LOSO error halved, since the shared GEMM-rate and NCCL-model errors
# cancel between two layouts of one model on one cluster (derived).
E_PAIR = E_DENSE / 2                                                        # derived

# ---- regimes the validation table covers thinly (leave-one-regime-out) ------------------------
# benchmarks/results/validate_published-2026-11-28.txt, "leave-one-regime-out": for each regime of
# benchmarks/validate_published.py REGIMES, the published rows in it and the mean error on them when
# none of them fitted the constants. A plan in a regime with fewer than REGIME_MIN_ROWS rows
# extrapolates: its band is at least that regime's held-out error (measured).
REGIME_MIN_ROWS = 5
REGIME_LORO = {"stack megatron-2021": (24, 0.056), "stack megatron-deepspeed": (4, 0.176),
               "stack megatron-core": (48, 0.119),
               "stack torchtitan": (18, 0.101), "stack llm-foundry": (36, 0.048), "gpu ampere": (30, 0.048),
               "gpu hopper": (98, 0.093), "gpu blackwell": (2, 0.134), "fp8 per-tensor scales": (36, 0.106),
               "fp8 block/row/mx recipes": (2, 0.073), "ep across nodes": (4, 0.109),
               "context >= 64k": (12, 0.139), "moe": (20, 0.115)}
# A regime with no published row takes a regime it resembles: meshplan's runtime is PyTorch-native
# like torchtitan (FSDP2, DTensor, SDPA, torchao FP8); the stack-neutral reference is Megatron-Core's
# baseline. Otherwise the mean held-out error over the regimes (derived).
REGIME_NEAREST = {"stack meshplan": "stack torchtitan", "stack reference": "stack megatron-core"}
REGIME_UNSEEN = sum(e for _, e in REGIME_LORO.values()) / len(REGIME_LORO)

COMPONENT_ERROR = {"compute": E_DENSE, "optimizer": E_DENSE, "overhead": E_DENSE, "tp": X_TP,
                   "pp": X_PP, "bubble": X_PP, "dp": X_DP, "cp": X_CP, "ep": X_EP}


def regime_of(layout: Layout, *, seq_len: int, precision: str, ep_cross_domain: bool) -> dict[str, bool]:
    """Flags for the regimes whose error differs from the validated default."""
    return {"fp8": precision == Precision.FP8,
            "cp_long": layout.cp > 1 and (seq_len > CP_VALIDATED_MAX_SEQ or
                                          seq_len // layout.cp < CP_VALIDATED_MIN_TOKENS),
            "zb": layout.schedule == "zb",
            "ep_cross": layout.ep > 1 and ep_cross_domain,
            "fsdp": layout.zero == 3}


def regime_generation(gpu_id: str) -> str:
    """The GPU-generation regime of `gpu_id` (attention.gpu_generation; AMD parts and CPU processes,
    which no published row covers, take the nearest covered regime, Hopper)."""
    gen = gpu_generation(gpu_id)
    return "hopper" if gen == "other" else gen


def plan_regimes(*, stack: str, gpu_id: str, precision: str, fp8_recipe: str, ep_cross: bool, seq_len: int,
                 moe: bool, fabric: str = "nvswitch") -> list[str]:
    """The REGIME_LORO regimes an estimate falls in (names as benchmarks/validate_published.py's
    REGIMES). `fabric`: the scale-up fabric its groups inside a node run on where it has one (every
    published run ran on NVSwitch nodes, so another fabric, an xGMI or NVLink mesh or PCIe, is a
    regime without rows: its collectives' bandwidths are the GPU table's estimates)."""
    out = [f"stack {stack}", f"gpu {regime_generation(gpu_id)}"]
    if fabric and fabric != "nvswitch":
        out.append(f"fabric {fabric}")
    if precision == Precision.FP8:
        out.append("fp8 per-tensor scales" if fp8_recipe in PER_TENSOR_FP8_RECIPES else "fp8 block/row/mx recipes")
    if ep_cross:
        out.append("ep across nodes")
    if seq_len >= 65536:
        out.append("context >= 64k")
    if moe:
        out.append("moe")
    return out


def extrapolation(regimes: list[str]) -> tuple[float, tuple[str, ...]]:
    """(the least band the thinly validated regimes among `regimes` call for, one note per such
    regime saying how many published rows it has and their held-out error)."""
    floor, notes = 0.0, []
    for name in regimes:
        n, err = REGIME_LORO.get(name, (0, None))
        if n >= REGIME_MIN_ROWS:
            continue
        if err is None:
            near = REGIME_NEAREST.get(name)
            err = REGIME_LORO[near][1] if near in REGIME_LORO else REGIME_UNSEEN
            notes.append(f"{name}: no published run in the validation table; held-out error of "
                         f"{near or 'the regimes'}: {err * 100:.0f}%")
        else:
            notes.append(f"{name}: {n} published run(s) in the validation table, held-out error {err * 100:.0f}%")
        floor = max(floor, err)
    return floor, tuple(notes)


# Within this share of the usable memory a GPU step runs where PyTorch's caching allocator may have to
# free its cached blocks and retry a cudaMalloc (`num_alloc_retries` in torch.cuda.memory_stats), each
# retry a device synchronisation the cost model does not price. The two published rows with the highest
# predicted peak are its two worst over-predictions outside context parallelism (MPT-30B at 8k on 8
# H100s, 99% of usable memory, +31%; Megatron-Bridge 25.11 Qwen3-30B-A3B, 97%, +79%), while four other
# rows at 95-96% are within 11%: too few to price, enough to say.
MEMORY_PRESSURE_FRAC = 0.95
_MEMORY_NOTE = "memory: "          # how the note starts: memory_pressed finds it by this


def memory_pressure(peak_gb: float, capacity_gb: float) -> tuple[str, ...]:
    """A note where a fitting plan's predicted peak is within MEMORY_PRESSURE_FRAC of the usable
    memory (none otherwise, or when it does not fit: that is an error, not a note)."""
    if capacity_gb <= 0 or not (MEMORY_PRESSURE_FRAC * capacity_gb < peak_gb <= capacity_gb):
        return ()
    return (f"{_MEMORY_NOTE}the predicted peak {peak_gb:.1f} GB is {peak_gb / capacity_gb * 100:.0f}% of the "
            f"{capacity_gb:.1f} GB usable; the allocator may have to free and retry (unpriced device "
            f"syncs; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True eases fragmentation), and the "
            f"memory model's own error can tip it over: a smaller micro-batch or more recompute buys margin",)


# The GPU waiting for the host in dropless MoE layers (Device.moe_host_wait: the dispatch reads its
# split sizes on the host, which then issues the rest of the layer's kernels with the GPU idle).
# One published pair measures it beyond the model: Megatron-Bridge's Qwen3-30B-A3B on 16 H100s ran
# the same layout at 10,494 tokens/s/GPU token-drop (25.09, padded: no wait) and 5,275 dropless
# (25.11), 1.99x, where the model's host wait makes dropless 1.29x; the B200 pair of the same
# summaries, 18,066 against 9,299 (1.94x), shows the same. Taken as a 100% error on the host wait's
# share of the step (the pair, which also differs in the expert overlap its 25.11 config turns on,
# puts the miss at 2-3x the modelled wait; one pair does not price a mechanism, so it widens the band
# by the wait itself), said in a note where that share is MOE_HOST_NOTE_FRAC or more.
X_MOE_HOST = 1.0                                                              # measured (one pair)
MOE_HOST_NOTE_FRAC = 0.10


def moe_host_risk(host_s: float, step: float) -> tuple[float, tuple[str, ...]]:
    """(the band component of the MoE layers' host wait, a note where it is a large share of the
    step). `host_s`: the seconds a step's slowest pipeline rank waits for the host in its MoE layers."""
    if step <= 0 or host_s <= 0:
        return 0.0, ()
    share = host_s / step
    if share < MOE_HOST_NOTE_FRAC:
        return X_MOE_HOST * share, ()
    return X_MOE_HOST * share, (
        f"MoE host wait: the dropless dispatch makes the host wait for the GPU in every MoE layer, and the "
        f"GPU then idles while the host issues the layer's kernels: {host_s * 1e3:.0f} ms, {share * 100:.0f}% of "
        f"the step, priced at the kernels' launch times, the least validated part of the MoE model (a published "
        f"dropless run of this kind measured twice its token-drop twin's step, the model 1.3x); padded dispatch "
        f"(a capacity factor) does not wait, and fewer experts per GPU (a larger ep) or one grouped GEMM for them "
        f"issue fewer kernels",)


def _errors(regime: Mapping[str, bool]) -> dict[str, float]:
    x = dict(COMPONENT_ERROR)
    if regime.get("fsdp"):
        x["dp"] = X_FSDP
    if regime.get("cp_long"):
        x["cp"] = X_CP_LONG
    if regime.get("zb"):
        x["bubble"] = x["pp"] = X_ZB
    if regime.get("ep_cross"):
        x["ep"] = X_EP_CROSS_NODE
    if regime.get("fp8"):
        x["compute"] = math.hypot(E_DENSE, X_FP8)
    return x


def hidden(time_s: Mapping[str, float], comm_s: Mapping[str, float] | None = None) -> dict[str, float]:
    """Seconds of each collective the model hides under compute: `Estimate.comm_s` (hidden +
    exposed) less what shows in `time_s`, for the step's components."""
    return {k: max(0.0, v - time_s[k]) for k, v in (comm_s or {}).items() if k in time_s and v > time_s[k]}


def step_uncertainty(time_s: Mapping[str, float], regime: Mapping[str, bool],
                     comm_s: Mapping[str, float] | None = None) -> tuple[float, dict[str, float]]:
    """(relative band of the step time, seconds of uncertainty contributed by each component): each
    component's error on the time it shows and, for a collective partly hidden under compute
    (`hidden`), X_HIDDEN on the hidden time, in quadrature."""
    x, h = _errors(regime), hidden(time_s, comm_s)
    contrib = {k: math.hypot(x.get(k, E_DENSE) * max(0.0, v), X_HIDDEN * h.get(k, 0.0)) for k, v in time_s.items()}
    step = sum(time_s.values())
    if step <= 0:
        return 0.0, contrib
    return math.sqrt(sum(c * c for c in contrib.values())) / step, contrib


# ---- an unbalanced router: a risk the point estimate cannot price ---------------------------
# A model that trains without load balancing (ModelProfile.moe_balance "none") is priced at the
# balanced load (where an untrained router collapses is not predictable), and its band widens on the
# upper side by the worst case: meshplan's own tiny-moe (no aux loss, no bias) measured max/mean
# expert load 1.96 of a possible 2.0 over its first 20 steps, and its EP2 step ran 2x the prediction
# (measured with meshplan train).


def worst_ep_load(experts: int, topk: int, ep: int, capacity: float | None = None) -> float:
    """The most rows one EP rank can receive, over the mean, with any routing: each token's k
    choices are distinct experts, so a rank holding E/ep experts gets at most min(k, E/ep) of a
    token's k copies, against a mean of k/ep. A model's own capacity factor drops copies beyond
    cf x an expert's mean, which caps it. ep = 1: every expert is on every rank, the rows are fixed."""
    if ep <= 1 or experts <= 1 or topk < 1:
        return 1.0
    worst = min(float(topk), experts / ep) * ep / topk
    return min(worst, capacity) if capacity else worst


def routed_expert_s(profile, cluster, layout, *, seq_len: int, fp8: bool, microbatches: int) -> float:
    """Seconds of routed-expert GEMMs (forward, data- and weight-gradient; the forward again under
    full recompute) per step on the pipeline rank holding the most MoE layers, at the balanced load."""
    from meshplan.cost_models.compute import grouped_gemm_time
    from meshplan.cost_models.layer import Context, gemm_shape
    moe = [b for b in profile.layer_blocks() if b.is_moe]
    if not moe:
        return 0.0
    ctx = Context.build(cluster, layout, seq_len, fp8, fp8_recipe=layout.fp8_recipe)
    passes = 4.0 if layout.recompute == "full" else 3.0

    def one_pass(b) -> float:
        t = 0.0
        for li in b.linears:
            if li.is_expert:
                rows, n, k, groups, _ = gemm_shape(li, ctx)
                t += grouped_gemm_time(rows, n, k, cluster, groups=groups, fp8=fp8, recipe=ctx.fp8_recipe,
                                       fitted=ctx.fitted)
        return t

    per_layer = [passes * one_pass(b) for b in moe]
    # an even split of the MoE layers over the pipeline ranks: the band needs the size, not the rank
    held = -(-len(moe) // max(1, layout.pp))
    return microbatches * held * max(per_layer)


def imbalance_risk(profile, cluster, layout, *, seq_len: int, fp8: bool, microbatches: int, ep_s: float,
                   step: float) -> tuple[float, float]:
    """(upper-side widening of the band relative to the step, worst load over the mean on the
    busiest EP rank) for a model whose routers nothing balances; (0, 1) otherwise, and at ep = 1.
    The expert part of the step (routed-expert GEMMs + the exposed EP all-to-all, `ep_s`) grows
    with the busiest rank's rows: by (worst - 1) of itself at worst."""
    if profile.moe_balance != "none" or layout.ep <= 1 or step <= 0:
        return 0.0, 1.0
    worst = max((worst_ep_load(b.experts, b.topk, layout.ep, profile.moe_capacity_factor)
                 for b in profile.layer_blocks() if b.is_moe), default=1.0)
    if worst <= 1.0:
        return 0.0, 1.0
    expert_s = routed_expert_s(profile, cluster, layout, seq_len=seq_len, fp8=fp8, microbatches=microbatches)
    return (worst - 1.0) * (expert_s + ep_s) / step, worst


def _as_dict(e) -> Mapping[str, Any]:
    """An Estimate's fields, from the Estimate or its dict."""
    return e if isinstance(e, Mapping) else e.__dict__


def band_coverage(pairs) -> tuple[float, float]:
    """(share of (error, band) pairs whose |error| is within the band, share within twice the band):
    how well bands read as "off by about this much" hold on runs the constants were not fitted to
    (benchmarks/validate_published.py, leave-one-source-out). A band that is a mean absolute error
    covers about 60% of normal or Laplace errors and 90-95% at twice it."""
    pairs = [(abs(e), b) for e, b in pairs]
    if not pairs:
        return float("nan"), float("nan")
    return (sum(e <= b for e, b in pairs) / len(pairs), sum(e <= 2 * b for e, b in pairs) / len(pairs))


def _est_fields(e) -> tuple[dict[str, float], dict[str, bool], float, dict[str, float]]:
    """(time_s, regime, step, hidden seconds) of an Estimate or its dict (one without comm_s, written
    before the field was read, hides nothing)."""
    d = _as_dict(e)
    return d["time_s"], d.get("regime") or {}, d["step_time_s"], hidden(d["time_s"], d.get("comm_s"))


def gain_band(best, other) -> tuple[float, float, dict[str, float]]:
    """(gain, band, per-component seconds) of `best` over `other` (Estimates or their dicts).

    gain = T_other / T_best - 1. The band is the uncertainty of that gain: for each component, the
    larger of the two layouts' relative errors times the DIFFERENCE of their times (a mis-modelled
    mechanism misprices both layouts the same way), X_HIDDEN times the difference of the time each
    hides under compute (`hidden`: one overlap model prices both), plus E_PAIR of the step for
    everything else.
    The per-component dict is the signed time `other` spends beyond `best` in each component: where
    the edge comes from."""
    tb, rb, Tb, hb = _est_fields(best)
    to, ro, To, ho = _est_fields(other)
    xb, xo = _errors(rb), _errors(ro)
    var = (E_PAIR * Tb) ** 2
    diff = {}
    for k in set(tb) | set(to):
        d = to.get(k, 0.0) - tb.get(k, 0.0)
        diff[k] = d
        eb, eo = xb.get(k, E_DENSE), xo.get(k, E_DENSE)
        if eb == eo:            # the same mechanism in the same regime: its error is shared
            var += (eb * d) ** 2
        else:                   # a regime only one of them is in (CP at long context, EP across
            # nodes, zero-bubble, FP8): the two errors are independent, each on its whole time
            var += (eb * tb.get(k, 0.0)) ** 2 + (eo * to.get(k, 0.0)) ** 2
        var += (X_HIDDEN * (ho.get(k, 0.0) - hb.get(k, 0.0))) ** 2
    return To / Tb - 1, math.sqrt(var) / Tb, diff


def upper_risk(e) -> float:
    """`Estimate.uncertainty_high` of an Estimate or its dict (0 where absent: a dense model, a
    balanced router, or an estimate made before the field existed)."""
    d = _as_dict(e)
    return float(d.get("uncertainty_high") or 0.0)


def _worst_load(e) -> float:
    """`Estimate.moe_worst_load` (1 where absent)."""
    d = _as_dict(e)
    return float(d.get("moe_worst_load") or 1.0)


def worst_case_gain(best, other) -> float:
    """The gain of `best` over `other` with each at the top of its upper-side risk:
    T_other (1 + high_other) / (T_best (1 + high_best)) - 1. The risk is a bound a router nothing
    balances can reach (tiny-moe came within 2% of it, see above), not a random error, so it is
    compared whole, not folded into the band in quadrature. Equal to the gain of `gain_band` when
    neither carries such a risk."""
    _, _, tb, _ = _est_fields(best)
    _, _, to, _ = _est_fields(other)
    return to * (1 + upper_risk(other)) / (tb * (1 + upper_risk(best))) - 1


def complexity(layout: Layout, regime: Mapping[str, bool] | None = None) -> int:
    """How many mechanisms beyond plain data parallelism a layout uses, less-validated ones counted
    twice: the planner's measure of "simpler" when two layouts are within each other's band."""
    L = layout
    n = (L.tp > 1) + (L.pp > 1) + (L.vp > 1) + (L.schedule == "zb") \
        + 2 * (L.cp > 1) + 2 * (L.ep > 1) + (L.zero == 3) \
        + 2 * L.offload_activations   # offloading: no published run validates it
    r = regime or {}
    n += 2 * bool(r.get("cp_long")) + 2 * bool(r.get("ep_cross"))   # zb already counted above
    return int(n)


def memory_pressed(e) -> bool:
    """Whether estimate `e` (or its dict) carries the memory-pressure note (a GPU plan within
    MEMORY_PRESSURE_FRAC of the usable memory: memory_pressure); False where the field is absent."""
    return any(n.startswith(_MEMORY_NOTE) for n in _as_dict(e).get("extrapolation") or ())


# Bands closer than this are the same band (the component mix of two micro-batch sizes of one mesh
# moves the band in its fifth decimal)
BAND_TIE = 1e-4
# prefer_simpler looks this far down the ranking (further only for a layout with less upper-side risk)
PREFER_SIMPLER_WINDOW = 64


def prefer_simpler(ranked: list, *, max_candidates: int = PREFER_SIMPLER_WINDOW):
    """Choose among fitting estimates ranked fastest first. Returns (chosen, note): the fastest
    unless a simpler (lower `complexity`) and no less certain (band no wider on the upper side)
    layout is slower by less than the band of the gain, in which case the simplest such layout (then the fastest of
    those, at its worst case). `note` says why, or is ''.

    The gain is judged at each layout's worst case (`worst_case_gain`): a fastest layout whose
    step plus its upper-side risk (`Estimate.uncertainty_high`, a MoE router nothing balances on
    an expert-parallel layout) is not better than a simpler one's by more than the band does not
    win on its point estimate. For the same reason a layout of the same complexity carrying less of
    that risk (less expert parallelism) may replace it too. Neither changes anything when no
    estimate carries such a risk. Likewise a layout as simple with memory headroom may replace a
    fastest whose GPU peak is within MEMORY_PRESSURE_FRAC of the usable memory, and a layout within it
    never replaces a fastest outside it."""
    if not ranked:
        return None, ""
    best = ranked[0]
    cb, hb, wb = complexity(best.layout, best.regime), upper_risk(best), _worst_load(best)
    pick, pick_key = best, None
    # a layout with less of the risk (less expert parallelism) may be well down the point-estimate
    # ranking and still have the better worst case: past the window, those are considered too
    beyond = [e for e in ranked[max_candidates:] if upper_risk(e) < hb] if hb > 0 else []
    for e in ranked[1:max_candidates] + beyond:
        if not e.fits or e.precision != best.precision:
            continue
        if memory_pressed(e) and not memory_pressed(best):
            continue      # simplicity bought with the fastest's memory headroom is a bet, not a saving
        ce, he = complexity(e.layout, e.regime), upper_risk(e)
        # only a simpler (or as simple with a lower bound on the busiest rank's load: ep2 against
        # ep8 when nothing balances, not a recompute variant of the same EP degree) AND no less
        # certain layout may replace the fastest; "certain" is the band's upper side, the risk
        # included (the symmetric band alone when neither carries one)
        safer = ce == cb and he < hb and _worst_load(e) < wb
        # or, as simple, one with memory headroom where the fastest runs within MEMORY_PRESSURE_FRAC
        # of the usable memory (a smaller micro-batch, more recompute): its peak is no bet on the
        # memory model's error or the allocator's fragmentation
        roomier = ce == cb and memory_pressed(best) and not memory_pressed(e)
        if not (ce < cb or safer or roomier) or e.uncertainty + he > best.uncertainty + hb + BAND_TIE:
            continue
        _, band, _ = gain_band(best, e)
        if worst_case_gain(best, e) <= band:
            key = (ce, e.step_time_s * (1 + he), e.step_time_s)
            if pick_key is None or key < pick_key:
                pick, pick_key = e, key
    if pick is best:
        return best, ""
    gain, band, diff = gain_band(best, pick)
    edge = ", ".join(f"{k} {d * 1e3:+.0f} ms" for k, d in sorted(diff.items(), key=lambda kv: -kv[1])
                     if d > 1e-3 * best.step_time_s)
    kind = "simpler" if complexity(pick.layout, pick.regime) < cb else \
        "roomier" if memory_pressed(best) and not memory_pressed(pick) else "less risky"
    head = (f"chose the {kind} {pick.layout.short()} over the fastest "
            f"{best.layout.short()}: its predicted gain {gain * 100:.1f}% ")
    tail = f" (the edge rests on: {edge or 'nothing'})"
    if gain <= band:
        return pick, head + f"is inside the band {band * 100:.1f}% of what the model can tell apart" + tail
    return pick, head + "does not hold at its worst case: " + worst_case_words(best, pick, band) + tail


def risk_clause(e) -> str:
    """Why an estimate carries an upper-side risk, in words: "its routers train without load
    balancing (up to 4.0x the mean rows on the busiest EP rank), step up to +85%"."""
    d = _as_dict(e)
    worst = float(d.get("moe_worst_load") or 0.0)
    load = f" (up to {worst:.1f}x the mean rows on the busiest EP rank)" if worst > 1.0 else ""
    return f"its routers train without load balancing{load}, step up to +{upper_risk(e) * 100:.0f}%"


def worst_case_words(fast, slow, band: float) -> str:
    """How `fast` compares with `slow` at their worst cases (`worst_case_gain`), in words, for the
    planner's note and Plan.explain()'s runner-ups."""
    w = worst_case_gain(fast, slow)
    who = slow.layout.short()
    other = f"; {who} itself up to +{upper_risk(slow) * 100:.0f}%" if upper_risk(slow) else ""
    where = (f"only {w * 100:.1f}% faster than {who}, within the band {band * 100:.1f}%" if w > 0
             else f"{-w * 100:.1f}% slower than {who}")
    return f"{risk_clause(fast)}{other}; at worst it is {where}"
