"""MoE routing imbalance: the busiest EP rank's routed rows exceed the mean by the
expected maximum of a balanced router's per-rank loads (cost_models.layer.moe_load_factor), and
the MoE layer's expert GEMMs, element-wise work and all-to-all run at that rank's pace; a capacity
factor (padded) or forced balance sets the factor instead."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from meshplan.cluster import Cluster
from meshplan.cost_models.layer import (
    Context,
    expected_max_std_normal,
    gemm_shape,
    layer_cost,
    moe_load_factor,
)
from meshplan.ir.layout import Layout
from meshplan.profiling.analytic import profile_from_config

MOE = profile_from_config(dict(family="moe", layers=2, hidden=2048, heads=16, kv_heads=4, vocab=32000,
                               ffn_hidden=4096, experts=8, topk=2, moe_ffn_hidden=2048))
BLOCK = next(b for b in MOE.layer_blocks() if b.is_moe)
CLUSTER = Cluster(gpu="h100-sxm", num_gpus=16, gpus_per_node=8)


def _ctx(layout, seq=2048):
    return Context.build(CLUSTER, layout, seq, False)


def _with_capacity(layout: Layout, cap: float):
    """The layout with its MoE routing capacity factor set."""
    return dataclasses.replace(layout, moe_capacity_factor=cap)


def test_expected_max_of_normals_matches_the_exact_integral():
    def exact(n):
        xs = np.linspace(-10, 10, 200001)
        phi = np.exp(-xs ** 2 / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + np.vectorize(math.erf)(xs / math.sqrt(2)))
        return float(np.trapezoid(xs * n * phi * cdf ** (n - 1), xs))
    assert expected_max_std_normal(1) == 0.0
    for n in (8, 32):
        assert expected_max_std_normal(n) == pytest.approx(exact(n), rel=0.01)


def test_load_factor_matches_simulated_balanced_routing():
    """Monte Carlo: every token of the EP group picks k distinct experts uniformly; the mean over
    trials of (busiest rank's rows / mean rows) is the factor the cost model charges."""
    lay = Layout(tp=1, ep=8, dp=16)
    c = _ctx(lay)
    n_tokens = int(c.tokens * lay.ep)                     # tokens routed by the EP group per micro-batch
    E, k, ep = BLOCK.experts, BLOCK.topk, lay.ep
    rng = np.random.default_rng(0)
    trials = 400
    ratios = []
    for _ in range(trials):
        choice = np.argsort(rng.random((n_tokens, E)), axis=1)[:, :k]      # k distinct experts per token
        rank = choice // (E // ep)
        load = np.bincount(rank.ravel(), minlength=ep)
        ratios.append(load.max() / load.mean())
    simulated = float(np.mean(ratios))
    predicted = moe_load_factor(BLOCK, c)
    assert predicted > 1.0
    # the excess over the mean within 5% (normal approximation, Blom's z)
    assert predicted - 1 == pytest.approx(simulated - 1, rel=0.05)


def test_imbalance_shrinks_with_tokens_and_vanishes_without_ep():
    assert moe_load_factor(BLOCK, _ctx(Layout(tp=1, ep=1, dp=16))) == 1.0
    short = moe_load_factor(BLOCK, _ctx(Layout(tp=1, ep=8, dp=16), seq=1024))
    long = moe_load_factor(BLOCK, _ctx(Layout(tp=1, ep=8, dp=16), seq=4096))
    assert short > long > 1.0
    assert (short - 1) / (long - 1) == pytest.approx(2.0, rel=1e-9)    # spread ~ 1/sqrt(N)


def test_expert_compute_and_all_to_all_run_at_the_busiest_ranks_pace():
    lay = Layout(tp=1, ep=8, dp=16)
    f = moe_load_factor(BLOCK, _ctx(lay))
    balanced = _ctx(_with_capacity(lay, 1.0))     # forced balance / capacity factor 1 with padding
    assert moe_load_factor(BLOCK, balanced) == 1.0
    expert = next(li for li in BLOCK.linears if li.role == "expert_in")
    assert gemm_shape(expert, _ctx(lay))[0] == pytest.approx(f * gemm_shape(expert, balanced)[0])
    dropless = layer_cost(BLOCK, _ctx(lay), policy="none")
    even = layer_cost(BLOCK, balanced, policy="none")
    assert dropless.comm_s["ep"] > even.comm_s["ep"]
    assert dropless.compute_s > even.compute_s
    # a padded capacity factor above 1 costs more than dropless routing's expected imbalance
    padded = layer_cost(BLOCK, _ctx(_with_capacity(lay, 1.25)), policy="none")
    assert padded.compute_s > dropless.compute_s


def test_forced_balance_is_round_robin_for_meshplan_and_random_logits_for_megatron():
    """meshplan's moe_force_balance hands each expert exactly its mean rows (capacity 1.0, no
    excess); Megatron-Core's --moe-router-force-load-balancing draws random logits and dispatches as
    usual: the statistical excess stays and so does the dropless dispatch's host wait."""
    from meshplan.cost_models.moe_load import routing_layout
    from meshplan.cost_models.tables import layer_table
    from meshplan.cost_models.validation import _moe_capacity
    from meshplan.ir.stack import STACKS

    lay = Layout(tp=1, dp=16, ep=8, mbs=1)
    assert routing_layout(lay, "forced").moe_capacity_factor == 1.0
    assert routing_layout(lay, "forced", STACKS["meshplan"]).moe_capacity_factor == 1.0
    assert routing_layout(lay, "forced", STACKS["megatron-core"]).moe_capacity_factor is None
    assert routing_layout(lay, "aux_loss").moe_capacity_factor is None

    forced = dataclasses.replace(MOE, moe_balance="forced")

    def moe_fwd(stack, profile):
        t = layer_table(profile, CLUSTER, lay, seq_len=2048, stack=stack)
        i = next(i for i, b in enumerate(profile.layer_blocks()) if b.is_moe)
        return t.cost(i, "none").fwd_s
    # Megatron's forced balance costs what its dropless routing does (random logits: the same floor)
    assert moe_fwd("megatron-core", forced) == pytest.approx(moe_fwd("megatron-core", MOE), rel=1e-9)
    # and more than round-robin would: the busiest rank's excess and the host wait
    padded = dataclasses.replace(lay, moe_capacity_factor=1.0)
    t_pad = layer_table(MOE, CLUSTER, padded, seq_len=2048, stack="megatron-core")
    i = next(i for i, b in enumerate(MOE.layer_blocks()) if b.is_moe)
    assert moe_fwd("megatron-core", forced) > t_pad.cost(i, "none").fwd_s

    # published rows: the forced-balance notes are dropless; only a padded capacity factor sets one
    assert _moe_capacity("dropless with --moe-router-force-load-balancing") is None
    assert _moe_capacity("forced-balance; NNODES=32") is None
    assert _moe_capacity("token drop, capacity factor 1.25 with padding") == 1.25
