"""FP8 is priced per linear, not per layer: a MoE layer whose attention and dense linears run FP8
while its stacked expert weights stay BF16 (meshplan's runtime swaps nn.Linear modules only) is
priced with BF16 expert GEMMs, BF16-stored expert inputs and a BF16 dispatch. The search used to
price such a layer as all-FP8, so the plan's FP8 placement then found the chosen layout over its
memory budget (DeepSeek-V3 on 1024 H100s raised DoesNotFitError)."""

from __future__ import annotations

import meshplan as mp
from meshplan.cost_models.estimate import estimate_profile, layer_table
from meshplan.cost_models.ranks import layer_fp8_flags

CL = mp.Cluster.preset("dgx-h100", nodes=2)
LAY = dict(tp=1, dp=16, ep=8, zero=1, mbs=1, recompute="none")


def _modules(prof, *, experts: bool) -> frozenset:
    out = set()
    for i, bi in enumerate(prof.layers):
        b = prof.blocks[bi]
        for li in b.linears:
            if li.role == "router" or (not experts and li.role in ("expert_in", "expert_out")):
                continue
            out.add(f"{b.instances[i] if len(b.instances) > i else f'layers.{i}'}.{li.name}")
    return frozenset(out)


def test_flags_name_the_fp8_linears_of_each_layer():
    prof = mp.profile("mixtral-8x7b")
    dense_only = _modules(prof, experts=False)
    flags = layer_fp8_flags(prof, True, dense_only)
    roles = {li.name: li.role for li in prof.blocks[prof.layers[0]].linears}
    assert all(isinstance(f, frozenset) and f for f in flags)
    assert not any(roles[n] in ("expert_in", "expert_out") for f in flags for n in f)
    assert layer_fp8_flags(prof, True, None) == [None] * prof.num_layers       # every linear
    assert layer_fp8_flags(prof, False, dense_only) == [False] * prof.num_layers


def test_bf16_experts_are_priced_bf16_inside_an_fp8_layer():
    prof = mp.profile("mixtral-8x7b")
    kw = dict(seq_len=4096, precision="fp8", stack="meshplan")
    all_fp8 = layer_table(prof, CL, LAY, fp8_modules=_modules(prof, experts=True), **kw)
    dense_fp8 = layer_table(prof, CL, LAY, fp8_modules=_modules(prof, experts=False), **kw)
    bf16 = layer_table(prof, CL, LAY, seq_len=4096, precision="bf16", stack="meshplan")
    # BF16 experts: more activation memory than all-FP8 (expert inputs in 2 bytes), less than all-BF16
    a_all, a_dense, a_bf16 = (t.act(0, "none") for t in (all_fp8, dense_fp8, bf16))
    assert a_all < a_dense < a_bf16
    # and slower than all-FP8: the expert GEMMs and the dispatch run at the BF16 rate / size
    assert all_fp8.cost(0, "none").fwd_s < dense_fp8.cost(0, "none").fwd_s < bf16.cost(0, "none").fwd_s


def test_a_moe_fp8_plan_prices_what_it_runs():
    """The plan's FP8 set leaves the stacked experts out (the runtime cannot swap them), and its
    prediction is the price of exactly that set."""
    model = mp.models.build("mixtral-8x7b", device="meta")
    cl = mp.Cluster.preset("dgx-h100", nodes=2)
    pl = mp.plan(model, cl, seq_len=4096, global_batch=128, precision="fp8")
    assert pl.precision == "fp8" and pl.fp8_modules
    assert not any(".experts." in m for m in pl.fp8_modules)
    again = estimate_profile(mp.profile(model, seq_len=4096), cl, pl.layout, seq_len=4096, global_batch=128,
                             precision="fp8", fp8_modules=frozenset(pl.fp8_modules), stack=pl.stack)
    assert again.step_time_s == pl.estimate.step_time_s and again.fits
