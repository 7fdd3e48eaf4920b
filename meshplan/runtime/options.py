"""`ParallelOptions`: how `parallelize` runs a Plan where the Plan leaves a choice to the machine.

The Plan says what to shard and where; these options say how this run executes it (compute dtype,
kernels, FP8 backend, compilation, ...). Every field has a default that runs the plan as priced,
so `parallelize(model, plan)` needs none; `parallelize(model, plan, materialize=False)` is
shorthand for `parallelize(model, plan, ParallelOptions(materialize=False))`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshplan.errors import ConfigError

__all__ = ["ParallelOptions", "FP8_BACKENDS", "FP8_RECIPES"]

FP8_BACKENDS = ("auto", "torchao", "te")
FP8_RECIPES = (None, "tensorwise", "rowwise", "delayed")
_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ParallelOptions:
    """The run-time modes of `parallelize`, each checked on construction (ConfigError names the
    field and the values it takes)."""

    compute_dtype: torch.dtype | None | str = "plan"
    """"plan" takes the plan's precision (bf16 parameters and compute, fp32 master weights,
    gradients reduced in the layout's grad_dtype); None or torch.float32 computes in the model's
    own dtype (what numerical-equivalence tests use); torch.bfloat16 / torch.float16 an explicit
    override of the plan's precision."""

    overlap: bool = True
    """FSDP2's explicit prefetching of the next unit's all-gather (fsdp.py); False lets each unit
    unshard on first use (slower; isolates overlap effects)."""

    loss_fn: Callable | None = None
    """`loss_fn(logits, labels)` returning the SUM over tokens (None: cross entropy ignoring -100).
    With a loss_fn the output layer keeps its eager form (the fused linear + cross-entropy computes
    the default loss) and, under TP, the loss gets whole logits: the output layer all-gathers them
    over the vocabulary, so every TP rank holds the full (tokens x vocab) logits and their gradient.
    The default loss instead runs on each rank's vocabulary slice (runtime/loss_parallel.py), as
    the cost model prices it; `parallelize` warns with the factor when a loss_fn meets tp > 1."""

    fused_kernels: bool | str = "auto"
    """"auto" swaps in the kernels the plan lists (Plan.fused_kernels) that are faster than eager
    with this device's backend (fused.FASTER_THAN_EAGER: Triton on CUDA; on CPU none - the reference
    fallbacks are slower); True swaps every listed kernel (correctness tests), False none.
    `ParallelModel.kernels` records what runs and why. Which implementation runs is
    meshplan.kernels.set_backend's choice: Triton on GPUs (or under TRITON_INTERPRET=1), the
    plain-PyTorch reference otherwise."""

    fp8: bool = True
    """For an FP8 plan, swap exactly Plan.fp8_modules for FP8 linears (runtime/fp8.py); False is the
    explicit override that runs the plan in `compute_dtype` instead. A missing backend fails in
    parallelize, before any collective."""

    fp8_backend: str = "auto"
    """"auto": Transformer Engine on CUDA when installed and tp == 1, else torchao; "torchao"; "te"."""

    fp8_recipe: str | None = None
    """None: the plan's Layout.fp8_recipe; "tensorwise", "rowwise", or Transformer Engine's "delayed"."""

    materialize: bool = True
    """Allocate and initialise a meta-device model's shards on this rank (runtime/materialize.py).
    False leaves a meta model sharded but unallocated: each rank's shard shapes can then be counted
    against the cost model without memory (a dry run; it cannot train)."""

    compile: bool | str = "auto"
    """torch.compile each block (runtime/compile.py): "auto" on CUDA (not under a zero-bubble
    pipeline schedule), True, or False."""

    fp32_grads: tuple[str, ...] = ()
    """Parameter-name patterns (("router", "norm"), or "router,norm") whose gradients reduce in
    fp32 under a grad_dtype "bf16" layout (runtime/fp32_grads.py); `ParallelModel.fp32_grads` lists
    the modules."""

    def __post_init__(self) -> None:
        dtype = self.compute_dtype
        if not (dtype == "plan" if isinstance(dtype, str) else dtype in _DTYPES):
            raise ConfigError(f"ParallelOptions.compute_dtype={dtype!r}: use 'plan' (the plan's precision), None "
                              "or torch.float32 (the model's own dtype), torch.bfloat16 or torch.float16")
        for name in ("overlap", "fp8", "materialize"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ParallelOptions.{name}={getattr(self, name)!r}: use True or False")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise ConfigError(f"ParallelOptions.loss_fn={self.loss_fn!r}: use None (cross entropy) or a callable "
                              "(logits, labels) -> summed loss")
        for name in ("fused_kernels", "compile"):
            v = getattr(self, name)
            if not (isinstance(v, bool) or v == "auto"):
                raise ConfigError(f"ParallelOptions.{name}={v!r}: use 'auto', True or False")
        if self.fp8_backend not in FP8_BACKENDS:
            raise ConfigError(f"ParallelOptions.fp8_backend={self.fp8_backend!r}: use one of {FP8_BACKENDS}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ConfigError(f"ParallelOptions.fp8_recipe={self.fp8_recipe!r}: use one of {FP8_RECIPES} "
                              "(None: the plan's)")
        object.__setattr__(self, "fp32_grads", _patterns(self.fp32_grads))

    @classmethod
    def of(cls, options: ParallelOptions | None = None, **overrides) -> ParallelOptions:
        """`options` (default: all defaults) with `overrides` applied; an unknown name is refused
        with the list of fields."""
        if options is not None and not isinstance(options, cls):
            raise ConfigError(f"options={options!r}: pass a ParallelOptions (or keyword overrides such as "
                              "compute_dtype=None)")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ConfigError(f"parallelize() got unknown option(s) {', '.join(unknown)}; the options are "
                              f"{', '.join(names)}")
        base = options or cls()
        return dataclasses.replace(base, **overrides) if overrides else base


def _patterns(spec) -> tuple[str, ...]:
    """"router,norm" or a sequence of names -> ("router", "norm") (whitespace and empties dropped)."""
    if not spec:
        return ()
    parts = spec.split(",") if isinstance(spec, str) else list(spec) if isinstance(spec, (list, tuple)) else None
    if parts is None or any(not isinstance(p, str) for p in parts):
        raise ConfigError(f"ParallelOptions.fp32_grads={spec!r}: use parameter-name patterns, e.g. "
                          "('router', 'norm') or 'router,norm'")
    return tuple(p.strip() for p in parts if p.strip())
