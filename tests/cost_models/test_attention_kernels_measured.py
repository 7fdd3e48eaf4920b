"""The attention kernels as this project measured them on an H200 (benchmarks/gpu_rates.py;
benchmarks/results/gpu_rates-2026-11-27-h200.md): PyTorch SDPA's FlashAttention-2 and cuDNN backends,
16k tokens per call, forward and backward, causal and not, head dims 128 and 64. The model (plateau
share x the shape mechanism of cost_models.attention, priced by compute.attention_time on an H200
without the in-step slowdown) must reproduce each curve point, the causal forward's launch-order
tail, the head-dim dependence and the cuDNN / FA2 ratio."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.cluster import Cluster
from meshplan.cost_models import constants as K
from meshplan.cost_models.attention import AttnCall, AttnShape, call_efficiency, head_dim_rate
from meshplan.cost_models.compute import attention_time

SMS = 132
MAMF = 794.0        # the BF16 matmul measured beside the curves (TFLOP/s)
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
# TFLOP/s of the masked FLOPs at SEQS (16k tokens per call: batch 16k / seq), 16 heads of 128
MEASURED = {
    ("fa2", False, False): (244, 315, 338, 344, 353, 353),
    ("fa2", True, False): (163, 220, 275, 299, 306, 315),
    ("fa2", False, True): (158, 205, 251, 274, 288, 297),
    ("fa2", True, True): (100, 151, 198, 241, 267, 300),
    ("cudnn", False, False): (454, 558, 622, 658, 673, 671),
    ("cudnn", True, False): (288, 382, 485, 559, 573, 617),
    ("cudnn", False, True): (283, 393, 487, 525, 539, 541),
    ("cudnn", True, True): (172, 267, 353, 429, 495, 544),
}


@pytest.fixture(scope="module")
def h200():
    c = Cluster.preset("hgx-h200", nodes=1)
    # the isolated kernel: MAMF (the datasheet peak x the MAMF share) without the in-step slowdown
    return c, dataclasses.replace(K.FITTED, training_gemm_eff=1.0)


def model_tflops(cluster, fitted, kernel, causal, backward, seq, heads=16, dim=128):
    batch = 16384 // seq
    flops = 4.0 * batch * heads * seq * seq * dim / (2 if causal else 1)
    shape = AttnShape(batch * heads, (AttnCall(seq, seq, causal),), head_dim=dim)
    t = attention_time(flops, cluster, backward=backward, kernel=kernel, shape=shape, fitted=fitted)
    return flops * (K.ATTN_BWD_FLOP_RATIO if backward else 1.0) / t / 1e12


@pytest.mark.parametrize("kernel,causal,backward", sorted(MEASURED))
def test_reproduces_the_measured_curves(h200, kernel, causal, backward):
    """Within 12% at every point, 6% on average (the fit's mean error is 1.8-3.4% per curve; the
    GPU's MAMF in the model is the datasheet's, 794.5, against 794 measured)."""
    cluster, fitted = h200
    errs = []
    for seq, meas in zip(SEQS, MEASURED[(kernel, causal, backward)]):
        model = model_tflops(cluster, fitted, kernel, causal, backward, seq)
        errs.append(model / meas - 1)
        assert model == pytest.approx(meas, rel=0.12), (seq, model, meas)
    assert sum(abs(e) for e in errs) / len(errs) < 0.06


def test_causal_forward_pays_the_launch_order_tail():
    """FA2 and cuDNN issue a causal forward's CTAs in grid order: at 16k (2048 CTAs on 132 SMs) the
    longest rows come last and cost ~10% (measured 315 / 353 = 0.89 for FA2), at 64k (8192 CTAs)
    ~2% (measured 345 / 353 = 0.98). FA3's scheduler issues the longest first: no tail. The
    backward's CTAs start longest first in either kernel: no tail (measured 300 / 297)."""
    def ratio(kernel, seq, backward=False):
        bh = 16384 // seq * 16 if seq <= 16384 else 16
        causal = call_efficiency(AttnShape(bh, (AttnCall(seq, seq, True),)), SMS, backward=backward, kernel=kernel)
        plain = call_efficiency(AttnShape(bh, (AttnCall(seq, seq, False),)), SMS, backward=backward, kernel=kernel)
        return causal / plain

    assert ratio("fa2", 16384) == pytest.approx(0.89, abs=0.04)
    assert ratio("fa2", 65536) == pytest.approx(0.98, abs=0.03)
    assert ratio("fa2", 16384) < ratio("fa2", 65536) < 1.0
    assert ratio("fa3", 16384) > ratio("fa2", 16384) + 0.05
    assert ratio("fa2", 16384, backward=True) == pytest.approx(1.0, abs=0.05)


def test_head_dim_64_runs_below_128(h200):
    """At head dim 64 a tile carries half the FLOPs for the same per-tile work: measured FA2 0.86 /
    0.90, cuDNN 0.71 / 0.79 of the head-dim-128 plateau (forward / backward)."""
    cluster, fitted = h200
    for kernel, (fwd, bwd) in (("fa2", (0.86, 0.90)), ("cudnn", (0.71, 0.79))):
        for backward, want in ((False, fwd), (True, bwd)):
            r = (model_tflops(cluster, fitted, kernel, False, backward, 16384, heads=32, dim=64)
                 / model_tflops(cluster, fitted, kernel, False, backward, 16384))
            assert r == pytest.approx(want, rel=0.01)      # the 32-head call fills the SMs a little differently
    assert head_dim_rate("fa2", 96, backward=False) == pytest.approx(0.86 + 0.14 * 0.585, abs=1e-3)
    assert head_dim_rate("fa2", 256, backward=False) == 1.0 and head_dim_rate("fa2", 32, backward=False) == 0.86


def test_cudnn_runs_faster_than_fa2_by_the_measured_ratio(h200):
    """At the plateau (a long non-causal call) cuDNN's fused attention reaches 1.84x / 1.81x
    FlashAttention-2 (forward / backward) on the H200; the in-step slowdown is shared by both."""
    cluster, _ = h200
    shape = AttnShape(16, (AttnCall(16384, 16384, False),))
    for backward, want in ((False, 1.84), (True, 1.81)):
        fa2 = attention_time(1e15, cluster, backward=backward, kernel="fa2", shape=shape)
        cudnn = attention_time(1e15, cluster, backward=backward, kernel="cudnn", shape=shape)
        assert fa2 / cudnn == pytest.approx(want, rel=0.02)
