"""Small readings of a run that several rules share."""

from __future__ import annotations

import statistics

from gpudiag.model.results import MeasuredFix, RunResult, SourceLine, StageResult


def reference_stage(run: RunResult, stage: StageResult) -> StageResult | None:
    """The reference stage (the ladder's train-fp16) when it ran and is not `stage`, else the
    highest-power training stage."""
    ref = run.stage_in_role("reference")
    if ref is not None and ref.ok and ref.name != stage.name:
        return ref
    others = [s for s in run.ok_stages() if s.name != stage.name
              and s.telemetry.power_mean_w is not None and s.facts.precision]
    return max(others, key=lambda s: s.telemetry.power_mean_w or 0.0, default=None)


def on_gpu(run: RunResult, stage: StageResult) -> bool:
    """Whether the stage ran on a GPU: GPU-only advice (pinned memory, NVLink) needs one."""
    if stage.timer == "cuda-events" or (stage.evidence and stage.evidence.backend == "cuda"):
        return True
    return run.env.device.startswith("cuda") and stage.timer != "host-clock"


def data_wait_share(stage: StageResult) -> float:
    waits = stage.phases_ms.get("data_wait")
    if not waits or not stage.ms_per_iter:
        return 0.0
    return statistics.median(waits) / stage.ms_per_iter


def device_ops(line: SourceLine, backend: str) -> float:
    """Device work per step from a line: kernels and copies on a GPU, operator calls on a CPU."""
    if backend == "cuda":
        return line.kernels_per_step + line.memcpys_per_step
    return line.ops_per_step


def pct(value: float) -> str:
    return f"{value:.0%}"


def pct_above_zero(value: float) -> str:
    """pct(), but a share that rounds to 0% yet is not nothing reads "under 1%"."""
    return "under 1%" if 0 < value < 0.005 else pct(value)


def duration(ms: float) -> str:
    """A time as a reader says it: ms below a second, then s, min, h."""
    if ms < 1e3:
        return f"{ms:,.0f} ms"
    if ms < 120e3:
        return f"{ms / 1e3:,.1f} s"
    return f"{ms / 60e3:,.0f} min" if ms < 2 * 3600e3 else f"{ms / 3600e3:,.1f} h"


def measured_fix(run: RunResult, remedy: str) -> MeasuredFix | None:
    """`remedy` as --try-fixes measured it (None: not measured, or it changed nothing)."""
    return next((f for f in run.fixes if f.remedy == remedy and f.status == "measured"
                 and not f.changed_nothing and f.speedup), None)


def measured_saving(run: RunResult, remedy: str) -> float | None:
    """The share of the mean step `remedy` saved, as --try-fixes measured it: 0 where its
    interval reaches 1 (no faster than the noise between runs); None: not measured."""
    fix = measured_fix(run, remedy)
    if fix is None or fix.speedup is None:
        return None
    if fix.speedup_low is not None and fix.speedup_low <= 1.0:
        return 0.0
    return max(0.0, 1.0 - 1.0 / fix.speedup)
