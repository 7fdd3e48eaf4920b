"""Flash-attention implementations: the Triton port is slower than FlashAttention-2 class kernels by
constants.ATTN_KERNEL_SLOWDOWN, and a layout names which one its stack runs."""

from __future__ import annotations

import math

import pytest

from meshplan.cluster import Cluster
from meshplan.cost_models import constants as K
from meshplan.cost_models.compute import attention_time
from meshplan.cost_models.estimate import estimate_profile
from meshplan.ir.layout import Layout
from meshplan.errors import ConfigError
from meshplan.profiling.analytic import profile_from_config


@pytest.fixture(scope="module")
def h100():
    return Cluster.preset("dgx-h100", nodes=1)


def test_triton_kernel_is_slower_by_the_sourced_factor(h100):
    for bwd in (False, True):
        flash = attention_time(1e12, h100, backward=bwd)
        triton = attention_time(1e12, h100, backward=bwd, kernel="triton")
        assert math.isclose(triton / flash, K.ATTN_KERNEL_SLOWDOWN["triton"])
    # FlashAttention-2 paper: FA2 is 1.3-2.5x faster than FlashAttention in Triton
    assert 1.3 <= K.ATTN_KERNEL_SLOWDOWN["triton"] <= 2.5


def test_unknown_kernel_names_the_known_ones(h100):
    with pytest.raises(ValueError, match="triton"):
        attention_time(1e12, h100, backward=False, kernel="xformers")
    with pytest.raises(ConfigError, match="attn_kernel"):
        Layout(attn_kernel="xformers")


def test_layout_kernel_reaches_the_step_time(h100):
    """Long sequences are attention-bound, so the kernel choice must change the step time there, and
    only through attention (same memory, same communication)."""
    prof = profile_from_config(dict(family="gpt", layers=4, hidden=4096, heads=32, vocab=50368,
                                    activation="gelu", norm="layernorm", position="learned", bias=True,
                                    tie_embeddings=True, seq_len=32768))
    kw = dict(seq_len=32768, global_batch=8)
    flash = estimate_profile(prof, h100, Layout(dp=8, zero=3, recompute="full"), **kw)
    triton = estimate_profile(prof, h100, Layout(dp=8, zero=3, recompute="full", attn_kernel="triton"), **kw)
    assert triton.step_time_s > 1.1 * flash.step_time_s
    assert triton.peak_memory_gb == flash.peak_memory_gb
    assert triton.comm_s == flash.comm_s
    assert "triton-attn" in Layout(attn_kernel="triton").short()


def test_fa2_reaches_a_larger_share_of_the_gemm_rate_on_ampere_than_on_hopper(h100):
    """FlashAttention-2 on A100: 73% / 63% of peak (fwd / bwd); on H100: 370 / 322 TFLOP/s, well
    below cuBLAS there. The model's FA2 time per FLOP, relative to its GEMM rate, follows that."""
    from meshplan.cost_models.roofline import matmul_rate
    a100 = Cluster.preset("dgx-a100", nodes=1)
    for bwd, (tflops_a100, tflops_h100) in ((False, (0.73 * 312, 370.0)), (True, (0.63 * 312, 322.0))):
        share = {}
        for cl in (a100, h100):
            t = attention_time(1e15, cl, backward=bwd)
            flops = 1e15 * (K.ATTN_BWD_FLOP_RATIO if bwd else 1.0)
            share[cl.gpu.id] = flops / t / matmul_rate(cl, False)
        measured = (tflops_a100 / 271.2) / (tflops_h100 / 794.5)      # each over its GPU's MAMF
        assert share[a100.gpu.id] / share[h100.gpu.id] == pytest.approx(measured, rel=0.01)
    # the kernels resolved per GPU: TE takes cuDNN on Hopper, FA2 on Ampere
    from meshplan.cost_models.attention import gpu_generation
    assert [gpu_generation(g) for g in ("a100-80gb", "l40s", "h200", "gb200", "mi300x")] == \
        ["ampere", "ampere", "hopper", "blackwell", "other"]
