"""Reference single-device models (dense GPT / Llama family, MoE) and named presets.

    model = meshplan.models.build("llama3-8b")                  # meta device: shapes only, instant
    model = meshplan.models.build("llama3-8b", layers=2)        # a preset with overrides
    model = meshplan.models.build("moe", layers=2, hidden=256, heads=4, vocab=1000,
                                  experts=8, topk=2, device="cpu")
    model.config                                                 # the ModelConfig it was built from

The models are plain nn.Modules with no parallelism inside; meshplan's tracer, cost model and
runtime treat them exactly like any user model.
"""

from __future__ import annotations

import torch
from torch import nn

from meshplan.errors import ConfigError, UnknownNameError
from meshplan.models.config import CONFIG_KEYS, FAMILIES, ModelConfig, _check_keys
from meshplan.models.grouped_mm import grouped_mm
from meshplan.models.mla import MLAttention
from meshplan.models.moe import GroupedExperts, MoE, load_balancing_loss
from meshplan.models.presets import PRESETS, config, presets
from meshplan.models.transformer import Attention, Block, FeedForward, Transformer, causal_lm_loss

__all__ = [
    "build", "config", "presets", "ModelConfig", "CONFIG_KEYS", "FAMILIES", "PRESETS",
    "Transformer", "Block", "Attention", "MLAttention", "FeedForward", "MoE", "GroupedExperts",
    "causal_lm_loss", "load_balancing_loss", "grouped_mm",
]


def resolve_config(name_or_family: str, **overrides: object) -> ModelConfig:
    """A preset name (with overrides) or a family name with config keywords -> `ModelConfig`."""
    if name_or_family in PRESETS:
        return config(name_or_family, **overrides)
    if name_or_family in FAMILIES:
        _check_keys(overrides)
        if "family" in overrides and overrides["family"] != name_or_family:
            raise ConfigError(
                f"build({name_or_family!r}, family={overrides['family']!r}) names two families; "
                f"pass just one, e.g. build({overrides['family']!r}, ...)")
        fields = {"name": name_or_family, **overrides, "family": name_or_family}
        return ModelConfig(**fields)  # type: ignore[arg-type]
    raise UnknownNameError("model", name_or_family, [*presets(), *FAMILIES])


def build(
    name_or_family: str | ModelConfig,
    *,
    device: torch.device | str = "meta",
    dtype: torch.dtype | None = None,
    **config: object,
) -> nn.Module:
    """Build a `Transformer` from a preset name, a family name or a `ModelConfig`.

    ``device="meta"`` (the default) allocates nothing: any preset builds in milliseconds and is
    ready for tracing. On a real device the weights come from `init_weights`, which draws from
    torch's default generator: ``torch.manual_seed(s)`` first makes it repeatable, and a
    meta-built model materialised later with ``to_empty(device=...)`` + ``init_weights()``
    under the same seed gets the same weights.
    ``dtype`` is the parameter dtype (default: torch's default dtype).
    """
    if isinstance(name_or_family, ModelConfig):
        cfg = name_or_family.replace(**config) if config else name_or_family
    else:
        cfg = resolve_config(name_or_family, **config)
    device = torch.device(device)
    previous_dtype = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        if device.type == "meta":
            with device:
                model = Transformer(cfg)
        else:
            # nn.Linear draws its own default init while being constructed; fork the generator
            # so the weights depend only on the seed, exactly as for a meta-built model that is
            # later materialised with to_empty() + init_weights().
            with torch.random.fork_rng(devices=_rng_devices(device), device_type=device.type), device:
                model = Transformer(cfg)
            model.init_weights()
    finally:
        torch.set_default_dtype(previous_dtype)
    return model


def _rng_devices(device: torch.device) -> list[int]:
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]
