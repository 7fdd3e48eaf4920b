"""Learning-rate schedules: linear warm-up, then cosine decay to a floor, or WSD.

Steps count optimizer steps from 0. During warm-up, step s gets base_lr * (s + 1) / warmup, so
the first step already learns and step warmup-1 reaches base_lr (nanoGPT's convention; Megatron's
s / warmup wastes step 0 on lr 0). From step `warmup` the rate follows half a cosine from
base_lr down to min_lr, reached at step `total` and kept after it.

WSD (warm-up, stable, decay; Hu et al. 2024 "MiniCPM", Megatron's `--lr-decay-style WSD`): the
same warm-up, then base_lr held constant, then over the last `decay_steps` steps before `total`
a decay to min_lr: "linear", "cosine" or "minus_sqrt" (lr = min + (base - min) (1 - sqrt(p))),
p going from 0 to 1 over the decay. A run can thus be extended from any stable-phase checkpoint.
"""

from __future__ import annotations

import math

import torch

from meshplan.errors import ConfigError

__all__ = ["lr_at", "lr_lambda", "warmup_cosine", "set_lr", "SCHEDULES", "WSD_DECAY_STYLES"]

SCHEDULES = ("cosine", "wsd")
WSD_DECAY_STYLES = ("linear", "cosine", "minus_sqrt")


def _check(*, base_lr: float, warmup: int, total: int, min_lr: float) -> None:
    if not (isinstance(base_lr, (int, float)) and math.isfinite(base_lr) and base_lr > 0):
        raise ConfigError(f"learning rate must be a positive number, got {base_lr!r}")
    if not (isinstance(min_lr, (int, float)) and 0 <= min_lr <= base_lr):
        raise ConfigError(f"min_lr must lie between 0 and the learning rate {base_lr}, got {min_lr!r}")
    for name, value in (("warmup", warmup), ("total", total)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} steps must be a whole number >= 0, got {value!r}")
    if total < 1:
        raise ConfigError(f"total steps must be >= 1, got {total}")
    if warmup > total:
        raise ConfigError(f"warm-up ({warmup} steps) is longer than the run ({total} steps); "
                          f"use --warmup at most {total}")


def check_wsd(*, warmup: int, total: int, decay_steps: int, decay_style: str = "linear") -> None:
    if isinstance(decay_steps, bool) or not isinstance(decay_steps, int) or decay_steps < 1:
        raise ConfigError(f"WSD decay steps must be a whole number >= 1, got {decay_steps!r}; e.g. "
                          f"{max(1, total // 10)} (the last 10% of the run)")
    if warmup + decay_steps > total:
        fix = (f"use --wsd-decay-steps at most {total - warmup}" if total - warmup >= 1
               else f"shorten the warm-up (--warmup) below {total}")
        raise ConfigError(f"WSD: warm-up ({warmup} steps) plus decay ({decay_steps} steps) exceed the run "
                          f"({total} steps); {fix}")
    if decay_style not in WSD_DECAY_STYLES:
        raise ConfigError(f"WSD decay style {decay_style!r} is not one of {', '.join(WSD_DECAY_STYLES)}")


def lr_at(step: int, *, base_lr: float, warmup: int, total: int, min_lr: float = 0.0, style: str = "cosine",
          decay_steps: int | None = None, decay_style: str = "linear") -> float:
    """Learning rate of optimizer step `step` (0-based); `style` "cosine" or "wsd" (then
    `decay_steps`, default the last 10% of `total`, and `decay_style`)."""
    _check(base_lr=base_lr, warmup=warmup, total=total, min_lr=min_lr)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be a whole number >= 0, got {step!r}")
    if style not in SCHEDULES:
        raise ConfigError(f"learning-rate schedule {style!r} is not one of {', '.join(SCHEDULES)}")
    if style == "wsd":
        decay_steps = max(1, total // 10) if decay_steps is None else decay_steps
        check_wsd(warmup=warmup, total=total, decay_steps=decay_steps, decay_style=decay_style)
    if step < warmup:
        return base_lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    if style == "wsd":
        start = total - decay_steps
        if step < start:
            return base_lr
        p = (step - start) / decay_steps                        # 0 at the start of the decay, -> 1
        if decay_style == "linear":
            frac = 1.0 - p
        elif decay_style == "cosine":
            frac = 0.5 * (1.0 + math.cos(math.pi * p))
        else:
            frac = 1.0 - math.sqrt(p)
        return min_lr + (base_lr - min_lr) * frac
    progress = (step - warmup) / (total - warmup)          # 0 at the end of warm-up, -> 1 at total
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def lr_lambda(*, warmup: int, total: int, min_lr_ratio: float = 0.0):
    """`LambdaLR` factor of step s: lr_at(s) / base_lr, with min_lr = base_lr * min_lr_ratio."""
    _check(base_lr=1.0, warmup=warmup, total=total, min_lr=min_lr_ratio)
    return lambda step: lr_at(step, base_lr=1.0, warmup=warmup, total=total, min_lr=min_lr_ratio)


def warmup_cosine(optimizer: torch.optim.Optimizer, *, warmup: int, total: int,
                  min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR giving every param group lr_at(s) relative to its own lr.

    Right after construction the groups hold the rate of step 0; call `.step()` after each
    optimizer step. To resume, load the scheduler's state_dict saved with the checkpoint, or skip
    the scheduler and call `set_lr(optimizer, lr_at(step, ...))` before each step (stateless).
    """
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(warmup=warmup, total=total, min_lr_ratio=min_lr_ratio))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every param group's learning rate (the stateless way to follow `lr_at`)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
