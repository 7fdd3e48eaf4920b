"""meshplan::grouped_mm under autocast and its CPU loop (models/grouped_mm.py).

Autocast casts the operands of the matmuls it knows, not a custom op's: the experts cast their
operands themselves (amp_operands), so their GEMMs run in bf16 forward and backward, as
nn.Linear's do, and the routed copies cross the expert-parallel all-to-all in bf16.
"""

import torch
from torch.testing import assert_close

from meshplan.models.grouped_mm import amp_operands, grouped_mm, grouped_mm_reference
from meshplan.models.moe import GroupedExperts


def _experts(seed=0):
    torch.manual_seed(seed)
    ex = GroupedExperts(3, 16, 24, activation="swiglu")
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return ex


def test_experts_under_autocast_run_bf16_like_linear_layers():
    ex = _experts()
    counts = torch.tensor([5, 0, 7])               # an expert with no rows, and a 1-row tail below
    x = torch.randn(13, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ex(x, counts)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()

    # the reference: the same loop written with autograd on bf16 copies of the operands
    ref = _experts()
    xr = x.detach().clone().requires_grad_()
    xb, w1, w2, w3 = (t.to(torch.bfloat16) for t in (xr, ref.w1, ref.w2, ref.w3))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = torch.nn.functional.silu(grouped_mm_reference(xb, w1, offs)) * grouped_mm_reference(xb, w3, offs)
    yr = grouped_mm_reference(h, w2, offs)
    assert_close(y, yr)
    yr.float().square().sum().backward()
    assert x.grad.dtype == torch.float32 and ex.w1.grad.dtype == torch.float32     # fp32 master weights
    assert_close(x.grad, xr.grad)
    for name in ("w1", "w2", "w3"):
        assert_close(getattr(ex, name).grad, getattr(ref, name).grad)
    assert not ex.w1.grad[1].any()                 # the empty expert's slice gets no gradient


def test_grouped_mm_loop_zeroes_rows_past_the_groups_and_empty_groups():
    torch.manual_seed(1)
    x = torch.randn(9, 8, requires_grad=True)
    w = torch.randn(3, 5, 8, requires_grad=True)
    offs = torch.tensor([3, 3, 7], dtype=torch.int32)          # group 1 empty, rows 7..8 outside
    y = grouped_mm(x, w, offs)
    assert not y[7:].any()
    assert_close(y, grouped_mm_reference(x, w, offs))
    g = torch.randn_like(y)
    y.backward(g)
    dx, dw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    grouped_mm_reference(x, w, offs).backward(g)
    assert_close(dx, x.grad)
    assert_close(dw, w.grad)
    assert not dx[7:].any() and not dw[1].any()


def test_amp_operands_leaves_integers_and_autocast_off_alone():
    a, i = torch.randn(2, 2), torch.tensor([1, 2])
    assert amp_operands(a, i) == (a, i)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ca, ci = amp_operands(a, i)
    assert ca.dtype == torch.bfloat16 and ci is i
