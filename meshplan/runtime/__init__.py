"""The parallelization engine: turn a `Plan` (meshplan.ir.plan) into sharded modules on
PyTorch's distributed engine. `parallelize(model, plan, options)` is a recipe (parallel.py) over
the run-time modes (`ParallelOptions`, options.py) and the plan's degrees and meshes
(`ParallelDims`, dims.py), one step per technique (steps.py) in a fixed order: pipeline split (pipeline.py), fused kernels (fused.py), tensor /
sequence parallelism (tensor_parallel.py), context parallelism (context_parallel.py), expert
parallelism (expert_parallel.py), FP8 (fp8.py), activation recompute (recompute.py), FSDP2 / DDP
(fsdp.py), deferred initialisation (materialize.py), then the pipeline schedule.

It reads only the Plan types, never the planner. The training application that drives it (loop,
data, checkpoints, launch, metrics) is meshplan.train.

Modules are imported on first use; ``import meshplan.runtime`` itself pulls in nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "parallelize": ("meshplan.runtime.parallel", "parallelize"),
    "ParallelModel": ("meshplan.runtime.parallel", "ParallelModel"),
    "ParallelOptions": ("meshplan.runtime.options", "ParallelOptions"),
    "ParallelDims": ("meshplan.runtime.dims", "ParallelDims"),
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'meshplan.runtime' has no attribute {name!r}")
