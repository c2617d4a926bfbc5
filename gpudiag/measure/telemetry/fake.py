"""A scripted GPU for tests and demos: the same interface as the NVML reader, no driver needed.

Power is a step function of the system-wide monotonic clock (`power_steps`: (start time, watts)
pairs), so the sampling worker process and the parent see the same GPU. The energy counter is
the exact integral of that power, like the real counter, so energy and power-integral estimates
can be checked against a known truth. Any metric can be refused, as a real GPU would refuse it.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

from gpudiag.measure.telemetry.reader import FAST_METRICS, GPM_METRICS

DEFAULT_FAST = {
    "kernel_active_pct": 95.0, "memory_busy_pct": 40.0, "sm_clock_mhz": 1980.0,
    "temperature_c": 55.0, "memory_used_mib": 20_000.0, "throttle_reasons": 0.0,
}
DEFAULT_GPM = {"sm_active_pct": 65.0, "sm_occupancy_pct": 35.0, "tensor_active_pct": 17.4,
               "dram_bw_pct": 44.0}


class FakeGpu:
    """Built from a JSON-able spec (see `fake_spec`), so a worker process can rebuild it."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.name = spec.get("name", "Fake H100")
        steps = sorted(spec.get("power_steps") or [[0.0, 300.0]])
        self._starts = [float(t) for t, _ in steps]
        self._watts = [float(w) for _, w in steps]
        self._values = {**DEFAULT_FAST, **spec.get("values", {})}
        self._gpm = {**DEFAULT_GPM, **spec.get("gpm", {})}
        self._limit = float(spec.get("power_limit_w", 700.0))
        refused = spec.get("refuse", {})
        self.metric_status = {m: refused.get(m, "ok")
                              for m in (*FAST_METRICS, "energy_counter", *GPM_METRICS)}
        self.live_gpm_snapshots = 0

    def power_at(self, t: float) -> float:
        i = bisect.bisect_right(self._starts, t) - 1
        return self._watts[max(i, 0)]

    def energy_j(self, t: float) -> float:
        """Joules from the first step's start to monotonic time t."""
        total = 0.0
        for i, start in enumerate(self._starts):
            end = self._starts[i + 1] if i + 1 < len(self._starts) else float("inf")
            if t <= start:
                break
            total += (min(t, end) - start) * self._watts[i]
        return total

    def _ok(self, metric: str) -> bool:
        return self.metric_status[metric] == "ok"

    def read(self) -> dict[str, float]:
        now = time.monotonic()
        values = {"power_instant_w": self.power_at(now),
                  "power_avg1s_w": self.energy_j(now) - self.energy_j(now - 1.0), **self._values}
        return {k: v for k, v in values.items() if self._ok(k)}

    def energy_mj(self) -> float | None:
        return self.energy_j(time.monotonic()) * 1e3 if self._ok("energy_counter") else None

    def power_limit_w(self) -> float | None:
        return self._limit

    def gpm_snapshot(self) -> Any | None:
        if not any(self._ok(m) for m in GPM_METRICS):
            return None
        self.live_gpm_snapshots += 1
        return time.monotonic()

    def gpm_metrics(self, first: Any, second: Any) -> dict[str, float]:
        return {m: v for m, v in self._gpm.items() if self._ok(m)}

    def gpm_release(self, snapshot: Any) -> None:
        if snapshot is not None:
            self.live_gpm_snapshots -= 1

    def describe(self) -> dict[str, Any]:
        return {"gpu_name": self.name, "power_limit_w": self._limit, "driver_version": "fake",
                "cuda_driver": None, "gpu_memory_mib": 81_559.0}

    def close(self) -> None:
        pass


def fake_spec(
    power_steps: list[tuple[float, float]] | None = None,
    *,
    refuse: dict[str, str] | None = None,
    values: dict[str, float] | None = None,
    gpm: dict[str, float] | None = None,
    name: str = "Fake H100",
    unavailable: str | None = None,
) -> dict[str, Any]:
    """A telemetry spec for a fake GPU. `unavailable` makes it fail like a machine without NVML.

    `power_steps` times are offsets in seconds from now (the spec is anchored when made).
    """
    now = time.monotonic()
    steps = [[now + t, w] for t, w in (power_steps or [(0.0, 300.0)])]
    spec: dict[str, Any] = {"kind": "fake", "power_steps": [[now - 3600.0, steps[0][1]], *steps],
                            "refuse": refuse or {}, "values": values or {}, "gpm": gpm or {},
                            "name": name}
    if unavailable is not None:
        spec["unavailable"] = unavailable
    return spec
