"""What a what-if sweep is asked: the parsing of its numbers (`parse_tokens`, `parse_money`,
`parse_duration_days`, `parse_counts`, `parse_prices`: '15T', '20M', '90d', '1024,2048',
'h100-sxm=2.5') and the GPU options (GPU ids, cluster JSON files, GPUSpecs or Clusters, each with
the node type it is swept on) together with the price each uses and where it comes from
(`PriceSource`). meshplan/reports/whatif.py runs the sweep over them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from meshplan.cluster import PRESETS, Cluster, GPUSpec, gpu
from meshplan.cluster.gpus import _GPU_ALIASES, _norm
from meshplan.errors import ConfigError

__all__ = ["PriceSource", "parse_tokens", "parse_duration_days", "parse_money", "parse_counts", "parse_prices",
           "DEFAULT_GPUS", "DEFAULT_COUNTS"]

DEFAULT_GPUS = ("h100-sxm", "h200", "b200")
DEFAULT_COUNTS = (1024, 2048, 4096, 8192, 16384)

# ---- parsing --------------------------------------------------------------------------------
_NUM = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_TOKEN_FORMS = "a number with an optional suffix K, M, B or T (e.g. 15T, 300B, 2.5e12)"
_MONEY_FORMS = "US dollars as a number with an optional $ and suffix k, M or B (e.g. 20M, 1.5k, $300000)"
_DURATION_FORMS = "a number with a unit d (days), h (hours) or w (weeks) (e.g. 90d, 36h, 2w); a bare number is days"


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _positive(what: str, text: Any, value: float, forms: str, allow_zero: bool = False) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{what} {text!r} must be {'non-negative' if allow_zero else 'positive'}; "
                          f"use {forms}")
    return float(value)


def _scaled(what: str, text: Any, forms: str, pattern: str, allow_zero: bool = False) -> float:
    if _is_number(text):
        return _positive(what, text, float(text), forms, allow_zero)
    if not isinstance(text, str):
        raise ConfigError(f"{what} {text!r} is not {forms}")
    s = text.strip().replace(",", "").replace("_", "")
    m = re.fullmatch(pattern, s)
    if not m:
        raise ConfigError(f"{what} {text!r} is not understood; use {forms}")
    return _positive(what, text, float(m.group(1)) * _SCALE[m.group(2).lower()], forms, allow_zero)


def parse_tokens(text: str | float) -> float:
    """'15T' -> 1.5e13, '300B', '2.5e12', '800M'; a number passes through."""
    return _scaled("token count", text, _TOKEN_FORMS, rf"({_NUM})\s*([kKmMbBgGtT]?)")


def parse_money(text: str | float, *, allow_zero: bool = False) -> float:
    """'20M' -> 2e7 USD, '1.5k', '$300000', '$1.2B'; a number passes through."""
    return _scaled("amount", text, _MONEY_FORMS, rf"\$?\s*({_NUM})\s*([kKmMbB]?)", allow_zero)


def parse_duration_days(text: str | float) -> float:
    """'90d' -> 90.0, '36h' -> 1.5, '2w' -> 14.0; a bare number is days."""
    if _is_number(text):
        return _positive("duration", text, float(text), _DURATION_FORMS)
    if not isinstance(text, str):
        raise ConfigError(f"duration {text!r} is not {_DURATION_FORMS}")
    m = re.fullmatch(rf"({_NUM})\s*([dDhHwW]?)", text.strip())
    if not m:
        raise ConfigError(f"duration {text!r} is not understood; use {_DURATION_FORMS}")
    per_unit = {"": 1.0, "d": 1.0, "h": 1 / 24, "w": 7.0}[m.group(2).lower()]
    return _positive("duration", text, float(m.group(1)) * per_unit, _DURATION_FORMS)


def parse_counts(text: str | Iterable[int]) -> tuple[int, ...]:
    """'1024,2048' (or an iterable of ints) -> sorted unique GPU counts."""
    items = [p.strip() for p in text.split(",") if p.strip()] if isinstance(text, str) else list(text)
    out = set()
    for item in items:
        if isinstance(item, str) and item.isdigit():
            item = int(item)
        if isinstance(item, bool) or not isinstance(item, int) or item < 1:
            raise ConfigError(f"GPU count {item!r} is not a positive whole number; use e.g. --gpus 1024,2048,4096")
        out.add(item)
    if not out:
        raise ConfigError("no GPU counts given; use e.g. --gpus 1024,2048,4096")
    return tuple(sorted(out))


def parse_prices(items: str | Iterable[str] | Mapping[str, Any] | None) -> dict[str, float]:
    """['h100-sxm=2.5', 'b200=$3.1,h200=2.9'] or {'h100-sxm': 2.5} -> {gpu: USD per GPU-hour}."""
    if items is None:
        return {}
    if isinstance(items, Mapping):
        pairs = [(str(k), v) for k, v in items.items()]
    else:
        parts = [items] if isinstance(items, str) else list(items)
        pairs = []
        for part in (p.strip() for chunk in parts for p in chunk.split(",")):
            if not part:
                continue
            if "=" not in part:
                raise ConfigError(f"price {part!r} is not gpu=usd_per_gpu_hour (e.g. --price h100-sxm=2.5)")
            k, v = (s.strip() for s in part.split("=", 1))
            pairs.append((k, v))
    return {k: parse_money(v, allow_zero=True) for k, v in pairs}


# ---- prices ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PriceSource:
    """The price used for one GPU option, and where it comes from."""

    gpu: str                          # the option's label
    gpu_id: str
    usd_per_gpu_hour: float | None    # None: no known price, costs are unknown
    source: str
    overridden: bool = False          # True when given with --price / prices=

    def __post_init__(self) -> None:
        if self.usd_per_gpu_hour is not None and not (_is_number(self.usd_per_gpu_hour)
                                                      and self.usd_per_gpu_hour >= 0):
            raise ConfigError(f"price for {self.gpu!r} must be a non-negative number, got {self.usd_per_gpu_hour!r}")


# ---- the GPU options ------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class _Option:
    label: str
    spec: GPUSpec
    base: Cluster | None = None   # Cluster used as the node type (cluster file / object), or None
    preset: str | None = None

    @property
    def gpus_per_node(self) -> int:
        if self.base is not None:
            return self.base.gpus_per_node
        if self.preset is not None:
            return Cluster.preset(self.preset).gpus_per_node
        return self.spec.node_gpus

    def cluster(self, count: int):
        gpn = self.gpus_per_node
        if count % gpn:
            lo, hi = count // gpn * gpn, (count // gpn + 1) * gpn
            near = " or ".join(str(n) for n in (lo, hi) if n > 0)
            raise ConfigError(f"{count} GPUs of {self.label} is not a whole number of {gpn}-GPU nodes; "
                              f"valid counts are multiples of {gpn} (nearest: {near})")
        try:
            if self.base is not None:
                return self.base.replace(nodes=count // gpn)
            if self.preset is not None:
                return Cluster.preset(self.preset, nodes=count // gpn)
            return Cluster(gpu=self.spec, gpus_per_node=gpn, nodes=count // gpn)
        except ConfigError as e:
            raise ConfigError(f"{count} x {self.label}: {e}") from None


def _preset_for(gpu_id: str) -> str | None:
    for name in sorted(PRESETS):
        if name != "local-cpu" and Cluster.preset(name).gpu.id == gpu_id:
            return name
    return None


def _options(gpus: Any) -> list[_Option]:
    items = [g.strip() for g in gpus.split(",") if g.strip()] if isinstance(gpus, str) else list(gpus)
    if not items:
        raise ConfigError(f"no GPU types given; use e.g. --gpu {','.join(DEFAULT_GPUS)}")
    out: list[_Option] = []
    for item in items:
        if isinstance(item, Cluster):
            out.append(_Option(label=item.name, spec=item.gpu, base=item))
        elif isinstance(item, GPUSpec):
            out.append(_Option(label=item.id, spec=item, preset=_preset_for(item.id)))
        elif isinstance(item, str) and (item.endswith(".json") or Path(item).is_file()):
            if not Path(item).is_file():
                raise ConfigError(f"cluster file {item!r} does not exist; --gpu takes GPU ids or cluster JSON files")
            cl = Cluster.load(item)
            out.append(_Option(label=Path(item).stem, spec=cl.gpu, base=cl))
        elif isinstance(item, str):
            spec = gpu(item)          # UnknownNameError lists the known GPUs
            if spec.id == "cpu":
                raise ConfigError("what-if sweeps are for GPU clusters; 'cpu' is this machine's processes")
            out.append(_Option(label=spec.id, spec=spec, preset=_preset_for(spec.id)))
        else:
            raise ConfigError(f"GPU option {item!r}: give a GPU id, a cluster JSON path, a GPUSpec or a Cluster")
    labels = [o.label for o in out]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ConfigError(f"GPU option(s) {dup} given twice")
    return out


def _price_sources(options: Sequence[_Option], overrides: Mapping[str, float]) -> list[PriceSource]:
    remaining = dict(overrides)
    out = []
    for o in options:
        hit = None
        for k in list(remaining):
            nk = _GPU_ALIASES.get(_norm(k), _norm(k))
            if k == o.label or nk == _norm(o.label) or (o.base is None and nk == o.spec.id):
                hit = k
                break
        if hit is not None:
            out.append(PriceSource(gpu=o.label, gpu_id=o.spec.id, usd_per_gpu_hour=remaining.pop(hit),
                                   source=f"given on the command line ({hit}=...)", overridden=True))
        else:
            out.append(PriceSource(gpu=o.label, gpu_id=o.spec.id, usd_per_gpu_hour=o.spec.price_usd_per_hour,
                                   source=o.spec.price_source))
    if remaining:
        raise ConfigError(f"price given for {sorted(remaining)}, which is not among the swept GPUs "
                          f"{[o.label for o in options]}")
    return out
