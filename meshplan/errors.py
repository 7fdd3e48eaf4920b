"""meshplan's own exceptions.

Every error a user can trigger with bad input is one of these. Each message names the problem
in the user's terms (the layer, the degree, the GPU) and says what would work instead.
They subclass ValueError so callers that already catch ValueError keep working.
"""

from __future__ import annotations

import contextlib
import logging

__all__ = [
    "quiet_imports",
    "MeshplanError",
    "UnknownNameError",
    "ConfigError",
    "LayoutError",
    "TraceError",
    "DoesNotFitError",
]


class MeshplanError(ValueError):
    """Base class of every error meshplan raises on purpose."""


class UnknownNameError(MeshplanError, KeyError):
    """An unknown preset, GPU, model or option name. The message lists the known ones."""

    def __init__(self, kind: str, name: str, known: list[str] | tuple[str, ...]):
        self.kind, self.name, self.known = kind, name, tuple(known)
        super().__init__(f"unknown {kind} {name!r}; known {kind}s: {', '.join(sorted(self.known))}")

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return self.args[0]


class ConfigError(MeshplanError):
    """A malformed configuration value (negative size, wrong type, contradictory fields)."""


class LayoutError(MeshplanError):
    """A parallel layout that cannot run this model on this cluster (indivisible degrees, ...)."""


class TraceError(MeshplanError):
    """A model, op or module that cannot be traced or classified."""


class DoesNotFitError(MeshplanError):
    """No layout (or not the requested one) fits in GPU memory."""


# Import-time log lines of third-party packages that a meshplan user cannot act on: torchao's
# optional CUDA extensions that a CPU build cannot load ("Failed to load ..._C_mxfp8...so") and
# torch's deprecation notice for the pytree registrations torchao makes ("... is an Enum subclass
# and is now natively supported by torch.compile"), printed once per process, i.e. on every rank.
_NOISY_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_imports():
    """Import torchao / transformers inside this to keep their import-time notices off the console
    (errors still show)."""
    loggers = [logging.getLogger(name) for name in _NOISY_IMPORT_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
