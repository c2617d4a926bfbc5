"""A background sampler over a whole run, with one labelled window per stage.

The thread reads the fast metrics every `period_s` and GPM every `gpm_period_s` (never faster
than 100 ms). Windows are opened and closed by the runner right after a device synchronisation;
at both edges the sampler reads the total-energy counter (milliseconds per read, so only there)
and takes a GPM sample, so a stage's energy and GPM averages cover exactly its timed steps.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import pandas as pd

from gpudiag.results import TelemetrySummary
from gpudiag.telemetry.reader import (
    GPM_METRICS,
    GPM_MIN_WINDOW_S,
    THROTTLE_BITS,
    GpuReader,
)


@dataclass
class _Window:
    label: str
    index: int
    t_begin: float
    energy_begin_mj: float | None
    gpm_begin: Any | None
    power_limit_w: float | None


class Sampler:
    """Use as a context manager. With `reader=None` every summary says `unavailable_reason`."""

    def __init__(
        self,
        reader: GpuReader | None,
        *,
        unavailable_reason: str = "no GPU telemetry",
        period_s: float = 0.05,
        gpm_period_s: float = 0.2,
    ) -> None:
        self._reader = reader
        self.unavailable_reason = unavailable_reason
        self.period_s = period_s
        self.gpm_period_s = max(gpm_period_s, GPM_MIN_WINDOW_S)
        self._rows: list[dict[str, Any]] = []
        self._label = ""
        self._window_index = -1
        self._window: _Window | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.perf_counter()

    @property
    def available(self) -> bool:
        return self._reader is not None

    @property
    def reader(self) -> GpuReader | None:
        return self._reader

    def __enter__(self) -> Sampler:
        if self._reader is not None:
            self._t0 = time.perf_counter()
            self._thread = threading.Thread(target=self._run, name="gpudiag-telemetry",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._reader is not None:
            if self._window is not None:
                self._reader.gpm_release(self._window.gpm_begin)
                self._window = None
            self._reader.close()
            self._reader = None

    def _run(self) -> None:
        reader = self._reader
        assert reader is not None
        gpm_ok = any(reader.metric_status.get(m) == "ok" for m in GPM_METRICS)
        next_tick = time.perf_counter()
        next_gpm = next_tick
        previous_gpm: Any | None = None
        while not self._stop.is_set():
            now = time.perf_counter()
            row: dict[str, Any] = {"t_s": now - self._t0, "stage": self._label,
                                   "window": self._window_index if self._label else -1}
            row.update(reader.read())
            if gpm_ok and now >= next_gpm:
                snapshot = reader.gpm_snapshot()
                if previous_gpm is not None and snapshot is not None:
                    row.update(reader.gpm_metrics(previous_gpm, snapshot))
                    reader.gpm_release(previous_gpm)
                previous_gpm = snapshot or previous_gpm
                next_gpm = now + self.gpm_period_s
            self._rows.append(row)
            next_tick += self.period_s
            self._stop.wait(max(0.0, next_tick - time.perf_counter()))
        reader.gpm_release(previous_gpm)

    def begin(self, label: str) -> None:
        """Open a window. Call right after the device has been synchronised."""
        if self._reader is None:
            return
        reader = self._reader
        self._window_index += 1
        self._window = _Window(
            label=label, index=self._window_index, t_begin=time.perf_counter() - self._t0,
            energy_begin_mj=reader.energy_mj(), gpm_begin=reader.gpm_snapshot(),
            power_limit_w=reader.power_limit_w(),
        )
        self._label = label

    def end(self) -> TelemetrySummary:
        """Close the window opened by `begin` (after a device sync) and summarise it."""
        if self._reader is None or self._window is None:
            return TelemetrySummary.unavailable(self.unavailable_reason)
        reader, window = self._reader, self._window
        t_end = time.perf_counter() - self._t0
        energy_end = reader.energy_mj()
        gpm_end = reader.gpm_snapshot() if window.gpm_begin is not None else None
        self._label = ""
        self._window = None
        gpm: dict[str, float] = {}
        if gpm_end is not None and t_end - window.t_begin >= GPM_MIN_WINDOW_S:
            gpm = reader.gpm_metrics(window.gpm_begin, gpm_end)
        reader.gpm_release(window.gpm_begin)
        reader.gpm_release(gpm_end)
        rows = [r for r in list(self._rows) if r["window"] == window.index]
        return summarize_window(
            pd.DataFrame(rows), window_s=t_end - window.t_begin,
            energy_begin_mj=window.energy_begin_mj, energy_end_mj=energy_end, gpm=gpm,
            power_limit_w=window.power_limit_w, period_s=self.period_s,
            metric_status=reader.metric_status,
        )

    def samples(self) -> pd.DataFrame:
        """Every sample so far, one row per tick, with the stage label ('' between stages)."""
        frame = pd.DataFrame(list(self._rows))
        return frame if len(frame.columns) else pd.DataFrame(columns=["t_s", "stage", "window"])


def _mean(frame: pd.DataFrame, column: str) -> float | None:
    if column not in frame or frame[column].isna().all():
        return None
    return float(frame[column].mean())


def _extreme(frame: pd.DataFrame, column: str, how: str) -> float | None:
    if column not in frame or frame[column].isna().all():
        return None
    return float(getattr(frame[column], how)())


def summarize_window(
    frame: pd.DataFrame,
    *,
    window_s: float,
    energy_begin_mj: float | None,
    energy_end_mj: float | None,
    gpm: dict[str, float],
    power_limit_w: float | None,
    period_s: float,
    metric_status: dict[str, str],
) -> TelemetrySummary:
    """Reduce one window's samples to a stage's telemetry. Pure: tested on synthetic frames."""
    energy_j: float | None = None
    source: str | None = None
    if energy_begin_mj is not None and energy_end_mj is not None:
        energy_j, source = (energy_end_mj - energy_begin_mj) / 1e3, "counter"
    elif "power_instant_w" in frame and frame["power_instant_w"].notna().sum() >= 2:
        # Without the counter, integrate the instantaneous power over the samples' time span
        # and scale to the window (aliasing makes this the weaker estimate; TELEMETRY.md).
        power = frame[["t_s", "power_instant_w"]].dropna()
        span = float(power["t_s"].iloc[-1] - power["t_s"].iloc[0])
        if span > 0:
            mean_w = float(np.trapezoid(power["power_instant_w"], power["t_s"])) / span
            energy_j, source = mean_w * window_s, "power-integral"
    power_max = _extreme(frame, "power_instant_w", "max")
    if power_max is None:
        power_max = _extreme(frame, "power_avg1s_w", "max")
    throttle: dict[str, float] = {}
    if "throttle_reasons" in frame and frame["throttle_reasons"].notna().any():
        bits = frame["throttle_reasons"].dropna().astype("int64")
        throttle = {name: float(((bits & bit) != 0).mean()) for name, bit in THROTTLE_BITS.items()}
    if not gpm and any(m in frame for m in GPM_METRICS):
        gpm = {m: v for m in GPM_METRICS if (v := _mean(frame, m)) is not None}
    return TelemetrySummary(
        available=True,
        sample_count=len(frame),
        period_s=period_s,
        window_s=window_s,
        energy_j=energy_j,
        energy_source=source,
        power_mean_w=energy_j / window_s if energy_j is not None and window_s > 0 else None,
        power_max_w=power_max,
        power_limit_w=power_limit_w,
        kernel_active_pct=_mean(frame, "kernel_active_pct"),
        memory_busy_pct=_mean(frame, "memory_busy_pct"),
        sm_clock_mhz_mean=_mean(frame, "sm_clock_mhz"),
        sm_clock_mhz_min=_extreme(frame, "sm_clock_mhz", "min"),
        temperature_max_c=_extreme(frame, "temperature_c", "max"),
        memory_used_max_mib=_extreme(frame, "memory_used_mib", "max"),
        throttle_share=throttle,
        gpm=gpm,
        unavailable_metrics={m: why for m, why in metric_status.items() if why != "ok"},
    )
