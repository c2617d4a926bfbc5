"""Timed steps: how many are run, on the host clock and on CUDA events (faked here: the
branch a GPU takes, forced on the CPU)."""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import pytest
import torch

from gpudiag.measure import timing
from gpudiag.measure.timing import EarlyEnd, median_within, time_steps


def test_a_median_is_pinned_down_by_its_order_statistics() -> None:
    steady = [240.0 + 0.1 * (k % 5) for k in range(15)]  # 0.2% apart at most
    assert median_within(steady, 0.005)
    noisy = [50.0, 60.0] * 15  # a 20% spread: 30 steps do not pin it to 0.5%
    assert not median_within(noisy, 0.005) and median_within(noisy, 0.2)
    assert not median_within([10.0] * 5, 0.005)  # too few for a 95% interval
    # One slow step in fifteen (a stall) does not move the median's interval (x4 .. x12).
    assert median_within([240.0] * 14 + [900.0], 0.005)


class _Clock:
    """perf_counter for the timing module: steps advance it by what they are told."""

    def __init__(self) -> None:
        self.now = 1024.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("durations_ms", "early", "expected"), [
    (itertools.repeat(10.0), EarlyEnd(after=15, precision=0.005), 15),  # steady: ends early
    (itertools.cycle([5.0, 15.0]), EarlyEnd(after=15, precision=0.005), 40),  # noisy: all
    (itertools.repeat(10.0), None, 40),  # no precision asked (--iters given): all
    (itertools.repeat(10.0), EarlyEnd(after=50, precision=0.005), 40),  # after > iters
])
def test_timed_steps_end_early_only_once_their_median_is_known(
        monkeypatch: pytest.MonkeyPatch, durations_ms: Any, early: EarlyEnd | None,
        expected: int) -> None:
    clock = _Clock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    durations = iter(durations_ms)

    def step() -> None:
        clock.now += next(durations) / 1e3

    times = time_steps(step, device=torch.device("cpu"), iters=40, early=early)
    assert len(times.iter_ms) == expected


def test_min_seconds_holds_before_a_precise_median_ends_the_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)

    def step() -> None:
        clock.now += 1 / 128  # exact in binary, as the sum of 32 of them is

    times = time_steps(step, device=torch.device("cpu"), iters=40, min_seconds=0.25,
                       early=EarlyEnd(after=15, precision=0.005))
    assert len(times.iter_ms) == 32  # 0.25 s of 7.8 ms steps, then precise


class _FakeEvent:
    """A CUDA event on a device that runs `lag` steps behind the host."""

    recorded: ClassVar[list[_FakeEvent]] = []
    lag = 3

    def __init__(self, enable_timing: bool = True) -> None:
        self.at_ms = 0.0

    def record(self) -> None:
        self.at_ms = 10.0 * len(_FakeEvent.recorded)
        _FakeEvent.recorded.append(self)

    def query(self) -> bool:
        return _FakeEvent.recorded.index(self) < len(_FakeEvent.recorded) - self.lag

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert (self.query() and end.query()) or queried_after_sync[0], "read before its end"
        return end.at_ms - self.at_ms


queried_after_sync = [False]


def test_on_cuda_only_steps_the_device_finished_count_and_none_is_synchronised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the host queues ahead: a step's time is known once the device passed its end
    event (query, not synchronize); the steps decide on those alone, and the one
    synchronisation is at the end."""
    _FakeEvent.recorded = []
    syncs: list[int] = []

    def synchronize(device: Any = None) -> None:
        syncs.append(len(_FakeEvent.recorded))
        queried_after_sync[0] = len(syncs) > 1

    monkeypatch.setattr(timing.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", synchronize)
    queried_after_sync[0] = False
    times = time_steps(lambda: None, device=torch.device("cuda"), iters=40,
                       early=EarlyEnd(after=15, precision=0.005))
    # 15 known steps are needed, and the device is 3 behind: 18 queued when it ends.
    assert len(times.iter_ms) == 15 + _FakeEvent.lag
    assert times.timer == "cuda-events" and set(times.iter_ms) == {10.0}
    assert syncs == [0, len(_FakeEvent.recorded)]  # before the first step, and to read them
