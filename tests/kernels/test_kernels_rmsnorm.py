"""RMSNorm and fused residual-add RMSNorm: Triton (interpreter) vs reference vs plain torch.

Tolerances (Triton vs reference; both reduce in fp32 and round once, so bf16 differs by
output rounding and summation order only):

| dtype    | atol  | rtol  | checked                         |
|----------|-------|-------|---------------------------------|
| float32  | 1e-5  | 1e-5  | y, new residual, dx, dres, dw   |
| bfloat16 | 2e-2  | 2e-2  | same (bf16 ulp is 2^-8 = 3.9e-3) |
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testutil import assert_all_close, fwd_bwd

from meshplan.errors import ConfigError
from meshplan.kernels import reference, rms_norm, rms_norm_residual

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
SHAPES = [(6, 96), (1, 200), (2, 5, 64), (3, 1)]


def test_reference_matches_torch_rms_norm():
    x, w = torch.randn(4, 7, 96), torch.randn(96)
    torch.testing.assert_close(reference.rms_norm(x, w, 1e-5), F.rms_norm(x, (96,), w, eps=1e-5))
    y, h = reference.rms_norm_residual(x, x * 2, w, 1e-5)
    torch.testing.assert_close(h, x * 3)
    torch.testing.assert_close(y, F.rms_norm(x * 3, (96,), w, eps=1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_triton_matches_reference(triton_backend, dtype, shape):
    x = torch.randn(shape).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    got = fwd_bwd(lambda a, b: rms_norm(a, b, 1e-6), [x, w])
    want = fwd_bwd(lambda a, b: reference.rms_norm(a, b, 1e-6), [x, w])
    assert_all_close(got[0], want[0], **TOL[dtype], what="y")
    assert_all_close(got[1], want[1], **TOL[dtype], what="grads")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 96), (1, 200)])
def test_rms_norm_residual_triton_matches_reference(triton_backend, dtype, shape):
    x, r = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    w = torch.randn(shape[-1]).to(dtype)
    got = fwd_bwd(lambda a, b, c: rms_norm_residual(a, b, c), [x, r, w])
    want = fwd_bwd(lambda a, b, c: reference.rms_norm_residual(a, b, c), [x, r, w])
    assert_all_close(got[0], want[0], **TOL[dtype], what="(y, h)")
    assert_all_close(got[1], want[1], **TOL[dtype], what="grads")


def test_only_the_normed_output_used(triton_backend):
    # the new-residual output gets no gradient: the op must treat its missing grad as zero
    x, r, w = torch.randn(4, 96), torch.randn(4, 96), torch.randn(96)
    grads = []
    for fn in (rms_norm_residual, reference.rms_norm_residual):
        leaves = [t.clone().requires_grad_() for t in (x, r, w)]
        fn(*leaves)[0].sum().backward()
        grads.append([t.grad for t in leaves])
    assert_all_close(grads[0], grads[1], atol=1e-5, rtol=1e-5, what="grads")


def test_non_contiguous_input_is_copied_not_misread(triton_backend):
    x = torch.randn(96, 8).t()  # (8, 96), stride (1, 8)
    w = torch.randn(96)
    torch.testing.assert_close(rms_norm(x, w), reference.rms_norm(x.contiguous(), w))


def test_weight_in_fp32_with_bf16_activations(triton_backend):
    x, w = torch.randn(4, 96).bfloat16(), torch.randn(96)
    got = fwd_bwd(rms_norm, [x, w])
    want = fwd_bwd(reference.rms_norm, [x, w])
    assert got[1][1].dtype == torch.float32
    assert_all_close(got[1], want[1], **TOL[torch.bfloat16], what="grads")


@pytest.mark.parametrize("call, match", [
    (lambda: rms_norm(torch.ones(2, 4, dtype=torch.int64), torch.ones(4)), "x has dtype int64"),
    (lambda: rms_norm(torch.ones(2, 4), torch.ones(5)), "weight has shape"),
    (lambda: rms_norm(torch.ones(2, 4), torch.ones(4), eps=-1.0), "eps must be"),
    (lambda: rms_norm_residual(torch.ones(2, 4), torch.ones(3, 4), torch.ones(4)), "residual has shape"),
    (lambda: rms_norm_residual(torch.ones(2, 4), torch.ones(2, 4).bfloat16(), torch.ones(4)),
     "residual has dtype"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_export_with_fake_inputs_keeps_the_custom_ops():
    class Block(torch.nn.Module):
        def forward(self, x, r, w):
            y, h = torch.ops.meshplan_kernels.rms_norm_residual(x, r, w, 1e-6)[:2]
            return torch.ops.meshplan_kernels.rms_norm(y + h, w, 1e-6)[0]

    args = tuple(torch.empty(s, device="meta") for s in [(2, 8, 96), (2, 8, 96), (96,)])
    ep = torch.export.export(Block(), args)
    text = str(ep.graph)
    assert "meshplan_kernels.rms_norm_residual" in text and "meshplan_kernels.rms_norm." in text
    out = [n for n in ep.graph.nodes if n.op == "output"][0].args[0][0]
    assert tuple(out.meta["val"].shape) == (2, 8, 96)


def test_compiled_training_step_traces_through_the_op(triton_backend):
    x, w = torch.randn(4, 96, requires_grad=True), torch.randn(96, requires_grad=True)
    f = torch.compile(lambda a, b: rms_norm(a, b).square().sum(), backend="aot_eager",
                      fullgraph=True)
    f(x, w).backward()
    got = [x.grad, w.grad]
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    reference.rms_norm(x2, w2).square().sum().backward()
    want = [x2.grad, w2.grad]
    assert_all_close(got, want, atol=1e-4, rtol=1e-4, what="compiled grads")
