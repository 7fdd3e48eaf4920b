"""The runtime: turn a `Plan` into sharded modules on PyTorch's distributed engine, feed them
data, train, checkpoint, and launch the processes (torchrun locally, Slurm on clusters).

Modules are imported on first use; ``import meshplan.runtime`` itself pulls in nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "parallelize": ("meshplan.runtime.parallel", "parallelize"),
    "ParallelModel": ("meshplan.runtime.parallel", "ParallelModel"),
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'meshplan.runtime' has no attribute {name!r}")
