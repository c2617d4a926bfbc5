"""A profiled script's step schedule, as one pure function of the step (as
`torch.profiler.schedule` is): steps [0, W) warm up, [W, W+T) are timed, [W+T, W+T+K) run under
the profiler, and later ones are kept in the run's timeline but never timed, since the profiler
slows what follows it on some GPUs (pytorch/pytorch#144455).

Steps count from 0: step i runs from the recorder's step mark i to mark i + 1, so the boundary
that ends step i - 1 begins step i. The recorder (recorder.py) asks this module, never its own
arithmetic, which phase a step is in and where the phases begin and end.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gpudiag.model.config import ProfileConfig


class Phase(enum.Enum):
    WARMUP = "warm-up"
    TIMED = "timed"
    PROFILED = "profiled"
    AFTER = "after"  # kept in the timeline, never timed


@dataclass(frozen=True)
class Schedule:
    warmup: int  # W
    timed: int  # T
    evidence_steps: int  # K: the profiler window's steps (0: no window)

    def __post_init__(self) -> None:
        if min(self.warmup, self.timed, self.evidence_steps) < 0:
            raise ValueError(f"a schedule counts steps, none negative: {self}")

    @classmethod
    def of(cls, config: ProfileConfig) -> Schedule:
        return cls(config.warmup, config.timed, config.evidence_steps)

    def phase(self, step: int) -> Phase:
        if step < 0:
            raise ValueError(f"steps count from 0, not {step}")
        if step < self.warmup:
            return Phase.WARMUP
        if step < self.warmup + self.timed:
            return Phase.TIMED
        if step < self.end:
            return Phase.PROFILED
        return Phase.AFTER

    @property
    def end(self) -> int:
        """The first step after the profiled ones: the steps the schedule needs."""
        return self.warmup + self.timed + self.evidence_steps

    @property
    def timed_steps(self) -> range:
        return range(self.warmup, self.warmup + self.timed)

    @property
    def profiled_steps(self) -> range:
        """The profiler window's steps; empty without one."""
        return range(self.warmup + self.timed, self.end)

    @property
    def quiet_steps(self) -> range:
        """Where nothing costly of gpudiag's own may land (a part written, say): the timed and
        profiled steps, and the step after them, at whose start the window closes (its trace
        analysed, its part written) or, without a window, the timed telemetry ends."""
        return range(self.warmup, self.end + 1)

    @property
    def unsampled_steps(self) -> range:
        """What the host sampler skips: the profiled steps, which the profiler slows, and the
        step after them, which the window's close lands in; none without a window."""
        return range(self.profiled_steps.start, self.end + 1) if self.evidence_steps else range(0)
