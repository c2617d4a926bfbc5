"""What the sampler needs from a GPU, whatever provides it (NVML, or the fake used in tests)."""

from __future__ import annotations

from typing import Any, Protocol

# Per-tick metrics (column names carry their units).
FAST_METRICS = (
    "power_instant_w", "power_avg1s_w", "kernel_active_pct", "memory_busy_pct", "sm_clock_mhz",
    "temperature_c", "memory_used_mib", "throttle_reasons",
)
# NVML GPM (Hopper and newer): shares of the chip, sampled no faster than every 100 ms.
GPM_METRICS = ("sm_active_pct", "sm_occupancy_pct", "tensor_active_pct", "dram_bw_pct")
GPM_MIN_WINDOW_S = 0.1

# Clock-event reason bits that mean the GPU slowed itself down (nvml.h). Idle and
# application-clock bits are not throttling.
THROTTLE_BITS = {
    "power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "power_brake": 0x80,
}


class TelemetryUnavailable(Exception):
    """No telemetry for this device; the message is the reason shown to the user."""


class GpuReader(Protocol):
    name: str
    metric_status: dict[str, str]  # metric -> "ok" or why it is unavailable

    def read(self) -> dict[str, float]: ...
    def energy_mj(self) -> float | None: ...
    def power_limit_w(self) -> float | None: ...
    def gpm_snapshot(self) -> Any | None: ...
    def gpm_metrics(self, first: Any, second: Any) -> dict[str, float]: ...
    def gpm_release(self, snapshot: Any) -> None: ...
    def describe(self) -> dict[str, Any]: ...
    def close(self) -> None: ...
