"""Batch-size schedules for the training loop: the global batch by step.

Two ways to say it, one mechanism (`meshplan.ir.rampup.BatchPhases`):

- a step-based schedule, ``--batch-schedule "0:64,100:128,500:256"``: from step 0 the global
  batch is 64 sequences, from step 100 it is 128, from step 500 on 256 (`StepBatchSchedule`);
- Megatron's linear ramp-up, ``--rampup-batch-size start increment samples`` (`BatchRampup`).

Either way the layout never changes: the micro-batch size stays the plan's and only the number
of micro-batches per step does, so every batch must be a multiple of dp x mbs. The plan is made
for the final (largest) batch. Step k reads the samples ``consumed(k) .. consumed(k) +
batch_size(k)`` of the data order, pure functions of k, so a run resumed mid-schedule continues
exactly. Under pipeline parallelism the pipeline schedule is built once per micro-batch count
(`meshplan.runtime.pipeline.ScheduleCache`); `check_pipeline` builds them all before step 1, so a
count the schedule cannot run (1F1B needs at least pp micro-batches) is refused up front.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from meshplan.errors import ConfigError
from meshplan.ir.rampup import BatchPhases, BatchRampup

__all__ = ["StepBatchSchedule", "batch_schedule_for", "check_pipeline", "parse_batch_schedule"]

_EXAMPLE = '"0:64,100:128,500:256"'


def parse_batch_schedule(spec: str | Sequence) -> tuple[tuple[int, int], ...]:
    """``"0:64,100:128"`` (or [(0, 64), (100, 128)]) -> ((0, 64), (100, 128)); checks the form only
    (first step 0, steps rising, batches >= 1 and never shrinking)."""
    if isinstance(spec, str):
        pairs = []
        for part in (p.strip() for p in spec.split(",") if p.strip()):
            step, sep, batch = part.partition(":")
            try:
                pairs.append((int(step), int(batch)))
            except ValueError:
                raise ConfigError(f"--batch-schedule: {part!r} is not STEP:GLOBAL_BATCH (whole numbers); "
                                  f"write the schedule as {_EXAMPLE}") from None
            if not sep:
                raise ConfigError(f"--batch-schedule: {part!r} is not STEP:GLOBAL_BATCH; e.g. {_EXAMPLE}")
    else:
        try:
            pairs = [(s, b) for s, b in spec]
        except (TypeError, ValueError):
            raise ConfigError(f"batch_schedule must be (step, global batch) pairs, e.g. ((0, 64), (100, 128)); "
                              f"got {spec!r}") from None
        if any(isinstance(v, bool) or not isinstance(v, int) for p in pairs for v in p):
            raise ConfigError(f"batch_schedule must hold whole numbers, got {spec!r}")
    if not pairs:
        raise ConfigError(f"--batch-schedule is empty; give STEP:GLOBAL_BATCH pairs, e.g. {_EXAMPLE}")
    if pairs[0][0] != 0:
        raise ConfigError(f"--batch-schedule must start at step 0 (the first batch size), got {pairs[0][0]}:"
                          f"{pairs[0][1]}; e.g. {_EXAMPLE}")
    for (s0, b0), (s1, b1) in pairwise(pairs):
        if s1 <= s0:
            raise ConfigError(f"--batch-schedule steps must rise: {s1}:{b1} comes after {s0}:{b0}")
        if b1 < b0:
            # the plan (memory, micro-batch count) is made for the final batch as the largest
            raise ConfigError(f"--batch-schedule batches must not shrink: {s1}:{b1} after {s0}:{b0}; the "
                              "plan is made for the final, largest batch")
    for s, b in pairs:
        if b < 1:
            raise ConfigError(f"--batch-schedule pair {s}:{b}: the global batch must be >= 1")
    return tuple(pairs)


class StepBatchSchedule(BatchPhases):
    """Global batch by step from (first step, global batch) pairs (see the module docstring).
    `multiple`: dp x micro-batch size; `final`: the plan's global batch, which the last pair must be."""

    def __init__(self, pairs: Sequence[tuple[int, int]] | str, *, final: int, multiple: int = 1,
                 multiple_note: str = ""):
        self.pairs = parse_batch_schedule(pairs)
        for step, batch in self.pairs:
            if batch % multiple:
                lo, hi = batch // multiple * multiple, (batch // multiple + 1) * multiple
                near = f"{step}:{lo} or {step}:{hi}" if lo else f"{step}:{hi}"
                raise ConfigError(
                    f"--batch-schedule pair {step}:{batch}: global batch {batch} is not a multiple of dp x "
                    f"micro-batch size = {multiple}{multiple_note}, so it does not split into whole "
                    f"micro-batches on every data-parallel rank; nearest valid: {near}")
        last = self.pairs[-1][1]
        if last != final:
            raise ConfigError(f"--batch-schedule ends at a global batch of {last}, but the plan was made for "
                              f"{final}; plan for the final batch (--global-batch {last}) or end the schedule "
                              f"at {final}")
        self.final = final
        self.phases = []
        consumed = 0
        for (step, batch), nxt in zip(self.pairs, self.pairs[1:] + ((None, None),)):
            self.phases.append((step, consumed, batch))
            if nxt[0] is not None:
                consumed += (nxt[0] - step) * batch

    def __repr__(self) -> str:
        return f"StepBatchSchedule({','.join(f'{s}:{b}' for s, b in self.pairs)})"

    def state(self) -> list:
        return ["steps", [list(p) for p in self.pairs]]


def batch_schedule_for(plan, config) -> BatchPhases | None:
    """The batch-size schedule of a TrainConfig for `plan` (None: the plan's batch every step)."""
    lay = plan.layout
    dp = plan.mesh.get("dp", 1)
    multiple = dp * lay.mbs
    if config.batch_schedule is not None:
        return StepBatchSchedule(config.batch_schedule, final=plan.global_batch, multiple=multiple,
                                 multiple_note=f" (dp={dp}, mbs={lay.mbs})")
    if config.rampup_batch_size is not None:
        start, increment, samples = config.rampup_batch_size
        return BatchRampup(start, increment, samples, final=plan.global_batch, multiple=multiple)
    return None


def check_pipeline(pm, schedule: BatchPhases | None) -> None:
    """Build the pipeline schedule for every micro-batch count `schedule` uses (pp > 1), so that
    a count the pipeline schedule cannot run is refused before step 1, naming the batch."""
    cache = getattr(pm, "schedules", None)
    if schedule is None or cache is None:
        return
    per = pm.plan.mesh.get("dp", 1) * pm.plan.layout.mbs
    for batch in schedule.sizes():
        try:
            cache.get(batch // per)
        except ValueError as e:
            raise ConfigError(f"global batch {batch} gives {batch // per} micro-batches (dp x mbs = {per}), which "
                              f"the {pm.plan.schedule!r} pipeline schedule with pp={pm.plan.mesh['pp']} cannot run "
                              f"({e}); start the batch schedule at a batch of at least "
                              f"{per * pm.plan.mesh['pp']}") from None
