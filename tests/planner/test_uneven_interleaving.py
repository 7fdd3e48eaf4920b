"""Interleaved pipelines over layer counts that do not split evenly: the search tries the nearly even
splits (planner.search.vp_options), so a model like Llama 3 405B (126 layers) gets the interleaved
layouts its trainers ran."""

import meshplan as mp
from meshplan.planner.search import MAX_UNEVEN_VP, vp_options


def test_even_splits_are_all_tried_and_nearly_even_ones_where_none_is():
    assert vp_options(32, 4) == [1, 2, 4, 8]                   # 32 layers: the divisors, as before
    assert vp_options(80, 4) == [1, 2, 4, 5, 10]              # even splits exist: only those
    # 126 layers split evenly over no pp4/8/16 chunk count: the vps whose busiest rank holds no more
    # than the plain pipeline's (ceil(126 / pp)) join
    assert vp_options(126, 16) == [1, 2, 4]                    # 64 chunks of 2 or 1: 8 per rank, as pp16
    assert vp_options(126, 8) == [1, 2, 4]                     # vp8 (64 chunks) is past MAX_UNEVEN_VP
    assert vp_options(126, 4) == [1, 2, 4]                     # vp3 (12 chunks of 11 or 10) gives a rank 33 > 32
    assert vp_options(126, 64) == [1]                          # two layers per rank: one chunk each
    assert vp_options(61, 8) == [1, 2, 4]
    assert vp_options(61, 8, max_vp=2) == [1, 2]               # the cap holds
    for layers, pp in ((126, 16), (126, 4), (61, 8), (94, 8)):
        plain = -(-layers // pp)
        assert all(v * -(-layers // (pp * v)) <= plain and v <= MAX_UNEVEN_VP for v in vp_options(layers, pp))


def test_the_405b_plan_on_16k_h100_is_as_fast_as_meta_s_interleaved_layout():
    """Llama 3 paper (arXiv 2407.21783) Table 4: 16,384 H100 at 8k context ran tp8 pp16 (interleaved,
    126 layers over 64 virtual stages). The free search must find a layout at least as fast as that
    one priced the same way; with only even splits it could not interleave pp16 at all."""
    model = mp.models.build("llama3-405b", device="meta")
    cl = mp.Cluster.preset("dgx-h100", nodes=2048)
    free = mp.plan(model, cl, seq_len=8192, global_batch=2048)
    meta = mp.plan(model, cl, seq_len=8192, global_batch=2048, fixed=dict(tp=8, pp=16, vp=4, cp=1))
    assert meta.layout.vp == 4 and sum(meta.layout.stage_layers) == 126 and len(meta.layout.stage_layers) == 64
    fastest = min([free.estimate] + [r for r in free.runner_ups if r.fits], key=lambda e: e.step_time_s)
    assert fastest.step_time_s <= meta.estimate.step_time_s * (1 + 1e-9)
    # the choice itself may be simpler than the fastest, but only inside the band of that gain
    assert free.estimate.step_time_s <= meta.estimate.step_time_s * (1 + meta.estimate.uncertainty)
