"""FP8 linears from the Plan: exactly the modules in `Plan.fp8_modules` run their GEMMs in FP8.

Step "FP8" of `parallelize` (after TP/SP, CP and EP, before recompute and FSDP). Two backends,
both imported lazily (neither is a core dependency):

| backend  | package (extra)                     | where        | recipe                                       |
|----------|-------------------------------------|--------------|----------------------------------------------|
| torchao  | torchao (`pip install meshplan[fp8]`) | CPU and GPU | "tensorwise" (per-tensor current scaling, default) or "rowwise" |
| te       | transformer-engine (`meshplan[gpu]`) | NVIDIA GPUs  | "tensorwise" = Float8CurrentScaling, "delayed" = DelayedScaling |

On CPU, torchao's `Float8Linear` runs in its emulation mode: the operands are quantised to FP8
with the same per-tensor (or per-row) scales and rounding as on an H100, then dequantised and
multiplied by an fp32 GEMM. That is the arithmetic of `torch._scaled_mm` (FP8 products, fp32
accumulation) at the fp32 GEMM rate; CPU `torch._scaled_mm` itself runs ~0.05 GFLOP/s, over 100x
slower than BF16. So the placement and its numerics are tested in CI at a CPU's normal speed. Under FSDP2 it can all-gather weights in FP8 (`fsdp_float8_all_gather`, the
default when the plan shards weights: zero=3, for weights TP has not sharded); this runs over
gloo too (tests/runtime/test_fp8.py).

The swap keeps the module object's forward hooks (TP's input/output redistributions were
registered on the nn.Linear by `parallelize_module`) and its parameters (already DTensors under TP),
so it works after TP as the fixed order wants.

Transformer Engine: `te.pytorch.Linear` with the plan's weights copied in, run inside
`te.pytorch.fp8_autocast(recipe)` around each swapped module's forward. It needs CUDA; selected
by `backend="te"` (or "auto" on a CUDA device where TE imports, for tp == 1 and a TE recipe). It is
not combined with DTensor TP here: "auto" picks torchao under tp > 1, and an explicit "te" is
refused there, naming torchao as the backend that works.

`module_precisions` reports what each parameterised module actually computes in, so a plan's
precision is never silently changed: parallelize() logs one line per kind and `meshplan train`
writes the full list to its run directory.
"""

from __future__ import annotations

import importlib.util
from typing import Iterable

import torch
from torch import nn

from meshplan.errors import ConfigError, quiet_imports
from meshplan.ir.precision import Precision

__all__ = ["BACKENDS", "RECIPES", "backend_available", "resolve_backend", "apply_fp8", "module_precisions",
           "precision_summary", "log_precisions", "merge", "Fp8Swap"]

BACKENDS = ("auto", "torchao", "te")
RECIPES = ("tensorwise", "rowwise", "delayed")
_PACKAGES = {"torchao": ("torchao", "pip install 'meshplan[fp8]' (torchao>=0.10)"),
             "te": ("transformer_engine", "pip install 'meshplan[gpu]' (transformer-engine[pytorch])")}


def backend_available(backend: str) -> bool:
    mod, _ = _PACKAGES[backend]
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def _te_runs(device: torch.device, tp: int, recipe: str | None) -> bool:
    """Whether the Transformer Engine backend can run this layout: CUDA, no DTensor tensor
    parallelism (its te.Linear is not a DTensor module), and a recipe it has ("rowwise" is
    torchao's)."""
    return device.type == "cuda" and tp == 1 and recipe in (None, "tensorwise", "delayed")


def resolve_backend(backend: str, device: torch.device, *, tp: int = 1, recipe: str | None = None) -> str:
    """The backend that will run: "auto" is Transformer Engine where installed and able to run the
    layout (CUDA, tp == 1, its recipes), else torchao. Raises ConfigError naming the package to
    install when the chosen one is missing."""
    if backend not in BACKENDS:
        raise ConfigError(f"fp8 backend {backend!r}: use one of {BACKENDS}")
    if backend == "auto":
        # TE is preferred where it runs, but apply_fp8 refuses it under tp > 1 and has no rowwise
        # scaling: "auto" must not pick a backend that then refuses the plan it was asked to run
        if backend_available("te") and _te_runs(device, tp, recipe):
            return "te"
        backend = "torchao"
    if backend == "te" and device.type != "cuda":
        raise ConfigError("the Transformer Engine FP8 backend needs CUDA GPUs; on CPU use fp8_backend='torchao' "
                          "(emulated FP8) or --precision bf16")
    if not backend_available(backend):
        pkg, how = _PACKAGES[backend]
        raise ConfigError(f"this plan runs {'' if backend == 'torchao' else 'Transformer Engine '}FP8 linears, "
                          f"but the {pkg} package is not installed: {how}; or pass --precision bf16 "
                          "(compute_dtype=torch.bfloat16) to train this plan in BF16 on purpose")
    return backend


class Fp8Swap:
    """What `apply_fp8` did: the swapped FQNs and the backend/recipe that runs them."""

    def __init__(self, modules: list[str], backend: str, recipe: str) -> None:
        self.modules, self.backend, self.recipe = modules, backend, recipe

    def __repr__(self) -> str:
        return f"Fp8Swap({len(self.modules)} modules, backend={self.backend!r}, recipe={self.recipe!r})"


def _copy_hooks(old: nn.Module, new: nn.Module) -> None:
    # TP's ColwiseParallel/RowwiseParallel redistribute inputs/outputs in hooks on the module itself
    for attr in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                 "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
                 "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks"):
        if hasattr(old, attr):
            getattr(new, attr).update(getattr(old, attr))


def _set_submodule(root: nn.Module, fqn: str, module: nn.Module) -> None:
    parent, _, leaf = fqn.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def _torchao_config(recipe: str, fsdp_float8_all_gather: bool, emulate: bool):
    import dataclasses

    with quiet_imports():
        from torchao.float8 import Float8LinearConfig
    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather,
                                  emulate=emulate)
    if recipe == "rowwise":
        # rowwise scales are per row: no FP8 all-gather of the weight (torchao supports it only tensorwise)
        return dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=emulate)
    raise ConfigError(f"recipe {recipe!r} is not a torchao float8 recipe; use 'tensorwise' or 'rowwise' "
                      "('delayed' is Transformer Engine's)")


def _swap_torchao(stage: nn.Module, fqns: list[str], recipe: str, fsdp_float8_all_gather: bool,
                  emulate: bool) -> None:
    from torch.distributed.tensor import DTensor
    with quiet_imports():
        from torchao.float8.float8_linear import Float8Linear
    for fqn in fqns:
        old = stage.get_submodule(fqn)
        sharded = isinstance(old.weight, DTensor)
        # torchao's FP8 all-gather wrapper wraps plain tensors; a TP-sharded weight (DTensor)
        # is all-gathered by FSDP in BF16 (the GEMMs still run in FP8)
        cfg = _torchao_config(recipe, fsdp_float8_all_gather and not sharded, emulate)
        new = Float8Linear.from_float(old, config=cfg)
        _copy_hooks(old, new)
        new.train(old.training)
        _set_submodule(stage, fqn, new)


def _swap_te(stage: nn.Module, fqns: list[str], recipe: str) -> None:
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipe
    if recipe == "delayed":
        rec = te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID)
    elif recipe == "tensorwise":
        rec = te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID)
    else:
        raise ConfigError(f"recipe {recipe!r} is not a Transformer Engine recipe here; use 'tensorwise' "
                          "(per-tensor current scaling) or 'delayed'")
    for fqn in fqns:
        old = stage.get_submodule(fqn)
        new = te.Linear(old.in_features, old.out_features, bias=old.bias is not None,
                        params_dtype=old.weight.dtype, device=old.weight.device)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            if old.bias is not None:
                new.bias.copy_(old.bias)
        _copy_hooks(old, new)
        inner = new.forward

        def forward(*args, _inner=inner, **kwargs):
            with te.fp8_autocast(enabled=True, fp8_recipe=rec):
                return _inner(*args, **kwargs)

        new.forward = forward
        new.__dict__["_meshplan_fp8_recipe"] = recipe
        _set_submodule(stage, fqn, new)


def apply_fp8(stage: nn.Module, fp8_modules: Iterable[str], *, backend: str = "auto", recipe: str = "tensorwise",
              device: torch.device | None = None, fsdp_float8_all_gather: bool = False,
              tp: int = 1) -> Fp8Swap:
    """Swap the modules of `stage` named in `fp8_modules` (original FQNs; those held by other
    pipeline stages are skipped) for FP8 linears. Returns what was swapped.

    Refuses (ConfigError, before any training) a named module that is not an nn.Linear, a linear
    whose dimensions FP8 GEMMs cannot take (multiples of 16), or a missing backend package.
    """
    wanted = list(dict.fromkeys(fp8_modules))
    if recipe not in RECIPES:
        raise ConfigError(f"fp8 recipe {recipe!r}: use one of {RECIPES}")
    device = device or next(stage.parameters()).device
    modules = dict(stage.named_modules())
    here = [m for m in wanted if m in modules and type(modules[m]).__name__ not in ("_PassThrough",)]
    if not here:
        return Fp8Swap([], "none", recipe)
    name = resolve_backend(backend, device, tp=tp, recipe=recipe)
    if name == "te" and tp > 1:
        raise ConfigError("the Transformer Engine backend is not combined with meshplan's DTensor tensor "
                          f"parallelism (tp={tp}); use fp8_backend='torchao' or a plan with tp=1")
    for fqn in here:
        mod = modules[fqn]
        if not isinstance(mod, nn.Linear):
            raise ConfigError(f"plan lists {fqn!r} as an FP8 module, but it is a {type(mod).__name__}, "
                              "not an nn.Linear; re-plan for this model")
        shape = tuple(mod.weight.shape)
        local = getattr(mod.weight, "to_local", None)
        if local is not None:
            shape = tuple(local().shape)
        if any(d % 16 for d in shape):
            raise ConfigError(f"{fqn}: FP8 GEMMs need dimensions that are multiples of 16; its weight is "
                              f"{shape} on this rank; re-plan (the planner excludes such modules)")
    if name == "torchao":
        # emulated wherever there are no FP8 matrix units to run torch._scaled_mm on (CPU)
        _swap_torchao(stage, here, recipe, fsdp_float8_all_gather, emulate=device.type != "cuda")
    else:
        _swap_te(stage, here, recipe)
    return Fp8Swap(here, name, recipe)


# ---- reporting -------------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype | None) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", None: "fp32"}.get(dtype, str(dtype))


def module_precisions(stages: list[nn.Module], compute_dtype: torch.dtype | None,
                      fp8: Fp8Swap | None = None) -> dict[str, str]:
    """{module FQN: precision it computes in} for every module holding parameters directly.

    FP8 linears read e.g. "fp8 (torchao tensorwise)"; the rest run in the FSDP param dtype
    (bf16/fp16) or fp32 when there is none."""
    base = _dtype_name(compute_dtype)
    fp8_set = set(fp8.modules) if fp8 else set()
    out: dict[str, str] = {}
    for st in stages:
        for fqn, mod in st.named_modules():
            if not any(True for _ in mod.parameters(recurse=False)):
                continue
            cls = type(mod).__name__
            if fqn in fp8_set or cls == "Float8Linear":
                out[fqn] = f"fp8 ({fp8.backend} {fp8.recipe}, {base} elsewhere)" if fp8 else "fp8"
            else:
                out[fqn] = base
    return out


def precision_summary(precisions: dict[str, str]) -> list[str]:
    """One line per kind: 'fp8 (torchao tensorwise, bf16 elsewhere): 14 modules (layers.1.attention.wq, ...)'."""
    groups: dict[str, list[str]] = {}
    for fqn, kind in precisions.items():
        groups.setdefault(kind, []).append(fqn)
    lines = []
    for kind, names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        lines.append(f"{kind}: {len(names)} module{'s' if len(names) != 1 else ''} ({shown})")
    return lines


def merge(swaps: list[Fp8Swap]) -> Fp8Swap | None:
    """One Fp8Swap for all of this rank's stages (None when nothing was swapped here)."""
    done = [s for s in swaps if s.modules]
    if not done:
        return None
    return Fp8Swap([m for s in done for m in s.modules], done[0].backend, done[0].recipe)


def log_precisions(precisions: dict[str, str], plan) -> None:
    """One log line per kind (logger "meshplan.runtime"); a warning when an FP8 plan runs no FP8 here
    although this rank holds FP8 modules (the explicit override)."""
    import logging
    import warnings
    log = logging.getLogger("meshplan.runtime")
    for line in precision_summary(precisions):
        log.info("precision %s", line)
    if plan.precision == Precision.FP8 and set(plan.fp8_modules) & set(precisions) and \
            not any(v.startswith("fp8") for v in precisions.values()):
        warnings.warn(f"the plan runs {len(plan.fp8_modules)} modules in FP8 but they run in "
                      f"{precisions[next(m for m in plan.fp8_modules if m in precisions)]} here "
                      "(explicit precision override)", stacklevel=3)
