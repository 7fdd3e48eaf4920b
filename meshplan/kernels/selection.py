"""Which implementation the fused kernels run: Triton or the plain-PyTorch reference.

The choice is explicit and process-wide (`set_backend`), and never made by catching errors:

- "triton": the Triton kernels, registered as `meshplan_kernels::*` custom ops. Needs the
  `triton` package and either a CUDA device or the Triton interpreter (TRITON_INTERPRET=1,
  which runs kernels on CPU tensors, slowly; used by the tests). Asking for it when it cannot
  run raises ConfigError saying why.
- "reference": plain PyTorch ops (meshplan.kernels.reference); RMSNorm and SwiGLU run it as
  autograd Functions that keep only what the Triton kernels keep (meshplan.kernels.lean), the
  others are differentiated by autograd.
- "auto" (the default): "triton" when it can run, else "reference".

The environment is read when the backend is resolved (at `set_backend` and at each call under
"auto"), never deep inside a kernel.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator

from meshplan.errors import UnknownNameError

__all__ = [
    "BACKENDS",
    "set_backend",
    "backend",
    "requested_backend",
    "use_backend",
    "triton_unavailable_reason",
    "interpreter_enabled",
]

BACKENDS = ("auto", "triton", "reference")

_requested = "auto"


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET=1: Triton then runs kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _imported_without_interpreter() -> bool:
    # Triton picks interpreted or compiled versions of its own library functions (tl.sigmoid,
    # tl.sum, ...) when it is imported; a kernel run later in the interpreter then fails.
    standard = sys.modules.get("triton.language.standard")
    return standard is not None and type(standard.sigmoid).__name__ != "InterpretedFunction"


def triton_unavailable_reason() -> str | None:
    """None when the Triton backend can run here, else a sentence saying why not."""
    if importlib.util.find_spec("triton") is None:
        return (
            "the 'triton' package is not installed (pip install 'meshplan[kernels]' or "
            "pip install triton)"
        )
    if interpreter_enabled() and not _cuda_available() and _imported_without_interpreter():
        return ("triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot "
                "run in the interpreter; set the variable before anything imports triton "
                "(torch's op dispatch may import it)")
    if not (_cuda_available() or interpreter_enabled()):
        return (
            "no CUDA device is available and the Triton interpreter is off; set "
            "TRITON_INTERPRET=1 before importing triton to run the kernels on CPU (slow), "
            "or use set_backend('reference')"
        )
    return None


def _check_name(name: str) -> None:
    if name not in BACKENDS:
        raise UnknownNameError("kernel backend", name, BACKENDS)


def _resolve(name: str) -> str:
    if name == "auto":
        return "triton" if triton_unavailable_reason() is None else "reference"
    if name == "triton":
        reason = triton_unavailable_reason()
        if reason is not None:
            from meshplan.errors import ConfigError

            raise ConfigError(f"kernel backend 'triton' was requested but cannot run: {reason}")
    return name


def set_backend(name: str) -> str:
    """Select "triton", "reference" or "auto"; returns the backend that will run.

    Raises UnknownNameError for other names and ConfigError when "triton" cannot run here.
    """
    global _requested
    _check_name(name)
    resolved = _resolve(name)
    _requested = name
    return resolved


def requested_backend() -> str:
    """What was asked for ("auto", "triton" or "reference")."""
    return _requested


def backend() -> str:
    """The backend the kernels run now: "triton" or "reference"."""
    return _resolve(_requested)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Context manager form of set_backend; restores the previous request on exit."""
    previous = _requested
    resolved = set_backend(name)
    try:
        yield resolved
    finally:
        set_backend(previous)
