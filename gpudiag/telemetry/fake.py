"""A scripted GPU for tests and demos: the same interface as the NVML reader, no driver needed.

Power follows `power_w(t)` (seconds since the fake was created); the energy counter is its exact
integral, like the real counter, so energy and power-integral estimates can be checked against
a known truth. Any metric can be refused, as a real GPU would refuse it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from scipy import integrate

from gpudiag.telemetry.reader import FAST_METRICS, GPM_METRICS, TelemetryUnavailable

DEFAULT_FAST = {
    "kernel_active_pct": 95.0, "memory_busy_pct": 40.0, "sm_clock_mhz": 1980.0,
    "temperature_c": 55.0, "memory_used_mib": 20_000.0, "throttle_reasons": 0.0,
}
DEFAULT_GPM = {"sm_active_pct": 65.0, "sm_occupancy_pct": 35.0, "tensor_active_pct": 17.4,
               "dram_bw_pct": 44.0}


class FakeGpu:
    def __init__(
        self,
        power_w: Callable[[float], float] = lambda t: 300.0,
        *,
        refuse: dict[str, str] | None = None,
        values: dict[str, float] | None = None,
        gpm: dict[str, float] | None = None,
        name: str = "Fake H100",
        power_limit_w: float = 700.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.name = name
        self._power_w = power_w
        self._clock = clock
        self._t0 = clock()
        self._values = {**DEFAULT_FAST, **(values or {})}
        self._gpm = {**DEFAULT_GPM, **(gpm or {})}
        self._limit = power_limit_w
        refused = refuse or {}
        self.metric_status = {m: refused.get(m, "ok")
                              for m in (*FAST_METRICS, "energy_counter", *GPM_METRICS)}
        self.closed = False
        self.live_gpm_snapshots = 0

    def _now(self) -> float:
        return self._clock() - self._t0

    def _ok(self, metric: str) -> bool:
        return self.metric_status[metric] == "ok"

    def read(self) -> dict[str, float]:
        t = self._now()
        values = {"power_instant_w": self._power_w(t),
                  "power_avg1s_w": self.energy_between(max(0.0, t - 1.0), t) / min(1.0, t or 1.0),
                  **self._values}
        return {k: v for k, v in values.items() if self._ok(k)}

    def energy_between(self, t0: float, t1: float) -> float:
        joules, _ = integrate.quad(self._power_w, t0, t1, limit=200)
        return float(joules)

    def energy_mj(self) -> float | None:
        return self.energy_between(0.0, self._now()) * 1e3 if self._ok("energy_counter") else None

    def power_limit_w(self) -> float | None:
        return self._limit

    def gpm_snapshot(self) -> Any | None:
        if not any(self._ok(m) for m in GPM_METRICS):
            return None
        self.live_gpm_snapshots += 1
        return self._now()

    def gpm_metrics(self, first: Any, second: Any) -> dict[str, float]:
        return {m: v for m, v in self._gpm.items() if self._ok(m)}

    def gpm_release(self, snapshot: Any) -> None:
        if snapshot is not None:
            self.live_gpm_snapshots -= 1

    def describe(self) -> dict[str, Any]:
        return {"gpu_name": self.name, "power_limit_w": self._limit, "driver_version": "fake",
                "cuda_driver": None, "gpu_memory_mib": 81_559.0}

    def close(self) -> None:
        self.closed = True


def unavailable_reader(reason: str) -> Callable[[str | None, int], FakeGpu]:
    """A reader factory that fails like a machine without NVML."""

    def open_gpu(uuid: str | None, index: int) -> FakeGpu:
        raise TelemetryUnavailable(reason)

    return open_gpu
