"""`Precision`: the number formats a plan trains in, declared once.

A `Precision` is a string enum, so it compares equal to its name ("fp8" == Precision.FP8), formats
as it, and serialises to JSON as the plain name: plans, estimates and command lines keep carrying
names. What differs between the sets below is who accepts what:

- `PRICED`: what the cost model has rates for (bf16, fp16 and fp8; fp32 is planned at bf16 costs);
- `PLAN_CHOICES`: what `meshplan.plan()`, `meshplan plan/train --precision` and the what-if
  sweeps take: every precision plus "auto" (the planner compares bf16 with fp8 where the GPU has FP8
  units).
"""

from __future__ import annotations

from enum import Enum

from meshplan.errors import ConfigError

__all__ = ["Precision", "PRICED", "PLAN_CHOICES", "AUTO", "parse_precision"]


class Precision(str, Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"

    # a name everywhere a string is expected (f-strings, str(), JSON)
    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def is_fp8(self) -> bool:
        return self is Precision.FP8

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element in this precision's forward (FP8 GEMMs keep bf16
        activations between them)."""
        return 4 if self is Precision.FP32 else 2


AUTO = "auto"
PRICED: tuple[Precision, ...] = (Precision.BF16, Precision.FP16, Precision.FP8)
PLAN_CHOICES: tuple[str, ...] = (*(p.value for p in Precision), AUTO)


def parse_precision(name: str, *, allowed: tuple[str, ...] = PLAN_CHOICES, what: str = "precision") -> str:
    """`name` if it is one of `allowed` (a Precision, or "auto"), else a ConfigError that lists them."""
    if isinstance(name, str) and name in allowed:
        return Precision(name) if name != AUTO else AUTO
    raise ConfigError(f"{what} {name!r}: use one of {', '.join(str(a) for a in allowed)}")
