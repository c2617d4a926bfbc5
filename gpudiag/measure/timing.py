"""Device-synchronised step timing.

On CUDA every step is bracketed by CUDA events recorded in a chain on the current stream, with no
synchronisation between steps: the host keeps queueing step i+1 while the GPU runs step i, as in
real training, and the event gap is still the step's own time on the GPU timeline (including any
idle time the GPU spends waiting for the host). One synchronisation at the end reads them all.
Elsewhere (CPU, or host-only work such as a DataLoader) a monotonic host clock is used.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import nvtx
import torch

from gpudiag.measure.interrupts import Stopped, raise_if_stopped, signal_of

# Bound on iterations when a stage runs "until min_seconds": keeps event lists and memory small
# for very fast steps (a DataLoader batch can take well under a millisecond).
MAX_ITERS_FACTOR = 100


@dataclass
class StepTimes:
    iter_ms: list[float]
    wall_s: float  # host time from the first step's start to the last step's completion
    timer: str  # "cuda-events" or "host-clock"


@dataclass(frozen=True)
class EarlyEnd:
    """Timed steps may end before their count, from `after` steps on, once their median is
    known within +-`precision` (a fraction of it)."""

    after: int
    precision: float


def time_steps(
    step: Callable[[], object],
    *,
    device: torch.device,
    iters: int,
    min_seconds: float = 0.0,
    early: EarlyEnd | None = None,
    host_only: bool = False,
    label: str = "step",
    on_step: Callable[[int], None] | None = None,
) -> StepTimes:
    """Run `step` at least `iters` times (and for at least `min_seconds`); time every call.
    With `early`, fewer than `iters` once the times already known pin the median down (on
    CUDA, those of the steps the device has finished: no synchronisation is added)."""
    use_events = device.type == "cuda" and not host_only
    max_iters = max(iters, iters * MAX_ITERS_FACTOR)
    marks: list[torch.cuda.Event] = []
    host_marks: list[float] = []
    known: list[float] = []  # step times known so far, for `early`

    def enough(done: int) -> bool:
        if time.perf_counter() - start < min_seconds and done < max_iters:
            return False
        if done >= iters:
            return True
        if early is None or done < early.after:
            return False
        _known_so_far(known, marks, host_marks)
        return len(known) >= early.after and median_within(known, early.precision)

    if use_events:
        torch.cuda.synchronize(device)
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[0].record()
    start = time.perf_counter()
    host_marks.append(start)
    done = 0
    try:
        while not enough(done):
            with nvtx.annotate(f"{label} {done}", domain="gpudiag"):
                step()
            if use_events:
                mark = torch.cuda.Event(enable_timing=True)
                mark.record()
                marks.append(mark)
            else:
                host_marks.append(time.perf_counter())
            done += 1
            raise_if_stopped()
            if on_step is not None:
                on_step(done)
    except KeyboardInterrupt as exc:  # the steps that finished are measurements: keep them
        raise Stopped(signal_of(exc), _step_times(marks, host_marks, start, device)) from exc
    return _step_times(marks, host_marks, start, device)


def _known_so_far(known: list[float], marks: list[torch.cuda.Event],
                  host_marks: list[float]) -> None:
    """`known` extended by the step times now known: on CUDA, of the steps whose end event
    the device has passed (a query, not a synchronisation)."""
    if marks:
        while len(known) + 1 < len(marks) and marks[len(known) + 1].query():
            known.append(marks[len(known)].elapsed_time(marks[len(known) + 1]))
    else:
        known.extend((b - a) * 1e3
                     for a, b in itertools.pairwise(host_marks[len(known):]))


def median_within(times: list[float], precision: float, z: float = 1.96) -> bool:
    """Whether the median of `times` is known within +-`precision` of it: the distribution-free
    interval between the order statistics n/2 -+ z*sqrt(n)/2 (the binomial's normal
    approximation; Conover, Practical Nonparametric Statistics, 3rd ed., section 3.2): at
    z = 1.96, 15 steps give (x4, x12), the exact binomial's 96.5% interval."""
    n = len(times)
    if n < 6:  # fewer order statistics than a 95% interval needs
        return False
    ordered = sorted(times)
    half = z * math.sqrt(n) / 2
    low = ordered[max(0, math.floor(n / 2 - half))]  # 0-based: x(r), r = floor(n/2 - h) + 1
    high = ordered[min(n - 1, math.ceil(n / 2 + half) - 1)]  # x(s), s = ceil(n/2 + h)
    median = statistics.median(ordered)
    return median > 0 and (high - low) / 2 <= precision * median


def _step_times(marks: list[torch.cuda.Event], host_marks: list[float], start: float,
                device: torch.device) -> StepTimes:
    if marks:
        torch.cuda.synchronize(device)
        iter_ms = [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
    else:
        iter_ms = [(b - a) * 1e3 for a, b in itertools.pairwise(host_marks)]
    return StepTimes(iter_ms=iter_ms, wall_s=time.perf_counter() - start,
                     timer="cuda-events" if marks else "host-clock")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseRecorder:
    """Times named phases inside a step (data wait, forward, backward, optimizer).

    Device phases are bracketed by CUDA events like whole steps (no synchronisation); host
    phases, such as waiting for a DataLoader, by the host clock. `collect()` synchronises once
    and returns milliseconds per phase, one entry per step in call order.
    """

    def __init__(self, device: torch.device) -> None:
        self._use_events = device.type == "cuda"
        self._device = device
        self._marks: list[tuple[str, object, object]] = []

    def clear(self) -> None:
        self._marks.clear()

    def _mark(self, host: bool) -> object:
        if host or not self._use_events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def phase(self, name: str, *, host: bool = False) -> Iterator[None]:
        start = self._mark(host)
        with nvtx.annotate(name, domain="gpudiag"):
            yield
        self._marks.append((name, start, self._mark(host)))

    def collect(self) -> dict[str, list[float]]:
        synchronize(self._device)
        phases: dict[str, list[float]] = {}
        for name, start, end in self._marks:
            if isinstance(start, float) and isinstance(end, float):
                ms = (end - start) * 1e3
            else:
                ms = start.elapsed_time(end)  # type: ignore[attr-defined]
            phases.setdefault(name, []).append(ms)
        return phases
