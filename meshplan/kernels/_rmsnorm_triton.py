"""Triton kernels for RMSNorm, optionally fused with the residual add. Imported lazily."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshplan.kernels import _launch


@triton.jit
def _rmsnorm_fwd(X, R, W, Y, H, RSTD, M, N, eps,
                 HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Round the sum to the storage dtype before normalising, as the unfused add would.
        x = (x.to(tl.float32) + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(H + offs, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)  # (BLOCK_M,)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rows < M)


@triton.jit
def _rmsnorm_bwd(DY, DH, X, W, RSTD, DX, DW_PARTIAL, M, N, rows_per_program,
                 HAS_DH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Each program walks rows [start, end) in tiles and keeps its share of dw in registers,
    # so dw needs no atomics: the partial sums are added up afterwards (deterministic).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, M)
    for row0 in range(start, end, BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        xhat = x * rstd[:, None]
        wdy = w[None, :] * dy
        # d/dx of x*rstd*w: rstd * (w*dy - xhat * mean(xhat * w * dy))
        c = tl.sum(xhat * wdy, axis=1) / N
        dx = (wdy - xhat * c[:, None]) * rstd[:, None]
        if HAS_DH:
            dx += tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=col_mask)


def _config(m: int, n: int) -> tuple[int, int, int]:
    block_n = _launch.next_pow2(n)
    block_m = _launch.rows_per_block(block_n, m)
    return block_m, block_n, _launch.num_warps(block_m * block_n)


def forward(x2d: torch.Tensor, residual2d: torch.Tensor | None, weight: torch.Tensor, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    m, n = x2d.shape
    y = torch.empty_like(x2d)
    h = torch.empty_like(x2d) if residual2d is not None else None
    rstd = torch.empty(m, device=x2d.device, dtype=torch.float32)
    block_m, block_n, warps = _config(m, n)
    grid = (_launch.cdiv(m, block_m),)
    _rmsnorm_fwd[grid](x2d, residual2d if residual2d is not None else x2d, weight, y,
                       h if h is not None else y, rstd, m, n, eps,
                       HAS_RESIDUAL=residual2d is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                       num_warps=warps)
    return y, h, rstd


def backward(dy2d: torch.Tensor, dh2d: torch.Tensor | None, x2d: torch.Tensor,
             weight: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x2d.shape
    dx = torch.empty_like(x2d)
    block_m, block_n, warps = _config(m, n)
    programs = _launch.reduction_programs(x2d.device, _launch.cdiv(m, block_m))
    rows_per_program = _launch.cdiv(m, programs)
    dw_partial = torch.empty(programs, n, device=x2d.device, dtype=torch.float32)
    _rmsnorm_bwd[(programs,)](dy2d, dh2d if dh2d is not None else dy2d, x2d, weight, rstd, dx,
                              dw_partial, m, n, rows_per_program, HAS_DH=dh2d is not None,
                              BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return dx, dw_partial.sum(0).to(weight.dtype)
