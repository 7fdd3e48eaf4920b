"""Per-step training metrics: a JSONL log, a one-line progress display, MFU and peak memory.

    log = MetricsLog("run/metrics.jsonl")          # appends; safe to reopen after a resume
    progress = Progress(total_steps=100)            # stderr; rewrites one line on a TTY
    m = StepMetrics(step=12, loss=3.21, grad_norm=0.9, lr=3e-4, tokens_per_s=4100.0,
                    step_time_s=0.84, predicted_step_time_s=0.80, mfu=0.012, peak_memory_gb=1.5)
    log.write(m); progress.update(m)
    # step 12/100 loss 3.21 tok/s 4.1k step 0.84 s (pred 0.80 s) mfu 1.2%

MoE models add their routing statistics (meshplan.runtime.expert_parallel.MoEBalancer, global
over the data-parallel ranks and the step's micro-batches): `moe_imbalance` (max over layers of
max/mean tokens per expert; 1.0 is perfect balance), `moe_imbalance_mean` (mean over layers),
`moe_aux_loss` and `moe_z_loss` (mean over layers, before their coefficients), `moe_dropped`
(fraction of token copies a capacity factor dropped) and `moe_layers` (those per layer); the
console line shows "moe max/mean 1.31 aux 1.02 z 0.41 drop 0.0%".

Only one process (global rank 0) should write the log and the display.
Memory is in GiB (2^30 bytes), like `Estimate.peak_memory_gb`.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any

from meshplan.errors import ConfigError

__all__ = ["StepMetrics", "MetricsLog", "read_metrics", "moe_metrics", "Progress", "format_progress", "mfu",
           "peak_memory_gb", "peak_reserved_gb", "reset_peak_memory", "human_count"]

GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """What one optimizer step measured. Optional fields are None when not known (no plan, no GPU peak)."""

    step: int
    loss: float
    grad_norm: float | None = None
    lr: float
    tokens_per_s: float
    step_time_s: float
    predicted_step_time_s: float | None = None
    cpu_time_s: float | None = None        # CPU seconds rank 0's process used in the step (all its threads):
                                           #   on CPU processes the step's work, apart from time-sharing
    cpu_update_s: float | None = None      # the part of cpu_time_s after forward and backward (gradient
                                           #   clipping, optimizer, routing statistics): the cost model's
                                           #   optimizer + overhead terms, apart from the loss all-reduce
    mfu: float | None = None               # fraction of peak, 0..1
    peak_memory_gb: float | None = None    # this step's peak, max over ranks (see peak_memory_gb())
    peak_memory_rank: int | None = None    # the rank that had it
    peak_reserved_gb: float | None = None  # CUDA: the caching allocator's reserved peak (max over ranks)
    param_norm: float | None = None        # global L2 norm of the weights (every shard, as one model)
    loss_scale: float | None = None        # fp16 dynamic loss scale used this step
    skipped: bool | None = None            # fp16: the step saw inf/nan gradients and did not update
    global_batch: int | None = None        # sequences this step (changes during a batch-size ramp-up)
    eval_loss: float | None = None         # validation loss after this step (steps where it was measured)
    moe_imbalance: float | None = None     # MoE: max over layers of max/mean tokens per expert
    moe_imbalance_mean: float | None = None
    moe_aux_loss: float | None = None      # mean over layers, before the coefficient
    moe_z_loss: float | None = None
    moe_dropped: float | None = None       # fraction of token copies dropped by a capacity factor
    moe_layers: dict | None = None         # {layer: {imbalance, aux_loss, z_loss, dropped}}

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ConfigError(f"step must be a whole number >= 0, got {self.step!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name not in ("step", "moe_layers", "skipped") and v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ConfigError(f"metric {f.name} must be a number, got {v!r}")
        for name in ("step_time_s", "tokens_per_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"metric {name} must be >= 0, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        # JSON has no NaN/inf: a diverged loss is written as null, not as an unparsable token;
        # fields that are None and not in every record (batch, MoE) are left out
        optional = ("peak_memory_rank", "peak_reserved_gb", "param_norm", "loss_scale", "skipped",
                    "global_batch", "eval_loss", "moe_imbalance", "moe_imbalance_mean", "moe_aux_loss", "moe_z_loss",
                    "moe_dropped", "moe_layers")
        return {k: _finite(v) for k, v in asdict(self).items() if not (k in optional and v is None)}


class MetricsLog:
    """Append-only JSONL file, one object per step.

    Each record goes out in a single write() on a file opened with O_APPEND, then is flushed,
    so concurrent appenders and readers never see interleaved or half records. A line cut off
    by a crash is closed with a newline on reopen; `read_metrics` skips it.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: IO[str] | None = open(self.path, "a", encoding="utf-8")
        if self.path.stat().st_size:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._f.write("\n")
                    self._f.flush()

    def write(self, metrics: StepMetrics | dict[str, Any]) -> None:
        if self._f is None:
            raise ConfigError(f"metrics log {self.path} is closed")
        record = metrics.to_dict() if isinstance(metrics, StepMetrics) else dict(metrics)
        self._f.write(json.dumps(record, allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | os.PathLike, *, last_per_step: bool = True) -> list[dict[str, Any]]:
    """Records of a metrics log in step order; unparsable lines (a crash mid-write) are skipped.

    A resumed run logs again the steps after its checkpoint; with last_per_step the latest
    record of each step wins.
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                records.append(rec)
    if not last_per_step:
        return records
    by_step = {r["step"]: r for r in records}
    return [by_step[s] for s in sorted(by_step)]


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    return v


def moe_metrics(routing: dict) -> dict[str, Any]:
    """StepMetrics fields from `MoEBalancer.finish_step()`'s summary (nothing for a dense model)."""
    if not routing:
        return {}
    keys = ("imbalance", "aux_loss", "z_loss", "dropped")
    return {"moe_imbalance": routing["imbalance"], "moe_imbalance_mean": routing["imbalance_mean"],
            "moe_aux_loss": routing["aux_loss"], "moe_z_loss": routing["z_loss"], "moe_dropped": routing["dropped"],
            "moe_layers": {name: {k: round(float(s[k]), 6) for k in keys} for name, s in routing["layers"].items()}}


# ---- display -----------------------------------------------------------------------------
def human_count(x: float) -> str:
    """4100 -> '4.1k', 2.5e6 -> '2.5M', 812 -> '812'."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{suffix}"
    return f"{x:.0f}"


def format_progress(m: StepMetrics, total_steps: int | None = None) -> str:
    """'step 12/100 loss 3.21 tok/s 4.1k step 0.84 s (pred 0.80 s) mfu 1.2%' (absent parts left out)."""
    parts = [f"step {m.step}/{total_steps}" if total_steps else f"step {m.step}", f"loss {m.loss:.2f}",
             f"tok/s {human_count(m.tokens_per_s)}"]
    if m.eval_loss is not None:
        parts.insert(2, f"eval loss {m.eval_loss:.2f}")
    timing = f"step {m.step_time_s:.2f} s"
    if m.predicted_step_time_s is not None:
        timing += f" (pred {m.predicted_step_time_s:.2f} s)"
    parts.append(timing)
    if m.mfu is not None:
        parts.append(f"mfu {100 * m.mfu:.1f}%")
    if m.peak_memory_gb is not None:
        parts.append(f"mem {m.peak_memory_gb:.1f} GB")
    if m.global_batch is not None:
        parts.append(f"batch {m.global_batch}")
    if m.skipped:
        parts.append(f"skipped (inf/nan gradients; loss scale -> {m.loss_scale:g})")
    if m.moe_imbalance is not None:
        moe = f"moe max/mean {m.moe_imbalance:.2f}"
        if m.moe_aux_loss is not None:
            moe += f" aux {m.moe_aux_loss:.3f}"
        if m.moe_z_loss:
            moe += f" z {m.moe_z_loss:.3f}"
        if m.moe_dropped:
            moe += f" drop {100 * m.moe_dropped:.1f}%"
        parts.append(moe)
    return " ".join(parts)


class Progress:
    """Progress on one line: rewritten in place with \\r on a terminal, one plain line per update
    otherwise (log files and CI keep every line)."""

    def __init__(self, *, total_steps: int | None = None, stream: IO[str] | None = None, tty: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.total_steps = total_steps
        self.tty = bool(tty if tty is not None else getattr(self.stream, "isatty", lambda: False)())
        self._width = 0

    def update(self, metrics: StepMetrics) -> str:
        line = format_progress(metrics, self.total_steps)
        if self.tty:
            # pad with spaces so a shorter line fully covers the previous one
            self.stream.write("\r" + line.ljust(self._width))
            self._width = max(self._width, len(line))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        return line

    def close(self) -> None:
        """End the in-place line so later output starts on a fresh one."""
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


# ---- derived numbers ---------------------------------------------------------------------
def mfu(model_flops_per_step: float, step_time_s: float, peak_flops_per_gpu: float, num_gpus: int) -> float:
    """Model FLOPs utilisation (0..1): model FLOPs of one step (all GPUs, no recompute, as in
    `Estimate.model_tflops_per_gpu`) over what the GPUs could do in that time at peak."""
    if step_time_s <= 0 or peak_flops_per_gpu <= 0 or num_gpus < 1:
        raise ConfigError(f"mfu needs a positive step time, peak FLOP/s and GPU count; got "
                          f"{step_time_s!r} s, {peak_flops_per_gpu!r} FLOP/s, {num_gpus!r} GPUs")
    return model_flops_per_step / (step_time_s * peak_flops_per_gpu * num_gpus)


def _on_cuda(device: Any) -> bool:
    import torch
    dev = torch.device(device) if device is not None else None
    return (dev is None and torch.cuda.is_available()) or (dev is not None and dev.type == "cuda")


def peak_memory_gb(device: Any = None) -> float:
    """Peak memory in GiB since the last `reset_peak_memory`: on CUDA, torch's max allocated bytes
    on `device`; on CPU, the peak resident set size of this whole process (Linux: VmHWM, which a
    reset sets back to the current RSS; elsewhere the max RSS of the process's life). The CPU
    number counts everything resident - the interpreter, torch, the data - not only tensors."""
    import torch
    if _on_cuda(device):
        return torch.cuda.max_memory_allocated(device) / GIB
    hwm = _proc_status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024 / GIB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024) / GIB     # Linux reports KiB, macOS bytes


def peak_reserved_gb(device: Any = None) -> float | None:
    """CUDA: the caching allocator's peak reserved bytes since the last reset (GiB); None on CPU."""
    import torch
    return torch.cuda.max_memory_reserved(device) / GIB if _on_cuda(device) else None


def reset_peak_memory(device: Any = None) -> bool:
    """Start a new peak for `peak_memory_gb`; False where the platform cannot (a CPU process
    off Linux: its max RSS only grows)."""
    import torch
    if _on_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:        # Linux: writing 5 to clear_refs resets the process's peak RSS (VmHWM) to its RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None
