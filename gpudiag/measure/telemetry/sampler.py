"""Telemetry over a whole run, with one labelled window per stage.

Per-tick sampling (fast metrics every `period_s`, GPM every `gpm_period_s`, never faster than
100 ms) runs in a worker process (see worker.py for why not a thread). Windows are opened and
closed by the runner right after a device synchronisation; at both edges this process reads the
total-energy counter (milliseconds per read, so only there) and takes a GPM sample, so a stage's
energy and GPM averages cover exactly its timed steps. Rows and windows share the system-wide
monotonic clock; rows are labelled with their stage afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from gpudiag.measure.telemetry.reader import (
    GPM_METRICS,
    GPM_MIN_WINDOW_S,
    THROTTLE_BITS,
    GpuReader,
)
from gpudiag.model.config import GPM_PERIOD_S, SAMPLE_PERIOD_S
from gpudiag.model.results import TelemetrySummary

if TYPE_CHECKING:  # pandas is imported where a window is reduced: a CPU run never needs it
    import pandas as pd

WORKER_STOP_TIMEOUT_S = 5.0


@dataclass
class _Window:
    label: str
    t_begin: float
    energy_begin_mj: float | None
    energy_begin_at: float  # when the counter was read (the middle of the read)
    gpm_begin: Any | None
    power_limit_w: float | None
    t_end: float | None = None


def _read_energy(reader: GpuReader) -> tuple[float | None, float]:
    """The energy counter and when it was read: the middle of the call (NVML's read takes
    milliseconds, and a preempted thread may read it later still), so that power is energy
    over the time between the two reads, not over the window's edges beside them."""
    before = time.monotonic()
    energy = reader.energy_mj()
    return energy, (before + time.monotonic()) / 2


class Sampler:
    """Use as a context manager. With `reader=None` every summary says `unavailable_reason`.

    `reader` serves the window edges in this process; `spec` lets the worker open the same GPU.
    """

    def __init__(
        self,
        reader: GpuReader | None,
        spec: dict[str, Any] | None,
        *,
        unavailable_reason: str = "no GPU telemetry",
        period_s: float = SAMPLE_PERIOD_S,
        gpm_period_s: float = GPM_PERIOD_S,
    ) -> None:
        self._reader = reader
        self._spec = spec
        self.unavailable_reason = unavailable_reason
        self.period_s = period_s
        self.gpm_period_s = max(gpm_period_s, GPM_MIN_WINDOW_S)
        self._rows: list[dict[str, Any]] = []
        self._windows: list[_Window] = []
        self._open: _Window | None = None
        self._worker: subprocess.Popen[bytes] | None = None
        self._waited = False  # wait_ready waits once: a worker that never writes costs 15 s once
        self._rows_path: Path | None = None
        self._errors_path: Path | None = None
        self._offset = 0
        self.timeline_error: str | None = None
        self._t0 = time.monotonic()

    @property
    def available(self) -> bool:
        return self._reader is not None

    @property
    def reader(self) -> GpuReader | None:
        return self._reader

    def __enter__(self) -> Sampler:
        if self._reader is not None and self._spec is not None:
            self._t0 = time.monotonic()
            self._start_worker()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _start_worker(self) -> None:
        fd, rows = tempfile.mkstemp(prefix="gpudiag-telemetry-", suffix=".jsonl")
        os.close(fd)
        fd, errors = tempfile.mkstemp(prefix="gpudiag-telemetry-", suffix=".err")
        self._rows_path, self._errors_path = Path(rows), Path(errors)
        command = [sys.executable, "-m", "gpudiag.measure.telemetry.worker",
                   "--spec", json.dumps(self._spec), "--out", rows,
                   "--period", str(self.period_s), "--gpm-period", str(self.gpm_period_s)]
        with os.fdopen(fd, "wb") as stderr:
            self._worker = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, stderr=stderr)

    def wait_ready(self, timeout_s: float = 15.0) -> bool:
        """Block until the worker has written its first sample (or died, or time ran out), so
        that its start-up (imports, NVML init) never overlaps a measurement; called before each
        window's warm-up, it waits only the first time (the worker started with the run and
        came up meanwhile, while the first stage was built)."""
        deadline = time.monotonic() + timeout_s
        while self._worker is not None and not self._waited and time.monotonic() < deadline:
            self._collect()
            if self._rows or self._worker.poll() is not None:
                break
            time.sleep(0.02)
        self._waited = True
        return bool(self._rows)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.terminate()
            try:
                self._worker.wait(timeout=WORKER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._worker.kill()
                self._worker.wait()
            self._collect()
            self._worker = None
            for path in (self._rows_path, self._errors_path):
                if path is not None:
                    path.unlink(missing_ok=True)
            self._rows_path = self._errors_path = None  # rows already read stay available
        if self._reader is not None:
            if self._open is not None:
                self._reader.gpm_release(self._open.gpm_begin)
                self._open = None
            self._reader.close()
            self._reader = None

    def _collect(self) -> None:
        """Read the rows the worker has written since the last call; note a dead worker."""
        if self._rows_path is None:
            return
        with self._rows_path.open("rb") as fh:
            fh.seek(self._offset)
            data = fh.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        self._rows += [json.loads(line) for line in complete.splitlines() if line]
        if self._worker is not None and self._worker.poll() not in (None, 0, -15):
            reason = self._errors_path.read_text().strip() if self._errors_path else ""
            self.timeline_error = reason.splitlines()[-1] if reason else "worker exited"

    def begin(self, label: str) -> None:
        """Open a window. Call right after the device has been synchronised."""
        if self._reader is None:
            return
        reader = self._reader
        t_begin = time.monotonic()
        energy, energy_at = _read_energy(reader)
        self._open = _Window(label=label, t_begin=t_begin, energy_begin_mj=energy,
                             energy_begin_at=energy_at, gpm_begin=reader.gpm_snapshot(),
                             power_limit_w=reader.power_limit_w())

    def end(self) -> TelemetrySummary:
        """Close the window opened by `begin` (after a device sync) and summarise it."""
        if self._reader is None or self._open is None:
            return TelemetrySummary.unavailable(self.unavailable_reason)
        reader, window = self._reader, self._open
        window.t_end = time.monotonic()
        energy_end, energy_end_at = _read_energy(reader)
        gpm_end = reader.gpm_snapshot() if window.gpm_begin is not None else None
        self._open = None
        self._windows.append(window)
        gpm: dict[str, float] = {}
        if gpm_end is not None and window.t_end - window.t_begin >= GPM_MIN_WINDOW_S:
            gpm = reader.gpm_metrics(window.gpm_begin, gpm_end)
        reader.gpm_release(window.gpm_begin)
        reader.gpm_release(gpm_end)
        time.sleep(min(self.period_s, 0.01))  # a tick stamped before t_end may still be writing
        self._collect()
        rows = [r for r in self._rows if window.t_begin <= r["t"] <= window.t_end]
        status = dict(reader.metric_status)
        if self.timeline_error:
            status["timeline"] = f"telemetry worker failed: {self.timeline_error}"
        import pandas as pd  # noqa: PLC0415 (0.4 s of start-up in the user's script otherwise)

        frame = pd.DataFrame(rows).rename(columns={"t": "t_s"})
        return summarize_window(
            frame, window_s=window.t_end - window.t_begin,
            energy_begin_mj=window.energy_begin_mj, energy_end_mj=energy_end,
            energy_span_s=energy_end_at - window.energy_begin_at, gpm=gpm,
            power_limit_w=window.power_limit_w, period_s=self.period_s, metric_status=status,
        )

    def samples(self) -> pd.DataFrame:
        """Every sample so far, one row per tick, with its stage ('' between stages)."""
        import pandas as pd  # noqa: PLC0415 (0.4 s of start-up in the user's script otherwise)

        self._collect()
        frame = pd.DataFrame(self._rows)
        if frame.empty:
            return pd.DataFrame(columns=["t_s", "stage", "window"])
        labels = pd.Series("", index=frame.index, dtype=object)
        windows = pd.Series(-1, index=frame.index)
        for i, w in enumerate(self._windows):
            inside = (frame["t"] >= w.t_begin) & (frame["t"] <= (w.t_end or w.t_begin))
            labels[inside], windows[inside] = w.label, i
        frame.insert(0, "t_s", frame.pop("t") - self._t0)
        frame.insert(1, "stage", labels)
        frame.insert(2, "window", windows)
        return frame


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
    energy_span_s: float | None = None,
    gpm: dict[str, float],
    power_limit_w: float | None,
    period_s: float,
    metric_status: dict[str, str],
) -> TelemetrySummary:
    """Reduce one window's samples to a stage's telemetry (`energy_span_s`: the time between
    the counter's two reads, the window's own if not given). Pure: tested on synthetic
    frames."""
    energy_j: float | None = None
    source: str | None = None
    power_mean_w: float | None = None
    if energy_begin_mj is not None and energy_end_mj is not None:
        energy_j, source = (energy_end_mj - energy_begin_mj) / 1e3, "counter"
        span = energy_span_s if energy_span_s is not None else window_s
        power_mean_w = energy_j / span if span > 0 else None
    elif "power_instant_w" in frame and frame["power_instant_w"].notna().sum() >= 2:
        # Without the counter, integrate the instantaneous power over the samples' time span
        # and scale to the window (sampling aliases short power swings: the weaker estimate;
        # docs/performance.md measures both).
        power = frame[["t_s", "power_instant_w"]].dropna()
        span = float(power["t_s"].iloc[-1] - power["t_s"].iloc[0])
        if span > 0:
            mean_w = float(np.trapezoid(power["power_instant_w"], power["t_s"])) / span
            energy_j, source, power_mean_w = mean_w * window_s, "power-integral", mean_w
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
        power_mean_w=power_mean_w,
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
