"""How much fresh processes of the same code differ: the prior knowledge behind every interval.

A trial's score (log throughput of one fresh process) differs from another process's of the
same code by a spread that belongs to the machine, not to the change: allocator layout, clocks,
host load. It is measured knowledge, so intervals start from it rather than from the two or
three trials a gate has: the spread is estimated as the prior (the built-in floor of the device
kind, or this machine's calibration) pooled with the trials' own spread, each weighted by its
degrees of freedom (the conjugate scaled-inverse-chi-squared update of a normal variance,
Gelman et al., Bayesian Data Analysis, 3rd ed., sec. 3.3). An interval then narrows as trials
are added, where Welch's t on two trials a side (1-2 degrees of freedom, t of 10-60 at 99%)
would give one far wider than a single trial with a known floor.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Literal

from gpudiag.diagnose.trials import device_samples, stage_samples
from gpudiag.model.calibration import (
    MIN_CALIBRATION_TRIALS,
    Calibration,
    CalibrationRecord,
    StageSpread,
)
from gpudiag.model.errors import BadInput
from gpudiag.model.results import RunResult, StageResult

Instrument = Literal["wall", "device"]


@dataclass(frozen=True)
class NoiseFloor:
    """The between-process standard deviation of one trial's log throughput, as a prior."""

    sigma: float
    df: float  # how many degrees of freedom it is worth (trials - 1 where it was measured)
    source: str  # where it comes from, for the summary

    def describe(self) -> str:
        return f"{self.sigma:.2%} ({self.source})"


# Built-in floors by device kind, each measured (docs/performance.md, "How the gate decides"):
# Wall time on GPUs: BERT fp16 training on a shared H100 VM ran 50.2-59.6 ms over six fresh
# processes (about 5%), dgca full-vectorized 3.3% over 8 (reports/examples/benchmarks/
# h100-gate-regressions.json); worth the six processes' 5 degrees of freedom. Tiny models on a
# shared 2-core CPU: 6.5% over 12 fresh runs, one of them 20% slow: 8%, 11 degrees of freedom.
WALL_FLOOR = {"cuda": NoiseFloor(0.05, 5, "built-in floor for CUDA GPUs"),
              "cpu": NoiseFloor(0.08, 11, "built-in floor for CPUs")}
# Device time (kernel time per step) waits on nothing but the GPU: fresh processes of one build
# differed by 0.09% over 8 trials on H100s (same file), 0.04% over six (BERT); the two hosts'
# medians by 0.15%. The floor is three times the former, worth the 8 trials' 7 degrees.
DEVICE_FLOOR = NoiseFloor(0.003, 7, "built-in floor for CUDA device time")


def device_kind(run: RunResult) -> str:
    return "cuda" if run.env.device.startswith("cuda") else "cpu"


def _calibrated(calibration: Calibration | None, run: RunResult, stage: str
                ) -> tuple[CalibrationRecord, StageSpread] | None:
    if calibration is None:
        return None
    return calibration.find(device_kind(run), run.env.gpu_name, _workload(run), stage)


def floor_for(runs: tuple[RunResult, RunResult], stage: str, instrument: Instrument,
              calibration: Calibration | None = None) -> NoiseFloor:
    """The prior for one stage and instrument of a comparison: this machine's calibration of
    the workload where one matches both runs, else the built-in floor (the larger of the two
    sides' device kinds)."""
    found = [_calibrated(calibration, run, stage) for run in runs]
    if found[0] is not None and found[1] is not None:
        record, spread = found[1]
        sd = spread.wall_sd if instrument == "wall" else spread.device_sd
        if sd is not None:
            where = record.gpu_name or record.device
            return NoiseFloor(sd, spread.trials - 1,
                              f"calibrated: {spread.trials} trials on {where}"
                              f"{', ' + record.created_utc[:10] if record.created_utc else ''}")
    if instrument == "device":
        return DEVICE_FLOOR
    return max((WALL_FLOOR[device_kind(run)] for run in runs), key=lambda f: f.sigma)


def _workload(run: RunResult) -> dict[str, str | int | None]:
    return {k: v if v is None or isinstance(v, (str, int)) else str(v)
            for k, v in run.config.identity().items()}


def _log_sd(scores: list[float]) -> float:
    return statistics.stdev(math.log(s) for s in scores)


def stage_spread(stage: StageResult) -> StageSpread | None:
    """The spread between the trials of one stage, or None with too few trials."""
    wall = stage_samples(stage)
    if wall.kind != "trials" or len(wall.scores) < MIN_CALIBRATION_TRIALS:
        return None
    device = device_samples(stage)
    device_sd = (_log_sd(device.scores) if device is not None and device.kind == "trials"
                 and len(device.scores) >= MIN_CALIBRATION_TRIALS else None)
    return StageSpread(stage=stage.name, trials=len(wall.scores), wall_sd=_log_sd(wall.scores),
                       device_sd=device_sd)


def calibration_record(run: RunResult, source: str) -> CalibrationRecord:
    """A calibration record from a run of several fresh-process trials (`run --trials N`);
    BadInput when no stage has enough trials."""
    spreads = [s for stage in run.ok_stages() if (s := stage_spread(stage)) is not None]
    if not spreads:
        raise BadInput(f"{source}: no stage has {MIN_CALIBRATION_TRIALS} or more valid trials "
                       "to measure a spread from (record one with --trials 8)")
    return CalibrationRecord(device=device_kind(run), gpu_name=run.env.gpu_name,
                             workload=_workload(run), stages=spreads,
                             driver_version=run.env.driver_version,
                             torch_version=run.env.torch_version, hostname=run.env.hostname,
                             created_utc=run.created_utc, source=source)
