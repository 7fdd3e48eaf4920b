"""Batch-size ramp-up (Megatron's ``--rampup-batch-size start increment samples``): the global
batch by step. Shared by the training loop's sampler (meshplan.train.data) and the what-if
report's time to train (meshplan.reports.whatif), so both count the same steps.

The batch grows from `start` by `increment` each time another samples/increments samples have
been consumed, until it reaches the plan's global batch; step k reads the samples
``consumed(k) .. consumed(k) + batch_size(k)``, pure functions of k, so a run resumed in the
middle of a ramp continues exactly.
"""

from __future__ import annotations

import math

from meshplan.errors import ConfigError

__all__ = ["BatchPhases", "BatchRampup"]


class BatchPhases:
    """A global batch size that changes by step: `phases` lists, for each size, (first step,
    samples consumed before it, batch size), in step order. Every batch-size schedule (the linear
    ramp-up here, the step-based `meshplan.train.batch_schedule.StepBatchSchedule`) is one of these,
    so the sampler, the training loop and the time-to-train report read them one way."""

    phases: list[tuple[int, int, int]]
    final: int                                  # the last (and largest) batch: what the plan is made for

    def state(self) -> list:
        """What identifies the schedule in a checkpoint's data position (a resume must match it)."""
        raise NotImplementedError

    @property
    def end_step(self) -> int:
        """The first step at the final global batch."""
        return self.phases[-1][0]

    def _phase(self, step: int) -> tuple[int, int, int]:
        return next(p for p in reversed(self.phases) if p[0] <= step)

    def batch_size(self, step: int) -> int:
        return self._phase(step)[2]

    def consumed(self, step: int) -> int:
        """Samples read by the steps before `step`."""
        first, consumed, size = self._phase(step)
        return consumed + (step - first) * size

    def steps_for(self, samples: int) -> int:
        """Steps needed to consume `samples` samples."""
        first, consumed, size = next(p for p in reversed(self.phases) if p[1] <= samples)
        return first + -(-(samples - consumed) // size)

    def sizes(self) -> list[int]:
        """The distinct batch sizes that some step uses, in order (a ramp-up phase may last 0 steps)."""
        used = [p[2] for p, nxt in zip(self.phases, self.phases[1:] + [None]) if nxt is None or nxt[0] > p[0]]
        return list(dict.fromkeys(used))


class BatchRampup(BatchPhases):
    """Global batch size by step during a ramp-up (see the module docstring); `final` is the
    plan's global batch. `multiple`: every batch must be a multiple of it (dp x micro-batch size)."""

    def __init__(self, start: int, increment: int, samples: int, *, final: int, multiple: int = 1):
        for name, value, low in (("start", start, 1), ("increment", increment, 1), ("samples", samples, 1),
                                 ("final", final, 1), ("multiple", multiple, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"--rampup-batch-size {name} must be a whole number >= {low}, got {value!r}")
        if start >= final:
            raise ConfigError(f"--rampup-batch-size start {start} must be below the global batch {final}; "
                              f"e.g. start={max(multiple, final // 4 // multiple * multiple)}")
        if (final - start) % increment:
            raise ConfigError(f"--rampup-batch-size: the global batch {final} minus start {start} is not a multiple "
                              f"of the increment {increment}; use an increment dividing {final - start}")
        for name, value in (("start", start), ("increment", increment)):
            if value % multiple:
                good = max(multiple, value // multiple * multiple)
                raise ConfigError(
                    f"--rampup-batch-size {name}={value} is not a multiple of dp x micro-batch size = {multiple}: "
                    f"every batch of the ramp must split into whole micro-batches on every data-parallel "
                    f"rank; use {name}={good}")
        self.start, self.increment, self.samples, self.final = start, increment, samples, final
        increments = (final - start) // increment
        per_increment = samples / increments               # samples consumed per batch size
        # phases[j] = (first step, consumed samples at it, batch size) for each batch size
        self.phases: list[tuple[int, int, int]] = []
        step, consumed = 0, 0
        for j in range(increments):
            size = start + j * increment
            self.phases.append((step, consumed, size))
            # Megatron: size = start + floor(consumed / per_increment) * increment
            n = max(0, math.ceil(((j + 1) * per_increment - consumed) / size))   # steps at this size
            step, consumed = step + n, consumed + n * size
        self.phases.append((step, consumed, final))

    def __repr__(self) -> str:
        return f"BatchRampup(start={self.start}, increment={self.increment}, samples={self.samples}, final={self.final})"

    def state(self) -> list[int]:
        return [self.start, self.increment, self.samples, self.final]
