"""The input-saving autograd Functions (meshplan.kernels.lean) against the reference math that
autograd differentiates (meshplan.kernels.reference): the same forward and gradients, and only
the kernel's tensors kept for backward (RMSNorm: x, weight and the fp32 rstd; SwiGLU: gate, up).

Tolerances: fp32 atol = rtol = 1e-5 (same math, another order of the backward's sums); bf16
2e-2 (one rounding of the output either way, bf16 ulp 2^-8)."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_testutil import assert_all_close, fwd_bwd

from meshplan.kernels import lean, reference, rms_norm, swiglu, swiglu_packed, use_backend

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _saved(fn, *inputs) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of every tensor autograd keeps for backward while `fn(*inputs)` runs."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    kept = []

    def pack(t):
        kept.append((t.dtype, tuple(t.shape)))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*leaves)
    return kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 96), (2, 5, 64), (3, 1)])
def test_rms_norm_matches_reference(dtype, shape):
    x = torch.randn(shape).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    got = fwd_bwd(lambda a, b: lean.rms_norm(a, b, 1e-6), [x, w])
    want = fwd_bwd(lambda a, b: reference.rms_norm(a, b, 1e-6), [x, w])
    assert_all_close(got[0], want[0], **TOL[dtype], what="y")
    assert_all_close(got[1], want[1], **TOL[dtype], what="grads")


def test_rms_norm_bf16_input_fp32_weight():
    """Autocast's case: a bf16 stream normalised with an fp32 master weight; output and dx in
    bf16, the weight's gradient in fp32."""
    x, w = torch.randn(4, 7, 32).bfloat16(), 1 + 0.1 * torch.randn(32)
    got = fwd_bwd(lambda a, b: lean.rms_norm(a, b, 1e-5), [x, w])
    want = fwd_bwd(lambda a, b: reference.rms_norm(a, b, 1e-5), [x, w])
    assert got[0][0].dtype == torch.bfloat16 and got[1][0].dtype == torch.bfloat16 and got[1][1].dtype == torch.float32
    assert_all_close(got[0], want[0], **TOL[torch.bfloat16], what="y")
    assert_all_close(got[1], want[1], **TOL[torch.bfloat16], what="grads")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_reference(dtype):
    g, u = torch.randn(3, 5, 48).to(dtype), torch.randn(3, 5, 48).to(dtype)
    for fn, ref, args in ((lean.swiglu, reference.swiglu, [g, u]),
                          (lean.swiglu_packed, reference.swiglu_packed, [torch.cat([g, u], -1)])):
        got, want = fwd_bwd(fn, args), fwd_bwd(ref, args)
        assert_all_close(got[0], want[0], **TOL[dtype], what=f"{fn.__name__} out")
        assert_all_close(got[1], want[1], **TOL[dtype], what=f"{fn.__name__} grads")


def test_only_the_kernels_tensors_are_kept():
    """What backward holds: the inputs (and RMSNorm's fp32 rstd, one per row), never an fp32
    copy of a bf16 input or an element-wise intermediate, which the reference's autograd keeps."""
    x, w = torch.randn(4, 6, 64).bfloat16(), torch.randn(64)
    assert sorted(_saved(lambda a, b: lean.rms_norm(a, b), x, w), key=str) == sorted(
        [(torch.bfloat16, (4, 6, 64)), (torch.float32, (64,)), (torch.float32, (4, 6, 1))], key=str)
    big = [s for s in _saved(lambda a, b: reference.rms_norm(a, b), x, w) if s == (torch.float32, (4, 6, 64))]
    assert big, "the reference keeps an fp32 copy of x (the check above would not notice a regression)"
    g, u = torch.randn(4, 96).bfloat16(), torch.randn(4, 96).bfloat16()
    assert _saved(lean.swiglu, g, u) == [(torch.bfloat16, (4, 96))] * 2
    assert _saved(lean.swiglu_packed, torch.cat([g, u], -1)) == [(torch.bfloat16, (4, 192))]
    assert len(_saved(reference.swiglu, g, u)) > 2


def test_reference_backend_runs_the_input_saving_functions():
    x, w = torch.randn(3, 32).bfloat16(), torch.randn(32).bfloat16()
    g = torch.randn(3, 32).bfloat16()
    with use_backend("reference"):
        assert len(_saved(lambda a, b: rms_norm(a, b), x, w)) == 3
        assert len(_saved(swiglu, g, g)) == 2
        assert len(_saved(swiglu_packed, torch.cat([g, g], -1))) == 1


def test_runtime_runs_eager_norms_and_swiglu_on_the_input_saving_functions():
    """runtime.fused.apply_lean_elementwise on tiny-llama (fp32, CPU): every nn.RMSNorm and the
    plan's swiglu modules run kernels.lean, the model computes what it computed (forward and
    gradients), and backward keeps no silu output and no normalised copy. Where the Triton
    rms_norm would be swapped in (CUDA), nn.RMSNorm runs that kernel instead."""
    import copy

    import meshplan as mp
    import meshplan.runtime.fused as fused
    from meshplan.ir.plan import FusedKernel
    torch.manual_seed(0)
    model = mp.models.build("tiny-llama", device="cpu", seq_len=16)
    model.init_weights()
    ref = copy.deepcopy(model)
    names = (("down", "w2"), ("gate", "w1"), ("up", "w3"))
    entries = [FusedKernel(kernel="swiglu", module=f"layers.{i}.feed_forward", options=names)
               for i in range(model.config.layers)]
    swapped = fused.apply_lean_elementwise(model, entries, device_type="cpu", mode="auto")
    norms = [n for n, m in ref.named_modules() if isinstance(m, torch.nn.RMSNorm)]
    assert sorted(swapped) == sorted([e.module for e in entries] + norms)
    assert all(model.get_submodule(n).__dict__["_meshplan_norm_fn"] is lean.rms_norm for n in norms)
    ids = torch.randint(0, model.config.vocab, (2, 16))
    out, want = model(ids), ref(ids)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    out.square().mean().backward()
    want.square().mean().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"grad {n}: {m}")
    h, f = model.config.hidden, model.config.ffn_hidden
    def f_wide(m) -> int:       # f-wide tensors saved for backward (any leading shape: 2 x 16 rows)
        return sum(1 for s in _saved(lambda i: m(i), ids) if s[1][-1:] == (f,) and math.prod(s[1]) == 32 * f)
    assert f_wide(model) == 3 * model.config.layers      # gate, up, and the product w2 keeps
    assert f_wide(ref) == 4 * ref.config.layers          # eager: silu's output too
    def h_wide_fp32(m) -> int:
        return sum(1 for s in _saved(lambda i: m(i), ids) if s[0] == torch.float32 and s[1] == (2, 16, h))
    # per norm: its input (the linears keep their inputs as 2-D views); eager aten.rms_norm also
    # keeps the normalised tensor before the weight multiply
    assert h_wide_fp32(model) == len(norms) < h_wide_fp32(ref)
    cuda = mp.models.build("tiny-llama", device="meta", seq_len=16)
    with pytest.MonkeyPatch.context() as mpatch:
        mpatch.setattr(fused, "backend", lambda: "triton")
        fused.apply_lean_elementwise(cuda, [], device_type="cuda", mode="auto")
    assert cuda.norm.__dict__["_meshplan_norm_fn"] is fused.rms_norm
