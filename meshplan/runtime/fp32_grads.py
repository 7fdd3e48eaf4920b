"""fp32 gradient reduction for a named subset of parameters while the rest reduce in bf16.

With the layout's grad_dtype "bf16" every gradient is summed over the data-parallel ranks in
bf16 (half the bytes). Some parameters are sensitive to that rounding - MoE routers, expert
biases, norm gains: few bytes, large effect - so `parallelize(..., fp32_grads=("router",
"norm"))` keeps theirs in fp32:

- FSDP2: mixed precision is set per `fully_shard` call, so the modules that own matching
  parameters become FSDP units of their own with reduce_dtype fp32, sharded before the blocks
  (nested units: the block units then leave their parameters alone). Each such unit adds its own
  all-gather and reduce-scatter per step: small, but collectives, so keep the patterns narrow.
  A unit is a whole module: its other parameters (if any) reduce in fp32 too.
- DDP (zero=0): the bf16 all-reduce hook reduces every bucket that holds a matching parameter in
  fp32 (DDP's buckets are not chosen per parameter).
- One data-parallel rank, or grad_dtype "fp32": nothing to change.

A pattern matches a parameter's fully qualified name: with * or ? as a glob (fnmatch), else as a
substring ("norm" matches layers.0.attention_norm.weight and norm.weight).
"""

from __future__ import annotations

import fnmatch

from torch import nn

from meshplan.errors import ConfigError

__all__ = ["fp32_grad_modules", "matching_params", "parse_patterns"]


def parse_patterns(spec: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """"router,expert_bias,norm" (or a sequence) -> ("router", "expert_bias", "norm")."""
    if not spec:
        return ()
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    out = tuple(p.strip() for p in parts if p and p.strip())
    if any(not isinstance(p, str) for p in out):
        raise ConfigError(f"fp32_grads must be parameter-name patterns, e.g. 'router,norm'; got {spec!r}")
    return out


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) if any(c in pattern for c in "*?[") else pattern in name


def matching_params(module: nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """Names of `module`'s parameters that some pattern matches."""
    return [n for n, _ in module.named_parameters() if any(_matches(n, p) for p in patterns)]


def fp32_grad_modules(stage: nn.Module, patterns: tuple[str, ...], *, exclude: list[str] = ()) -> list[str]:
    """FQNs of the outermost modules owning the parameters `patterns` match (one FSDP unit each),
    leaving out those inside `exclude` (expert modules: units of their own over another mesh).
    Refuses a parameter held by the stage root itself, which cannot be a unit apart."""
    owners: list[str] = []
    for name in matching_params(stage, patterns):
        owner = name.rpartition(".")[0]
        if any(owner == e or owner.startswith(e + ".") for e in exclude):
            continue
        if not owner:
            raise ConfigError(f"--fp32-grads: parameter {name!r} belongs to the model itself, not to a submodule, "
                              "so it cannot reduce apart from the model's other top-level parameters; use a "
                              "pattern that leaves it out")
        owners.append(owner)
    owners = list(dict.fromkeys(owners))
    # nested owners are covered by an outer one
    return [o for o in owners if not any(o.startswith(other + ".") for other in owners if other != o)]
