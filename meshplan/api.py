"""Public entry points that take user-level objects (an nn.Module, a preset name, a cluster)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping, Sequence

from meshplan.cluster import Cluster
from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.context import for_stack
from meshplan.errors import ConfigError, quiet_imports
from meshplan.ir import plan as ir_plan
from meshplan.ir.estimate import Estimate
from meshplan.ir.layout import Layout
from meshplan.ir.precision import Precision
from meshplan.ir.profile import ModelProfile
from meshplan.ir.stack import Stack, resolve_stack
from meshplan.planner.explain import explain as _explain
from meshplan.planner.policy import plan_profile, resolve_precision
from meshplan.profiling.analytic import profile_from_config
import meshplan.export as _export

__all__ = ["Plan", "estimate", "plan", "profile", "resolve_cluster"]


class Plan(ir_plan.Plan):
    """The Plan as users hold it: the planner/runtime contract (meshplan.ir.plan.Plan, which is
    all the runtime reads) plus the planner's explanation and the exports to other frameworks."""

    @classmethod
    def of(cls, plan: ir_plan.Plan) -> "Plan":
        if isinstance(plan, cls):
            return plan
        return cls(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)})

    def explain(self) -> str:
        """Why this layout: what limits it, the runner-ups and why each lost."""
        return _explain(self)

    # ---- exports to other frameworks (meshplan/export/, docs/exports.md) ------
    def to_megatron_args(self, model=None) -> list[str]:
        """Megatron-LM flags; `model` (preset name, ModelConfig, ModelProfile) adds the shape flags."""
        return _export.to_megatron_args(self, model)

    def to_torchtitan(self, model=None) -> dict[str, Any]:
        """torchtitan (v0.2.2 TOML) job config sections as a nested dict."""
        return _export.to_torchtitan(self, model)

    def to_nemo(self, model=None, *, flavor: str = "nemo") -> dict[str, Any]:
        """NeMo 2 (or flavor='megatron-bridge') recipe overrides, dotted key -> value."""
        return _export.to_nemo(self, model, flavor=flavor)

# The cost model needs the architecture, not long sequences: profiles are traced at a short
# sequence (shapes scale linearly in tokens, attention is recomputed for the real seq_len).
TRACE_SEQ_LEN = 128


def profile(model: Any, *, seq_len: int = TRACE_SEQ_LEN, **trace_kwargs) -> ModelProfile:
    """A `ModelProfile` for an nn.Module (traced on meta/fake tensors), a preset name, a config
    mapping, or a profile (returned as is)."""
    if isinstance(model, ModelProfile):
        return model
    if isinstance(model, Mapping):
        return profile_from_config(model, seq_len=seq_len)
    if isinstance(model, str):
        model = load_model(model)
    from meshplan.profiling.trace import (
        trace,  # torch-heavy: only when a module must be traced
    )
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
        # transformers imports torchao (its quantizers) on first use where it is installed
        with torch.device(device), quiet_imports():
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
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, str):
        return Cluster.preset(cluster)
    raise ConfigError(f"cluster must be a meshplan.Cluster or a preset name, not {type(cluster).__name__}; "
                      "e.g. meshplan.Cluster.preset('dgx-h100', nodes=4)")


def estimate(model: Any, cluster: Any, layout: Layout | Mapping[str, Any] | None = None, *, seq_len: int,
             global_batch: int, precision: Precision | str = Precision.BF16,
             stack: Stack | str | None = None) -> Estimate:
    """Score one layout: predicted step time, throughput, MFU and per-GPU memory.

    model: an nn.Module (any device, usually meta), a preset name ("llama3-70b"), a config
    mapping, or a ModelProfile. layout: a Layout or a dict with keys tp, cp, ep, etp, pp, vp, dp,
    zero, mbs, recompute, schedule (missing keys default; dp defaults to what fills the cluster).
    stack: the software that runs it, a preset name (meshplan.ir.stack.STACKS: "meshplan",
    "torchtitan", "megatron-core", ...) or a Stack; None prices the stack-neutral "reference"
    baseline (FlashAttention-2-class attention, fused element-wise kernels, the layout's flags).
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
    st = resolve_stack(stack, default="reference")
    prof = for_stack(profile(model, seq_len=seq_len), st)
    return estimate_profile(prof, cl, layout, seq_len=seq_len, global_batch=global_batch, precision=precision,
                            stack=st)


def plan(model: Any, cluster: Any, *, seq_len: int, global_batch: int, precision: Precision | str = Precision.BF16,
         fixed: Mapping[str, Any] | None = None, top_k: int = 5, allow_cross_domain: bool = False,
         fused_kernels: bool = True, stack: Stack | str | None = None, fp8_force_in: Sequence[str] = (),
         fp8_force_out: Sequence[str] = (), for_runtime: bool | None = None, optimizer: str | None = None):
    """Find the fastest layout that fits: returns a `Plan` (see `Plan.explain()`).

    stack: the software that will run the plan (meshplan.ir.stack): "meshplan" (default: meshplan's
    runtime; only layouts it runs, meshplan.ir.support), "torchtitan", "megatron-core" (Megatron-LM,
    NeMo 2, Megatron-Bridge), ... The search offers only what the stack runs (its recompute policies,
    schedules, FP8 recipes) and prices each layout as that stack runs it (attention kernel, fusion,
    TP overlap, context-parallel implementation, gradient accumulation). `for_runtime` is the older
    spelling: True is stack="meshplan", False stack="megatron-core".

    precision: a Precision (meshplan.ir.precision) or its name, "bf16", "fp16", "fp8", "fp32", or
    "auto" (bf16 and fp8 are both tried where the GPU has FP8 units), the names `meshplan train
    --precision` takes. "fp8" on a device without FP8 units (local-cpu) gives an emulated FP8 plan
    with a warning: BF16 costs, the FP8 module set the placement ILP would choose on an FP8 GPU of
    the same BF16 rate (torchao runs it on CPU).
    "fp32" is planned with BF16 costs (warned) and trained in fp32.
    fixed: constrain any layout key, e.g. {"tp": 8, "recompute": "full"}; {"optimizer_dtype": "bf16"}
    keeps Adam's moments in bf16 (fp32 master weights; 8 instead of 12 optimizer bytes/param).
    optimizer: "adamw" (default) or "muon" (the same as fixed={"optimizer": ...}): Muon for the
    hidden matrices, priced with its state, step buffers and owner exchange (cost_models/muon.py).
    fused_kernels: list the modules meshplan's fused kernels replace (Plan.fused_kernels; found
    from the traced graph) and cost them fused; False keeps every module eager and costs it so.
    fp8_force_in / fp8_force_out: linears (FQNs or glob patterns, e.g. "layers.0.*") the FP8 placement
    overrides its defaults for (it keeps the first and last block, the output layer and routers in
    BF16); the search prices FP8 layouts with the same set, so e.g. fp8_force_in=("layers.*",) plans
    for a stack that runs every transformer layer in FP8, as estimate(precision="fp8") prices it.
    """
    if for_runtime is not None:
        warnings.warn("plan(for_runtime=...) is deprecated: pass stack='meshplan' (the runtime) or the stack "
                      "that will run the plan, e.g. stack='megatron-core'", DeprecationWarning, stacklevel=2)
        stack = stack or ("meshplan" if for_runtime else "megatron-core")
    stack = resolve_stack(stack)
    cl = resolve_cluster(cluster)
    prec = resolve_precision(precision, cl)     # before tracing: a bad precision fails fast
    fixed = dict(fixed or {})
    if optimizer is not None:
        if fixed.get("optimizer", optimizer) != optimizer:
            raise ConfigError(f"optimizer={optimizer!r} but fixed={{'optimizer': {fixed['optimizer']!r}}}: give one")
        fixed["optimizer"] = optimizer
    prof = profile(model, seq_len=seq_len)
    out = plan_profile(prof, cl, seq_len=seq_len, global_batch=global_batch, precision=prec, stack=stack,
                       fixed=fixed, top_k=top_k, allow_cross_domain=allow_cross_domain, fused_kernels=fused_kernels,
                       fp8_force_in=fp8_force_in, fp8_force_out=fp8_force_out,
                       module=model if hasattr(model, "named_modules") else None)
    if isinstance(model, str):
        out = dataclasses.replace(out, model_source=model)
    return Plan.of(out)
