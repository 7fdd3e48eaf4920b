"""Input validation shared by the kernels: every message names the argument at fault."""

from __future__ import annotations

import torch

from meshplan.errors import ConfigError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t: object, *, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
                 ndim: int | None = None, min_ndim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ConfigError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; "
                          f"supported: {_names(dtypes)}")
    if ndim is not None and t.dim() != ndim:
        raise ConfigError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ConfigError(f"{name} must have at least {min_ndim} dims, got shape {tuple(t.shape)}")
    return t


def check_same_device(**tensors: torch.Tensor | None) -> None:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ConfigError(f"{name} is on {t.device} but {first_name} is on {first.device}; "
                              "move them to one device")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise ConfigError(f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; "
                              "cast one of them")


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ConfigError(f"{name} has shape {tuple(t.shape)} but must be {tuple(expected)} "
                          f"({what})")


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def is_traced(t: torch.Tensor) -> bool:
    """True for meta / fake tensors and under torch.compile: value checks needing a host sync
    are skipped there (the values do not exist yet)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.device.type == "meta" or isinstance(t, FakeTensor) or torch.compiler.is_compiling()
