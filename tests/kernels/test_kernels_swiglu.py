"""SwiGLU (two tensors, and the packed gate/up projection): Triton vs reference vs torch.

Tolerances (Triton vs reference; both compute in fp32 and round once):

| dtype    | atol  | rtol  | checked               |
|----------|-------|-------|-----------------------|
| float32  | 1e-5  | 1e-5  | out, dgate, dup       |
| bfloat16 | 2e-2  | 2e-2  | same                  |
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testutil import assert_all_close, fwd_bwd

from meshplan.errors import ConfigError
from meshplan.kernels import reference, swiglu, swiglu_packed

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def test_reference_matches_eager_torch():
    g, u = torch.randn(5, 200), torch.randn(5, 200)
    torch.testing.assert_close(reference.swiglu(g, u), F.silu(g) * u)
    torch.testing.assert_close(reference.swiglu_packed(torch.cat([g, u], -1)), F.silu(g) * u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 200), (1, 96), (2, 3, 33)])
def test_swiglu_triton_matches_reference(triton_backend, dtype, shape):
    g, u = (5 * torch.randn(shape)).to(dtype), torch.randn(shape).to(dtype)
    got = fwd_bwd(swiglu, [g, u])
    want = fwd_bwd(reference.swiglu, [g, u])
    assert_all_close(got[0], want[0], **TOL[dtype], what="out")
    assert_all_close(got[1], want[1], **TOL[dtype], what="grads")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 400), (2, 3, 66)])
def test_swiglu_packed_triton_matches_reference(triton_backend, dtype, shape):
    x = (3 * torch.randn(shape)).to(dtype)
    got = fwd_bwd(swiglu_packed, [x])
    want = fwd_bwd(reference.swiglu_packed, [x])
    assert got[0][0].shape == (*shape[:-1], shape[-1] // 2)
    assert_all_close(got[0], want[0], **TOL[dtype], what="out")
    assert_all_close(got[1], want[1], **TOL[dtype], what="grads")


def test_non_contiguous_inputs_are_copied(triton_backend):
    g, u = torch.randn(40, 6).t(), torch.randn(6, 40)
    torch.testing.assert_close(swiglu(g, u), reference.swiglu(g.contiguous(), u))
    x = torch.randn(80, 6).t()
    torch.testing.assert_close(swiglu_packed(x), reference.swiglu_packed(x.contiguous()))


@pytest.mark.parametrize("call, match", [
    (lambda: swiglu(torch.ones(2, 4), torch.ones(2, 5)), "up has shape"),
    (lambda: swiglu(torch.ones(2, 4), torch.ones(2, 4).half()), "up has dtype"),
    (lambda: swiglu(torch.ones(2, 4, dtype=torch.int32), torch.ones(2, 4)), "gate has dtype int32"),
    (lambda: swiglu_packed(torch.ones(2, 5)), "gate_up's last dim must be even"),
    (lambda: swiglu_packed([1.0, 2.0]), "gate_up must be a torch.Tensor"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_export_with_fake_inputs_keeps_the_custom_ops():
    class Mlp(torch.nn.Module):
        def forward(self, gu, g, u):
            return torch.ops.meshplan_kernels.swiglu_packed(gu) + torch.ops.meshplan_kernels.swiglu(g, u)

    args = (torch.empty(3, 8, 64, device="meta"), torch.empty(3, 8, 32, device="meta"),
            torch.empty(3, 8, 32, device="meta"))
    ep = torch.export.export(Mlp(), args)
    text = str(ep.graph)
    assert "meshplan_kernels.swiglu_packed" in text and "meshplan_kernels.swiglu." in text
