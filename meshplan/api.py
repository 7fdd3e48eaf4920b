"""Public entry points that take user-level objects (an nn.Module, a preset name, a cluster)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from meshplan.cost_models.estimate import Estimate, estimate_profile
from meshplan.cost_models.layout import Layout
from meshplan.errors import ConfigError
from meshplan.planner.profile import ModelProfile

__all__ = ["estimate", "profile", "resolve_cluster"]

# The cost model needs the architecture, not long sequences: profiles are traced at a short
# sequence (shapes scale linearly in tokens, attention is recomputed for the real seq_len).
TRACE_SEQ_LEN = 128


def profile(model: Any, *, seq_len: int = TRACE_SEQ_LEN, **trace_kwargs) -> ModelProfile:
    """A `ModelProfile` for an nn.Module (traced on meta/fake tensors), a preset name, a config
    mapping, or a profile (returned as is)."""
    if isinstance(model, ModelProfile):
        return model
    if isinstance(model, Mapping):
        from meshplan.planner.analytic import profile_from_config
        return profile_from_config(model, seq_len=seq_len)
    if isinstance(model, str):
        model = load_model(model)
    from meshplan.planner.trace import trace   # torch-heavy: only when a module must be traced
    return trace(model, seq_len=min(seq_len, TRACE_SEQ_LEN), **trace_kwargs)


def load_model(spec: str, *, device: str = "meta", **config):
    """An nn.Module from a preset name, `path/to/file.py:factory` (a function returning an
    nn.Module; it is called under `device`) or a transformers config JSON. On the meta device by
    default (planning); `device="cpu"` builds real weights (training: the same seed on every rank
    gives the same weights). `config` overrides preset config names (e.g. seq_len)."""
    import os
    if spec.endswith(".json"):
        if not os.path.exists(spec):
            raise ConfigError(f"model config file {spec!r} does not exist")
        import json

        import torch
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError:
            raise ConfigError("a transformers config JSON needs the transformers package: pip install transformers") from None
        data = json.loads(open(spec).read())
        if "model_type" not in data:
            raise ConfigError(f"{spec}: not a transformers config (no 'model_type' key)")
        cfg = AutoConfig.for_model(**data)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(cfg)
    if ".py:" in spec:
        import importlib.util

        import torch
        path, _, factory = spec.rpartition(":")
        if not os.path.exists(path):
            raise ConfigError(f"model file {path!r} does not exist")
        mod_spec = importlib.util.spec_from_file_location("meshplan_user_model", path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
        fn = getattr(mod, factory, None)
        if fn is None or not callable(fn):
            raise ConfigError(f"{path} has no function {factory!r}; expected path/to/file.py:factory where "
                              "factory() returns an nn.Module")
        with torch.device(device):
            model = fn()
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"{spec} returned {type(model).__name__}, not an nn.Module")
        return model
    from meshplan import models
    model = models.build(spec, device=device, **config)
    if device != "meta" and hasattr(model, "init_weights"):
        model.init_weights()
    return model


def resolve_cluster(cluster: Any):
    from meshplan.cluster import Cluster
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, str):
        return Cluster.preset(cluster)
    raise ConfigError(f"cluster must be a meshplan.Cluster or a preset name, not {type(cluster).__name__}; "
                      "e.g. meshplan.Cluster.preset('dgx-h100', nodes=4)")


def estimate(model: Any, cluster: Any, layout: Layout | Mapping[str, Any] | None = None, *, seq_len: int,
             global_batch: int, precision: str = "bf16") -> Estimate:
    """Score one layout: predicted step time, throughput, MFU and per-GPU memory.

    model: an nn.Module (any device, usually meta), a preset name ("llama3-70b"), a config
    mapping, or a ModelProfile. layout: a Layout or a dict with keys tp, cp, ep, etp, pp, vp, dp,
    zero, mbs, recompute, schedule (missing keys default; dp defaults to what fills the cluster).
    """
    cl = resolve_cluster(cluster)
    if layout is None:
        layout = {}
    if not isinstance(layout, Layout):
        layout = dict(layout)
        if "dp" not in layout:
            rest = layout.get("tp", 1) * layout.get("cp", 1) * layout.get("pp", 1)
            if cl.num_gpus % rest == 0:
                layout["dp"] = cl.num_gpus // rest
        layout = Layout.from_dict(layout)
    prof = profile(model, seq_len=seq_len)
    return estimate_profile(prof, cl, layout, seq_len=seq_len, global_batch=global_batch, precision=precision)


def plan(model: Any, cluster: Any, *, seq_len: int, global_batch: int, precision: str = "bf16",
         fixed: Mapping[str, Any] | None = None, top_k: int = 5, allow_cross_domain: bool = False,
         fused_kernels: bool = True):
    """Find the fastest layout that fits: returns a `Plan` (see `Plan.explain()`).

    precision: "bf16", "fp8" or "auto" (both are tried where the GPU has FP8 units).
    fixed: constrain any layout key, e.g. {"tp": 8, "recompute": "full"}.
    fused_kernels: list the modules meshplan's fused kernels replace (Plan.fused_kernels; found
    from the traced graph) and cost them fused; False keeps every module eager and costs it so.
    """
    from meshplan.planner.build import build_plan
    from meshplan.planner.search import search
    cl = resolve_cluster(cluster)
    if precision == "auto":
        precisions = ("bf16", "fp8") if cl.gpu.fp8_tflops else ("bf16",)
    elif precision in ("bf16", "fp16", "fp8"):
        if precision == "fp8" and not cl.gpu.fp8_tflops:
            raise ConfigError(f"{cl.gpu.name} has no FP8 matrix units; use precision='bf16'")
        precisions = (precision,)
    else:
        raise ConfigError(f"precision {precision!r}: use 'bf16', 'fp8' or 'auto'")
    prof = profile(model, seq_len=seq_len)
    if not fused_kernels:
        prof = dataclasses.replace(prof, fusions=tuple((name, False) for name, _ in prof.fusions))
    res = search(prof, cl, seq_len=seq_len, global_batch=global_batch, precisions=precisions,
                 fixed=fixed, allow_cross_domain=allow_cross_domain)
    return build_plan(prof, cl, res, seq_len=seq_len, global_batch=global_batch, top_k=top_k, fixed=fixed)
