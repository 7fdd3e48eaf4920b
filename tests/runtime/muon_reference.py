"""A plain single-device Muon (+ AdamW for the rest), written for the tests to compare with
meshplan.train.muon: whole matrices, one parameter at a time, no sharding, no batching."""

from __future__ import annotations

import math

import torch


def orthogonalise(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.t()
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        s = x @ x.t()
        x = a * x + b * (s @ x) + c * (s @ (s @ x))
    return x.t() if tall else x


def muon_step(named: dict, grads: dict, state: dict, *, lr: float, wd: float, mu: float = 0.95,
              betas=(0.9, 0.95), eps: float = 1e-8, muon_names: set) -> None:
    """One step on {name: tensor} in place; `state` persists between steps."""
    for n, w in named.items():
        g = grads[n]
        st = state.setdefault(n, {})
        if n in muon_names:
            buf = st.setdefault("momentum_buffer", torch.zeros_like(w))
            buf.mul_(mu).add_(g)
            u = g + mu * buf
            mats = [u] if w.dim() == 2 else list(u)
            outs = []
            for m in mats:
                o = orthogonalise(m)
                outs.append(o * 0.2 * math.sqrt(max(m.shape)))
            upd = outs[0] if w.dim() == 2 else torch.stack(outs)
            w.mul_(1 - lr * wd).sub_(lr * upd)
        else:
            t = st["t"] = st.get("t", 0) + 1
            m = st["m"] = st.get("m", torch.zeros_like(w)) * betas[0] + (1 - betas[0]) * g
            v = st["v"] = st.get("v", torch.zeros_like(w)) * betas[1] + (1 - betas[1]) * g * g
            w.mul_(1 - lr * wd)
            w.sub_(lr * (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps))
