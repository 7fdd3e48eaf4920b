"""What the planner searches for a model and how it finishes the answer: the policy between a
user's request and the search.

- `resolve_precision`: the precisions (`meshplan.ir.precision.Precision`) a precision name stands
  for on a cluster, and the one the plan records where it differs from the priced one (fp32
  planned at BF16 costs; FP8 emulated on CPU).
- `plan_profile`: the search and the Plan's construction for one profile. It prices FP8 with the
  module set the FP8 placement will run (the linears the runtime's FP8 backends can swap), falls
  back to bf16 Adam moments only when nothing fits with fp32 ones, and gives a device without FP8
  units the FP8 module set the placement ILP would choose on an FP8 GPU.

`meshplan.api.plan` resolves the user's arguments (model, cluster, stack), profiles the model and
calls `plan_profile`.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from meshplan.cost_models.context import for_stack
from meshplan.errors import ConfigError, DoesNotFitError
from meshplan.ir.plan import Plan
from meshplan.ir.precision import AUTO, PLAN_CHOICES, Precision, parse_precision
from meshplan.ir.profile import ModelProfile
from meshplan.ir.stack import Stack
from meshplan.planner.build import _fp8_modules, block_instances, build_plan
from meshplan.planner.ilp.fp8 import fp8_layer_modules
from meshplan.planner.search import search
from meshplan.profiling.traits import model_traits

__all__ = ["PRECISIONS", "ResolvedPrecision", "resolve_precision", "plan_profile"]

# precision names plan() and `meshplan train --precision` share (one declaration: ir/precision.py)
PRECISIONS = PLAN_CHOICES


@dataclass(frozen=True)
class ResolvedPrecision:
    """A precision name resolved on a cluster: what the search prices (`search`), and what the
    plan records where that differs from the priced precision (`run_as`, else None)."""
    search: tuple[Precision, ...]
    run_as: Precision | None = None


def resolve_precision(precision: Precision | str, cluster) -> ResolvedPrecision:
    """The precisions `precision` (one of PRECISIONS) stands for on `cluster`: raises on a name
    the planner does not know or FP8 on a GPU without FP8 units, and warns where the plan is
    priced in another precision than it runs in."""
    precision = parse_precision(precision)
    bf16, fp8 = Precision.BF16, Precision.FP8
    if precision == AUTO:
        return ResolvedPrecision((bf16, fp8) if cluster.gpu.fp8_tflops else (bf16,))
    if precision in (bf16, Precision.FP16):
        return ResolvedPrecision((precision,))
    # stacklevel 3: the warning names the caller of meshplan.api.plan, the user's code
    if precision is Precision.FP32:
        # the cost model has BF16/FP16/FP8 tables only: the layout is searched at BF16 costs and the
        # runtime runs fp32 (twice the weight and activation bytes; step times of the fp32 rate)
        warnings.warn("precision='fp32': the layout is planned with BF16 costs (the cost model prices "
                      "bf16/fp16/fp8); the runtime trains in fp32, so memory and step time exceed the "
                      "prediction", stacklevel=3)
        return ResolvedPrecision((bf16,), Precision.FP32)
    if cluster.gpu.fp8_tflops:          # precision is FP8 from here on
        return ResolvedPrecision((fp8,))
    if cluster.gpu.id != "cpu":
        raise ConfigError(f"{cluster.gpu.name} has no FP8 matrix units; use precision='bf16' (FP8 is "
                          "emulated on CPU processes only: cluster 'local-cpu')")
    warnings.warn(f"{cluster.gpu.name} has no FP8 matrix units: FP8 is emulated (torchao on CPU: the same "
                  "quantisation, no speed-up). The layout is priced in BF16 and the FP8 modules are "
                  "those the placement ILP would choose on an FP8 GPU with this BF16 rate", stacklevel=3)
    return ResolvedPrecision((bf16,), fp8)


def plan_profile(prof: ModelProfile, cluster, *, seq_len: int, global_batch: int, precision: ResolvedPrecision,
                 stack: Stack, fixed: Mapping[str, Any] | None = None, top_k: int = 5,
                 allow_cross_domain: bool = False, fused_kernels: bool = True, fp8_force_in: Sequence[str] = (),
                 fp8_force_out: Sequence[str] = (), module=None) -> Plan:
    """The Plan of the fastest layout of `prof` that fits on `cluster` and that `stack` runs.

    precision: from `resolve_precision`. module: the nn.Module `prof` was traced from, or None (a
    preset or config profile); with it the model traits read the module, and for meshplan's runtime
    the linears its FP8 backends cannot swap stay out of FP8. fused_kernels False prices every
    module eager. The other arguments are meshplan.api.plan's."""
    fixed = dict(fixed or {})
    prof = for_stack(prof, stack)       # meshplan's fused kernels run in meshplan's runtime only
    if not fused_kernels:
        prof = dataclasses.replace(prof, fusions=tuple((name, False) for name, _ in prof.fusions))
    traits = model_traits(prof, module)

    forces = {k: (v,) if isinstance(v, str) else tuple(v)
              for k, v in (("fp8_force_in", fp8_force_in), ("fp8_force_out", fp8_force_out))}
    if stack.runtime_checks and module is not None:
        forces["fp8_force_out"] += _not_swappable_fp8(prof, module, forces["fp8_force_in"])
    fp8_layers = fp8_layer_modules(prof, forces["fp8_force_in"], forces["fp8_force_out"])

    def run(fix: dict):
        res = search(prof, cluster, seq_len=seq_len, global_batch=global_batch, precisions=precision.search,
                     fixed=fix, allow_cross_domain=allow_cross_domain, stack=stack, traits=traits,
                     fp8_modules=fp8_layers)
        return build_plan(prof, cluster, res, seq_len=seq_len, global_batch=global_batch, top_k=top_k, fixed=fix,
                          stack=stack, **forces)

    try:
        out = run(fixed)
    except DoesNotFitError as e:
        if "optimizer_dtype" in fixed:
            raise
        # Adam moments in bf16 (fp32 master weights): 8 instead of 12 optimizer bytes per parameter;
        # chosen only when nothing fits with fp32 moments, and said so (they change the numerics)
        try:
            out = run({**fixed, "optimizer_dtype": "bf16"})
        except DoesNotFitError:
            raise e from None
        out = dataclasses.replace(out, notes=out.notes.replace(optimizer_note=(
            "Adam moments in bf16 (fp32 master weights): no layout fits with fp32 moments; "
            "pass fixed={'optimizer_dtype': 'fp32'} to refuse")))
    if precision.run_as is Precision.FP8:
        out = _emulated_fp8_plan(prof, cluster, out, seq_len=seq_len, global_batch=global_batch, **forces)
    elif precision.run_as and precision.run_as != out.precision:
        out = dataclasses.replace(out, precision=precision.run_as)
    return out


def _not_swappable_fp8(prof, model, force_in: tuple[str, ...]) -> tuple[str, ...]:
    """The traced GEMMs the runtime's FP8 backends cannot swap: those that are not an nn.Linear
    module (GPT-2's transposed Conv1D, stacked expert weights). They stay bf16 in the plan, as they
    would in the run; forcing one in is refused here rather than on N ranks."""
    from torch import nn
    if not all(b.instances for b in prof.blocks):
        return ()                               # a profile from a config: no modules to look at
    modules = dict(model.named_modules())
    names = [f"{inst}.{li.name}" for inst, bi in zip(block_instances(prof), prof.layers)
             for li in prof.blocks[bi].linears]
    out = [n for n in names if not isinstance(modules.get(n), nn.Linear)]
    forced = [n for n in out if n in force_in]      # named exactly (a glob pattern just skips them)
    if forced:
        raise ConfigError(f"fp8_force_in names {', '.join(forced[:3])}, which the FP8 backends cannot run "
                          "(they swap nn.Linear modules only); leave them out")
    return tuple(dict.fromkeys(out))


def _emulated_fp8_plan(prof, cl, plan, *, seq_len: int, global_batch: int, fp8_force_in=(), fp8_force_out=()):
    """An FP8 plan for a device without FP8 units (CPU): the BF16 plan's layout and prediction,
    with the FP8 placement ILP run as on a GPU whose FP8 rate is twice its BF16 rate (H100's
    ratio), so the module set is the planner's own choice (first/last block and head excluded)."""
    gpu = dataclasses.replace(cl.gpu, fp8_tflops=2 * cl.gpu.bf16_tflops, fp8_gemm_efficiency=cl.gpu.gemm_efficiency)
    emu = dataclasses.replace(cl, gpu=gpu)
    mods = _fp8_modules(prof, emu, plan.layout, plan.estimate, seq_len, global_batch, fp8_force_in, fp8_force_out)
    return dataclasses.replace(plan, precision=Precision.FP8, fp8_modules=mods,
                               notes=plan.notes.replace(fp8_emulated=True))
