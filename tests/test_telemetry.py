"""Telemetry: the sampler (worker process + window edges) on a scripted fake GPU, and the pure
per-window reducer on synthetic frames. No GPU or driver needed.

Timing-dependent quantities (sample counts, window lengths) get wide tolerances; energy and
power are checked tightly where the fake makes them exact: its energy counter is the exact
integral of a step-function power, so a window's energy lies between the integrals over the
shortest and longest spans the window edges could have covered.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pytest

from gpudiag.measure.telemetry import GPM_METRICS, Sampler, open_sampler, summarize_window
from gpudiag.measure.telemetry.fake import DEFAULT_GPM, fake_spec
from gpudiag.measure.telemetry.reader import THROTTLE_BITS
from gpudiag.model.results import TelemetrySummary

PERIOD_S = 0.02
GPM_PERIOD_S = 0.1


def _open(spec: dict[str, Any]) -> Sampler:
    return open_sampler("cuda", "fake-uuid", 0, period_s=PERIOD_S, gpm_period_s=GPM_PERIOD_S,
                        spec=spec)


@dataclass
class Timed:
    """A window's summary, with monotonic times taken just before and after begin() and end()."""

    summary: TelemetrySummary
    before_begin: float
    after_begin: float
    before_end: float
    after_end: float


def _window(sampler: Sampler, label: str, *, seconds: float | None = None,
            until: float | None = None) -> Timed:
    """Run one window of `seconds`, or until monotonic time `until`."""
    before_begin = time.monotonic()
    sampler.begin(label)
    after_begin = time.monotonic()
    time.sleep(seconds if seconds is not None else max(0.0, (until or 0.0) - after_begin))
    before_end = time.monotonic()
    summary = sampler.end()
    return Timed(summary, before_begin, after_begin, before_end, time.monotonic())


def _exact_energy_j(spec: dict[str, Any], t0: float, t1: float) -> float:
    """Integral of the spec's step-function power over [t0, t1] (independent of FakeGpu)."""
    steps = sorted((float(t), float(w)) for t, w in spec["power_steps"])
    ends = [t for t, _ in steps[1:]] + [math.inf]
    return sum(max(0.0, min(end, t1) - max(start, t0)) * watts
               for (start, watts), end in zip(steps, ends, strict=True))


def _assert_counter_energy(spec: dict[str, Any], timed: Timed) -> None:
    """The counter was read once during begin() and once during end(): its difference lies
    between the integrals over the shortest and the longest span those reads can cover."""
    s = timed.summary
    assert s.energy_source == "counter"
    assert s.energy_j is not None
    low = _exact_energy_j(spec, timed.after_begin, timed.before_end)
    high = _exact_energy_j(spec, timed.before_begin, timed.after_end)
    assert low - 1e-6 <= s.energy_j <= high + 1e-6
    assert s.window_s is not None
    assert timed.before_end - timed.after_begin <= s.window_s
    assert s.window_s <= timed.after_end - timed.before_begin
    # Power: the energy over the time between the counter's two reads, inside those spans.
    assert s.power_mean_w is not None
    assert s.energy_j / (timed.after_end - timed.before_begin) - 1e-6 <= s.power_mean_w
    assert s.power_mean_w <= s.energy_j / (timed.before_end - timed.after_begin) + 1e-6


# --- the sampler on a fake GPU ----------------------------------------------------------------


@pytest.mark.slow
def test_constant_power_window_reports_the_fake_gpu_values() -> None:
    spec = fake_spec([(0.0, 250.0)])
    with _open(spec) as sampler:
        assert sampler.available
        assert sampler.wait_ready()
        timed = _window(sampler, "train", seconds=0.5)
        fake = sampler.reader
        assert fake is not None
        assert fake.live_gpm_snapshots == 0  # both edge snapshots released

    s = timed.summary
    assert s.available and s.reason is None
    _assert_counter_energy(spec, timed)
    assert s.power_mean_w == pytest.approx(250.0, rel=0.02)
    assert s.power_max_w == 250.0
    assert s.power_limit_w == 700.0
    assert s.period_s == PERIOD_S
    assert s.window_s >= 0.5
    assert s.sample_count >= 5  # ~25 expected; a loaded machine may stall the worker
    assert s.kernel_active_pct == 95.0
    assert s.memory_busy_pct == 40.0
    assert s.sm_clock_mhz_mean == 1980.0
    assert s.sm_clock_mhz_min == 1980.0
    assert s.temperature_max_c == 55.0
    assert s.memory_used_max_mib == 20_000.0
    assert s.throttle_share == dict.fromkeys(THROTTLE_BITS, 0.0)
    assert s.gpm == DEFAULT_GPM
    assert s.unavailable_metrics == {}


@pytest.mark.slow
def test_energy_integrates_a_power_step() -> None:
    spec = fake_spec([(0.0, 100.0), (0.5, 300.0)])
    step_at = max(t for t, _ in spec["power_steps"])
    with _open(spec) as sampler:
        # Energy comes from the counter in this process, so the window need not wait for the
        # worker; starting at once keeps the window's begin safely before the step.
        across = _window(sampler, "across", until=step_at + 0.4)
        after = _window(sampler, "after", seconds=0.3)

    assert across.after_begin < step_at, "the machine was too slow to open the window in time"
    _assert_counter_energy(spec, across)
    assert 100.0 < across.summary.power_mean_w < 300.0
    # ~0.5 s at 100 W then 0.4 s at 300 W: a mean near 189 W, nowhere near either end.
    assert across.summary.power_mean_w == pytest.approx(
        _exact_energy_j(spec, across.after_begin, across.before_end)
        / (across.before_end - across.after_begin), rel=0.05)

    _assert_counter_energy(spec, after)
    assert after.summary.power_mean_w == pytest.approx(300.0, rel=0.02)


@pytest.mark.slow
def test_power_is_the_energy_over_the_time_between_the_counters_reads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread held up between a window's edge and the counter's read (a loaded machine: a
    stage of a constant 250 W once read 241.9 W) still reads the power: the energy is divided
    by the time between the reads, not between the edges."""
    from gpudiag.measure.telemetry import sampler as sampler_module

    read = sampler_module._read_energy
    reads: list[float] = []

    def held_up_at_the_end(reader: Any) -> tuple[float | None, float]:
        reads.append(time.monotonic())
        if len(reads) == 2:
            time.sleep(0.1)  # half the window, between its end and the read
        return read(reader)

    monkeypatch.setattr(sampler_module, "_read_energy", held_up_at_the_end)
    with _open(fake_spec([(0.0, 250.0)])) as sampler:
        timed = _window(sampler, "train", seconds=0.2)
    assert len(reads) == 2
    assert timed.summary.window_s is not None and timed.summary.window_s < 0.28
    assert timed.summary.power_mean_w == pytest.approx(250.0, rel=0.01)


@pytest.mark.slow
def test_energy_falls_back_to_the_power_integral_without_a_counter() -> None:
    reason = "counter refused by the test"
    spec = fake_spec([(0.0, 250.0)], refuse={"energy_counter": reason})
    with _open(spec) as sampler:
        assert sampler.wait_ready()
        timed = _window(sampler, "train", seconds=0.5)

    s = timed.summary
    assert s.available
    assert s.energy_source == "power-integral"
    assert s.power_mean_w == pytest.approx(250.0, rel=0.10)
    assert s.energy_j == pytest.approx(s.power_mean_w * s.window_s)
    assert s.unavailable_metrics == {"energy_counter": reason}


@pytest.mark.slow
def test_refused_metrics_are_none_and_listed_while_others_remain() -> None:
    refuse = {"sm_clock_mhz": "clock refused", **dict.fromkeys(GPM_METRICS, "no GPM here")}
    spec = fake_spec([(0.0, 250.0)], refuse=refuse)
    with _open(spec) as sampler:
        assert sampler.wait_ready()
        timed = _window(sampler, "train", seconds=0.3)
        frame = sampler.samples()

    s = timed.summary
    assert s.available
    assert s.sm_clock_mhz_mean is None
    assert s.sm_clock_mhz_min is None
    assert s.gpm == {}
    assert s.unavailable_metrics == refuse
    assert s.kernel_active_pct == 95.0
    assert s.temperature_max_c == 55.0
    _assert_counter_energy(spec, timed)
    assert "sm_clock_mhz" not in frame
    assert not set(GPM_METRICS) & set(frame.columns)
    assert "kernel_active_pct" in frame


@pytest.mark.slow
def test_one_refused_gpm_metric_leaves_the_others() -> None:
    spec = fake_spec([(0.0, 250.0)], refuse={"tensor_active_pct": "not on this chip"},
                     gpm={"sm_active_pct": 80.0})
    with _open(spec) as sampler:
        timed = _window(sampler, "train", seconds=0.2)  # GPM needs >= 0.1 s between edges

    expected = {**DEFAULT_GPM, "sm_active_pct": 80.0}
    del expected["tensor_active_pct"]
    assert timed.summary.gpm == expected
    assert timed.summary.unavailable_metrics == {"tensor_active_pct": "not on this chip"}


@pytest.mark.parametrize(
    ("device_type", "spec", "reason"),
    [
        ("cpu", None, "device is cpu"),
        ("cuda", fake_spec(unavailable="no NVIDIA driver"), "no NVIDIA driver"),
    ],
    ids=["cpu", "no-driver"],
)
def test_unavailable_sampler_degrades_without_raising(
    device_type: str, spec: dict[str, Any] | None, reason: str
) -> None:
    sampler = open_sampler(device_type, None, 0, period_s=PERIOD_S, gpm_period_s=GPM_PERIOD_S,
                           spec=spec)
    assert not sampler.available
    assert sampler.reader is None
    assert reason in sampler.unavailable_reason
    with sampler:
        assert sampler._worker is None  # nothing to sample with, so no process
        assert not sampler.wait_ready(timeout_s=1.0)
        sampler.begin("train")
        summary = sampler.end()
        unopened = sampler.end()
        frame = sampler.samples()

    for s in (summary, unopened):
        assert isinstance(s, TelemetrySummary)
        assert s.available is False
        assert s.reason is not None and reason in s.reason
        assert s.energy_j is None and s.sample_count == 0
    assert frame.empty
    assert list(frame.columns) == ["t_s", "stage", "window"]


@pytest.mark.slow
def test_samples_are_labelled_with_their_window() -> None:
    with _open(fake_spec([(0.0, 250.0)])) as sampler:
        assert sampler.wait_ready()
        a = _window(sampler, "a", seconds=0.3)
        time.sleep(0.1)
        b = _window(sampler, "b", seconds=0.3)
        time.sleep(0.1)
        frame = sampler.samples()
        t0 = sampler._t0

    assert list(frame.columns[:3]) == ["t_s", "stage", "window"]
    assert {"power_instant_w", "kernel_active_pct"} <= set(frame.columns)
    assert (frame["t_s"] >= 0).all()
    assert (np.diff(frame["t_s"].to_numpy()) > 0).all()

    pairs = set(zip(frame["stage"], frame["window"], strict=True))
    assert pairs <= {("", -1), ("a", 0), ("b", 1)}
    assert {"", "a", "b"} <= set(frame["stage"])  # wait_ready guarantees a row before "a"

    t = frame["t_s"] + t0
    for label, timed in (("a", a), ("b", b)):
        inside = frame["stage"] == label
        assert t[inside].between(timed.before_begin, timed.after_end).all()
        # Rows certainly inside the window carry its label.
        surely_inside = t.between(timed.after_begin, timed.before_end)
        assert (frame.loc[surely_inside, "stage"] == label).all()
    # Unlabelled rows lie outside both windows.
    between = frame[frame["stage"] == ""]
    for timed in (a, b):
        assert not (between["t_s"] + t0).between(timed.after_begin, timed.before_end).any()
    # Window summaries counted the rows samples() labels with them (both read the same file).
    assert (frame["stage"] == "a").sum() >= a.summary.sample_count


@pytest.mark.slow
def test_closing_stops_the_worker_and_removes_its_files() -> None:
    with _open(fake_spec()) as sampler:
        assert sampler.wait_ready()
        worker = sampler._worker
        paths = [sampler._rows_path, sampler._errors_path]
        assert worker is not None and worker.poll() is None
        assert all(p is not None and p.exists() for p in paths)

    assert sampler._worker is None
    assert worker.returncode == 0  # stopped on SIGTERM, cleanly
    assert sampler.timeline_error is None
    assert not any(p.exists() for p in paths if p is not None)


@pytest.mark.slow
def test_an_exception_inside_the_sampler_still_stops_the_worker() -> None:
    with pytest.raises(RuntimeError, match="stage failed"), _open(fake_spec()) as sampler:
        worker = sampler._worker
        paths = [sampler._rows_path, sampler._errors_path]
        fake = sampler.reader
        sampler.begin("left open")  # a window never ended: its GPM snapshot must be freed
        raise RuntimeError("stage failed")

    assert sampler._worker is None
    assert worker is not None and worker.poll() is not None
    assert not any(p.exists() for p in paths if p is not None)
    assert fake is not None and fake.live_gpm_snapshots == 0


# --- summarize_window: pure, on synthetic frames ------------------------------------------------


def _summarize(frame: pd.DataFrame, **overrides: Any) -> TelemetrySummary:
    args: dict[str, Any] = {"window_s": 1.0, "energy_begin_mj": None, "energy_end_mj": None,
                            "gpm": {}, "power_limit_w": 700.0, "period_s": 0.05,
                            "metric_status": {}}
    args.update(overrides)
    return summarize_window(frame, **args)


def test_summary_energy_from_the_counter() -> None:
    frame = pd.DataFrame({"t_s": [0.0, 0.1], "power_instant_w": [999.0, 999.0]})
    s = _summarize(frame, window_s=0.5, energy_begin_mj=1_000.0, energy_end_mj=101_000.0)
    assert s.energy_source == "counter"
    assert s.energy_j == pytest.approx(100.0)
    assert s.power_mean_w == pytest.approx(200.0)  # the counter wins over the samples
    # Over the time between the counter's reads, where the caller timed them.
    assert _summarize(frame, window_s=0.5, energy_begin_mj=1_000.0, energy_end_mj=101_000.0,
                      energy_span_s=0.4).power_mean_w == pytest.approx(250.0)
    assert s.power_max_w == 999.0
    assert s.sample_count == 2
    assert s.window_s == 0.5 and s.period_s == 0.05 and s.power_limit_w == 700.0


def test_summary_power_integral_is_time_weighted() -> None:
    # Uneven sampling: trapezoid = 0.1 s * 200 W + 0.3 s * 300 W = 110 J over 0.4 s = 275 W,
    # where a plain mean of the samples would say 233 W.
    frame = pd.DataFrame({"t_s": [0.0, 0.1, 0.4], "power_instant_w": [100.0, 300.0, 300.0]})
    s = _summarize(frame, window_s=0.5, energy_begin_mj=5.0)  # one edge alone is no counter
    assert s.energy_source == "power-integral"
    assert s.power_mean_w == pytest.approx(275.0)
    assert s.energy_j == pytest.approx(275.0 * 0.5)


def test_summary_without_energy_or_enough_power_samples() -> None:
    frame = pd.DataFrame({"t_s": [0.0, 0.1], "power_instant_w": [250.0, np.nan]})
    s = _summarize(frame)
    assert s.energy_j is None and s.energy_source is None and s.power_mean_w is None
    assert s.power_max_w == 250.0


def test_summary_of_an_empty_window() -> None:
    s = _summarize(pd.DataFrame(), metric_status={"sm_clock_mhz": "refused", "temperature_c": "ok"})
    assert s.available and s.sample_count == 0
    assert s.energy_j is None and s.power_max_w is None and s.kernel_active_pct is None
    assert s.throttle_share == {} and s.gpm == {}
    assert s.unavailable_metrics == {"sm_clock_mhz": "refused"}


def test_throttle_share_from_the_reason_bitmask() -> None:
    # JSON rows carry floats; one row lost its reading (NaN) and does not count.
    frame = pd.DataFrame({"throttle_reasons": [0x4, 0x0, np.nan, 0x4 | 0x40, 0x1]},
                         dtype="float64")
    s = _summarize(frame)
    assert s.throttle_share == {"power_cap": 0.5, "hw_slowdown": 0.0, "sw_thermal": 0.0,
                                "hw_thermal": 0.25, "power_brake": 0.0}


def test_throttle_share_when_half_the_samples_are_power_capped() -> None:
    s = _summarize(pd.DataFrame({"throttle_reasons": [4.0, 0.0, 4.0, 0.0]}))
    assert s.throttle_share["power_cap"] == 0.5
    assert s.throttle_share["hw_thermal"] == 0.0


def test_power_max_prefers_instantaneous_power() -> None:
    frame = pd.DataFrame({"t_s": [0.0, 0.1], "power_instant_w": [420.0, 100.0],
                          "power_avg1s_w": [300.0, 310.0]})
    assert _summarize(frame).power_max_w == 420.0


@pytest.mark.parametrize("instant", [None, [np.nan, np.nan, np.nan]], ids=["missing", "all-nan"])
def test_power_max_falls_back_to_the_one_second_average(instant: list[float] | None) -> None:
    columns = {"t_s": [0.0, 0.1, 0.2], "power_avg1s_w": [200.0, 310.0, 250.0]}
    if instant is not None:
        columns["power_instant_w"] = instant
    assert _summarize(pd.DataFrame(columns)).power_max_w == 310.0


def test_gpm_averages_come_from_the_frame_when_the_edges_gave_none() -> None:
    # The worker writes GPM only every few ticks: the other rows have NaN there.
    frame = pd.DataFrame({
        "kernel_active_pct": [90.0, 92.0, 94.0],
        "sm_active_pct": [60.0, np.nan, 70.0],
        "tensor_active_pct": [10.0, np.nan, 20.0],
        "dram_bw_pct": [np.nan, np.nan, np.nan],
    })
    s = _summarize(frame)
    assert s.gpm == {"sm_active_pct": 65.0, "tensor_active_pct": 15.0}
    assert s.kernel_active_pct == 92.0


def test_gpm_from_the_window_edges_wins_over_the_frame() -> None:
    frame = pd.DataFrame({"sm_active_pct": [60.0, 70.0]})
    assert _summarize(frame, gpm={"sm_active_pct": 12.5}).gpm == {"sm_active_pct": 12.5}


def test_summary_means_and_extremes() -> None:
    frame = pd.DataFrame({
        "sm_clock_mhz": [1980.0, 1410.0, 1755.0],
        "temperature_c": [50.0, 71.0, 60.0],
        "memory_used_mib": [100.0, 300.0, 200.0],
        "memory_busy_pct": [10.0, 20.0, 60.0],
    })
    s = _summarize(frame)
    assert s.sm_clock_mhz_mean == pytest.approx(1715.0)
    assert s.sm_clock_mhz_min == 1410.0
    assert s.temperature_max_c == 71.0
    assert s.memory_used_max_mib == 300.0
    assert s.memory_busy_pct == pytest.approx(30.0)


@pytest.mark.slow
def test_samples_stay_readable_after_close() -> None:
    sampler = open_sampler("cpu", None, 0, period_s=0.02, gpm_period_s=0.2,
                           spec=fake_spec([(0.0, 200.0)]))
    with sampler:
        sampler.wait_ready()
        sampler.begin("a")
        time.sleep(0.1)
        sampler.end()
    frame = sampler.samples()
    assert len(frame) >= 1 and "a" in set(frame["stage"])


@pytest.mark.slow
def test_a_worker_that_never_writes_is_waited_for_once(tmp_path: Any) -> None:
    """measure_window asks before every stage's warm-up: a worker that came up is not
    waited for again, and one that hangs costs its timeout once, not once a stage."""
    sampler = Sampler(None, None)
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b"")
    sampler._rows_path = rows
    sampler._worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = time.monotonic()
        assert not sampler.wait_ready(timeout_s=0.5)
        first = time.monotonic() - start
        start = time.monotonic()
        assert not sampler.wait_ready(timeout_s=0.5)
        again = time.monotonic() - start
    finally:
        sampler._worker.kill()
        sampler._worker.wait()
    assert first >= 0.5
    assert again < 0.25  # a margin a loaded machine keeps: nothing is waited for
