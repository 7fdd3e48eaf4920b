"""FP8 placement ILP (meshplan.planner.ilp.fp8): optimality against brute force, exactness of the
grouped model, candidates consistent with the cost model, default exclusions on Llama-3 8B and an
MoE model, memory budgets, forced modules, infeasibility messages and the CBC path."""

from __future__ import annotations

import itertools
import random
import re
import time

import pytest

from meshplan.cluster import Cluster
from meshplan.cost_models import constants as K
from meshplan.cost_models.compute import fp8_weight_cast_time
from meshplan.cost_models.layer import Context, _gemms
from meshplan.ir.layout import Layout
from meshplan.errors import ConfigError, DoesNotFitError
from meshplan.models.presets import config
from meshplan.profiling.analytic import profile_from_config
from meshplan.planner.ilp.fp8 import Fp8Candidate, choose_fp8, fp8_candidates
from meshplan.planner.ilp.solver import available_solvers

SOLVERS = available_solvers()
# Mixtral-sized experts (small ones gain nothing from FP8) plus a shared expert and one dense layer
MOE = dict(layers=5, hidden=4096, heads=32, kv_heads=8, vocab=32000, experts=8, topk=2, moe_ffn_hidden=14336,
           shared_experts=1, dense_layers=1)


@pytest.fixture(scope="module")
def h100():
    return Cluster.preset("dgx-h100", nodes=1)


@pytest.fixture(scope="module")
def llama8b():
    return profile_from_config(config("llama3-8b"))


def exact_memory(cands, chosen: set[str]) -> dict[int, float]:
    """Per-rank memory change of a choice: a group's saving counts only with every reader in FP8."""
    mem: dict[int, float] = {}
    groups: dict[str, list[Fp8Candidate]] = {}
    for c in cands:
        mem.setdefault(c.stage, 0.0)
        if c.module in chosen:
            mem[c.stage] += c.weight_cache_gb
        groups.setdefault(c.input_group or c.module, []).append(c)
    for members in groups.values():
        if all(c.module in chosen for c in members):
            mem[members[0].stage] -= sum(c.activation_saved_gb for c in members)
    return mem


def brute_force(cands, budget, force_in=(), force_out=(), min_gain_s=0.0):
    best = None
    free = [c for c in cands if c.module not in force_in and c.module not in force_out
            and not c.default_excluded and c.gain_s > min_gain_s]
    fixed_in = {c.module for c in cands if c.module in force_in}
    for bits in itertools.product((0, 1), repeat=len(free)):
        chosen = fixed_in | {c.module for c, b in zip(free, bits) if b}
        mem = exact_memory(cands, chosen)
        if budget is not None and any(v > budget + 1e-12 for v in mem.values()):
            continue
        gain = sum(c.gain_s for c in cands if c.module in chosen)
        if best is None or gain > best:
            best = gain
    return best


def random_candidates(rng: random.Random, n_units: int, stages: int = 2, identical: bool = False):
    out = []
    template = None
    for u in range(n_units):
        size = rng.choice((1, 2, 3))
        if identical and template is not None:
            specs = template
        else:
            specs = [(rng.uniform(1, 3), rng.uniform(0.3, 2.5), rng.uniform(0.0, 0.4), rng.uniform(0, 0.3))
                     for _ in range(size)]
            template = specs
        stage = u % stages
        group = f"u{u}:in" if len(specs) > 1 else ""
        for j, (tb, tf, cache, saved) in enumerate(specs):
            share = saved / len(specs)
            excl = "first block" if (not identical and rng.random() < 0.1) else None
            out.append(Fp8Candidate(module=f"u{u}.m{j}", bf16_time_s=tb, fp8_time_s=tf,
                                    memory_delta_gb=cache - share, default_excluded=excl, stage=stage,
                                    input_group=group, activation_saved_gb=share))
    return out


# ---- exactness -----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_matches_brute_force(seed):
    rng = random.Random(seed)
    cands = random_candidates(rng, n_units=6)[:12]
    total_cache = sum(max(0.0, c.memory_delta_gb) for c in cands)
    force_in = {cands[0].module} if seed % 2 else set()
    force_out = {cands[-1].module} if seed % 3 == 0 else set()
    for budget in (None, total_cache / 4, -0.05 if seed % 2 == 0 else 0.0):
        want = brute_force(cands, budget, force_in, force_out, min_gain_s=0.2)
        for s in SOLVERS:
            if want is None:
                with pytest.raises(DoesNotFitError):
                    choose_fp8(cands, memory_budget_gb=budget, force_in=force_in, force_out=force_out,
                               min_gain_s=0.2, solver=s)
                continue
            got = choose_fp8(cands, memory_budget_gb=budget, force_in=force_in, force_out=force_out,
                             min_gain_s=0.2, solver=s)
            assert got.time_saved_s == pytest.approx(want, rel=1e-9, abs=1e-12), (budget, s)
            mem = exact_memory(cands, set(got.modules))
            assert got.memory_delta_by_stage == pytest.approx(tuple(mem[k] for k in sorted(mem)))
            if budget is not None:
                assert max(mem.values()) <= budget + 1e-9
            assert force_in <= got.modules and not (force_out & got.modules)
            assert set(got.reasons) == {c.module for c in cands}


def test_grouped_model_is_exact():
    # 40 identical units collapse into a handful of classes; nudging every number by a relative
    # 1e-12 makes them distinct (no grouping) - both models must reach the same optimum.
    rng = random.Random(11)
    same = random_candidates(rng, n_units=40, stages=2, identical=True)
    nudged = [Fp8Candidate(module=c.module, bf16_time_s=c.bf16_time_s * (1 + 1e-12 * i), fp8_time_s=c.fp8_time_s,
                           memory_delta_gb=c.memory_delta_gb * (1 + 1e-12 * i), stage=c.stage,
                           input_group=c.input_group, activation_saved_gb=c.activation_saved_gb)
              for i, c in enumerate(same)]
    budget = sum(max(0.0, c.memory_delta_gb) for c in same) / 2 / 3   # binding on both ranks
    a = choose_fp8(same, memory_budget_gb=budget)
    b = choose_fp8(nudged, memory_budget_gb=budget)
    assert a.time_saved_s == pytest.approx(b.time_saved_s, rel=1e-9)
    assert 0 < len(a.modules) < len(same)
    assert max(exact_memory(same, set(a.modules)).values()) <= budget + 1e-9


# ---- candidates from the cost model --------------------------------------------------------------
def test_candidates_follow_the_cost_model(h100, llama8b):
    layout = Layout(tp=2, dp=4, mbs=2)
    cands = fp8_candidates(llama8b, h100, layout, seq_len=4096, global_batch=64)
    assert len(cands) == 32 * 7 + 1
    m = 64 // (4 * 2)
    ctx = Context.build(h100, layout, 4096, fp8=False)
    block = llama8b.blocks[0]
    fwd, _ = _gemms(block, ctx)
    layer3 = [c for c in cands if c.module.startswith("layers.3.")]
    assert [c.module for c in layer3][:2] == ["layers.3.attention.wq", "layers.3.attention.wk"]
    assert sum(c.bf16_time_s for c in layer3) == pytest.approx(3 * m * fwd, rel=1e-12)
    fwd8, _ = _gemms(block, Context.build(h100, layout, 4096, fp8=True))
    # plus Transformer Engine's once-per-step cast of each weight to FP8
    casts = sum(fp8_weight_cast_time(c.weight_cache_gb * 2 ** 30 / K.FP8_WEIGHT_CACHE_BYTES, h100) for c in layer3)
    assert sum(c.fp8_time_s for c in layer3) == pytest.approx(3 * m * fwd8 + casts, rel=1e-9)
    # weight cache: FP8_WEIGHT_CACHE_BYTES (FP8 copy + its transpose) per parameter of the tp shard
    w1 = next(c for c in layer3 if c.module.endswith("feed_forward.w1"))
    assert w1.weight_cache_gb == pytest.approx(K.FP8_WEIGHT_CACHE_BYTES * 4096 * 14336 / 2 / 2 ** 30)
    # q/k/v share the attention norm's output; its saving is split over the three readers
    qkv = [c for c in layer3 if c.input_group == "layers.3:attn_in"]
    assert len(qkv) == 3
    tokens = 2 * 4096
    assert sum(c.activation_saved_gb for c in qkv) == pytest.approx(0.5 * 2 * 4096 * tokens / 2 / 2 ** 30)


def test_llama3_8b_defaults_keep_the_ends_in_bf16(h100, llama8b):
    cands = fp8_candidates(llama8b, h100, {"dp": 8}, seq_len=8192)
    got = choose_fp8(cands, memory_budget_gb=None)
    for name in ("layers.0.attention.wq", "layers.0.feed_forward.w2", "layers.31.feed_forward.w1", "output"):
        assert name not in got.modules
    assert "first block" in got.reasons["layers.0.attention.wq"]
    assert "last block" in got.reasons["layers.31.feed_forward.w1"]
    assert "output layer" in got.reasons["output"]
    assert "layers.5.feed_forward.w1" in got.modules and "layers.30.attention.wo" in got.modules
    assert got.reasons["layers.5.feed_forward.w1"].startswith("FP8: chosen, saves")
    # GQA k/v projections (4096 -> 1024) gain little: their input's and output gradient's casts are
    # large against their GEMMs (w1 saves a third); sharded 4 ways over TP they lose
    by = {c.module: c for c in cands}
    wk, w1 = by["layers.5.attention.wk"], by["layers.5.feed_forward.w1"]
    assert wk.fp8_time_s > 0.85 * wk.bf16_time_s and w1.fp8_time_s < 0.7 * w1.bf16_time_s
    tp4 = {c.module: c for c in fp8_candidates(llama8b, h100, {"tp": 4, "dp": 2}, seq_len=8192)}
    assert tp4["layers.5.attention.wk"].default_excluded == "too small to gain"
    assert got.time_saved_s > 0 and got.solver in SOLVERS
    assert set(got.reasons) == {c.module for c in cands}


def test_moe_router_stays_bf16(h100):
    prof = profile_from_config(MOE)
    cands = fp8_candidates(prof, h100, {"dp": 8, "ep": 8}, seq_len=4096)
    routers = [c for c in cands if c.module.endswith("moe.router")]
    assert len(routers) == 4 and all(c.default_excluded == "router" for c in routers)
    got = choose_fp8(cands, memory_budget_gb=None)
    assert not any(c.module in got.modules for c in routers)
    assert {"layers.2.moe.experts.w1", "layers.2.moe.shared_experts.w1"} <= got.modules
    # router and shared expert read the same input: with the router in BF16 that input is not saved
    shared = next(c for c in cands if c.module == "layers.2.moe.shared_experts.w1")
    assert shared.input_group == "layers.2:moe_in"
    both = choose_fp8(cands, memory_budget_gb=None, force_in=["layers.2.moe.router"])
    saved = sum(c.activation_saved_gb for c in cands if c.input_group == "layers.2:moe_in")
    assert both.memory_delta_gb == pytest.approx(got.memory_delta_gb + routers[1].weight_cache_gb - saved)


def test_no_fp8_gpu_is_a_config_error(llama8b):
    a100 = Cluster.preset("dgx-a100", nodes=1) if "dgx-a100" in Cluster.presets() else None
    if a100 is None:
        pytest.skip("no A100 preset")
    with pytest.raises(ConfigError, match=re.escape(a100.gpu.name) + " has no FP8 matrix units"):
        fp8_candidates(llama8b, a100, {"dp": 8}, seq_len=2048)


# ---- memory, forcing, errors ---------------------------------------------------------------------
def test_memory_budget_changes_the_choice(h100, llama8b):
    cands = fp8_candidates(llama8b, h100, {"dp": 8}, seq_len=8192)
    free = choose_fp8(cands, memory_budget_gb=None)
    tight = choose_fp8(cands, memory_budget_gb=free.memory_delta_gb / 3)
    assert tight.memory_delta_gb <= free.memory_delta_gb / 3 + 1e-9
    assert tight.time_saved_s < free.time_saved_s and tight.modules != free.modules
    left_out = sorted(free.modules - tight.modules)
    assert left_out and "memory budget of pipeline rank 0" in tight.reasons[left_out[0]]
    # modules that save memory (row-parallel outputs free their stored input) are kept
    assert "layers.5.feed_forward.w2" in tight.modules


def test_force_in_and_out(h100, llama8b):
    cands = fp8_candidates(llama8b, h100, {"dp": 8}, seq_len=8192)
    got = choose_fp8(cands, memory_budget_gb=None, force_out=["layers.*.feed_forward.w2"],
                     force_in=["output", "layers.0.attention.*", "layers.7.feed_forward.w2"])
    assert "output" in got.modules and "layers.0.attention.wq" in got.modules
    assert "forced in by the user" in got.reasons["output"]
    # forced in even where FP8 is slower (GQA k/v sharded over TP): the user decides
    tp4 = choose_fp8(fp8_candidates(llama8b, h100, {"tp": 4, "dp": 2}, seq_len=8192), memory_budget_gb=None,
                     force_in=["layers.0.attention.*"])
    assert "layers.0.attention.wk" in tp4.modules and "costs" in tp4.reasons["layers.0.attention.wk"]
    # the exact name beats the pattern
    assert [m for m in got.modules if m.endswith("feed_forward.w2")] == ["layers.7.feed_forward.w2"]
    assert got.reasons["layers.8.feed_forward.w2"] == "BF16: forced out by the user"
    with pytest.raises(ConfigError, match="did you mean layers.3.attention.wq"):
        choose_fp8(cands, memory_budget_gb=None, force_in=["layers.3.attention.wqq"])
    with pytest.raises(ConfigError, match="both forced in and forced out"):
        choose_fp8(cands, memory_budget_gb=None, force_in=["output"], force_out=["output"])
    with pytest.raises(ConfigError, match="layers.0.feed_forward.w2 is both forced in and forced out"):
        choose_fp8(cands, memory_budget_gb=None, force_in=["layers.0.*"], force_out=["layers.*.feed_forward.w2"])


def test_forced_in_module_that_breaks_the_budget(h100, llama8b):
    cands = fp8_candidates(llama8b, h100, {"dp": 8}, seq_len=8192)
    head = next(c for c in cands if c.module == "output")
    assert head.weight_cache_gb > 0.9     # 128256 x 4096 weights, 2 bytes each (FP8 copy + transpose)
    with pytest.raises(DoesNotFitError, match=r"forcing FP8 on output \(\+0\.979 GB\).*pipeline rank 0.*"
                                              r"memory budget of -0\.50 GB"):
        choose_fp8(cands, memory_budget_gb=-0.5, force_in=["output"], force_out=["layers.*"])
    with pytest.raises(DoesNotFitError, match="must shed 50.00 GB"):
        choose_fp8(cands, memory_budget_gb=-50.0)


def test_pipeline_ranks_have_their_own_budgets(h100, llama8b):
    layout = Layout(pp=2, dp=4)
    cands = fp8_candidates(llama8b, h100, layout, seq_len=8192, global_batch=32)
    assert {c.stage for c in cands if c.module.startswith("layers.3.")} == {0}
    assert {c.stage for c in cands if c.module.startswith("layers.20.")} == {1}
    assert next(c for c in cands if c.module == "output").stage == 1
    free = choose_fp8(cands, memory_budget_gb=None)
    got = choose_fp8(cands, memory_budget_gb=[free.memory_delta_by_stage[0], 0.05])
    assert got.memory_delta_by_stage[1] <= 0.05 + 1e-9
    assert all(m in got.modules for m in free.modules if m.startswith("layers.3."))   # rank 0 unconstrained
    with pytest.raises(ConfigError, match="one budget per rank"):
        choose_fp8(cands, memory_budget_gb=[1.0])


def test_cbc_matches_highs_and_405b_is_fast(h100):
    prof = profile_from_config(config("llama3-405b"))
    cluster = Cluster.preset("dgx-h100", nodes=16)
    layout = Layout(tp=8, pp=8, vp=2, dp=2)
    t0 = time.perf_counter()
    cands = fp8_candidates(prof, cluster, layout, seq_len=8192, global_batch=64)
    t_cands = time.perf_counter() - t0
    assert len(cands) == 126 * 7 + 1
    results = {}
    for s in SOLVERS:
        t0 = time.perf_counter()
        results[s] = choose_fp8(cands, memory_budget_gb=0.4, solver=s)
        assert time.perf_counter() - t0 < 2.0      # measured ~0.1 s
    assert t_cands < 1.0
    vals = {round(r.time_saved_s, 9) for r in results.values()}
    assert len(vals) == 1
    assert all(max(r.memory_delta_by_stage) <= 0.4 + 1e-9 for r in results.values())
    assert results["cbc"].solver == "cbc"


def _gpt2(seq: int = 64):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=seq,
                                  attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(cfg)


def test_fp8_plans_list_only_linears_the_runtime_swaps():
    """The FP8 backends swap nn.Linear modules. GPT-2's Conv1D linears and stacked expert weights
    (meshplan's GroupedExperts w1/w2/w3 are parameters, not modules) stay bf16 in the plan, as they
    do in the run; naming one in fp8_force_in is refused by plan(), not by the runtime on N ranks."""
    import warnings

    from torch import nn

    import meshplan as mp
    from meshplan.runtime.parallel import _check
    cl = mp.Cluster.preset("local-cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        moe = mp.models.build("tiny-moe", seq_len=64, device="meta")
        p = mp.plan(moe, cl, seq_len=64, global_batch=8, precision="fp8")
        modules = dict(moe.named_modules())
        assert p.fp8_modules and all(isinstance(modules.get(m), nn.Linear) for m in p.fp8_modules), p.fp8_modules
        gpt2 = _gpt2()
        assert mp.plan(gpt2, cl, seq_len=64, global_batch=8, precision="fp8").fp8_modules == ()
        with pytest.raises(ConfigError, match=r"transformer.h.1.mlp.c_fc.*nn.Linear modules only"):
            mp.plan(gpt2, cl, seq_len=64, global_batch=8, precision="fp8", fp8_force_in=("transformer.h.1.mlp.c_fc",))
        # a plan naming a non-Linear (hand-edited, or from an older meshplan) is refused before any collective
        import dataclasses
        bad = dataclasses.replace(p, fp8_modules=p.fp8_modules + ("layers.1.feed_forward.experts.w1",))
        with pytest.raises(ConfigError, match=r"not nn.Linear modules of this model \(e.g. layers.1.feed_forward"):
            _check(moe, bad, 4)
