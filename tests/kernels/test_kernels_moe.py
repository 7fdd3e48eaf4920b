"""MoE routing, load-balancing loss, permute / unpermute: Triton vs reference vs plain torch.

Router logits are distinct within each row so top-k has no ties (ties are broken towards the
lower expert index by the kernel, and unspecified by torch.topk).

Tolerances (Triton vs reference; router math is fp32 in both, the permutation is a copy):

| what                       | dtype    | atol  | rtol  |
|----------------------------|----------|-------|-------|
| routing weights, prob_sum  | float32  | 1e-5  | 1e-5  |  (fp32 outputs)
| routing weights, prob_sum  | bfloat16 | 1e-5  | 1e-4  |  (fp32 math on bf16 inputs)
| dlogits                    | float32  | 1e-5  | 1e-5  |
| dlogits                    | bfloat16 | 8e-3  | 1e-2  |  (bf16 output, 1 ulp = 2^-8)
| permuted tokens            | any      | 0     | 0     |  (exact copy)
| unpermuted sum, all grads  | float32  | 1e-5  | 1e-5  |
| unpermuted sum, all grads  | bfloat16 | 2e-2  | 2e-2  |
"""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import assert_all_close, fwd_bwd

from meshplan.errors import ConfigError
from meshplan.kernels import (
    MoeRouting,
    load_balancing_loss,
    moe_permute,
    moe_route,
    moe_unpermute,
    reference,
)

ROUTE_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-5, rtol=1e-4)}
DLOGITS_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5),
               torch.bfloat16: dict(atol=8e-3, rtol=1e-2)}
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def distinct_logits(t: int, e: int, dtype=torch.float32) -> torch.Tensor:
    vals = torch.randperm(t * e).float() / (t * e) * 8 - 4  # spacing >> bf16 ulp at |x| <= 4
    return vals.view(t, e).to(dtype)


def test_reference_softmax_route_is_softmax_over_the_top_k_logits():
    z = distinct_logits(9, 8)
    w, idx, psum, counts = reference.moe_route(z, 2)
    top = torch.topk(z, 2, dim=-1)
    torch.testing.assert_close(idx, top.indices)
    torch.testing.assert_close(w, torch.softmax(top.values, -1))
    torch.testing.assert_close(psum, torch.softmax(z, -1).sum(0))
    assert counts.sum() == 18 and torch.equal(counts, torch.bincount(idx.flatten(), minlength=8))


def test_reference_sigmoid_route_uses_bias_only_for_selection():
    z = distinct_logits(5, 6)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 10.0])  # forces expert 5 into every top-k
    w, idx, psum, _ = reference.moe_route(z, 2, score_func="sigmoid", expert_bias=bias)
    assert (idx[:, 0] == 5).all()
    s = torch.sigmoid(z)
    other = torch.topk(s[:, :5], 1, dim=-1).indices.squeeze(1)
    torch.testing.assert_close(idx[:, 1], other)
    picked = s.gather(1, idx)
    torch.testing.assert_close(w, picked / picked.sum(-1, keepdim=True))
    torch.testing.assert_close(psum, (s / s.sum(-1, keepdim=True)).sum(0))


def test_load_balancing_loss_is_one_when_balanced_and_matches_formula():
    e, k, t = 4, 2, 8
    experts = torch.arange(t * k).remainder(e).view(t, k)
    even = reference.moe_route(torch.zeros(t, e), k)  # uniform probabilities
    r = MoeRouting(even[0], experts, even[2], torch.full((e,), t * k // e))
    torch.testing.assert_close(load_balancing_loss(r), torch.tensor(1.0))
    z = distinct_logits(t, e)
    r = moe_route(z, k)
    p = torch.softmax(z, -1).mean(0)
    f = torch.nn.functional.one_hot(r.experts, e).float().sum((0, 1)) / (t * k)
    torch.testing.assert_close(load_balancing_loss(r), e * (f * p).sum())


def test_reference_permute_groups_by_expert_and_unpermute_inverts():
    x = torch.randn(6, 5)
    experts = torch.tensor([[2, 0], [1, 2], [0, 1], [2, 1], [0, 2], [1, 0]])
    tokens, counts, row_map, pf = reference.moe_permute(x, experts, 4)
    assert counts.tolist() == [4, 4, 4, 0]
    want_rows = [t for e in range(4) for t in range(6) if e in experts[t].tolist()]
    torch.testing.assert_close(tokens, x[want_rows])
    for t in range(6):
        for i in range(2):
            torch.testing.assert_close(tokens[row_map[t, i]], x[t])
            assert pf[row_map[t, i]] == t * 2 + i
    w = torch.rand(6, 2)
    torch.testing.assert_close(reference.moe_unpermute(tokens * 3, row_map, w),
                               3 * x * w.sum(1, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, e, k, score_func, with_bias", [
    (13, 8, 2, "softmax", False), (7, 6, 3, "sigmoid", True), (1, 5, 1, "softmax", True),
    (9, 16, 4, "sigmoid", False),
])
def test_route_triton_matches_reference(triton_backend, dtype, t, e, k, score_func, with_bias):
    z = distinct_logits(t, e, dtype)
    bias = torch.randn(e) * 0.1 if with_bias else None
    kernel = moe_route(z, k, score_func=score_func, expert_bias=bias)
    want = reference.moe_route(z, k, score_func=score_func, expert_bias=bias)
    assert torch.equal(kernel.experts, want[1]) and torch.equal(kernel.tokens_per_expert, want[3])

    def both(f):  # differentiate the routing weights and the aux loss together
        def g(logits):
            r = f(logits)
            return r[0], r[2]
        return g
    got = fwd_bwd(both(lambda x: moe_route(x, k, score_func=score_func, expert_bias=bias)), [z])
    ref = fwd_bwd(both(lambda x: reference.moe_route(x, k, score_func=score_func,
                                                     expert_bias=bias)), [z])
    assert_all_close(got[0], ref[0], **ROUTE_TOL[dtype], what="(weights, prob_sum)")
    assert_all_close(got[1], ref[1], **DLOGITS_TOL[dtype], what="dlogits")


def test_aux_loss_gradient_alone(triton_backend):
    z = distinct_logits(10, 8)
    grads = []
    for impl in ("kernel", "ref"):
        leaf = z.clone().requires_grad_()
        if impl == "kernel":
            loss = load_balancing_loss(moe_route(leaf, 2))
        else:
            loss = load_balancing_loss(MoeRouting(*reference.moe_route(leaf, 2)))
        loss.backward()
        grads.append(leaf.grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def moe_layer(permute, unpermute, x, scale, w, experts, e):
    """route-independent part of an MoE layer: permute, per-expert scaling, unpermute."""
    perm = permute(x, experts, e)
    tokens, counts = perm[0], perm[1]
    expert_of_row = torch.repeat_interleave(torch.arange(e), counts)
    out = tokens * scale[expert_of_row].unsqueeze(1).to(tokens.dtype)
    return unpermute(out, perm, w), tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, h, e, k", [(11, 96, 5, 2), (1, 200, 4, 3), (16, 33, 8, 1)])
def test_permute_unpermute_triton_matches_reference(triton_backend, dtype, t, h, e, k):
    x = torch.randn(t, h).to(dtype)
    experts = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    w = torch.rand(t, k)
    scale = torch.randn(e)

    def ref_unpermute(out, perm, weights):
        return reference.moe_unpermute(out, perm[2], weights)

    def kernel(xx, ww):
        return moe_layer(moe_permute, moe_unpermute, xx, scale, ww, experts, e)

    def ref(xx, ww):
        return moe_layer(reference.moe_permute, ref_unpermute, xx, scale, ww, experts, e)

    got, want = fwd_bwd(kernel, [x, w]), fwd_bwd(ref, [x, w])
    torch.testing.assert_close(got[0][1], want[0][1], atol=0, rtol=0)  # permuted tokens
    assert_all_close(got[0][:1], want[0][:1], **TOL[dtype], what="unpermuted")
    assert_all_close(got[1], want[1], **TOL[dtype], what="(dx, dweights)")
    perm = moe_permute(x, experts, e)
    assert perm.offsets[-1] == t * k and torch.equal(perm.offsets[1:] - perm.offsets[:-1],
                                                     perm.counts)
    assert torch.equal(perm.source_token, perm.permuted_from // k)


@pytest.mark.parametrize("call, match", [
    (lambda: moe_route(torch.randn(4, 3), 4), "top_k=4 exceeds"),
    (lambda: moe_route(torch.randn(4, 3), 0), "top_k must be a positive int"),
    (lambda: moe_route(torch.randn(4, 3), 1, score_func="relu"), "score_func must be one of"),
    (lambda: moe_route(torch.randn(4, 3), 1, expert_bias=torch.zeros(4)), "expert_bias has shape"),
    (lambda: moe_route(torch.randn(4), 1), "router_logits must have 2 dims"),
    (lambda: moe_permute(torch.randn(4, 8), torch.zeros(4, 2), 3), "experts has dtype float32"),
    (lambda: moe_permute(torch.randn(4, 8), torch.full((4, 2), 3), 3), "experts holds ids"),
    (lambda: moe_permute(torch.randn(4, 8), torch.zeros(5, 2, dtype=torch.long), 3),
     "experts has shape"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_unpermute_shape_mismatch_is_named(reference_backend):
    perm = moe_permute(torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.long), 3)
    with pytest.raises(ConfigError, match="expert_out has shape"):
        moe_unpermute(torch.randn(7, 8), perm, torch.rand(4, 2))
    with pytest.raises(ConfigError, match="weights has shape"):
        moe_unpermute(torch.randn(8, 8), perm, torch.rand(4, 3))


def test_export_with_fake_inputs_keeps_the_custom_ops():
    class Moe(torch.nn.Module):
        def forward(self, x, logits):
            w, idx, psum, counts = torch.ops.meshplan_kernels.moe_route(logits, None, 2, "softmax")
            tokens, counts, row_map, pf = torch.ops.meshplan_kernels.moe_permute(x, idx, 8)
            return torch.ops.meshplan_kernels.moe_unpermute(tokens * 2, row_map, w, pf), psum

    args = (torch.empty(64, 32, device="meta"), torch.empty(64, 8, device="meta"))
    ep = torch.export.export(Moe(), args)
    text = str(ep.graph)
    for op in ("moe_route", "moe_permute", "moe_unpermute"):
        assert f"meshplan_kernels.{op}" in text
