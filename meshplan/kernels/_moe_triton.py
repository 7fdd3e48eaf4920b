"""Triton kernels for MoE routing and token permutation. Imported lazily.

Routing (one program = BLOCK_T tokens x all E experts, fp32 in registers):
  softmax: p = softmax(z); pick top-k of p (+ bias); w = p[top-k] / sum(p[top-k]).
  sigmoid: s = sigmoid(z); pick top-k of s + bias; w = s[top-k] / sum(s[top-k]).
  Also the per-program column sums of the full distribution (softmax p, or s / sum(s)) for the
  load-balancing loss, added up afterwards (deterministic, no atomics).
Backward, with g = dL/dw and c = dL/dprob_sum (the same c for every token):
  softmax top-k part  dz_i = w_i (g_i - sum_j w_j g_j)                  for i in top-k
  sigmoid top-k part  dz_i = (g_i - sum_j w_j g_j) / S * s_i (1 - s_i),  S = sum_top-k s
  aux part  softmax:  dz  += p * (c - p.c);   sigmoid: dz += (c - q.c) / sum(s) * s (1 - s)
Permutation kernels gather whole rows: no atomics anywhere, so results are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshplan.kernels import _launch

GPU_BLOCK_H = 1024  # hidden columns per tile on a GPU; rows fill the rest of the tile budget
NEG_BIG = tl.constexpr(-1.0e30)  # constexpr: compiled kernels may only read constexpr globals


@triton.jit
def _route_scores(Z, rows, cols, row_mask, E, SIGMOID: tl.constexpr):
    """(score, dist, mask): score = softmax or sigmoid of the logits; dist = the distribution
    over experts used by the load-balancing loss (softmax, or sigmoid normalised)."""
    mask = row_mask[:, None] & (cols[None, :] < E)
    z = tl.load(Z + rows.to(tl.int64)[:, None] * E + cols[None, :], mask=mask, other=0.0)
    z = z.to(tl.float32)
    if SIGMOID:
        score = tl.where(mask, tl.sigmoid(z), 0.0)
        dist = score / tl.maximum(tl.sum(score, axis=1), 1e-30)[:, None]
    else:
        z = tl.where(mask, z, NEG_BIG)
        e = tl.where(mask, tl.exp(z - tl.max(z, axis=1)[:, None]), 0.0)
        score = e / tl.maximum(tl.sum(e, axis=1), 1e-30)[:, None]
        dist = score
    return score, dist, mask


@triton.jit
def _route_fwd(Z, BIAS, W, IDX, PSUM, T, E,
               K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < T
    score, dist, mask = _route_scores(Z, rows, cols, row_mask, E, SIGMOID)
    sel = score
    if HAS_BIAS:
        sel = sel + tl.load(BIAS + cols, mask=cols < E, other=0.0).to(tl.float32)[None, :]
    sel = tl.where(mask, sel, float("-inf"))
    kcols = tl.arange(0, BLOCK_K)
    picked = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    chosen = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
    for i in tl.static_range(K):
        best = tl.argmax(sel, axis=1)  # first index among equal maxima
        hit = cols[None, :] == best[:, None]
        val = tl.sum(tl.where(hit, score, 0.0), axis=1)
        picked = tl.where(kcols[None, :] == i, val[:, None], picked)
        chosen = tl.where(kcols[None, :] == i, best.to(tl.int64)[:, None], chosen)
        sel = tl.where(hit, float("-inf"), sel)
    w = picked / tl.maximum(tl.sum(picked, axis=1), 1e-30)[:, None]
    kmask = row_mask[:, None] & (kcols[None, :] < K)
    out = rows.to(tl.int64)[:, None] * K + kcols[None, :]
    tl.store(W + out, w, mask=kmask)
    tl.store(IDX + out, chosen, mask=kmask)
    tl.store(PSUM + pid * E + cols, tl.sum(dist, axis=0), mask=cols < E)


@triton.jit
def _route_bwd(Z, IDX, W, DW, DPSUM, DZ, T, E,
               K: tl.constexpr, SIGMOID: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < T
    score, dist, mask = _route_scores(Z, rows, cols, row_mask, E, SIGMOID)
    # aux (load-balancing) part through prob_sum
    c = tl.load(DPSUM + cols, mask=cols < E, other=0.0).to(tl.float32)
    dist_c = tl.sum(dist * c[None, :], axis=1)
    if SIGMOID:
        total = tl.maximum(tl.sum(score, axis=1), 1e-30)
        dz = (c[None, :] - dist_c[:, None]) / total[:, None] * score * (1.0 - score)
    else:
        dz = dist * (c[None, :] - dist_c[:, None])
    # top-k part through the renormalised weights
    kbase = rows.to(tl.int64) * K
    wg = tl.zeros((BLOCK_T,), dtype=tl.float32)
    picked_sum = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for i in tl.static_range(K):
        w_i = tl.load(W + kbase + i, mask=row_mask, other=0.0).to(tl.float32)
        g_i = tl.load(DW + kbase + i, mask=row_mask, other=0.0).to(tl.float32)
        wg += w_i * g_i
        if SIGMOID:
            idx = tl.load(IDX + kbase + i, mask=row_mask, other=0)
            picked_sum += tl.sum(tl.where(cols[None, :] == idx[:, None], score, 0.0), axis=1)
    for i in tl.static_range(K):
        idx = tl.load(IDX + kbase + i, mask=row_mask, other=0)
        w_i = tl.load(W + kbase + i, mask=row_mask, other=0.0).to(tl.float32)
        g_i = tl.load(DW + kbase + i, mask=row_mask, other=0.0).to(tl.float32)
        hit = cols[None, :] == idx[:, None]
        if SIGMOID:
            coef = (g_i - wg) / tl.maximum(picked_sum, 1e-30)
            dz += tl.where(hit, coef[:, None] * score * (1.0 - score), 0.0)
        else:
            dz += tl.where(hit, (w_i * (g_i - wg))[:, None], 0.0)
    tl.store(DZ + rows.to(tl.int64)[:, None] * E + cols[None, :], dz.to(DZ.dtype.element_ty),
             mask=mask)


@triton.jit
def _gather_rows(SRC, FROM, DST, N, H, K, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    """DST[j] = SRC[FROM[j] // K] (permute: FROM = permuted_from, K = top_k)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    src_rows = (tl.load(FROM + rows, mask=row_mask, other=0) // K).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = row_mask[:, None] & (cols[None, :] < H)
        x = tl.load(SRC + src_rows[:, None] * H + cols[None, :], mask=mask, other=0.0)
        tl.store(DST + rows.to(tl.int64)[:, None] * H + cols[None, :], x, mask=mask)


@triton.jit
def _gather_sum(SRC, ROW_MAP, WEIGHT, DST, T, H, K: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """DST[t] = sum_i WEIGHT[t, i] * SRC[ROW_MAP[t, i]], summed in fp32."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    kbase = rows.to(tl.int64) * K
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = row_mask[:, None] & (cols[None, :] < H)
        acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for i in tl.static_range(K):
            src = tl.load(ROW_MAP + kbase + i, mask=row_mask, other=0).to(tl.int64)
            x = tl.load(SRC + src[:, None] * H + cols[None, :], mask=mask, other=0.0)
            x = x.to(tl.float32)
            if HAS_WEIGHT:
                w_i = tl.load(WEIGHT + kbase + i, mask=row_mask, other=0.0).to(tl.float32)
                x = x * w_i[:, None]
            acc += x
        tl.store(DST + rows.to(tl.int64)[:, None] * H + cols[None, :],
                 acc.to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _unpermute_bwd(DY, EXP, FROM, WEIGHT, DEXP, DWEIGHT, N, H, K,
                   BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    """For permuted row j holding copy f = FROM[j] of token f // K:
    DEXP[j] = WEIGHT[f] * DY[f // K];  DWEIGHT[f] = DY[f // K] . EXP[j]."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    f = tl.load(FROM + rows, mask=row_mask, other=0).to(tl.int64)
    w = tl.load(WEIGHT + f, mask=row_mask, other=0.0).to(tl.float32)
    tok = f // K
    dot = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = row_mask[:, None] & (cols[None, :] < H)
        dy = tl.load(DY + tok[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        off = rows.to(tl.int64)[:, None] * H + cols[None, :]
        e = tl.load(EXP + off, mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(dy * e, axis=1)
        tl.store(DEXP + off, (dy * w[:, None]).to(DEXP.dtype.element_ty), mask=mask)
    tl.store(DWEIGHT + f, dot, mask=row_mask)


def _row_config(n_rows: int, width: int) -> tuple[int, int, int]:
    block_h = _launch.next_pow2(width)
    if not _launch.interpreter_enabled():
        block_h = min(block_h, GPU_BLOCK_H)
    block_n = _launch.rows_per_block(block_h, n_rows)
    return block_n, block_h, _launch.num_warps(block_n * block_h)


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, sigmoid: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, e = logits.shape
    block_e = _launch.next_pow2(e)  # a token's whole expert row lives in one tile
    block_t = _launch.rows_per_block(block_e, t)
    warps = _launch.num_warps(block_t * block_e)
    grid = _launch.cdiv(t, block_t)
    weights = torch.empty(t, top_k, device=logits.device, dtype=torch.float32)
    experts = torch.empty(t, top_k, device=logits.device, dtype=torch.int64)
    psum = torch.empty(grid, e, device=logits.device, dtype=torch.float32)
    _route_fwd[(grid,)](logits, bias if bias is not None else logits, weights, experts, psum,
                        t, e, K=top_k, SIGMOID=sigmoid, HAS_BIAS=bias is not None,
                        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=_launch.next_pow2(top_k),
                        num_warps=warps)
    return weights, experts, psum.sum(0)


def route_backward(dweights: torch.Tensor, dprob_sum: torch.Tensor, logits: torch.Tensor,
                   experts: torch.Tensor, weights: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    t, e = logits.shape
    block_e = _launch.next_pow2(e)
    block_t = _launch.rows_per_block(block_e, t)
    dz = torch.empty_like(logits)
    _route_bwd[(_launch.cdiv(t, block_t),)](logits, experts, weights, dweights, dprob_sum, dz,
                                            t, e, K=experts.shape[1], SIGMOID=sigmoid,
                                            BLOCK_T=block_t, BLOCK_E=block_e,
                                            num_warps=_launch.num_warps(block_t * block_e))
    return dz


def gather_rows(src: torch.Tensor, permuted_from: torch.Tensor, top_k: int) -> torch.Tensor:
    n, h = permuted_from.shape[0], src.shape[1]
    dst = torch.empty(n, h, device=src.device, dtype=src.dtype)
    block_n, block_h, warps = _row_config(n, h)
    _gather_rows[(_launch.cdiv(n, block_n),)](src, permuted_from, dst, n, h, top_k,
                                              BLOCK_N=block_n, BLOCK_H=block_h, num_warps=warps)
    return dst


def gather_sum(src: torch.Tensor, row_map: torch.Tensor, weight: torch.Tensor | None
               ) -> torch.Tensor:
    (t, k), h = row_map.shape, src.shape[1]
    dst = torch.empty(t, h, device=src.device, dtype=src.dtype)
    block_t, block_h, warps = _row_config(t, h)
    _gather_sum[(_launch.cdiv(t, block_t),)](src, row_map, weight if weight is not None else src,
                                             dst, t, h, K=k, HAS_WEIGHT=weight is not None,
                                             BLOCK_T=block_t, BLOCK_H=block_h, num_warps=warps)
    return dst


def unpermute_backward(dy: torch.Tensor, expert_out: torch.Tensor, permuted_from: torch.Tensor,
                       weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, h = expert_out.shape
    k = weights.shape[1]
    dexp = torch.empty_like(expert_out)
    dweights = torch.empty(weights.shape, device=weights.device, dtype=torch.float32)
    block_n, block_h, warps = _row_config(n, h)
    _unpermute_bwd[(_launch.cdiv(n, block_n),)](dy, expert_out, permuted_from, weights, dexp,
                                                dweights, n, h, k, BLOCK_N=block_n,
                                                BLOCK_H=block_h, num_warps=warps)
    return dexp, dweights.to(weights.dtype)
