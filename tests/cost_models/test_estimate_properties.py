"""Property test: for random models, clusters and layouts, `meshplan.estimate` either returns a
sane Estimate or raises a MeshplanError; no other exception type may escape."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import meshplan
from meshplan.cluster import Cluster
from meshplan.ir.layout import SCHEDULES, divisors
from meshplan.errors import ConfigError, MeshplanError

PRESETS = ("dgx-a100", "hgx-a100-40gb", "dgx-h100", "h100-pcie-8", "h800-8", "hgx-h200", "dgx-b200",
           "gb200-nvl72", "mi300x-8", "mi325x-8", "l40s-8")


@st.composite
def model_configs(draw):
    heads = draw(st.sampled_from([1, 2, 4, 8, 12, 16, 32, 64]))
    kv = draw(st.sampled_from(divisors(heads)))
    hidden = heads * 8 * draw(st.integers(1, 32))
    cfg = dict(layers=draw(st.integers(1, 96)), hidden=hidden, heads=heads, kv_heads=kv,
               vocab=8 * 128 * draw(st.integers(1, 160)), gated=draw(st.booleans()))
    if draw(st.booleans()):
        cfg["ffn_hidden"] = 8 * draw(st.integers(1, 4 * hidden // 8 + 1))
    if draw(st.booleans()):   # MoE
        experts = draw(st.sampled_from([2, 4, 8, 16, 64]))
        cfg.update(experts=experts, topk=draw(st.integers(1, min(8, experts))),
                   moe_ffn_hidden=8 * draw(st.integers(1, hidden // 8 + 1)),
                   shared_experts=draw(st.integers(0, 2)),
                   dense_layers=draw(st.integers(0, min(3, cfg["layers"]))))
    return cfg


@st.composite
def clusters(draw):
    name = draw(st.sampled_from(PRESETS))
    nodes = draw(st.sampled_from([1, 2, 4, 8, 16]))
    try:
        return Cluster.preset(name, nodes=nodes)
    except ConfigError:
        assume(False)


@st.composite
def layouts(draw, n: int, cfg: dict):
    """Degrees from the divisors of the GPU count; mostly ones the model admits (so most examples
    reach the cost model), sometimes any divisor (so the validation paths run too)."""
    wild = draw(st.integers(0, 4)) == 0
    tp_ok = [t for t in divisors(n) if wild or (cfg["kv_heads"] % t == 0 and cfg["vocab"] % t == 0)]
    tp = draw(st.sampled_from(tp_ok))
    cp = draw(st.sampled_from(divisors(n // tp)))
    pp = draw(st.sampled_from([q for q in divisors(n // (tp * cp)) if wild or q <= cfg["layers"]]))
    dp = n // (tp * cp * pp)
    fold = dp * cp * tp
    experts = cfg.get("experts", 0)
    if experts and not wild:
        ep = draw(st.sampled_from([e for e in divisors(fold) if experts % e == 0]))
        etp = draw(st.sampled_from([t for t in (1, 2) if (fold // ep) % t == 0]))
    elif wild:
        ep, etp = draw(st.sampled_from(divisors(fold))), draw(st.sampled_from([1, 2]))
    else:
        ep = etp = 1
    schedule = draw(st.sampled_from(SCHEDULES))
    vp = draw(st.sampled_from([1, 2, 3])) if wild else {"interleaved": draw(st.sampled_from([2, 3])),
                                                         "zbv": 2}.get(schedule, 1)
    zero = draw(st.integers(0, 3))
    # stack mechanisms; an fsdp_impl other than fsdp2 with zero < 3 must be refused as a ConfigError
    fsdp_impl = draw(st.sampled_from(["fsdp2", "fsdp2", "megatron", "deepspeed"])) if zero == 3 or wild else "fsdp2"
    return dict(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, vp=vp, schedule=schedule,
                zero=zero, mbs=draw(st.sampled_from([1, 2, 4])),
                recompute=draw(st.sampled_from(["none", "selective", "full", 0, 1, 4])),
                tp_comm_overlap=draw(st.booleans()), flash_attention=draw(st.sampled_from([True, True, False])),
                grad_dtype=draw(st.sampled_from(["fp32", "bf16"])),
                moe_dispatcher=draw(st.sampled_from(["alltoall", "deepep"])), fsdp_impl=fsdp_impl)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.filter_too_much])
@given(cfg=model_configs(), cluster=clusters(), data=st.data(),
       seq_len=st.sampled_from([128, 512, 1000, 2048, 4096, 8192, 32768]),
       gb_mult=st.sampled_from([1, 2, 3, 8, 32]),
       precision=st.sampled_from(["bf16", "bf16", "fp16", "fp8"]))
def test_estimate_returns_sane_result_or_meshplan_error(cfg, cluster, data, seq_len, gb_mult, precision):
    n = cluster.num_gpus
    layout = data.draw(layouts(n, cfg))
    global_batch = gb_mult * layout["dp"] * layout["mbs"] * data.draw(st.sampled_from([1, 1, 2, 3]))
    try:
        e = meshplan.estimate(cfg, cluster, layout, seq_len=seq_len, global_batch=global_batch,
                              precision=precision)
    except MeshplanError:
        return
    for name in ("step_time_s", "tokens_per_s_per_gpu", "peak_memory_gb", "model_tflops_per_gpu", "mfu"):
        v = getattr(e, name)
        assert math.isfinite(v) and v > 0, (name, v)
    assert e.hfu >= e.mfu * (1 - 1e-9)
    # MFU is against the dense BF16 peak; only FP8 GEMMs could in principle go past it
    assert e.mfu < (2.0 if precision == "fp8" else 1.0), e.mfu
    for table in (e.time_s, e.comm_s, e.memory_gb):
        for k, v in table.items():
            assert math.isfinite(v) and v >= -1e-12 * max(1.0, e.step_time_s), (k, v, table)
    assert sum(e.time_s.values()) == pytest.approx(e.step_time_s, rel=1e-9)
    assert len(e.memory_by_stage) == layout["pp"]
    assert e.num_microbatches * e.layout.dp * e.layout.mbs == global_batch
    assert e.fits == (e.peak_memory_gb <= e.capacity_gb)

