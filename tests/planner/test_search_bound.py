"""The search's lower bound (planner/bound.py): it never exceeds an estimate of its candidate, and
a search that skips candidates by it ranks exactly what a full search ranks in the planner's window
and returns the same plan."""

from __future__ import annotations

import math

import pytest

import meshplan as mp
from meshplan.planner import search as S
from meshplan.profiling.analytic import profile_from_config
from meshplan.planner.bound import MeshBound, policies_of
from meshplan.planner import build as build_module
from meshplan.planner.build import build_plan

CASES = [  # (model, cluster preset, GPUs, seq, global batch, precisions, stack)
    ("llama3-70b", "dgx-h100", 512, 8192, 512, ("bf16",), "meshplan"),
    ("llama3-8b", "dgx-b200", 128, 8192, 512, ("bf16", "fp8"), "megatron-core"),
    ("mixtral-8x7b", "dgx-h100", 64, 4096, 256, ("bf16",), "torchtitan"),
    ("tiny-llama", "local-cpu", 4, 256, 16, ("bf16",), "meshplan"),
]


def _case(i):
    name, preset, n, seq, gb, precisions, stack = CASES[i]
    prof = profile_from_config(mp.models.config(name), seq_len=seq)
    return prof, mp.Cluster.preset(preset, num_gpus=n), seq, gb, precisions, stack


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{c[0]}@{c[2]}-{c[1]}" for c in CASES])
def test_bound_is_below_every_estimate_and_the_bounded_search_plans_as_the_full_one(i, monkeypatch):
    prof, cl, seq, gb, precisions, stack = _case(i)
    checked = []
    bounds: dict[int, MeshBound] = {}
    real = S._cost_mesh

    def spy(profile, cluster, base, f, seq_len, global_batch, precs, ranked, rejected, stats, fp8_modules=None,
            stack=None, cutoff=math.inf):
        n0, r0 = len(ranked), len(rejected)
        real(profile, cluster, base, f, seq_len, global_batch, precs, ranked, rejected, stats, fp8_modules, stack,
             cutoff)
        bound = bounds.get(base.pp)
        if bound is None:
            bound = bounds[base.pp] = MeshBound(
                profile, cluster, seq_len=seq_len, global_batch=global_batch, precisions=precs,
                policies=policies_of(S._recompute_options(profile, base.pp, seq_len, stack)),
                fp8_modules=fp8_modules, stack=stack)
        lb = bound(base, S._mbs_options(base, global_batch // base.dp, f, stack))
        for e in ranked[n0:] + rejected[r0:]:
            checked.append((lb, e.step_time_s, base))

    kw = dict(seq_len=seq, global_batch=gb, precisions=precisions, stack=stack)
    monkeypatch.setattr(S, "_cost_mesh", spy)
    full = S.search(prof, cl, bound=False, **kw)
    monkeypatch.setattr(S, "_cost_mesh", real)
    assert len(checked) > 20
    bad = [(lb, step, c) for lb, step, c in checked if lb > step * (1 + 1e-12)]
    assert not bad, f"{len(bad)} estimates below their bound, e.g. {bad[0]}"
    # the bound is not vacuous: on GPUs it is most of the step for the leading candidates
    if cl.gpu.id != "cpu":
        best = min(step for _, step, _ in checked)
        assert max(lb / step for lb, step, _ in checked if step < 1.2 * best) > 0.7

    # skipping candidates by the bound keeps the planner's window and its plan exactly
    fast = S.search(prof, cl, **kw)
    window = S.PLANNER_WINDOW
    key = lambda r: [(e.layout, e.precision, e.step_time_s) for e in r.ranked[:window]]
    assert key(fast) == key(full)
    assert fast.stats["estimates"] <= full.stats["estimates"]
    if cl.num_gpus >= 128:
        assert fast.stats["pruned_bound"] > 0
    # the stage-split ILP that build_plan runs on the leading candidates stops at a time limit (its
    # answer may differ between two runs on a loaded machine): outside what the bound decides
    monkeypatch.setattr(build_module, "refine_stages", lambda profile, cluster, e, **kw: e)
    plans = [build_plan(prof, cl, r, seq_len=seq, global_batch=gb, stack=stack) for r in (full, fast)]
    assert plans[0].layout == plans[1].layout
    assert plans[0].estimate.step_time_s == plans[1].estimate.step_time_s
    assert [(r.layout, r.step_time_s) for r in plans[0].runner_ups] == \
        [(r.layout, r.step_time_s) for r in plans[1].runner_ups]


def test_search_keeps_to_the_fp8_recipes_the_stack_runs():
    """A fixed FP8 recipe the stack does not run is refused by name (torchao has no delayed scaling);
    "auto" precision on a stack without FP8 (llm-foundry) plans BF16 instead of failing."""
    from meshplan.errors import ConfigError
    from meshplan.ir.precision import Precision
    from meshplan.planner.search import search
    prof = profile_from_config(mp.models.config("llama3-8b"), seq_len=4096)
    cl = mp.Cluster.preset("dgx-h100", num_gpus=8)
    kw = dict(seq_len=4096, global_batch=64, keep=4)
    with pytest.raises(ConfigError, match="torchtitan stack has no FP8 scaling recipe 'delayed'.*tensorwise, rowwise"):
        search(prof, cl, precisions=(Precision.FP8,), fixed={"fp8_recipe": "delayed"}, stack="torchtitan", **kw)
    with pytest.raises(ConfigError, match="llm-foundry stack runs no FP8"):
        search(prof, cl, precisions=(Precision.FP8,), stack="llm-foundry", **kw)
    auto = search(prof, cl, precisions=(Precision.BF16, Precision.FP8), stack="llm-foundry", **kw)
    assert auto.ranked and all(e.precision == Precision.BF16 for e in auto.ranked)
    ok = search(prof, cl, precisions=(Precision.FP8,), fixed={"fp8_recipe": "delayed"}, stack="megatron-core", **kw)
    assert ok.ranked and all(e.layout.fp8_recipe == "delayed" for e in ok.ranked)
