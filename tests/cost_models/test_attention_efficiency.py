"""Shape dependence of flash attention on GPUs (meshplan.cost_models.attention): longer
calls run closer to the kernel's plateau, causal diagonal tiles waste less as the call grows, context
parallelism's chunked calls cost more per FLOP than one long call, few CTAs leave SMs idle, and the
backward runs below the forward. Every test compares numbers that the mechanism makes differ."""

from __future__ import annotations

import math

import pytest

from meshplan.cluster import Cluster
from meshplan.cost_models import constants as K
from meshplan.cost_models.attention import AttnCall, AttnShape, call_efficiency, layer_calls, shape_penalty, sm_count
from meshplan.cost_models.compute import attention_time
from meshplan.cost_models.host import ring_blocks

SMS = 132
SEQS = (512, 1024, 2048, 4096, 8192, 16384)


@pytest.fixture(scope="module")
def h100():
    return Cluster.preset("dgx-h100", nodes=1)


def bench(s: int, causal: bool) -> AttnShape:
    """The FlashAttention-2/3 papers' benchmark shape: 16k tokens (batch = 16k / s), 16 heads of 128."""
    return AttnShape(16384 / s * 16, (AttnCall(s, s, causal),))


def test_longer_calls_approach_the_plateau():
    for causal in (False, True):
        for bwd in (False, True):
            eff = [call_efficiency(bench(s, causal), SMS, backward=bwd) for s in SEQS + (65536,)]
            assert all(a < b for a, b in zip(eff, eff[1:])), (causal, bwd, eff)
            assert eff[0] < 0.8 and eff[-1] > 0.95 and max(eff) <= 1.0


@pytest.mark.parametrize("curve,causal,bwd", [
    ((467, 565, 625, 638, 646, 648), False, False),   # FA3 fwd, Shah et al. 2024 Fig. 5 (constants.py)
    ((292, 423, 521, 579, 602, 616), True, False),
    ((316, 424, 501, 542, 559, 561), False, True),    # FA3 bwd
    ((191, 260, 298, 319, 333, 335), True, False),    # FA2 fwd causal on H100
])
def test_reproduces_the_published_kernel_curves(curve, causal, bwd):
    """Relative to the 16k point, the model lands within 16% of each published point (it is fitted
    jointly to FA2 and FA3, so neither curve alone is matched exactly)."""
    model = [call_efficiency(bench(s, causal), SMS, backward=bwd) for s in SEQS]
    for m, v in zip(model, curve):
        assert m / model[-1] == pytest.approx(v / curve[-1], rel=0.16)


def test_causal_diagonal_waste_is_one_tile_over_the_length(monkeypatch):
    """With no per-CTA overhead and many CTAs the causal penalty is the diagonal tiles alone: the
    kernel computes nt(nt+1)/2 whole tiles for n^2/2 masked entries, (1 + T/n)."""
    monkeypatch.setitem(K.ATTN_CTA_FIXED_TILES, "fa3", (0.0, K.ATTN_CTA_FIXED_TILES["fa3"][1]))
    T = K.ATTN_TILE
    prev = math.inf
    for n in (256, 1024, 4096, 32768):
        p = shape_penalty(AttnShape(4096, (AttnCall(n, n, True),)), SMS, backward=False)
        assert p == pytest.approx(1 + T / n, rel=1e-9)
        assert p < prev
        prev = p
    # an unmasked call whose length is a whole number of tiles wastes nothing
    assert shape_penalty(AttnShape(SMS * 8, (AttnCall(1024, 1024, False),)), SMS, backward=False) == pytest.approx(1.0)
    # a ragged last tile is padded: 1025 keys cost 9 tiles of 128
    assert shape_penalty(AttnShape(SMS * 8, (AttnCall(1024, 1025, False),)), SMS, backward=False) == \
        pytest.approx(9 * 128 / 1025)


def test_wave_quantisation_leaves_sms_idle():
    """Equal CTAs run in whole waves: one CTA more than the SMs takes two waves."""
    n = 8 * K.ATTN_TILE                                   # 8 query tiles per sequence-head
    full = AttnShape(SMS / 8, (AttnCall(n, n, False),))
    over = AttnShape(SMS / 8 + 1 / 8, (AttnCall(n, n, False),))
    assert shape_penalty(over, SMS, backward=False) / shape_penalty(full, SMS, backward=False) == \
        pytest.approx(2 * SMS / (SMS + 1), rel=1e-6)


def test_cp_chunks_cost_more_per_flop_than_one_long_call():
    for s in (8192, 32768, 131072):
        one = shape_penalty(layer_calls(s, 32, causal=True), SMS, backward=False)
        prev = one
        for cp in (2, 4, 8, 16):
            ring = shape_penalty(layer_calls(s, 32, causal=True, cp=cp), SMS, backward=False)
            assert ring > prev, (s, cp)
            prev = ring


def test_cp_calls_partition_the_masked_work():
    """Every CP implementation's calls cover exactly the rank's 1/cp of the causal score matrix, and the
    ring's calls are host.ring_blocks chunk pairs."""
    s, bh = 65536, 8.0
    for cp in (2, 4, 8):
        c = s / (2 * cp)
        for kind in ("p2p", "all_gather", "a2a"):
            shape = layer_calls(s, bh, causal=True, cp=cp, cp_kind=kind)
            pairs = sum(x.count * shape.batch_heads * (x.q_len * x.k_len - (x.q_len ** 2 / 2 if x.causal else 0))
                        for x in shape.calls)
            assert pairs == pytest.approx(bh * s * s / 2 / cp), kind
        ring = layer_calls(s, bh, causal=True, cp=cp)
        blocks = sum(x.count * (x.q_len * x.k_len - (x.q_len ** 2 / 2 if x.causal else 0)) for x in ring.calls)
        # ring_blocks counts chunk pairs: the two on the diagonal are half masked
        assert blocks / (c * c) == pytest.approx(ring_blocks(cp, True) - 2 + 2 * 0.5)
        assert ring.kernels == pytest.approx(cp)


def test_backward_runs_below_the_forward(h100):
    """Per forward FLOP the backward costs more than its FLOP ratio (its plateau is lower), and its
    per-CTA overhead makes short calls lose more in backward than in forward."""
    shape = layer_calls(4096, 32, causal=True)
    f = attention_time(1e12, h100, backward=False, shape=shape)
    b = attention_time(1e12, h100, backward=True, shape=shape)
    assert b / f > K.ATTN_BWD_FLOP_RATIO
    for s in (512, 2048, 8192):
        assert call_efficiency(bench(s, True), SMS, backward=True) < call_efficiency(bench(s, True), SMS, backward=False)


def test_shape_reaches_attention_time_and_launches_cost(h100):
    plateau = attention_time(1e12, h100, backward=False)
    short = attention_time(1e12, h100, backward=False, shape=layer_calls(1024, 8, causal=True))
    long = attention_time(1e12, h100, backward=False, shape=layer_calls(65536, 8, causal=True))
    assert plateau < long < short
    assert sm_count(h100) == 132
    # the per-kernel fixed cost dominates a tiny call
    tiny = attention_time(1e6, h100, backward=True, shape=layer_calls(128, 1, causal=True))
    assert tiny >= K.ATTN_BWD_KERNELS * K.ATTN_KERNEL_FIXED_S


def test_cpu_attention_ignores_the_gpu_shape():
    cpu = Cluster.preset("local-cpu")
    shape = layer_calls(128, 16, causal=True, cp=2)
    for bwd in (False, True):
        assert attention_time(1e9, cpu, backward=bwd, shape=shape) == attention_time(1e9, cpu, backward=bwd)
