"""Triton kernel for the softmax / cross-entropy / dlogits part of fused linear + CE.

One program owns BLOCK_R full rows of a chunk's logits (C, V). Pass 1 streams the row in
BLOCK_V tiles with an online max / sum-of-exp (and the label logit and the row sum needed for
label smoothing); pass 2 re-reads the tiles and overwrites them with dloss/dlogits, already
multiplied by the reduction scale (1/n_valid for "mean", read from device memory so the host
never syncs). Per-row losses go to LOSS; ignored rows get loss 0 and gradient 0.

With eps = label_smoothing, lse = logsumexp(z), torch's definition gives per valid row
    loss = (1 - eps) * (lse - z_y) + eps * (lse - sum(z) / V)
    dloss/dz_j = softmax(z)_j - eps / V - (1 - eps) * [j == y]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshplan.kernels import _launch

GPU_BLOCK_V = 4096  # vocab tile on a GPU: 16 KiB fp32 per row tile, 8 warps
# finite "minus infinity": fully masked tiles then give no inf - inf = NaN; a constexpr
# because compiled Triton kernels may only read constexpr globals
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _ce_chunk(LOGITS, stride, LABELS, LOSS, SCALE, n_rows, V, ignore_index, eps,
              HAS_SMOOTHING: tl.constexpr, COMPUTE_GRAD: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    labels = tl.load(LABELS + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    valid = row_mask & (labels != ignore_index)
    base = LOGITS + rows.to(tl.int64)[:, None] * stride
    m = tl.full((BLOCK_R,), NEG_BIG, dtype=tl.float32)
    d = tl.zeros((BLOCK_R,), dtype=tl.float32)
    z_label = tl.zeros((BLOCK_R,), dtype=tl.float32)
    z_sum = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (cols[None, :] < V)
        z = tl.load(base + cols[None, :], mask=mask, other=NEG_BIG).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new
        z_label += tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
        if HAS_SMOOTHING:
            z_sum += tl.sum(tl.where(mask, z, 0.0), axis=1)
    lse = m + tl.log(d)
    if HAS_SMOOTHING:
        loss = lse - (1.0 - eps) * z_label - eps * z_sum / V
    else:
        loss = lse - z_label
    tl.store(LOSS + rows, tl.where(valid, loss, 0.0), mask=row_mask)
    if COMPUTE_GRAD:
        scale = tl.load(SCALE)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            mask = row_mask[:, None] & (cols[None, :] < V)
            z = tl.load(base + cols[None, :], mask=mask, other=NEG_BIG).to(tl.float32)
            g = tl.exp(z - lse[:, None])
            if HAS_SMOOTHING:
                g = g - eps / V
            g = g - tl.where(cols[None, :] == labels[:, None], 1.0 - eps, 0.0)
            g = tl.where(valid[:, None], g * scale, 0.0)
            tl.store(base + cols[None, :], g.to(LOGITS.dtype.element_ty), mask=mask)


def ce_chunk(logits: torch.Tensor, labels: torch.Tensor, loss_rows: torch.Tensor,
             scale: torch.Tensor, ignore_index: int, label_smoothing: float,
             compute_grad: bool) -> None:
    """logits (C, V), unit column stride: overwritten with scaled dlogits when compute_grad."""
    c, v = logits.shape
    if _launch.interpreter_enabled():
        block_v = _launch.next_pow2(v)
        block_r = _launch.rows_per_block(block_v, c)
        warps = 1
    else:
        block_v, block_r, warps = min(GPU_BLOCK_V, _launch.next_pow2(v)), 1, 8
    grid = (_launch.cdiv(c, block_r),)
    _ce_chunk[grid](logits, logits.stride(0), labels, loss_rows, scale, c, v, ignore_index,
                    float(label_smoothing), HAS_SMOOTHING=label_smoothing > 0,
                    COMPUTE_GRAD=compute_grad, BLOCK_R=block_r, BLOCK_V=block_v,
                    num_warps=warps)
