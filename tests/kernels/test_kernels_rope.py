"""Rotary embedding on q and k: Triton vs reference vs a complex-number formulation.

Tolerances (Triton vs reference; both compute in fp32 and round once):

| dtype    | atol  | rtol  | checked               |
|----------|-------|-------|-----------------------|
| float32  | 1e-5  | 1e-5  | q_out, k_out, dq, dk  |
| bfloat16 | 2e-2  | 2e-2  | same                  |
"""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import assert_all_close, fwd_bwd

from meshplan.errors import ConfigError
from meshplan.kernels import reference, rope

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def tables(s: int, r: int, interleaved: bool, batch: int | None = None, base: float = 10000.0):
    pos = torch.arange(s, dtype=torch.float32)
    if batch is not None:  # per-sequence positions (e.g. packed documents)
        pos = pos + torch.arange(batch, dtype=torch.float32)[:, None] * 3
    inv = base ** (-torch.arange(0, r, 2, dtype=torch.float32) / r)
    ang = pos[..., None] * inv  # (..., S, r/2)
    ang = ang.repeat_interleave(2, -1) if interleaved else torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def rope_complex(x, s, r, interleaved, base=10000.0):
    """Independent check: rotate feature pairs as complex numbers by e^{i*pos*freq}."""
    pos = torch.arange(s, dtype=torch.float32)
    inv = base ** (-torch.arange(0, r, 2, dtype=torch.float32) / r)
    rot = torch.polar(torch.ones(s, r // 2), pos[:, None] * inv)[None, :, None, :]
    xr = x[..., :r]
    pairs = xr.unflatten(-1, (r // 2, 2)) if interleaved else torch.stack(xr.chunk(2, -1), -1)
    out = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * rot)
    out = out.flatten(-2) if interleaved else torch.cat([out[..., 0], out[..., 1]], -1)
    return torch.cat([out, x[..., r:]], -1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("r", [16, 8])
def test_reference_matches_complex_rotation(interleaved, r):
    q, k = torch.randn(2, 5, 3, 16), torch.randn(2, 5, 1, 16)
    cos, sin = tables(5, r, interleaved)
    qo, ko = reference.rope(q, k, cos, sin, interleaved=interleaved)
    torch.testing.assert_close(qo, rope_complex(q, 5, r, interleaved), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ko, rope_complex(k, 5, r, interleaved), atol=1e-5, rtol=1e-5)


CASES = [  # (B, S, Hq, Hk, D, r, interleaved, per-batch tables)
    (2, 5, 4, 2, 32, 32, False, False),    # GQA, full rotary, Llama layout
    (1, 7, 3, 1, 24, 8, False, True),      # partial rotary, (B,S,r) tables, head_dim not 2^n
    (2, 3, 2, 2, 16, 16, True, False),     # interleaved layout
    (1, 1, 1, 1, 10, 6, True, False),      # single token, partial, interleaved
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_rope_triton_matches_reference(triton_backend, dtype, case):
    b, s, hq, hk, d, r, inter, per_batch = case
    q, k = torch.randn(b, s, hq, d).to(dtype), torch.randn(b, s, hk, d).to(dtype)
    cos, sin = tables(s, r, inter, batch=b if per_batch else None)
    got = fwd_bwd(lambda x, y: rope(x, y, cos, sin, rotary_dim=r, interleaved=inter), [q, k])
    want = fwd_bwd(lambda x, y: reference.rope(x, y, cos, sin, interleaved=inter), [q, k])
    assert_all_close(got[0], want[0], **TOL[dtype], what="(q_out, k_out)")
    assert_all_close(got[1], want[1], **TOL[dtype], what="(dq, dk)")


def test_head_major_layout_through_transpose_view(triton_backend):
    q_bhsd, k_bhsd = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)
    cos, sin = tables(6, 16, False)
    q, k = q_bhsd.transpose(1, 2), k_bhsd.transpose(1, 2)  # (B, S, H, D) views, not contiguous
    got = rope(q, k, cos, sin)
    want = reference.rope(q, k, cos, sin)
    assert_all_close(list(got), list(want), atol=1e-5, rtol=1e-5, what="outputs")


@pytest.mark.parametrize("call, match", [
    (lambda: rope(torch.ones(2, 3, 4), torch.ones(2, 3, 4), torch.ones(3, 4), torch.ones(3, 4)),
     "q must have 4 dims"),
    (lambda: rope(torch.ones(1, 3, 2, 8), torch.ones(1, 4, 2, 8), torch.ones(3, 8), torch.ones(3, 8)),
     "k has shape"),
    (lambda: rope(torch.ones(1, 3, 2, 8), torch.ones(1, 3, 1, 8), torch.ones(5, 8), torch.ones(5, 8)),
     "cos has shape"),
    (lambda: rope(torch.ones(1, 3, 2, 8), torch.ones(1, 3, 1, 8), torch.ones(3, 10), torch.ones(3, 10)),
     "rotary_dim"),
    (lambda: rope(torch.ones(1, 3, 2, 8), torch.ones(1, 3, 1, 8), torch.ones(3, 8), torch.ones(3, 8),
                  rotary_dim=4), "rotary_dim=4"),
    (lambda: rope(torch.ones(1, 3, 2, 8), torch.ones(1, 3, 1, 8).half(), torch.ones(3, 8),
                  torch.ones(3, 8)), "k has dtype"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_export_with_fake_inputs_keeps_the_custom_op():
    class Attn(torch.nn.Module):
        def forward(self, q, k, cos, sin):
            return torch.ops.meshplan_kernels.rope(q, k, cos, sin, False)

    args = (torch.empty(2, 8, 4, 64, device="meta"), torch.empty(2, 8, 1, 64, device="meta"),
            torch.empty(8, 64, device="meta"), torch.empty(8, 64, device="meta"))
    ep = torch.export.export(Attn(), args)
    assert "meshplan_kernels.rope" in str(ep.graph)
