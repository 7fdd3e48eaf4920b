"""Triton kernels for SwiGLU, silu(gate) * up. Imported lazily.

gate/up may be strided views of one (M, 2F) projection output (row stride 2F), so the packed
form needs no split copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshplan.kernels import _launch

GPU_MAX_BLOCK_F = 1024  # columns per tile on a GPU; rows fill the rest of the tile budget


@triton.jit
def _swiglu_fwd(G, U, O, M, F, sg, su, so, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows[:, None] < M) & (cols[None, :] < F)
    r64 = rows[:, None].to(tl.int64)
    g = tl.load(G + r64 * sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + r64 * su + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = g * tl.sigmoid(g) * u
    tl.store(O + r64 * so + cols[None, :], out.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(DO, G, U, DG, DU, M, F, sdo, sg, su, sdg, sdu,
                BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows[:, None] < M) & (cols[None, :] < F)
    r64 = rows[:, None].to(tl.int64)
    do = tl.load(DO + r64 * sdo + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + r64 * sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + r64 * su + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu(g)/dg = sig * (1 + g * (1 - sig))
    dg = do * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(DG + r64 * sdg + cols[None, :], dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + r64 * sdu + cols[None, :], (do * silu).to(DU.dtype.element_ty), mask=mask)


def _config(m: int, f: int) -> tuple[int, int, int]:
    block_f = _launch.next_pow2(f)
    if not _launch.interpreter_enabled():
        block_f = min(block_f, GPU_MAX_BLOCK_F)
    block_m = _launch.rows_per_block(block_f, m)
    return block_m, block_f, _launch.num_warps(block_m * block_f)


def forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: (M, F) with unit column stride; returns a new (M, F) tensor."""
    m, f = gate.shape
    out = torch.empty((m, f), device=gate.device, dtype=gate.dtype)
    block_m, block_f, warps = _config(m, f)
    grid = (_launch.cdiv(m, block_m), _launch.cdiv(f, block_f))
    _swiglu_fwd[grid](gate, up, out, m, f, gate.stride(0), up.stride(0), out.stride(0),
                      BLOCK_M=block_m, BLOCK_F=block_f, num_warps=warps)
    return out


def backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
             dgate: torch.Tensor, dup: torch.Tensor) -> None:
    """Writes into dgate, dup (views of one buffer in the packed case)."""
    m, f = gate.shape
    block_m, block_f, warps = _config(m, f)
    grid = (_launch.cdiv(m, block_m), _launch.cdiv(f, block_f))
    _swiglu_bwd[grid](dout, gate, up, dgate, dup, m, f, dout.stride(0), gate.stride(0),
                      up.stride(0), dgate.stride(0), dup.stride(0),
                      BLOCK_M=block_m, BLOCK_F=block_f, num_warps=warps)
