"""GPU telemetry: NVML (and GPM) sampling that degrades to "unavailable: <reason>", never raises."""

from __future__ import annotations

from typing import Any

from gpudiag.measure.telemetry.reader import (
    FAST_METRICS,
    GPM_METRICS,
    GpuReader,
    TelemetryUnavailable,
)
from gpudiag.measure.telemetry.readers import nvml_spec, open_reader
from gpudiag.measure.telemetry.sampler import Sampler, summarize_window


def open_sampler(
    device_type: str,
    uuid: str | None,
    index: int,
    *,
    period_s: float,
    gpm_period_s: float,
    spec: dict[str, Any] | None = None,
) -> Sampler:
    """A sampler for the run's device: NVML on CUDA, an 'unavailable' stand-in elsewhere.

    `spec` replaces the device's own reader (tests pass a fake GPU's spec).
    """
    if spec is None:
        if device_type != "cuda":
            return Sampler(None, None, unavailable_reason=f"device is {device_type}: "
                                                         "no GPU telemetry")
        spec = nvml_spec(uuid, index)
    reader, reason = open_reader(spec)
    return Sampler(reader, spec if reader is not None else None, unavailable_reason=reason,
                   period_s=period_s, gpm_period_s=gpm_period_s)


__all__ = [
    "FAST_METRICS", "GPM_METRICS", "GpuReader", "Sampler", "TelemetryUnavailable",
    "nvml_spec", "open_reader", "open_sampler", "summarize_window",
]
