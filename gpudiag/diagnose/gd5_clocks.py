"""GD5xx, clocks: a GPU that slowed itself down (heat, power limit)."""

from __future__ import annotations

from collections.abc import Iterator

from gpudiag.diagnose.common import pct
from gpudiag.diagnose.ledger import NoPart
from gpudiag.diagnose.registry import Draft, Threshold, rule, severity_for
from gpudiag.model.results import RunResult

THERMAL_REASONS = ("sw_thermal", "hw_thermal", "hw_slowdown", "power_brake")
THERMAL_WARNING, THERMAL_CRITICAL, POWER_CAP_INFO = 0.10, 0.50, 0.50
# Clock loss while thermally throttled, for ranking only: NVML gives no boost clock to compare.
THROTTLED_SLOWDOWN = 0.2


@rule(
    "GD501", "clock-throttling", concern="clocks",
    summary="The GPU lowered its clocks during a stage (heat, or its power limit).",
    why=("Thermal or hardware slowdown makes timings depend on the room, not the code; a power "
         "cap means the stage is compute-bound and draws all the power it may."),
    fix=("Thermal: check cooling and airflow, and do not compare timings across throttled runs. "
         "Power cap: the GPU is saturated; only less work (lower precision, smaller model) "
         "makes it faster."),
    prices=NoPart("throttled clocks slow every part of the step alike"),
    thresholds=(Threshold("thermal_share", THERMAL_WARNING, "thermal reasons in 10% of samples"),
                Threshold("power_cap_share", POWER_CAP_INFO, "power cap in half of the samples"),
                Threshold("critical_thermal_share", THERMAL_CRITICAL,
                          "thermal reasons in half of the samples"),
                Threshold("throttled_slowdown", THROTTLED_SLOWDOWN,
                          "the step time a throttled sample is assumed to lose (the impact)")),
)
def clock_throttling(run: RunResult) -> Iterator[Draft]:
    """Thermal/hardware slowdown in 10%+ of a stage's samples (warning); power cap in half of
    them (information: the stage is compute-bound)."""
    for stage in run.ok_stages():
        shares = stage.telemetry.throttle_share
        thermal = max((shares.get(r, 0.0) for r in THERMAL_REASONS), default=0.0)
        evidence = {"throttle_share": shares, "sm_clock_mhz_min": stage.telemetry.sm_clock_mhz_min,
                    "sm_clock_mhz_mean": stage.telemetry.sm_clock_mhz_mean,
                    "temperature_max_c": stage.telemetry.temperature_max_c}
        if thermal >= THERMAL_WARNING:
            yield Draft(severity=severity_for(thermal, warning=THERMAL_WARNING,
                                              critical=THERMAL_CRITICAL),
                        stage=stage.name,
                        title=f"Thermal/hardware clock slowdown in {pct(thermal)} of samples",
                        impact=thermal * THROTTLED_SLOWDOWN, evidence=evidence,
                        fix=("Fix cooling before trusting these timings; compare only "
                             "unthrottled runs."))
        elif shares.get("power_cap", 0.0) >= POWER_CAP_INFO:
            yield Draft(severity="info", stage=stage.name,
                        title=(f"At the power limit in {pct(shares['power_cap'])} of samples: "
                               "compute-bound"),
                        impact=0.0, evidence=evidence,
                        fix="Saturated: speed now comes from doing less work (precision, fusion).")
