"""What the training loop reports beyond metrics.jsonl: per-step peak memory over every rank,
TensorBoard / Weights & Biases logging, and the run summary (`<out>/summary.json`).

- `StepMemory`: each step's peak memory on this rank, reset as the step begins (CUDA: allocated
  and reserved peaks of torch's allocator; CPU on Linux: the process's peak resident set, VmHWM,
  set back to the current RSS at each reset — it counts everything resident, interpreter and
  torch included, not only tensors), then gathered from every rank: the max and which rank had it.
- `Loggers`: ``log=("tensorboard", "wandb")`` on rank 0. TensorBoard writes event files under
  `<out>/tb` with torch.utils.tensorboard (needs the `tensorboard` package); wandb logs to the
  project in $WANDB_PROJECT (default "meshplan") and honours its own environment, e.g.
  WANDB_MODE=offline. Asking for one that is not installed is an error before training starts.
- `RunSummary`: steps, tokens, mean tokens/s, measured vs predicted step time, best and final
  loss, the peak memory (max over ranks and steps), the skipped fp16 steps and the last
  checkpoint, printed and written to `<out>/summary.json`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshplan.errors import ConfigError
from meshplan.train.metrics import (
    StepMetrics,
    peak_memory_gb,
    peak_reserved_gb,
    reset_peak_memory,
)

__all__ = ["LOGGERS", "Loggers", "MemoryPeak", "RunSummary", "StepMemory", "check_loggers"]

LOGGERS = ("tensorboard", "wandb")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_loggers(kinds: tuple[str, ...]) -> None:
    """Refuse an unknown logger, or one whose package is not installed, naming what to install."""
    for kind in kinds:
        if kind not in LOGGERS:
            raise ConfigError(f"unknown logger {kind!r}; --log takes a comma-separated list of {', '.join(LOGGERS)}")
        if importlib.util.find_spec(_PACKAGES[kind]) is None:
            raise ConfigError(f"--log {kind} needs the {_PACKAGES[kind]!r} package, which is not installed: "
                              f"pip install {_PACKAGES[kind]} (or leave {kind} out of --log)")


class Loggers:
    """TensorBoard and/or wandb on rank 0 (see the module docstring); every numeric field of a
    StepMetrics becomes a scalar `train/<field>` at its step."""

    def __init__(self, kinds: tuple[str, ...], out: Path, *, config: dict[str, Any] | None = None) -> None:
        check_loggers(kinds)
        self.tb = self.wandb = None
        if "tensorboard" in kinds:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(log_dir=str(out / "tb"))
        if "wandb" in kinds:
            import wandb
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "meshplan"), name=out.name,
                                    dir=str(out), config=config or {}, resume="allow")

    def log(self, m: StepMetrics) -> None:
        scalars = {k: float(v) for k, v in m.to_dict().items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if m.skipped is not None:
            scalars["skipped"] = float(m.skipped)
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(f"train/{k}", v, m.step)
        if self.wandb is not None:
            self.wandb.log({f"train/{k}": v for k, v in scalars.items()}, step=m.step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


@dataclass(frozen=True, kw_only=True)
class MemoryPeak:
    """One step's peak memory over the ranks (GiB)."""

    peak_gb: float                  # max over ranks of each rank's peak
    rank: int                       # the rank with that peak
    reserved_gb: float | None       # CUDA: max over ranks of the allocator's reserved peak
    per_rank_gb: tuple[float, ...]


class StepMemory:
    """Per-step peak memory of this rank, gathered over ranks (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.resets = reset_peak_memory(device)      # False: a platform whose peak cannot be reset

    def begin(self) -> None:
        reset_peak_memory(self.device)

    def end(self) -> MemoryPeak:
        """This step's peak on every rank (collective: one all-gather of two numbers per rank)."""
        reserved = peak_reserved_gb(self.device)
        mine = torch.tensor([[peak_memory_gb(self.device), -1.0 if reserved is None else reserved]],
                            dtype=torch.float64, device=self.device)                          # (1, 2)
        world = dist.get_world_size() if dist.is_initialized() else 1
        every = [torch.empty_like(mine) for _ in range(world)]
        if world > 1:
            dist.all_gather(every, mine)
        else:
            every = [mine]
        table = torch.cat(every).cpu()                                                          # (world, 2)
        rank = int(table[:, 0].argmax())
        res = float(table[:, 1].max())
        return MemoryPeak(peak_gb=float(table[rank, 0]), rank=rank, reserved_gb=None if res < 0 else res,
                          per_rank_gb=tuple(float(v) for v in table[:, 0]))


# a run whose mean step is this far from the prediction (either way) says how to price the machine
PREDICTION_OFF = 1.5


@dataclass
class RunSummary:
    """Accumulates the steps of one train() call; `finish` prints it and writes summary.json."""

    seq_len: int
    start_step: int = 0
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    predicted_s: float = 0.0                # sum of the predicted step times (steps with a prediction)
    predicted_steps: int = 0
    best_loss: float | None = None
    best_step: int | None = None
    final_loss: float | None = None
    final_step: int | None = None
    peak_memory_gb: float = 0.0
    peak_memory_rank: int | None = None
    peak_memory_per_rank_gb: list[float] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)

    def add(self, m: StepMetrics, *, memory: MemoryPeak | None = None) -> None:
        self.steps += 1
        batch = m.global_batch or 0
        self.tokens += batch * self.seq_len
        self.seconds += m.step_time_s
        if m.predicted_step_time_s is not None:
            self.predicted_s += m.predicted_step_time_s
            self.predicted_steps += 1
        if math.isfinite(m.loss) and (self.best_loss is None or m.loss < self.best_loss):
            self.best_loss, self.best_step = m.loss, m.step
        self.final_loss, self.final_step = m.loss, m.step
        if m.skipped:
            self.skipped_steps.append(m.step)
        if memory is not None:
            if memory.peak_gb >= self.peak_memory_gb:
                self.peak_memory_gb, self.peak_memory_rank = memory.peak_gb, memory.rank
            per = list(memory.per_rank_gb)
            self.peak_memory_per_rank_gb = [max(a, b) for a, b in zip(self.peak_memory_per_rank_gb, per)] \
                if self.peak_memory_per_rank_gb else per

    def to_dict(self, *, checkpoint: str | None, loss_scale: float | None = None) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            tokens_per_s=self.tokens / self.seconds if self.seconds > 0 else None,
            mean_step_time_s=self.seconds / self.steps if self.steps else None,
            mean_predicted_step_time_s=self.predicted_s / self.predicted_steps if self.predicted_steps else None,
            checkpoint=checkpoint, loss_scale=loss_scale)
        for k in ("seconds", "predicted_s", "predicted_steps"):
            d.pop(k)
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}

    def finish(self, out: Path, *, checkpoint: str | None, loss_scale: float | None = None,
               stream=None) -> dict[str, Any]:
        """Write `out`/summary.json and print the summary (rank 0 calls it)."""
        import sys
        d = self.to_dict(checkpoint=checkpoint, loss_scale=loss_scale)
        (out / "summary.json").write_text(json.dumps(d, indent=1) + "\n")
        stream = stream or sys.stdout
        if self.steps:
            pred = d["mean_predicted_step_time_s"]
            lines = [(f"run summary: steps {self.start_step + 1}..{self.final_step} ({self.steps} steps), "
                      f"{self.tokens:,} tokens, {d['tokens_per_s'] or 0.0:.1f} tokens/s"),
                     f"  step time {d['mean_step_time_s']:.3f} s" + (f" (predicted {pred:.3f} s)" if pred else "")]
            ratio = d["mean_step_time_s"] / pred if pred else 1.0
            if not 1 / PREDICTION_OFF < ratio < PREDICTION_OFF:
                # a preset's rates were measured on another machine (local-cpu's on one 2-core VM: a CPU
                # without fast bf16 matmuls runs its job ~3x slower), a calibrated profile prices this one
                lines.append(f"  measured {ratio:.1f}x the predicted step: the plan priced the cluster it was given, "
                             "whose rates come from another machine unless calibrated; `meshplan calibrate --quick "
                             "--nproc <processes> --out this.json` measures this one, `--cluster this.json` plans "
                             "with it")
            lines += [f"  loss: final {self.final_loss:.4f}" + (f", best {self.best_loss:.4f} at step {self.best_step}"
                                                                 if self.best_loss is not None else ""),
                      f"  peak memory {self.peak_memory_gb:.2f} GiB (rank {self.peak_memory_rank})"]
            if self.skipped_steps:
                lines.append(f"  skipped {len(self.skipped_steps)} steps on inf/nan gradients (fp16): "
                             f"{self.skipped_steps[:10]}; final loss scale {loss_scale:g}")
            lines.append(f"  checkpoint {checkpoint}; summary -> {out / 'summary.json'}")
            print("\n".join(lines), file=stream, flush=True)
        return d
