"""The structural fingerprint that ties a Plan to the model it was made for.

The planner stores it in `Plan.model_fingerprint` (through the tracer's `ModelProfile`); the
runtime recomputes it on the model it is given and refuses a plan made for another structure.
Works on any nn.Module (duck-typed: torch is not imported here).
"""

from __future__ import annotations

import hashlib

__all__ = ["fingerprint", "tensor_desc"]


def tensor_desc(t) -> str:
    return "None" if t is None else f"{tuple(t.shape)}:{t.dtype}"


def fingerprint(model) -> str:
    """Stable hash of the module tree, parameter/buffer names, shapes and dtypes (16 hex)."""
    h = hashlib.sha256()
    for name, module in model.named_modules(remove_duplicate=False):
        h.update(f"m:{name}:{type(module).__qualname__};".encode())
        for pname, p in module._parameters.items():
            h.update(f"p:{pname}:{tensor_desc(p)};".encode())
        for bname, b in module._buffers.items():
            h.update(f"b:{bname}:{tensor_desc(b)};".encode())
        # a sliding attention window changes what a layer computes, not its parameters (meshplan's
        # and transformers' attention modules carry it as `sliding_window`); hashed only when set,
        # so the fingerprints of models without one are unchanged
        window = getattr(module, "sliding_window", None)
        if isinstance(window, int) and not isinstance(window, bool) and window > 0:
            h.update(f"w:{name}:{window};".encode())
    # tied parameters change the parameter count, so they are part of the structure
    owners: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first = owners.setdefault(id(p), name)
        if first != name:
            h.update(f"tie:{name}={first};".encode())
    return h.hexdigest()[:16]
