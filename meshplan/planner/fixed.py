"""What a caller may fix in a search, checked before the search runs: keys, degrees against the GPU
count, the model's widths and the stack's parallel dimensions, each value as Layout checks it. A
mistake is named in the user's terms with what would work, rather than leaving the search no
candidate to report."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping

from meshplan.errors import ConfigError
from meshplan.ir.layout import Layout, divisors
from meshplan.ir.profile import ModelProfile
from meshplan.ir.stack import PARALLEL_DIMS, Stack

__all__ = ["FIXABLE", "PASSED_THROUGH", "SINGLE_CHUNK_SCHEDULES", "check_fixed", "check_fixed_against_model",
           "check_fixed_dims", "check_fixed_values", "no_blocks", "tp_indivisible"]

# execution choices a user may fix that the search otherwise leaves at their defaults: the software
# stack (kept as given, e.g. to score a published run on its own framework's conventions) and the
# Adam moments' dtype (bf16 changes the optimizer's numerics: the user's call, or plan()'s fallback
# when nothing fits with fp32 moments; never a silent speed choice), and the optimizer (Muon, too,
# changes the numerics: only when asked)
# (moe_capacity_factor: the MoE routing mode, dropless or padded to a capacity; cost_models.layer.moe_load_factor)
# (offload_activations: fixed True offloads every candidate; left free, the search offloads a mesh only
# where nothing fits on it without: _cost_mesh)
PASSED_THROUGH = tuple(k for k in (
    "sp", "tp_comm_overlap", "ep_comm_overlap", "flash_attention", "attn_kernel", "grad_dtype", "fsdp_impl", "moe_dispatcher",
    "fp8_recipe", "cp_comm_type", "grad_accum_fusion", "optimizer_dtype", "optimizer", "moe_capacity_factor",
    "offload_activations")
    if k in {f.name for f in fields(Layout)})
FIXABLE = ("tp", "cp", "ep", "etp", "pp", "vp", "dp", "zero", "mbs", "recompute", "schedule", "stage_layers",
           "fsdp_shard", "reshard_after_forward") + PASSED_THROUGH
# schedules with one model chunk per pipeline rank: a fixed one keeps vp = 1 (never rewritten)
SINGLE_CHUNK_SCHEDULES = ("1f1b", "zb", "gpipe")
_DIM_NAMES = {"tp": "tensor parallelism", "cp": "context parallelism", "ep": "expert parallelism",
              "pp": "pipeline parallelism"}


def check_fixed(fixed: Mapping[str, Any], n: int) -> dict[str, Any]:
    unknown = sorted(set(fixed) - set(FIXABLE))
    if unknown:
        raise ConfigError(f"cannot fix {unknown}; fixable keys: {', '.join(FIXABLE)}")
    f = dict(fixed)
    prod = 1
    named = []
    for k in ("tp", "cp", "pp", "dp"):
        if k in f:
            prod *= int(f[k])
            named.append(f"{k}={f[k]}")
    if n % prod:
        if len(named) == 1:
            k = named[0].split("=")[0]
            raise ConfigError(f"fixed {named[0]} does not divide the {n} GPUs; {k} must divide the GPU count: "
                              f"use one of {divisors(n)}")
        raise ConfigError(f"fixed {' = '.join([' * '.join(named), str(prod)])} does not divide the {n} GPUs; "
                          "the degrees tp*cp*pp*dp must multiply to the GPU count")
    if all(k in f for k in ("tp", "cp", "pp", "dp")) and prod != n:
        raise ConfigError(f"fixed {' * '.join(named)} = {prod}, but the cluster has {n} GPUs")
    if "vp" in f and int(f["vp"]) > 1 and int(f.get("pp", 2)) == 1:
        raise ConfigError("fixed vp > 1 contradicts fixed pp = 1: virtual stages need pipeline parallelism")
    if f.get("schedule") == "interleaved" and int(f.get("vp", 2)) == 1:
        raise ConfigError("fixed schedule='interleaved' contradicts fixed vp = 1")
    if f.get("schedule") in SINGLE_CHUNK_SCHEDULES and int(f.get("vp", 1)) > 1:
        raise ConfigError(f"fixed schedule={f['schedule']!r} runs one model chunk per pipeline rank and "
                          f"contradicts fixed vp = {f['vp']}; use schedule='interleaved' (or 'zbv', vp=2)")
    return f


def check_fixed_against_model(f: Mapping[str, Any], profile: ModelProfile, experts: int, *, heads: int, kv: int,
                               ffns: list[int], n: int) -> None:
    """Fixed degrees the model's shapes rule out, named in its terms (else the search would find no
    candidate and report that nothing fits)."""
    ep, etp = int(f.get("ep", 1)), int(f.get("etp", 1))
    if (ep > 1 or etp > 1) and not experts:
        raise ConfigError(f"fixed ep={ep}, etp={etp}: {profile.name} has no routed experts (its trace found no "
                          "router top-k feeding expert weights), so there is nothing to shard over ep / etp; "
                          "use ep=1, etp=1 (or leave them free)")
    if ep > 1 and experts % ep:
        raise ConfigError(f"fixed ep={ep} does not divide the {experts} experts of {profile.name}; "
                          f"use one of {divisors(experts)}")
    tp = int(f.get("tp", 1))
    if tp > 1 and not any(b.heads for b in profile.layer_blocks()):
        # heads default to 1 for the divisibility checks, which rules tp > 1 out: say why instead
        raise ConfigError(f"fixed tp={tp}: the trace found no attention in {profile.name}'s blocks "
                          f"({', '.join(_block_names(profile))}; attention is an SDPA call or softmax(q·kᵀ)·v), "
                          "and meshplan plans tensor parallelism over attention heads, so there are none to "
                          "split; use tp=1 (or leave tp free)")
    bad = tp_indivisible(tp, profile.vocab, heads=heads, kv=kv, ffns=ffns)
    if tp > 1 and bad:
        ok = [t for t in divisors(n) if not tp_indivisible(t, profile.vocab, heads=heads, kv=kv, ffns=ffns)]
        raise ConfigError(f"fixed tp={tp} does not divide {profile.name}'s {', '.join(bad)}; tp values that "
                          f"divide them and the {n} GPUs: {ok} (or leave tp free)")


def _block_names(profile: ModelProfile, most: int = 3) -> list[str]:
    """The first layers of the model's blocks by FQN (by index for a profile from a config)."""
    names = [inst for i, b in enumerate(profile.blocks) for inst in (b.instances or (f"block {i}",))]
    return names[:most] + ([f"{len(names) - most} more"] if len(names) > most else [])


def no_blocks(profile: ModelProfile) -> str:
    """Why a profile without blocks cannot be planned, in the terms of the model the user traced."""
    # the top-level modules holding the parameters: where the layers are, named as the user wrote them
    owners = list(dict.fromkeys(m.split(".")[0] for m in profile.pre_modules + profile.post_modules))
    where = (f"; its parameters sit in {', '.join(owners[:6])}{', ...' if len(owners) > 6 else ''}"
             if owners else "")
    return (f"cannot plan {profile.name}: its trace found no blocks, so it has no layers to split into pipeline "
            f"stages or to shard over tensor / context / expert parallelism ({len(profile.pre_ops)} ops, all "
            f"outside any block{where}). A block is one layer of the model: a child of an nn.ModuleList or "
            "nn.ModuleDict whose children are all modules with parameters and sub-modules, or a run of repeated "
            "such modules in an nn.Sequential; the tracer finds them in the module tree, not in forward(). "
            "What would work: hold the layers in an nn.ModuleList (e.g. self.layers = nn.ModuleList(...), as "
            "transformers' and meshplan's models do) and iterate over it in forward()")


def tp_indivisible(tp: int, vocab: int, *, heads: int, kv: int, ffns: list[int]) -> list[str]:
    """The model widths tensor parallelism of degree `tp` would have to split but cannot, named."""
    return [f"{what} {v}" for what, v in (("attention heads", heads), ("kv heads", kv), ("vocabulary", vocab))
            if v % tp] + [f"FFN width {w}" for w in sorted(set(ffns)) if w % tp]


def check_fixed_values(f: Mapping[str, Any]) -> None:
    """Each fixed value as Layout checks it (a known recompute policy, dtype, schedule, ...): a
    misspelt one is refused here, in Layout's words, rather than leaving the search no candidate.
    Choices Layout checks against another are checked beside a value that admits them."""
    for k, v in f.items():
        if k == "stage_layers":
            continue        # its length is checked against each candidate's pp * vp
        context = {"zero": 3} if k in ("fsdp_impl", "fsdp_shard", "reshard_after_forward") else \
            {"vp": 2} if k == "schedule" and v == "interleaved" else {}
        try:
            Layout(**{**context, k: v})
        except ConfigError as e:
            raise ConfigError(f"fixed {k}: {e}") from None


def check_fixed_dims(f: Mapping[str, Any], stack: Stack) -> None:
    """A fixed degree above 1 in a parallel dimension the stack does not run (Stack.parallel_dims), or
    a fixed ZeRO stage it does not run beside a fixed pipeline (Stack.max_zero_with_pp)."""
    if int(f.get("pp", 1)) > 1 and int(f.get("zero", 0)) > stack.max_zero_with_pp:
        raise ConfigError(f"fixed zero={f['zero']} with pp={f['pp']}: the {stack.name} stack runs ZeRO up to stage "
                          f"{stack.max_zero_with_pp} with pipeline parallelism; use zero<={stack.max_zero_with_pp} "
                          "or pp=1")
    for dim in PARALLEL_DIMS:
        if dim not in stack.parallel_dims and f.get(dim, 1) != 1:
            raise ConfigError(f"fixed {dim}={f[dim]}: the {stack.name} stack runs no {_DIM_NAMES[dim]} "
                              f"(it runs {', '.join(stack.parallel_dims) or 'data parallelism / FSDP only'}); "
                              f"leave {dim} unset or plan for a stack that runs it, e.g. 'megatron-core'")
