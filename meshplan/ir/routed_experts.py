"""Recognising transformers-style routed experts by their structure (class names are never read):
shared by the planner (what expert parallelism can run, meshplan.profiling.traits) and the runtime
(the adapter that runs them under expert parallelism, meshplan.runtime.hf_experts)."""

from __future__ import annotations

import inspect

__all__ = ["is_routed_experts"]

_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")


def _inputs(module) -> list[str] | None:
    fwd = getattr(module, "__meshplan_orig_forward__", None) or module.forward
    try:
        sig = inspect.signature(fwd)       # follows functools.wraps (transformers' experts decorator)
    except (TypeError, ValueError):
        return None
    return [p.name for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]


def is_routed_experts(module) -> bool:
    """Whether `module` is a transformers-style routed experts module this adapter can split:
    exactly two own parameters, `gate_up_proj` (E, 2f, h) and `down_proj` (E, h, f) with the same
    E >= 2, an `act_fn`, no parameters in child modules, forward(hidden_states, top_k_index,
    top_k_weights), and no declared transposed / interleaved / biased layout."""
    own = {n: p for n, p in module.named_parameters(recurse=False) if p is not None}
    if set(own) != {"gate_up_proj", "down_proj"} or not callable(getattr(module, "act_fn", None)):
        return False
    gu, down = own["gate_up_proj"], own["down_proj"]
    if gu.dim() != 3 or down.dim() != 3 or gu.shape[0] != down.shape[0] or gu.shape[0] < 2:
        return False
    if gu.shape[1] != 2 * down.shape[2] or gu.shape[2] != down.shape[1]:
        return False
    if any(True for c in module.children() for _ in c.parameters()):
        return False
    if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False) \
            or getattr(module, "is_concatenated", True) is False or getattr(module, "has_gate", True) is False:
        return False
    return tuple(_inputs(module) or ()) == _INPUTS
