"""What the runtime and the planner choose, without processes: fixed schedules kept
or refused, fused kernels only where faster, zero=0 (DDP) offered by the search."""

from __future__ import annotations

import pytest

import meshplan as mp
from meshplan.ir.layout import Layout
from meshplan.errors import ConfigError
from meshplan.ir.plan import FusedKernel
from meshplan.runtime.fused import FASTER_THAN_EAGER, choose_kernels
from meshplan.runtime.parallel import ddp_runs

ENTRIES = (FusedKernel(kernel="rms_norm", module="layers.0.attention_norm", options=(("weight", "weight"), ("eps", "1e-05"))),
           FusedKernel(kernel="swiglu", module="layers.0.feed_forward", options=(("gate", "w1"), ("up", "w3"), ("down", "w2"))),
           FusedKernel(kernel="linear_cross_entropy", module="output"))


def test_named_schedule_is_kept_or_refused():
    assert Layout(pp=2, vp=2).schedule == "interleaved"          # no schedule named: vp picks it
    assert Layout(pp=2, vp=1, schedule="1f1b").schedule == "1f1b"
    assert Layout(pp=2).schedule == "1f1b"
    for sched in ("1f1b", "zb", "gpipe"):
        with pytest.raises(ConfigError, match="one model chunk per pipeline rank"):
            Layout(pp=2, vp=2, schedule=sched)


def test_planner_keeps_a_fixed_schedule():
    model = mp.models.build("tiny-llama", seq_len=64, device="meta")
    cluster = mp.Cluster.preset("local-cpu")
    plan = mp.plan(model, cluster, seq_len=64, global_batch=8, fixed={"pp": 2, "schedule": "1f1b"})
    assert plan.schedule == "1f1b" and plan.layout.vp == 1
    with pytest.raises(ConfigError, match="contradicts fixed vp"):
        mp.plan(model, cluster, seq_len=64, global_batch=8, fixed={"pp": 2, "vp": 2, "schedule": "1f1b"})


def test_search_offers_plain_ddp():
    model = mp.models.build("tiny-llama", seq_len=64, device="meta")
    plan = mp.plan(model, mp.Cluster.preset("local-cpu"), seq_len=64, global_batch=8,
                   fixed={"dp": 4, "zero": 0})
    assert plan.layout.zero == 0 and ddp_runs(plan.layout)
    assert not ddp_runs(Layout(tp=2, dp=2, zero=0)) and not ddp_runs(Layout(dp=4, zero=1))
    # expert parallelism runs under DDP too (experts' gradients reduced over their edp ranks);
    # expert tensor parallelism does not
    assert ddp_runs(Layout(dp=4, ep=2, zero=0)) and not ddp_runs(Layout(dp=4, ep=2, etp=2, zero=0))


def test_fused_kernels_only_where_faster(monkeypatch):
    import meshplan.kernels as kernels
    monkeypatch.setattr(kernels, "backend", lambda: "reference")
    run, why = choose_kernels(ENTRIES, "cpu", "auto")
    assert run == [] and set(why) == {"rms_norm", "swiglu", "linear_cross_entropy"}
    assert all(v.startswith("eager") for v in why.values())
    run, why = choose_kernels(ENTRIES, "cpu", True)            # correctness tests force the swap
    assert run == list(ENTRIES) and all(v.startswith("fused") for v in why.values())
    assert choose_kernels(ENTRIES, "cpu", False)[0] == []
    monkeypatch.setattr(kernels, "backend", lambda: "triton")
    run, why = choose_kernels(ENTRIES, "cuda", "auto")
    assert run == list(ENTRIES) and FASTER_THAN_EAGER[("cuda", "triton")] >= set(why)
    with pytest.raises(ConfigError):
        choose_kernels(ENTRIES, "cpu", "sometimes")


def test_partial_recompute_counts_layers_per_pipeline_rank():
    """recompute=N fully recomputes the first N layers a pipeline RANK holds, over its virtual
    stages: the rule the cost model prices (Layout.recompute_policy); the runtime used to apply
    N per virtual stage, recomputing N*vp layers."""
    from meshplan.runtime.recompute import apply_recompute
    model = mp.models.build("tiny-llama", seq_len=64, device="meta")
    lay = Layout(pp=2, vp=2, recompute=1)          # 4 layers: rank 0 holds layers 0 and 2
    assert [lay.recompute_policy(i) for i in range(2)] == ["full", "none"]
    first = apply_recompute(model, ["layers.0"], lay, first_index=0)      # rank 0, chunk 0
    second = apply_recompute(model, ["layers.2"], lay, first_index=1)     # rank 0, chunk 1
    assert first == ["layers.0"] and second == []
    assert apply_recompute(model, ["layers.2"], Layout(recompute="none")) == []


def test_async_tp_refuses_a_tp_group_across_hosts():
    """Symmetric memory reaches only one host's GPUs: a hand-written layout with tp_comm_overlap and a
    TP group spanning hosts is refused before torch's rendezvous would fail."""
    from meshplan.errors import LayoutError
    from meshplan.runtime.tensor_parallel import check_async_tp_hosts
    check_async_tp_hosts([8, 9, 10, 11, 12, 13, 14, 15], 8)          # one host (the second)
    check_async_tp_hosts([0, 1], 2)
    with pytest.raises(LayoutError, match=r"16 ranks on 2 hosts.*tp <= 8.*tp_comm_overlap=False"):
        check_async_tp_hosts(list(range(16)), 8)
    with pytest.raises(LayoutError, match="on 2 hosts"):
        check_async_tp_hosts([3, 4], 4)                              # two ranks, straddling a boundary
