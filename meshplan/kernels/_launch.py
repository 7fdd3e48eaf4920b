"""Launch configuration shared by the Triton kernels (fixed under the interpreter).

The interpreter costs ~1.3-3 ms per program instance whatever its size
(shared/reference/cpu_platform.md §7), so under TRITON_INTERPRET=1 each program takes a large
multi-row tile; on a GPU a tile of a few thousand elements keeps registers in check.
`@triton.autotune` does not run under the interpreter, so every config here is fixed.
"""

from __future__ import annotations

import torch

from meshplan.kernels.selection import interpreter_enabled

# Elements in one program's 2-D tile. GPU: 8192 fp32 values over 8 warps = 32 registers per
# thread per live tile, the budget Triton's own layer-norm tutorial works within. Interpreter:
# big tiles, because per-program overhead dominates there.
GPU_TILE_ELEMENTS = 8192
INTERPRETER_TILE_ELEMENTS = 1 << 16
# Persistent reductions (dw partial sums) use this many programs per SM on a GPU.
PROGRAMS_PER_SM = 2
INTERPRETER_REDUCTION_PROGRAMS = 2


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rows_per_block(n_cols_pow2: int, n_rows: int) -> int:
    """Rows in one tile of width n_cols_pow2 (a power of two)."""
    budget = INTERPRETER_TILE_ELEMENTS if interpreter_enabled() else GPU_TILE_ELEMENTS
    rows = max(1, budget // n_cols_pow2)
    return min(next_pow2(rows), next_pow2(max(n_rows, 1)))


def num_warps(tile_elements: int) -> int:
    # One warp per 256 fp32 elements, within Triton's 1..16 range (its tutorials' rule of thumb).
    return max(1, min(16, next_pow2(cdiv(tile_elements, 256))))


def reduction_programs(device: torch.device, n_blocks: int) -> int:
    """Programs for a kernel that also reduces across rows (partial sums per program)."""
    if interpreter_enabled() or device.type != "cuda":
        return max(1, min(n_blocks, INTERPRETER_REDUCTION_PROGRAMS))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_blocks, PROGRAMS_PER_SM * sms))
