"""Pipeline schedules: bubble time and micro-batches in flight (cost_models.md §6).

Given per-rank times for one micro-batch (forward + backward of all the rank's chunks),
the step's pipeline time is `m * t_slowest + bubble`. With uniform ranks the bubble is:
  1F1B / GPipe   (p-1)(t_F+t_B)                          Narayanan et al. SC'21 §2.2
  interleaved    (p-1)(t_F+t_B)/v                        ibid.
  ZB-H1 ("zb")   (p-1)(t_F+t_B-2 t_W)                    Qi et al. ICLR'24
  ZB-V ("zbv")   ~0 once m >= 2p; (p-1)(t_F+t_B-2t_W) below that (the V needs enough micro-batches)
For uneven ranks the (p-1)*t term becomes sum(t_r) - max(t_r): the fill and drain walk every rank.
"""

from __future__ import annotations

__all__ = ["pipeline_time", "pipeline_time_lower_bound", "in_flight", "ep_unpaired_steps"]


def pipeline_time(schedule: str, m: int, vp: int, rank_fb: list[float], rank_w: list[float]) -> tuple[float, float]:
    """(busy time of the slowest rank, bubble) for one step.

    rank_fb[r]: forward+backward seconds of rank r for one micro-batch (all its chunks);
    rank_w[r]: the weight-gradient part of that backward.
    """
    p = len(rank_fb)
    t_max = max(rank_fb)
    busy = m * t_max
    if p == 1:
        return busy, 0.0
    fill = sum(rank_fb) - t_max
    if schedule == "interleaved":
        bubble = fill / vp
    elif schedule in ("zb", "zbv"):
        w = sum(rank_w) - max(rank_w)
        bubble = max(0.0, fill - 2 * w)
        if schedule == "zbv":
            bubble = bubble / vp if m < 2 * p else 0.0
    else:   # "1f1b", "gpipe"
        bubble = fill
    return busy, bubble


def pipeline_time_lower_bound(schedule: str, m: int, vp: int, p: int, total_fb: float) -> float:
    """A lower bound on busy + bubble of `pipeline_time` for `p` ranks whose per-micro-batch times
    sum to at least `total_fb`, however the work is split between them (the search's bound).

    With t_max >= sum/p: 1F1B's m t_max + (sum - t_max) = (m - 1) t_max + sum; interleaved's
    m t_max + (sum - t_max)/vp = (m - 1/vp) t_max + sum/vp; the zero-bubble schedules' bubble may
    vanish, leaving m t_max. Each is smallest at t_max = sum/p and grows with sum."""
    if p <= 1:
        return m * total_fb
    if schedule == "interleaved":
        return (m - 1 / vp) * total_fb / p + total_fb / vp
    if schedule in ("zb", "zbv"):
        return m * total_fb / p
    return (m - 1) * total_fb / p + total_fb       # "1f1b", "gpipe"


def in_flight(schedule: str, m: int, p: int, vp: int, rank: int) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak, in units of
    (all of the rank's layers for one micro-batch)."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved" and vp > 1:
        # Megatron-Core's interleaved 1F1B (pipeline_parallel/schedules.py,
        # forward_backward_pipelining_with_interleaving; torch.distributed.pipelining's Interleaved1F1B
        # counts alike) runs (p - rank - 1) * 2 + (vp - 1) * p chunk forwards before its first backward
        # and one more in step with it; every chunk's forward when m == p. Each chunk is 1/vp of the
        # rank's layers. On rank 0 that is Korthikanti's p * (1 + (p-1)/(p*vp)); the last rank still
        # holds (vp - 1) * p + 1 chunks, close to p micro-batches, not 1F1B's one.
        warmup = (p - rank - 1) * 2 + (vp - 1) * p
        return float(m) if m == p else min(warmup + 1, m * vp) / vp
    return float(min(m, p - rank))


def ep_unpaired_steps(pp: int, vp: int, m: int, rank: int) -> int:
    """Chunk-steps of pipeline rank `rank` that Megatron-Core's merged 1F1B schedule (its expert
    all-to-all overlap, --overlap-moe-expert-parallel-comm) runs with no partner: it pairs one
    micro-batch's forward of a model chunk with another's backward, so its warm-up forwards and the
    as many cool-down backwards run alone, their all-to-alls exposed. Counted from the schedule's
    code (megatron/core/pipeline_parallel/schedules.py, get_schedule_table / the interleaved warm-up:
    2(pp - 1 - rank) + (vp - 1) * pp forwards, one more with the overlap "to ensure the forward and
    backward computations are independent in all 1f1b steps"; combined_1f1b.py without pipelining:
    the first forward and the last backward alone), at most every one of the m * vp steps."""
    if pp == 1:
        return min(m, 1)
    return min(m * vp, 2 * (pp - 1 - rank) + (vp - 1) * pp + 1)
