"""Triton kernel for rotary position embedding on q and k in one launch. Imported lazily.

Each program takes BLOCK_S (batch, position) rows, loads their cos/sin once and applies them to
every q head and every k head (GQA: different head counts). Columns at or past rotary_dim pass
through unchanged. With p(c) the partner column of c and sign(c) = -1 for the first member of a
pair (c < r/2 in the "rotate_half" layout, even c in the interleaved layout):

    forward   out[c] = x[c] cos[c] + sign(c) x[p(c)] sin[c]
    backward  dx[c]  = dy[c] cos[c] - sign(c) dy[p(c)] sin[p(c)]     (the transpose; p(p(c)) = c)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshplan.kernels import _launch

# GPU: positions per program such that a (positions x head_dim) tile is ~2K elements, so an
# 8192-token sequence at head_dim 128 gives 512 programs (H100 has 132 SMs); each program then
# loops over all heads. The interpreter keeps the large shared tile budget.
GPU_ROPE_TILE_ELEMENTS = 2048


@triton.jit
def _rotate_heads(X, O, n_heads, x_off, o_off, sxh, soh, cols, mask, partner, pmask, sign,
                  cos, sin, sin_p, BACKWARD: tl.constexpr):
    for h in range(n_heads):
        xp = X + x_off + h * sxh
        x = tl.load(xp + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xq = tl.load(xp + partner[None, :], mask=pmask, other=0.0).to(tl.float32)
        if BACKWARD:
            out = x * cos - sign[None, :] * xq * sin_p
        else:
            out = x * cos + sign[None, :] * xq * sin
        tl.store(O + o_off + h * soh + cols[None, :], out.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _rope(Q, K, QO, KO, COS, SIN, n_rows, S, HQ, HK, D, R,
          sqb, sqs, sqh, skb, sks, skh, sob_q, soh_q, sob_k, soh_k, scb, scs,
          INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)  # flattened (b, s)
    row_mask = rows < n_rows
    b = (rows // S).to(tl.int64)
    s = (rows % S).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    half = R // 2
    if INTERLEAVED:
        partner = cols ^ 1
        sign = tl.where(cols % 2 == 0, -1.0, 1.0)
    else:
        partner = tl.where(cols < half, cols + half, cols - half)
        sign = tl.where(cols < half, -1.0, 1.0)
    rot = cols < R
    mask = row_mask[:, None] & (cols[None, :] < D)
    pmask = row_mask[:, None] & rot[None, :]
    c_off = b[:, None] * scb + s[:, None] * scs
    cos = tl.load(COS + c_off + cols[None, :], mask=pmask, other=1.0).to(tl.float32)
    sin = tl.load(SIN + c_off + cols[None, :], mask=pmask, other=0.0).to(tl.float32)
    sin_p = sin
    if BACKWARD:
        sin_p = tl.load(SIN + c_off + partner[None, :], mask=pmask, other=0.0).to(tl.float32)
    rows64 = rows.to(tl.int64)[:, None]
    _rotate_heads(Q, QO, HQ, b[:, None] * sqb + s[:, None] * sqs, rows64 * sob_q, sqh, soh_q,
                  cols, mask, partner, pmask, sign, cos, sin, sin_p, BACKWARD)
    _rotate_heads(K, KO, HK, b[:, None] * skb + s[:, None] * sks, rows64 * sob_k, skh, soh_k,
                  cols, mask, partner, pmask, sign, cos, sin, sin_p, BACKWARD)


def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          interleaved: bool, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B,S,Hq,D), k (B,S,Hk,D): any strides with unit stride on D. cos/sin (S,r)/(B,S,r)
    with unit last stride. Returns new contiguous tensors."""
    bsz, s, hq, d = q.shape
    hk = k.shape[2]
    r = cos.shape[-1]
    qo = torch.empty((bsz, s, hq, d), device=q.device, dtype=q.dtype)
    ko = torch.empty((bsz, s, hk, d), device=k.device, dtype=k.dtype)
    n_rows = bsz * s
    if n_rows == 0:
        return qo, ko
    scb, scs = (cos.stride(0), cos.stride(1)) if cos.dim() == 3 else (0, cos.stride(0))
    block_d = _launch.next_pow2(d)
    if _launch.interpreter_enabled():
        block_s = _launch.rows_per_block(block_d, n_rows)
    else:
        block_s = min(_launch.next_pow2(max(1, GPU_ROPE_TILE_ELEMENTS // block_d)),
                      _launch.next_pow2(n_rows))
    grid = (_launch.cdiv(n_rows, block_s),)
    _rope[grid](q, k, qo, ko, cos, sin, n_rows, s, hq, hk, d, r,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                hq * d, d, hk * d, d, scb, scs,
                INTERLEAVED=interleaved, BACKWARD=backward, BLOCK_S=block_s, BLOCK_D=block_d,
                num_warps=_launch.num_warps(block_s * block_d))
    return qo, ko
