"""torch.compile of the transformer blocks (`parallelize(..., compile=...)`).

Each block the stage owns is compiled in place (`nn.Module.compile`), after TP / CP / EP / FP8 /
recompute have rewritten it and before FSDP wraps it, the order torchtitan uses: FQNs, hooks,
checkpoints and FSDP units are unchanged, and the compiled region is one block, so identical
blocks share one compiled graph (parameters are graph inputs) and pipeline stages compile only
what they hold. Inductor fuses the element-wise work around the matmuls (norms, rotary, SwiGLU,
residual adds, FP8 casts) that eager runs as separate kernels.

Why "auto" compiles on CUDA only: on one H100 a 1.2B Llama step took 0.196 s eager and 0.157 s
compiled (benchmarks/results/gpu_suite-2026-11-24-nvidia-h100-80gb-hbm3-fp8-runtime.md), and torchao's FP8
needs compile to be faster than BF16 at all (0.140 s compiled FP8 vs 0.365 s eager FP8). On CPU
inductor spends tens of seconds compiling each distinct block for small or no gains at the
model sizes CPU runs, so "auto" leaves CPU eager; True forces it (the tests do).
"""

from __future__ import annotations

from torch import nn

from meshplan.errors import ConfigError

__all__ = ["compile_wanted", "compile_blocks"]


# Zero-bubble schedules split each stage's backward into input- and weight-gradient passes over
# the autograd graph; a compiled block's backward is one opaque node computing both (torchtitan
# does not combine them either), so "auto" leaves those plans eager
SPLIT_BACKWARD_SCHEDULES = ("zb", "zbv")


def compile_wanted(mode, device_type: str, schedule: str = "1f1b", pp: int = 1) -> bool:
    """`mode`: "auto" (CUDA only, not with a zero-bubble pipeline schedule), True or False."""
    if mode == "auto":
        return device_type == "cuda" and not (pp > 1 and schedule in SPLIT_BACKWARD_SCHEDULES)
    if isinstance(mode, bool):
        return mode
    raise ConfigError(f"compile={mode!r}: use 'auto' (compile on CUDA), True or False")


def compile_blocks(stage: nn.Module, blocks: list[str]) -> list[str]:
    """Compile each block of `stage` in place; returns the FQNs compiled."""
    for fqn in blocks:
        stage.get_submodule(fqn).compile()
    return list(blocks)
