"""meshplan: auto-parallel planner and compiler for PyTorch training.

    import meshplan as mp
    cluster = mp.Cluster.preset("dgx-h100", nodes=8)
    model = mp.models.build("llama3-70b", device="meta")
    est = mp.estimate(model, cluster, layout={"tp": 8, "pp": 4, "dp": 2}, seq_len=8192, global_batch=512)

Heavy parts (torch, the tracer, the runtime) are imported lazily on first use, so importing
meshplan for planning stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> (module, attribute); resolved on first access
_LAZY = {
    "Cluster": ("meshplan.cluster", "Cluster"),
    "GPUSpec": ("meshplan.cluster", "GPUSpec"),
    "Layout": ("meshplan.ir.layout", "Layout"),
    "Estimate": ("meshplan.ir.estimate", "Estimate"),
    "ModelProfile": ("meshplan.ir.profile", "ModelProfile"),
    "estimate": ("meshplan.api", "estimate"),
    "plan": ("meshplan.api", "plan"),
    "Plan": ("meshplan.api", "Plan"),
    "profile": ("meshplan.api", "profile"),
    "whatif": ("meshplan.reports.whatif", "whatif"),
    "trace": ("meshplan.profiling.trace", "trace"),
    "profile_from_config": ("meshplan.profiling.analytic", "profile_from_config"),
    "MeshplanError": ("meshplan.errors", "MeshplanError"),
    "parallelize": ("meshplan.runtime.parallel", "parallelize"),
    "ParallelModel": ("meshplan.runtime.parallel", "ParallelModel"),
}
_SUBMODULES = ("ir", "models", "cluster", "errors", "profiling", "planner", "cost_models", "kernels", "export", "runtime",
               "train", "reports")

__all__ = sorted(list(_LAZY) + list(_SUBMODULES))

if TYPE_CHECKING:  # pragma: no cover
    from meshplan.api import estimate, plan, profile
    from meshplan.api import Plan
    from meshplan.cluster import Cluster, GPUSpec
    from meshplan.ir.estimate import Estimate
    from meshplan.ir.layout import Layout


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(mod), attr)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        value = importlib.import_module(f"meshplan.{name}")
        globals()[name] = value
        return value
    raise AttributeError(f"module 'meshplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
