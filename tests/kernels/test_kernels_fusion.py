"""The fusion table for the cost model: pure arithmetic, no torch needed."""

from __future__ import annotations

import pytest

from meshplan.errors import ConfigError, UnknownNameError
from meshplan.kernels import fusion


def test_every_fusion_names_a_public_kernel():
    import meshplan.kernels as k

    for f in fusion.FUSIONS.values():
        assert callable(getattr(k, f.kernel)), f.kernel


def test_llama8b_rms_norm_saving_matches_the_derivation():
    # (28 + 4b) + (60 + 8b) - 5b with b = 2 -> 102 bytes per element
    assert fusion.bytes_saved("rms_norm", tokens=8192, hidden=4096) == 8192 * 4096 * 102


def test_savings_scale_linearly_and_are_positive():
    shapes = {
        "rms_norm": dict(tokens=8, hidden=64),
        "rms_norm_residual": dict(tokens=8, hidden=64),
        "swiglu": dict(tokens=8, ffn_hidden=64),
        "rope": dict(tokens=8, q_heads=4, kv_heads=2, head_dim=16),
        "linear_cross_entropy": dict(tokens=8, vocab=64),
        "moe_unpermute": dict(tokens=8, hidden=64, top_k=2),
    }
    assert set(shapes) == set(fusion.FUSIONS)
    for name, kw in shapes.items():
        one = fusion.bytes_saved(name, **kw)
        two = fusion.bytes_saved(name, **{**kw, "tokens": 16})
        assert one > 0 and two == pytest.approx(2 * one), name
    assert fusion.bytes_saved("rms_norm_residual", tokens=8, hidden=64) > \
        fusion.bytes_saved("rms_norm", tokens=8, hidden=64)


def test_bad_names_and_keywords():
    with pytest.raises(UnknownNameError, match="known fusions: .*rms_norm"):
        fusion.bytes_saved("layer_norm", tokens=1, hidden=1)
    with pytest.raises(ConfigError, match="takes keywords \\(tokens, hidden, dtype_bytes\\)"):
        fusion.bytes_saved("rms_norm", tokens=1, vocab=3)
    with pytest.raises(ConfigError, match="tokens must be a non-negative number"):
        fusion.bytes_saved("swiglu", tokens=-1, ffn_hidden=3)
