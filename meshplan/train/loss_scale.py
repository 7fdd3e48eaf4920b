"""Dynamic loss scaling for fp16 training, aware of every shard and every parallel group.

fp16 has 5 exponent bits: small gradients underflow to zero unless the loss is multiplied by a
large scale before backward. Per step:

1. `ParallelModel.loss_scale` = the scale: backward runs on loss x scale (the loss reported is
   the unscaled one);
2. `unscale_and_check`: every local gradient shard (DTensor shards of FSDP2 / TP, a pipeline
   rank's own stages, expert shards) is divided by the scale and checked for inf/nan; the found
   flag is all-reduced (max) over the whole world, so every rank of every tp / cp / ep / pp / dp
   group agrees;
3. on inf/nan the step is skipped on every rank (no optimizer step, gradients dropped) and the
   scale halves; after `growth_interval` clean steps in a row it doubles.

Why not torch's scalers: torch.amp.GradScaler finds infs per process only (no collective), so
ranks could disagree on skipping; torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler
(torch 2.13) does all-reduce the flag (over WORLD by default) but was written for FSDP1: it walks
the optimizer's parameter groups with a fused unscale kernel and has no DTensor path, and it
couples skipping to its own `scaler.step(optimizer)`. Here the gradients are FSDP2 / TP DTensors
(unscaled through their local shards), the skip decision is needed before clipping, and the loop
owns the optimizer step, so the scaler is these few lines. Scales are powers of two, so scaling
and unscaling are exact.

The scaler's state (scale, clean-step count, skipped steps) is saved in each checkpoint's meta
and restored on resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshplan.errors import ConfigError

__all__ = ["DynamicLossScaler", "loss_scaler_for"]


@dataclass(kw_only=True)
class DynamicLossScaler:
    scale: float = 2.0 ** 16
    growth_interval: int = 1000             # clean steps before the scale doubles (Megatron's loss-scale window)
    backoff: float = 0.5
    growth: float = 2.0
    min_scale: float = 1.0
    good_steps: int = 0
    skipped: list[int] = field(default_factory=list)   # steps (1-based) skipped on inf/nan gradients

    def __post_init__(self) -> None:
        if not self.scale > 0 or self.growth_interval < 1:
            raise ConfigError(f"loss scale must be > 0 and its growth interval >= 1 step; got scale={self.scale}, "
                              f"growth_interval={self.growth_interval}")

    def unscale_and_check(self, pm) -> bool:
        """Divide every gradient by the scale; True when any rank saw inf/nan (collective over the world)."""
        from torch.distributed.tensor import DTensor
        inv = 1.0 / self.scale
        bad = torch.zeros((), dtype=torch.float32, device=pm.device)
        with torch.no_grad():
            for p in pm.parameters():
                g = p.grad
                if g is None:
                    continue
                local = g.to_local() if isinstance(g, DTensor) else g
                bad = torch.maximum(bad, (~torch.isfinite(local)).any().float())   # no sync per tensor
                local.mul_(inv)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)      # the default group: every parallel group at once
        return bool(bad.item())

    def update(self, found_inf: bool, step: int) -> None:
        """After a step: back off on inf/nan (the step was skipped), grow after a clean run."""
        if found_inf:
            self.scale = max(self.min_scale, self.scale * self.backoff)
            self.good_steps = 0
            self.skipped.append(step)
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": list(self.skipped)}

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return          # a checkpoint from a run without loss scaling: start from the initial scale
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped = [int(s) for s in state.get("skipped", [])]


def loss_scaler_for(pm, mode: str, *, initial: float, growth_interval: int) -> DynamicLossScaler | None:
    """The run's loss scaler: `mode` "auto" scales when the model computes in fp16, "dynamic"
    always, "off" never."""
    if mode not in ("auto", "dynamic", "off"):
        raise ConfigError(f"loss_scaling must be 'auto', 'dynamic' or 'off', got {mode!r}")
    fp16 = any(str(v).startswith("fp16") or "fp16 elsewhere" in str(v) for v in (pm.precisions or {}).values())
    if mode == "off" or (mode == "auto" and not fp16):
        return None
    for st in pm.stages:
        for name, mod in st.named_modules():
            if getattr(mod, "aux_loss_coeff", 0.0) or getattr(mod, "z_loss_coeff", 0.0):
                # their gradient enters backward as a fixed 1 (models/moe.py), not scaled with the loss
                raise ConfigError(f"fp16 loss scaling does not scale the MoE balancing losses of {name!r} "
                                  "(moe_aux_loss_coeff / moe_z_loss_coeff); train this model in bf16, or "
                                  "without those losses")
    return DynamicLossScaler(scale=initial, growth_interval=growth_interval)
