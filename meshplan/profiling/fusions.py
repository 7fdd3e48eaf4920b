"""Which modules of the user's model the fused kernels replace, found from the traced graph.

A module qualifies by what it computes, never by its class name, so a user's own RMSNorm or
SwiGLU MLP is found as well as transformers' or meshplan's:

- rms_norm: a leaf module whose ops are the RMSNorm chain (square, mean, + eps, rsqrt, scale,
  weight multiply, casts) and that reads exactly one parameter (its weight). A module that
  calls `aten.rms_norm` (F.rms_norm, nn.RMSNorm) is left alone: PyTorch already runs that as
  one fused op, so swapping it would save nothing the cost model could count.
- swiglu: a module whose forward is `down(silu(gate(x)) * up(x))` with three linear children
  (an activation child without parameters, like transformers' `act_fn`, is allowed).
- linear_cross_entropy: the output layer, when it is one linear without bias whose result is
  the model's output (only casts or views after it) and the head is not split over tensor
  parallelism (the kernel needs the whole vocabulary on one GPU). The runtime then computes
  the loss from the hidden state in chunks.

The Plan records each match as a `FusedKernel` (kernel, module FQN, options) for every instance
of a repeated block; `eps` is read from the traced graph.

Patterns whose eager form stays in the model because no module can be swapped (rotary
embedding is a function inside the attention's forward, not a module) are reported as
`unfused`, so the cost model charges their extra HBM traffic (meshplan.kernels.fusion).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.ir.plan import FusedKernel
from meshplan.profiling.aten_ops import RMS_CHAIN_OPS, RMS_NORM_OPS, schema_of
from meshplan.ir.profile import BlockProfile, ModelProfile, OpInfo

__all__ = ["FusionPlan", "find_fusions"]

# what may follow the output layer's matmul before the model returns
_AFTER_HEAD = frozenset({"view", "other"})


@dataclass(frozen=True, kw_only=True)
class FusionPlan:
    """The modules to swap and, per fusion the cost model knows, whether it runs fused."""

    modules: tuple[FusedKernel, ...] = ()   # one record per module instance (absolute FQNs)
    # fusion name -> True (a kernel replaces it) / False (its eager form runs); names absent
    # from the mapping do not occur in the model
    applied: tuple[tuple[str, bool], ...] = ()

    def applied_map(self) -> dict[str, bool]:
        return dict(self.applied)


# --- matching ------------------------------------------------------------------------------

def _inside(o: OpInfo, module: str) -> bool:
    return o.module == module or o.module.startswith(module + ".")


def _match_rms_norm(ops: list[OpInfo]) -> tuple[bool, tuple[tuple[str, str], ...]] | None:
    """(decomposed, options) when `ops` (one leaf module's) are an RMSNorm with a weight; options
    are its eps and, when not "weight", the weight's attribute name."""
    params = {p for o in ops for p in o.params}
    if len(params) != 1:
        return None
    weight = next(iter(params))[len(ops[0].module) + 1:] if ops[0].module else next(iter(params))
    extra = (("weight", weight),) if weight != "weight" else ()
    if "." in weight:
        return None
    work = [o for o in ops if o.kind != "view"]
    bases = [schema_of(o.target) for o in work]
    if len(bases) == 1 and bases[0] in RMS_NORM_OPS:
        return False, extra
    if not set(bases) <= RMS_CHAIN_OPS or "aten::mean" not in bases:
        return None
    if "aten::rsqrt" not in bases and not {"aten::sqrt", "aten::div"} <= set(bases):
        return None
    adds = [o for o in work if schema_of(o.target) == "aten::add" and o.scalars]
    if len(adds) != 1 or sum(1 for o in work if o.params) != 1:
        return None
    return True, (("eps", repr(adds[0].scalars[0])), *extra)


def _through_views(name: str, by_name: dict[str, OpInfo]) -> str:
    """The op a value comes from once reshapes and casts are looked through."""
    seen = 0
    while name in by_name and by_name[name].kind == "view" and by_name[name].inputs and seen < 16:
        name = by_name[name].inputs[0]
        seen += 1
    return name


def _match_swiglu(module: str, ops: list[OpInfo]) -> dict[str, str] | None:
    """{gate, up, down} child names when `ops` (everything under `module`) are a SwiGLU MLP."""
    work = [o for o in ops if o.kind != "view"]
    linears = [o for o in work if o.kind == "linear"]
    silus = [o for o in work if schema_of(o.target) == "aten::silu"]
    muls = [o for o in work if schema_of(o.target) == "aten::mul" and not o.params]
    if len(linears) != 3 or len(silus) != 1 or len(muls) != 1 or len(work) != 5:
        return None
    by_name = {o.name: o for o in ops}
    lin = {o.name: o for o in linears}
    gate = lin.get(_through_views(silus[0].inputs[0], by_name)) if silus[0].inputs else None
    srcs = [_through_views(i, by_name) for i in muls[0].inputs]
    if gate is None or len(srcs) != 2 or silus[0].name not in srcs:
        return None
    up = lin.get(srcs[1 - srcs.index(silus[0].name)])
    rest = [o for o in linears if o is not gate and o is not up]
    if up is None or len(rest) != 1:
        return None
    down = rest[0]
    feeds = [_through_views(i, by_name) for i in down.inputs]
    if muls[0].name not in feeds:
        return None
    names = {}
    for role, o in (("gate", gate), ("up", up), ("down", down)):
        child = o.module[len(module) + 1:] if o.module.startswith(module + ".") else ""
        if not child or "." in child:      # the runtime calls the three linears as children
            return None
        names[role] = child
    return names


def _match_head(profile: ModelProfile) -> bool:
    head = profile.head_fqn
    ops = list(profile.post_ops)
    idx = [i for i, o in enumerate(ops) if o.kind == "linear" and o.module == head]
    if not head or len(idx) != 1:
        return False
    if len(ops[idx[0]].params) != 1:            # a bias: the kernel has none
        return False
    return all(o.kind in _AFTER_HEAD and not o.params for o in ops[idx[0] + 1:])


def _has_eager_rope(b) -> bool:
    """Rotary embedding applied with element-wise ops on q/k-shaped tensors before attention."""
    if not b.heads:
        return False
    att = [o for o in b.ops if o.kind == "attention"]
    if not att:
        return False
    module = att[0].module
    return any(o.module == module and o.kind == "elementwise" and schema_of(o.target) == "aten::mul"
               and o.output_shapes and o.output_shapes[0] and o.output_shapes[0][-1] <= b.head_dim
               for o in b.ops)


def _leaf_groups(ops) -> dict[str, list[OpInfo]]:
    groups: dict[str, list[OpInfo]] = {}
    for o in ops:
        groups.setdefault(o.module, []).append(o)
    return groups


def _router_module(b) -> str | None:
    """The block-relative path of the MoE layer holding the block's router linear, if any."""
    for li in b.linears:
        if li.role == "router" and "." in li.name:
            return li.name.rsplit(".", 1)[0]
    return None


def find_fusions(profile: ModelProfile, *, tp: int = 1) -> FusionPlan:
    """Match the fused kernels against the traced graph (pure: the profile's ops only).

    `tp` is the plan's tensor-parallel degree: the fused output layer + loss is only used at 1.
    A profile without traced ops (meshplan.profiling.analytic) gives an empty plan.
    """
    modules: list[FusedKernel] = []

    def each(b: BlockProfile, kernel: str, rel: str, options=()) -> None:
        # the block was traced once; every instance runs the same module at the same path
        modules.extend(FusedKernel(kernel=kernel, module=f"{inst}.{rel}", options=options) for inst in b.instances)

    applied: dict[str, bool] = {}
    for b in profile.blocks:
        if not b.ops or not b.instances:
            continue
        inst = b.instances[0]
        groups = _leaf_groups(b.ops)
        for mod, ops in groups.items():
            if not mod.startswith(inst + ".") or any(m.startswith(mod + ".") for m in groups):
                continue
            found = _match_rms_norm(ops)
            if found is None:
                continue
            decomposed, options = found
            if decomposed:
                each(b, "rms_norm", mod[len(inst) + 1:], options)
                applied["rms_norm"] = True
        for mod in sorted({m for m in groups if m.startswith(inst + ".")}, key=len):
            names = _match_swiglu(mod, [o for o in b.ops if _inside(o, mod)])
            if names:
                each(b, "swiglu", mod[len(inst) + 1:], tuple(names.items()))
                applied["swiglu"] = True
        if b.gated and b.ffn_hidden and "swiglu" not in applied:
            applied["swiglu"] = False
        router = _router_module(b)
        # group-limited routing (DeepSeek-V3) adds top-ks over the groups; the fused kernel takes
        # the top-k over every expert, so such layers keep the eager router (runtime/fused.py)
        if router and sum("topk" in o.target for o in b.ops) > 1:
            router = None
        if router:
            # the MoE layer whose router linear this is: top-k, softmax/sigmoid, expert bias and the
            # aux-loss statistics run as one kernel (meshplan.kernels.moe_route); the runtime swaps it
            # where the layer exposes its routing (meshplan's MoE) and the kernel is faster there
            each(b, "moe_router", router)
            applied["moe_router"] = True
        if _has_eager_rope(b):
            applied["rope"] = False
    for mod, ops in _leaf_groups([*profile.pre_ops, *profile.post_ops]).items():
        found = _match_rms_norm(ops) if mod else None
        if found and found[0]:
            modules.append(FusedKernel(kernel="rms_norm", module=mod, options=found[1]))
            applied.setdefault("rms_norm", True)
    if profile.head_fqn:
        fuse_head = tp == 1 and _match_head(profile)
        applied["linear_cross_entropy"] = fuse_head
        if fuse_head:
            modules.append(FusedKernel(kernel="linear_cross_entropy", module=profile.head_fqn))
    return FusionPlan(modules=tuple(modules), applied=tuple(sorted(applied.items())))

