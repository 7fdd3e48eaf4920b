"""`Estimate`: the cost model's prediction for one training step of one layout, per GPU.

Produced by `meshplan.cost_models.estimate.estimate_profile`; carried inside a `Plan`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from meshplan.ir.layout import Layout
from meshplan.ir.precision import PRICED

__all__ = ["Estimate", "PRECISIONS", "TIME_KEYS", "GB"]

PRECISIONS = tuple(p.value for p in PRICED)       # what the cost model prices (ir/precision.py)
# Memory is reported in GiB (2^30 bytes), the unit torch.cuda and nvidia-smi use; the "80 GB" of an
# H100 is 80 GiB. The cluster's usable memory already excludes the CUDA context, NCCL buffers and
# allocator fragmentation (meshplan.cluster).
GB = 2 ** 30
# the step-time split, in the order reports show it
TIME_KEYS = ("compute", "tp", "cp", "ep", "pp", "dp", "bubble", "optimizer", "overhead")


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """Predicted cost of one training step of one layout, per GPU."""

    step_time_s: float
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu: float        # Megatron convention: fwd+bwd, no recompute, causal attention halved
    hardware_tflops_per_gpu: float     # + recomputed forward passes
    mfu: float                         # model FLOP/s / dense BF16 peak (FP8 runs included)
    hfu: float
    peak_memory_gb: float
    memory_gb: dict[str, float]        # by category, on the pipeline rank with the peak
    memory_by_stage: tuple[dict[str, float], ...]   # by category for each pipeline rank
    capacity_gb: float
    fits: bool
    time_s: dict[str, float]           # step time split: compute, exposed tp/cp/ep/pp/dp, bubble, optimizer, overhead
    comm_s: dict[str, float]           # total communication time per dimension (hidden + exposed)
    num_microbatches: int
    peak_stage: int
    layout: Layout                     # the layout priced, its defaults resolved
    seq_len: int
    global_batch: int
    precision: str
    model: str
    cluster: str
    num_gpus: int
    bottleneck: str = ""
    notes: tuple[str, ...] = field(default=())
    # How sure the prediction is (meshplan.cost_models.uncertainty): relative band of the step time,
    # from the validation error of each mechanism the step leans on, and each component's share
    uncertainty: float = 0.0
    uncertainty_s: dict[str, float] = field(default_factory=dict)
    regime: dict[str, bool] = field(default_factory=dict)
    # the software stack priced (meshplan.ir.stack) and, where the layout sits in a regime the
    # validation table covers thinly, one note per such regime (the band is at least its error); on
    # GPUs also a note where the predicted peak is close to the usable memory (uncertainty.memory_pressure)
    # and one where MoE layers wait on the host for a large share of the step (uncertainty.moe_host_risk)
    stack: str = ""
    extrapolation: tuple[str, ...] = ()
    # A risk the point estimate cannot price, on the upper side only: a MoE model trained without load
    # balancing (moe_balance "none") is priced balanced, and its busiest EP rank may receive up to
    # moe_worst_load x the mean rows; uncertainty_high is what that adds to the step, relative to it
    # (meshplan.cost_models.uncertainty.imbalance_risk). moe_balance: the profile's ("" = dense model).
    uncertainty_high: float = 0.0
    moe_balance: str = ""
    moe_worst_load: float = 1.0

    def __post_init__(self) -> None:
        # readers use the layout's attributes and methods; a dict here would fail far from its source
        if not isinstance(self.layout, Layout):
            raise TypeError(f"Estimate.layout must be a Layout, not {type(self.layout).__name__} "
                            "(Layout.from_dict reads a layout's dict)")

    @property
    def step_time_range_s(self) -> tuple[float, float]:
        """(low, high) step time inside the band; the high end adds the upper-side risk (the worst
        case is a bound, not a random error, so it adds to the band rather than in quadrature)."""
        return (self.step_time_s * (1 - self.uncertainty),
                self.step_time_s * (1 + self.uncertainty + self.uncertainty_high))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layout"] = self.layout.to_dict()      # Layout's own form (stage_layers a list), not asdict's
        d["memory_by_stage"] = list(d["memory_by_stage"])
        d["notes"] = list(d["notes"])
        d["extrapolation"] = list(d["extrapolation"])
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Estimate":
        d = dict(d)
        d["layout"] = Layout.from_dict(d["layout"])
        d["memory_by_stage"] = tuple(d["memory_by_stage"])
        d["notes"] = tuple(d.get("notes", ()))
        d["extrapolation"] = tuple(d.get("extrapolation", ()))
        return cls(**d)

    def _band(self) -> str:
        if self.uncertainty_high:
            return f"+{(self.uncertainty + self.uncertainty_high) * 100:.0f}% / -{self.uncertainty * 100:.0f}%"
        return f"+/- {self.uncertainty * 100:.0f}%"

    def summary(self) -> str:
        t = self.time_s
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items() if v > 0)
        mem = ", ".join(f"{k} {v:.1f}" for k, v in self.memory_gb.items() if v > 0.05)
        return (f"{self.model} on {self.num_gpus}x {self.cluster} [{self.layout.short()}] "
                f"{self.precision}\n"
                f"  step {self.step_time_s:.3f} s ({self._band()}) = {parts}\n"
                f"  {self.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {self.model_tflops_per_gpu:.0f} model TFLOP/s/GPU, "
                f"MFU {self.mfu * 100:.1f}%\n"
                f"  memory {self.peak_memory_gb:.1f} / {self.capacity_gb:.1f} GB on stage {self.peak_stage} "
                f"({mem}) -> {'fits' if self.fits else 'DOES NOT FIT'}\n"
                f"  bottleneck: {self.bottleneck}")
