"""Layout validation: every bad layout raises LayoutError / ConfigError naming the problem and
suggesting values that would work; round trips and uneven stage splits."""

from __future__ import annotations

import json

import pytest

import meshplan
from meshplan.cluster import Cluster
from meshplan.ir.layout import Layout, check_layout, split_layers
from meshplan.errors import ConfigError, LayoutError, MeshplanError
from meshplan.profiling.analytic import profile_from_config

LLAMA = dict(layers=32, hidden=4096, heads=32, kv_heads=8, vocab=128256, ffn_hidden=14336)
MOE = dict(layers=8, hidden=2048, heads=16, kv_heads=4, vocab=32768, experts=8, topk=2, moe_ffn_hidden=1024)



def est(cfg, cluster, seq_len=2048, global_batch=64, precision="bf16", **layout):
    return meshplan.estimate(cfg, cluster, Layout(**layout), seq_len=seq_len, global_batch=global_batch,
                             precision=precision)


def test_errors_are_meshplan_and_value_errors():
    assert issubclass(LayoutError, MeshplanError) and issubclass(LayoutError, ValueError)
    assert issubclass(ConfigError, MeshplanError)


def test_product_must_equal_gpu_count(h100x16):
    with pytest.raises(LayoutError, match=r"16 GPUs") as ei:
        est(LLAMA, h100x16, tp=2, pp=2, dp=2)
    assert "= 8" in str(ei.value) and "dp=4" in str(ei.value)


def test_tp_must_divide_heads(h100x8):
    cfg = dict(layers=4, hidden=768, heads=12, vocab=32768)   # 12 heads: tp=8 does not divide
    with pytest.raises(LayoutError, match=r"12 attention heads") as ei:
        est(cfg, h100x8, tp=8, dp=1)
    msg = str(ei.value)
    assert "tp=8" in msg and "1, 2, 3, 4, 6, 12" in msg


def test_tp_must_divide_kv_heads(h100x8):
    cfg = dict(layers=4, hidden=2048, heads=16, kv_heads=2, vocab=32768)
    with pytest.raises(LayoutError, match=r"key/value heads") as ei:
        est(cfg, h100x8, tp=4, dp=2)
    assert "{1, 2}" in str(ei.value) and "2 key/value heads" in str(ei.value)


def test_experts_divisible_by_ep(h100x8):
    cfg = dict(MOE, experts=6, topk=2)
    with pytest.raises(LayoutError, match=r"ep=4 does not divide the 6 experts") as ei:
        est(cfg, h100x8, dp=8, ep=4)
    assert "1, 2, 3, 6" in str(ei.value)


def test_ep_etp_must_divide_fold(h100x8):
    with pytest.raises(LayoutError, match=r"ep\*etp = 8 must divide dp\*cp\*tp = 4") as ei:
        est(MOE, h100x8, pp=2, dp=4, ep=8)
    assert "1, 2, 4" in str(ei.value)


def test_seq_divisible_by_two_cp(h100x8):
    with pytest.raises(LayoutError, match=r"2\*cp = 8") as ei:
        est(LLAMA, h100x8, seq_len=2044, cp=4, dp=2)
    assert "2044" in str(ei.value)


def test_batch_divisible_lists_valid_mbs(h100x8):
    with pytest.raises(LayoutError, match=r"dp\*mbs") as ei:
        est(LLAMA, h100x8, global_batch=24, dp=8, mbs=2)
    assert "use mbs in {1, 3}" in str(ei.value)
    with pytest.raises(LayoutError, match=r"choose dp"):
        est(LLAMA, h100x8, global_batch=12, dp=8)


def test_layers_divisible_by_stages_suggests_stage_layers(h100x8):
    cfg = dict(LLAMA, layers=30)
    with pytest.raises(LayoutError, match=r"30 layers do not split evenly") as ei:
        est(cfg, h100x8, pp=4, dp=2)
    msg = str(ei.value)
    assert "stage_layers" in msg and "1, 2, 3, 5, 6, 10, 15, 30" in msg
    with pytest.raises(LayoutError, match=r"only 30 layers"):
        est(cfg, Cluster.preset("dgx-h100", nodes=8), pp=32, dp=2)


def test_ep_on_dense_model(h100x8):
    with pytest.raises(LayoutError, match=r"no MoE layers") as ei:
        est(LLAMA, h100x8, dp=8, ep=2)
    assert "ep=1" in str(ei.value)


def test_interleaved_needs_enough_microbatches(h100x8):
    with pytest.raises(LayoutError, match=r"at least pp=4 micro-batches") as ei:
        est(LLAMA, h100x8, global_batch=4, pp=4, vp=2, dp=2)
    assert "vp=1" in str(ei.value)
    est(LLAMA, h100x8, global_batch=8, pp=4, vp=2, dp=2)    # m = 4 = pp is enough


@pytest.mark.parametrize("kwargs,match", [
    (dict(recompute="everything"), "recompute"),
    (dict(recompute=-1), "recompute"),
    (dict(recompute=True), "recompute"),
    (dict(schedule="1f2b"), "schedule"),
    (dict(schedule="interleaved"), "vp > 1"),
    (dict(schedule="zbv", vp=4), "vp=2"),
    (dict(zero=4), "zero"),
    (dict(tp=0), "tp"),
    (dict(mbs=1.5), "mbs"),
    (dict(dp=True), "dp"),
    (dict(pp=2, stage_layers=(16,)), "pp\\*vp = 2"),
])
def test_bad_layout_values_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Layout(**kwargs)


def test_fp8_on_a100_is_config_error():
    with pytest.raises(ConfigError, match=r"no FP8"):
        est(LLAMA, Cluster.preset("dgx-a100"), dp=8, precision="fp8")


def test_unknown_precision(h100x8):
    with pytest.raises(ConfigError, match=r"bf16"):
        est(LLAMA, h100x8, dp=8, precision="int4")


def test_from_dict_unknown_key_lists_known():
    with pytest.raises(ConfigError, match=r"unknown layout key") as ei:
        Layout.from_dict({"tp": 2, "pipeline": 4})
    msg = str(ei.value)
    assert "pipeline" in msg
    for k in ("tp", "pp", "dp", "zero", "recompute", "schedule"):
        assert k in msg


def test_estimate_with_unknown_layout_key(h100x8):
    with pytest.raises(ConfigError, match=r"known keys"):
        meshplan.estimate(LLAMA, h100x8, {"tp": 2, "tensor_parallel": 2}, seq_len=1024, global_batch=8)


@pytest.mark.parametrize("layout", [
    Layout(),
    Layout(tp=2, pp=4, vp=2, dp=2, zero=3, mbs=2, recompute="selective"),
    Layout(tp=4, cp=2, ep=4, etp=2, pp=2, dp=1, recompute=3, schedule="zb", tp_comm_overlap=True),
    Layout(pp=2, schedule="zbv"),
    Layout(pp=3, stage_layers=(10, 12, 10), sp=False, flash_attention=False),
])
def test_layout_json_round_trip(layout):
    d = json.loads(json.dumps(layout.to_dict()))
    back = Layout.from_dict(d)
    assert back == layout
    assert back.to_dict() == layout.to_dict()


def test_layout_defaults_and_normalisation():
    assert Layout(tp=2).sp is True and Layout(tp=1).sp is False
    assert Layout(pp=2, vp=2).schedule == "interleaved"
    assert Layout(pp=2, schedule="zbv").vp == 2          # unset vp takes the schedule's default
    with pytest.raises(ConfigError, match="use vp=2"):
        Layout(pp=2, vp=1, schedule="zbv")                # a value the caller set is never rewritten
    assert Layout(tp=2, cp=2, pp=2, dp=3).world == 24
    assert Layout(tp=2, dp=4, ep=4).edp == 2


def test_replace_validates_and_keeps_what_was_resolved():
    a = Layout(tp=2, pp=4, vp=2, dp=8, zero=3)
    b = a.replace(mbs=2, recompute="full")
    fresh = Layout(tp=2, pp=4, vp=2, dp=8, zero=3, mbs=2, recompute="full")
    assert b == fresh and hash(b) == hash(fresh) and b.to_dict() == fresh.to_dict()
    assert (a.mbs, a.recompute) == (1, "none")                    # the original is untouched
    assert a.replace(tp=1).sp is True                             # resolved defaults are kept...
    assert a.replace(tp=1, sp=None).sp is False                   # ...and derived again when asked
    assert a.replace(stage_layers=[4] * 8).stage_layers == (4,) * 8
    with pytest.raises(ConfigError, match="needs zero=3, not zero=1"):
        a.replace(zero=1, fsdp_impl="megatron")
    with pytest.raises(ConfigError, match="vp=3"):
        Layout(pp=2, schedule="zb").replace(vp=3)
    with pytest.raises(ConfigError, match=r"unknown layout key\(s\) \['mbz'\]"):
        a.replace(mbz=2)


def test_split_layers_even_and_remainder_in_middle():
    assert split_layers(32, 4) == (8, 8, 8, 8)
    s = split_layers(30, 4)
    assert sum(s) == 30 and s[0] == s[-1] == 7 and max(s) - min(s) == 1


def test_stage_layers_uneven_split(h100x8):
    cfg = dict(LLAMA, layers=30)
    prof = profile_from_config(cfg)
    assert check_layout(Layout(pp=4, dp=2, stage_layers=(6, 8, 8, 8)), prof, h100x8, seq_len=2048,
                        global_batch=16) == (6, 8, 8, 8)
    a = est(cfg, h100x8, global_batch=16, pp=4, dp=2, stage_layers=(6, 8, 8, 8))
    b = est(cfg, h100x8, global_batch=16, pp=4, dp=2, stage_layers=(9, 7, 7, 7))
    assert a.memory_by_stage[0]["weights"] < b.memory_by_stage[0]["weights"]
    assert a.memory_by_stage[0]["activations"] < b.memory_by_stage[0]["activations"]
    assert a.memory_by_stage[1]["weights"] > b.memory_by_stage[1]["weights"]
    with pytest.raises(LayoutError, match=r"sums to 29 but the model has 30 layers"):
        est(cfg, h100x8, global_batch=16, pp=4, dp=2, stage_layers=(5, 8, 8, 8))


def test_recompute_layers_bounded_by_stage(h100x8):
    with pytest.raises(LayoutError, match=r"holds only 16"):
        est(LLAMA, h100x8, global_batch=16, pp=2, dp=4, recompute=17)
    e = est(LLAMA, h100x8, global_batch=16, pp=2, dp=4, recompute=8)
    none = est(LLAMA, h100x8, global_batch=16, pp=2, dp=4)
    full = est(LLAMA, h100x8, global_batch=16, pp=2, dp=4, recompute="full")
    assert full.memory_gb["activations"] < e.memory_gb["activations"] < none.memory_gb["activations"]
