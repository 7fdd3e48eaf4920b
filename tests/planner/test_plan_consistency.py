"""Planner / cost-model consistency: the search and `estimate` price one layout
the same way, and the free plan is never predicted slower than a layout inside its search space.

Rows of benchmarks/plan_vs_published.py that used to fail, each for its own root cause:
- GPT-3 20B, FP8, tp2 dp32: the FP8 placement ILP's memory budget counted the FP8 weight cache
  twice, so it kept 13 of 264 linears in FP8 (the fixed-layout plan 26% slower than `estimate`);
- GPT-3 175B / Llama 3 8B, FP8: the search priced every layer in FP8 while the plan keeps the
  first and last block in BF16 (the stack's FP8 set is now an input: plan(fp8_force_in=...));
- Nemotron-4 340B, pp8 vp12: vp was capped at 8, so the published layout was outside the space;
- Llama 3 8B: the planner keeps a simpler layout whose loss is inside the band (prefer_simpler),
  but its search found one at least as fast as the published layout.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import meshplan as mp
from meshplan.api import plan
from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.validation import DEFAULT_CSV, load_rows
from meshplan.profiling.analytic import profile_from_config
from meshplan.planner.ilp.fp8 import fp8_layer_modules


_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench():
    sys.path.insert(0, str(_BENCH))     # plan_vs_published imports validate_published from there
    try:
        spec = importlib.util.spec_from_file_location("plan_vs_published", _BENCH / "plan_vs_published.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod         # its dataclass looks its module up there
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(_BENCH))
    return mod


@pytest.fixture(scope="module")
def bench():
    return _bench()


@pytest.fixture(scope="module")
def rows():
    return {r.id: r for r in load_rows()}


# (row, layout keys the free plan keeps as published: a narrower search, to keep the test fast)
@pytest.mark.parametrize("row_id,keep", [("nemo2407-gpt3-20b-64gpu", ("pp", "cp")), ("nemo2407-llama3-8b-8gpu", ()),
                                         ("nemo2407-nemotron-340b-128gpu", ("tp", "cp", "pp", "dp"))])
def test_fixed_plan_equals_estimate_and_free_plan_is_no_slower(bench, rows, row_id, keep):
    c = bench.compare_row(rows[row_id], {}, keep=keep)
    assert c is not None
    # the published layout is in the search space and priced exactly as estimate() prices it
    assert c.same.estimate.step_time_s == pytest.approx(c.pub.step_time_s, rel=1e-9)
    assert c.same.layout.short() == mp.Layout.from_dict(c.layout).short()
    # the search finds a layout at least as fast; the plan is that one, or a simpler one whose loss
    # is inside the band (and says so)
    assert c.fastest_s <= c.pub.step_time_s * (1 + 1e-9)
    assert c.free.estimate.step_time_s <= c.pub.step_time_s * (1 + 1e-9) or c.free.notes.band_choice


GPT20B = profile_from_config(dict(family="gpt", layers=44, hidden=6144, heads=48, kv_heads=48, ffn_hidden=24576,
                                  vocab=51200, activation="gelu", norm="layernorm", position="learned", bias=True,
                                  name="gpt3-20b"))


def test_default_fp8_plan_prices_what_the_search_ranked():
    """Without forces the plan keeps the first and last block in BF16; the search ranks the layout
    at that price, and the ILP (its budget no longer counting the FP8 weight cache twice) puts every
    other layer in FP8, so the plan's estimate is the search's."""
    cl = mp.Cluster(gpu="h100-sxm", num_gpus=64, gpus_per_node=8)
    lay = dict(tp=2, cp=1, pp=1, dp=32, zero=1, mbs=2, recompute="none", schedule="1f1b", grad_dtype="bf16",
               tp_comm_overlap=True)
    pl = plan(GPT20B, cl, seq_len=2048, global_batch=2048, precision="fp8", fixed=lay, stack="megatron-core")
    layers = fp8_layer_modules(GPT20B)
    assert not any(m.startswith(("layers.0.", "layers.43.")) for m in layers)
    ranked = estimate_profile(GPT20B, cl, pl.layout, seq_len=2048, global_batch=2048, precision="fp8",
                              fp8_modules=layers, stack=pl.stack)
    assert pl.estimate.step_time_s == pytest.approx(ranked.step_time_s, rel=1e-9)
    assert {m.split(".")[1] for m in pl.fp8_modules} == {str(i) for i in range(1, 43)}
    # forcing every layer in reproduces estimate(precision="fp8"), which prices all layers in FP8
    forced = plan(GPT20B, cl, seq_len=2048, global_batch=2048, precision="fp8", fixed=lay, stack="megatron-core",
                  fp8_force_in=("layers.*",))
    direct = estimate_profile(GPT20B, cl, pl.layout, seq_len=2048, global_batch=2048, precision="fp8",
                              stack=pl.stack)
    assert forced.estimate.step_time_s == pytest.approx(direct.step_time_s, rel=1e-9)
    assert forced.estimate.step_time_s < pl.estimate.step_time_s


def test_fp8_layer_modules_follows_forces():
    assert fp8_layer_modules(GPT20B, force_in=("layers.*",)) is None
    first = fp8_layer_modules(GPT20B, force_in=("layers.0.attention.wq",))
    assert "layers.0.attention.wq" in first and not any(m.startswith("layers.43.") for m in first)
    out = fp8_layer_modules(GPT20B, force_out=("layers.5.*",))
    assert not any(m.startswith("layers.5.") for m in out) and any(m.startswith("layers.6.") for m in out)


def test_forced_fp8_set_that_fits_by_the_estimate_is_placed():
    """Under full recompute a layer's peak is its recomputed working set, where FP8-stored inputs
    (a MoE layer's routed expert inputs: ~1.9 GB at micro-batch 8) shrink what the ILP's per-module
    credits do not see: the ILP alone finds forcing every layer linear over budget while the estimate
    of exactly that set fits. The plan places the forced set and prices it."""
    from meshplan.errors import DoesNotFitError
    from meshplan.ir.stack import STACKS
    from meshplan.models.presets import PRESETS
    from meshplan.planner.ilp.fp8 import choose_fp8, fp8_candidates
    cfg = {k: v for k, v in PRESETS["qwen3-235b-a22b"].items() if k not in ("seq_len", "rope_theta", "norm_eps")}
    prof = profile_from_config({**cfg, "name": "qwen3-235b-a22b"})
    cl = mp.Cluster(gpu="h100-sxm", num_gpus=256, gpus_per_node=8)
    lay = mp.Layout(tp=1, pp=1, dp=256, ep=8, zero=3, mbs=8, recompute="full", grad_dtype="bf16",
                    ep_comm_overlap=True)
    kw = dict(seq_len=4096, global_batch=8192)
    forced = [f"{inst}.{li.name}" for b in prof.blocks for inst in b.instances for li in b.linears
              if li.role != "router"]
    base = estimate_profile(prof, cl, lay, precision="fp8", fp8_modules=frozenset(), stack="megatron-core", **kw)
    budget = [base.capacity_gb - sum(v for k, v in s.items() if k not in ("fp8_cache", "host_offload"))
              for s in base.memory_by_stage]
    cands = fp8_candidates(prof, cl, lay, stack=STACKS["megatron-core"], **kw)
    with pytest.raises(DoesNotFitError):
        choose_fp8(cands, memory_budget_gb=budget, force_in=forced)
    pl = plan(prof, cl, precision="fp8", fixed=lay.to_dict(), stack="megatron-core", fp8_force_in=forced, **kw)
    assert set(pl.fp8_modules) == set(forced)
    exact = estimate_profile(prof, cl, pl.layout, precision="fp8", fp8_modules=frozenset(forced),
                             stack="megatron-core", **kw)
    assert exact.fits and pl.estimate.step_time_s == pytest.approx(exact.step_time_s, rel=1e-9)
