"""Fused linear + cross-entropy: Triton (interpreter) vs the full-logits reference vs torch.

Tolerances (Triton vs reference). The logits are rounded to the input dtype in both, the
softmax is fp32 in both; the kernel adds grad_weight chunk by chunk (one rounding per chunk):

| dtype    | loss atol / rtol | grad atol / rtol | checked                         |
|----------|------------------|------------------|---------------------------------|
| float32  | 1e-5 / 1e-5      | 1e-5 / 1e-4      | loss, d hidden, d weight        |
| bfloat16 | 1e-3 / 1e-3      | 1e-2 / 2e-2      | same                            |
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from meshplan.errors import ConfigError
from meshplan.kernels import fused_linear_cross_entropy, reference
from meshplan.kernels.linear_ce import default_chunk_size

LOSS_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-3, rtol=1e-3)}
GRAD_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=2e-2)}


def make(t=13, h=96, v=1000, dtype=torch.float32, ignore_frac=0.25):
    hidden = torch.randn(t, h).to(dtype)
    weight = (torch.randn(v, h) / math.sqrt(h)).to(dtype)
    labels = torch.randint(0, v, (t,))
    labels[torch.rand(t) < ignore_frac] = -100
    return hidden, weight, labels


def run(fn, hidden, weight, labels, grad_scale=1.0, **kw):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = fn(h, w, labels, **kw)
    (loss * grad_scale).backward()
    return loss.detach(), h.grad, w.grad


def check(got, want, dtype):
    torch.testing.assert_close(got[0], want[0], **LOSS_TOL[dtype], equal_nan=True)
    torch.testing.assert_close(got[1].float(), want[1].float(), **GRAD_TOL[dtype])
    torch.testing.assert_close(got[2].float(), want[2].float(), **GRAD_TOL[dtype])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_reference_matches_log_softmax_formula(reduction, smoothing):
    hidden, weight, labels = make(t=9, h=16, v=50)
    logp = torch.log_softmax(hidden @ weight.t(), -1)
    valid = labels != -100
    nll = -logp[valid].gather(1, labels[valid, None]).squeeze(1)
    per_row = (1 - smoothing) * nll - smoothing * logp[valid].mean(-1)
    want = per_row.mean() if reduction == "mean" else per_row.sum()
    got = reference.linear_cross_entropy(hidden, weight, labels, reduction=reduction,
                                         label_smoothing=smoothing)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction, smoothing", [("mean", 0.0), ("sum", 0.0), ("mean", 0.1),
                                                  ("sum", 0.2)])
def test_triton_matches_reference(triton_backend, dtype, reduction, smoothing):
    hidden, weight, labels = make(dtype=dtype)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    got = run(fused_linear_cross_entropy, hidden, weight, labels, chunk_size=4, **kw)
    want = run(reference.linear_cross_entropy, hidden, weight, labels, **kw)
    check(got, want, dtype)


@pytest.mark.parametrize("t, h, v, chunk", [(1, 200, 1000, None), (6, 96, 37, 5), (5, 8, 3000, 2)])
def test_awkward_shapes(triton_backend, t, h, v, chunk):
    hidden, weight, labels = make(t=t, h=h, v=v, ignore_frac=0.0)
    got = run(fused_linear_cross_entropy, hidden, weight, labels, chunk_size=chunk)
    want = run(reference.linear_cross_entropy, hidden, weight, labels)
    check(got, want, torch.float32)


def test_ignore_index_everywhere_but_one_and_custom_index(triton_backend):
    hidden, weight, labels = make(t=10, v=300)
    labels[:] = 7
    labels[3] = 42
    kw = dict(ignore_index=7, label_smoothing=0.1)
    got = run(fused_linear_cross_entropy, hidden, weight, labels, chunk_size=3, **kw)
    want = run(reference.linear_cross_entropy, hidden, weight, labels, **kw)
    check(got, want, torch.float32)
    assert got[1][torch.arange(10) != 3].abs().max() == 0  # ignored rows get no gradient


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_behaves_like_torch(triton_backend, reduction):
    hidden, weight, labels = make(t=6, v=100)
    labels[:] = -100
    got = run(fused_linear_cross_entropy, hidden, weight, labels, reduction=reduction)
    want = run(reference.linear_cross_entropy, hidden, weight, labels, reduction=reduction)
    assert math.isnan(got[0]) if reduction == "mean" else got[0] == 0
    assert math.isnan(want[0]) if reduction == "mean" else want[0] == 0
    assert got[1].abs().sum() == 0 and got[2].abs().sum() == 0
    assert want[1].abs().sum() == 0 and want[2].abs().sum() == 0


def test_incoming_gradient_scales_the_stored_gradients(triton_backend):
    hidden, weight, labels = make(t=7, v=200)
    got = run(fused_linear_cross_entropy, hidden, weight, labels, grad_scale=-2.5, chunk_size=3)
    want = run(reference.linear_cross_entropy, hidden, weight, labels, grad_scale=-2.5)
    check(got, want, torch.float32)


def test_no_grad_call_returns_the_loss(triton_backend):
    hidden, weight, labels = make(t=5, v=64)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, labels)
    torch.testing.assert_close(loss, reference.linear_cross_entropy(hidden, weight, labels))


def test_default_chunk_size():
    assert default_chunk_size(8192, 128256, 2) == 1024  # 256 MiB of bf16 logits
    assert default_chunk_size(13, 1000, 4) == 16  # never past the token count's power of two
    assert default_chunk_size(4, 2**31, 4) == 1


@pytest.mark.parametrize("kw, match", [
    (dict(labels=torch.zeros(13)), "labels has dtype float32"),
    (dict(labels=torch.zeros(12, dtype=torch.long)), "labels has shape"),
    (dict(labels=torch.full((13,), 1000)), "outside \\[0, vocab=1000\\)"),
    (dict(weight=torch.randn(1000, 95)), "weight has shape"),
    (dict(weight=torch.randn(1000, 96).bfloat16()), "weight has dtype"),
    (dict(reduction="none"), "reduction must be one of"),
    (dict(label_smoothing=1.5), "label_smoothing must be"),
    (dict(chunk_size=0), "chunk_size must be"),
])
def test_bad_input_names_the_argument(kw, match):
    hidden, weight, labels = make()
    args = dict(hidden=hidden, weight=weight, labels=labels)
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    with pytest.raises(ConfigError, match=match):
        fused_linear_cross_entropy(args["hidden"], args["weight"], args["labels"], **kw)


def test_export_with_fake_inputs_keeps_the_custom_op():
    class Head(torch.nn.Module):
        def forward(self, hidden, weight, labels):
            return torch.ops.meshplan_kernels.fused_linear_cross_entropy(
                hidden, weight, labels, -100, "mean", 0.0, 256, True)[0]

    args = (torch.empty(1024, 64, device="meta"), torch.empty(128256, 64, device="meta"),
            torch.empty(1024, dtype=torch.long, device="meta"))
    ep = torch.export.export(Head(), args)
    assert "meshplan_kernels.fused_linear_cross_entropy" in str(ep.graph)


def test_reference_backend_needs_no_triton(reference_backend):
    hidden, weight, labels = make(t=4, v=50)
    torch.testing.assert_close(fused_linear_cross_entropy(hidden, weight, labels),
                               F.cross_entropy(hidden @ weight.t(), labels))
