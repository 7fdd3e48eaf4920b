"""torch.library.opcheck on every forward op: schema, fake (meta) impl, autograd registration.

opcheck runs each op several times (eager, under FakeTensorMode, through autograd) and checks
that the fake implementation agrees with the real one on shapes, dtypes and strides.
"""

from __future__ import annotations

import pytest
import torch

from meshplan.kernels.ops import OPS


def _cases():
    x = torch.randn(3, 24, requires_grad=True)
    w = torch.randn(24, requires_grad=True)
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    k = torch.randn(1, 4, 1, 8, requires_grad=True)
    cos, sin = torch.randn(4, 8), torch.randn(4, 8)
    z = (torch.randperm(12).float() / 3).view(3, 4).requires_grad_()
    experts = torch.tensor([[0, 2], [1, 0], [2, 3]])
    return {
        "rms_norm": (x, w, 1e-6),
        "rms_norm_residual": (x, torch.randn(3, 24), w, 1e-6),
        "swiglu": (x, torch.randn(3, 24, requires_grad=True)),
        "swiglu_packed": (x,),
        "rope": (q, k, cos, sin, False),
        "fused_linear_cross_entropy": (x, torch.randn(30, 24, requires_grad=True),
                                       torch.tensor([1, -100, 29]), -100, "mean", 0.1, 2, True),
        "moe_route": (z, None, 2, "softmax"),
        "moe_permute": (x, experts, 4),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_opcheck(triton_backend, name):
    torch.library.opcheck(OPS[name], _cases()[name],
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))
