"""GPU telemetry: NVML (and GPM) sampling that degrades to "unavailable: <reason>", never raises."""

from __future__ import annotations

from collections.abc import Callable

from gpudiag.telemetry.reader import (
    FAST_METRICS,
    GPM_METRICS,
    GpuReader,
    TelemetryUnavailable,
)
from gpudiag.telemetry.sampler import Sampler, summarize_window

ReaderFactory = Callable[[str | None, int], GpuReader]


def open_reader(uuid: str | None, index: int,
                factory: ReaderFactory | None = None) -> tuple[GpuReader | None, str]:
    """The GPU's reader, or None and the reason it is unavailable."""
    if factory is None:
        try:
            from gpudiag.telemetry.nvml import open_gpu as factory
        except ImportError as exc:  # nvidia-ml-py missing
            return None, f"nvidia-ml-py is not installed ({exc})"
    try:
        return factory(uuid, index), ""
    except TelemetryUnavailable as exc:
        return None, str(exc)


def open_sampler(
    device_type: str,
    uuid: str | None,
    index: int,
    *,
    period_s: float,
    gpm_period_s: float,
    factory: ReaderFactory | None = None,
) -> Sampler:
    """A sampler for the run's device: NVML on CUDA, an 'unavailable' stand-in elsewhere."""
    if device_type != "cuda":
        return Sampler(None, unavailable_reason=f"device is {device_type}: no GPU telemetry")
    reader, reason = open_reader(uuid, index, factory)
    return Sampler(reader, unavailable_reason=reason,
                   period_s=period_s, gpm_period_s=gpm_period_s)


__all__ = [
    "FAST_METRICS", "GPM_METRICS", "GpuReader", "ReaderFactory", "Sampler",
    "TelemetryUnavailable", "open_reader", "open_sampler", "summarize_window",
]
