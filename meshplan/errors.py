"""meshplan's own exceptions.

Every error a user can trigger with bad input is one of these. Each message names the problem
in the user's terms (the layer, the degree, the GPU) and says what would work instead.
They subclass ValueError so callers that already catch ValueError keep working.
"""

from __future__ import annotations

__all__ = [
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
