"""Helpers for the kernel tests: run a function forward+backward and compare with a reference."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def fwd_bwd(fn: Callable[..., object], inputs: Sequence[torch.Tensor], seed: int = 1
            ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Outputs (float tensors) and the grads of every input w.r.t. a fixed random projection."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    outs = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [leaf.grad if leaf.is_floating_point() else None
                                        for leaf in leaves]


def assert_all_close(got: Sequence[torch.Tensor | None], want: Sequence[torch.Tensor | None],
                     *, atol: float, rtol: float, what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None or not g.abs().any(), f"{what}[{i}]"
            continue
        assert g is not None, f"{what}[{i}] missing"
        torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=rtol,
                                   msg=lambda m: f"{what}[{i}]: {m}")
