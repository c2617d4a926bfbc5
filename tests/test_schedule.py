"""The step schedule of `gpudiag profile` (gpudiag/measure/profile/inscript/schedule.py): each
step's phase and the ranges the recorder reads, for schedules with and without warm-up and a
profiler window; and which steps the recorder inside the script times
(gpudiag/measure/profile/inscript/recorder.py), on the host clock and on CUDA events, and which
pace the profiler window is held against."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from gpudiag.measure.profile.inscript.recorder import Recorder
from gpudiag.measure.profile.inscript.schedule import Phase, Schedule
from gpudiag.model.config import ProfileConfig
from gpudiag.model.results import TimingStats

W, T, P, A = Phase.WARMUP, Phase.TIMED, Phase.PROFILED, Phase.AFTER

# (warmup, timed, evidence_steps) -> the phases of steps 0, 1, 2, ...
PHASES = [
    ((2, 3, 2), [W, W, T, T, T, P, P, A, A]),
    ((0, 3, 2), [T, T, T, P, P, A]),  # no warm-up: step 0 is timed
    ((2, 3, 0), [W, W, T, T, T, A, A]),  # no profiler window
    ((0, 2, 0), [T, T, A]),
    ((1, 1, 1), [W, T, P, A]),
    ((5, 30, 3), [W] * 5 + [T] * 30 + [P] * 3 + [A] * 2),  # the defaults
]


@pytest.mark.parametrize(("schedule", "phases"), PHASES, ids=[str(s) for s, _ in PHASES])
def test_each_steps_phase(schedule: tuple[int, int, int], phases: list[Phase]) -> None:
    plan = Schedule(*schedule)
    assert [plan.phase(step) for step in range(len(phases))] == phases
    assert plan.phase(10_000) is Phase.AFTER


# (warmup, timed, evidence_steps) -> timed, profiled, quiet, unsampled steps; end
RANGES = [
    ((2, 3, 2), range(2, 5), range(5, 7), range(2, 8), range(5, 8), 7),
    ((0, 3, 2), range(0, 3), range(3, 5), range(0, 6), range(3, 6), 5),
    ((2, 3, 0), range(2, 5), range(5, 5), range(2, 6), range(0), 5),
    ((0, 2, 0), range(0, 2), range(2, 2), range(0, 3), range(0), 2),
]


@pytest.mark.parametrize(("schedule", "timed", "profiled", "quiet", "unsampled", "end"), RANGES,
                         ids=[str(r[0]) for r in RANGES])
def test_the_ranges_the_recorder_reads(schedule: tuple[int, int, int], timed: range,
                                       profiled: range, quiet: range, unsampled: range,
                                       end: int) -> None:
    plan = Schedule(*schedule)
    assert (plan.timed_steps, plan.profiled_steps, plan.end) == (timed, profiled, end)
    assert (plan.quiet_steps, plan.unsampled_steps) == (quiet, unsampled)
    assert all(plan.phase(s) is Phase.TIMED for s in timed)
    assert all(plan.phase(s) is Phase.PROFILED for s in profiled)


def test_a_config_gives_its_schedule_and_needs_its_steps() -> None:
    config = ProfileConfig(warmup=4, timed=10, evidence_steps=2)
    assert Schedule.of(config) == Schedule(4, 10, 2)
    assert Schedule.of(config).end == config.steps_needed


@pytest.mark.parametrize("bad", [(-1, 3, 2), (2, -3, 2), (2, 3, -1)])
def test_no_negative_counts(bad: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="none negative"):
        Schedule(*bad)


def test_steps_count_from_zero() -> None:
    with pytest.raises(ValueError, match="from 0"):
        Schedule(1, 1, 1).phase(-1)


class _Event:
    """A CUDA event on a clock of its own: each record() is 1 ms after the one before it."""

    clock = itertools.count()

    def __init__(self, enable_timing: bool) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = float(next(self.clock))

    def elapsed_time(self, end: _Event) -> float:
        return end.at - self.at


def test_cuda_events_end_each_warmup_and_timed_step(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Events start at the first step boundary (step 0 has no device time) and end with the
    last timed step: the steps after are on the host clock only."""
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    recorder = Recorder(tmp_path, ProfileConfig(warmup=2, timed=3, evidence_steps=0,
                                                telemetry="off", host_sample_hz=0))
    recorder.cuda = True  # decided: no telemetry to open at the first boundary
    monkeypatch.setattr(recorder, "_write_part", lambda **_: None)  # (it asks the device)
    for _ in range(9):
        recorder.boundary()
    assert len(recorder.events) == 5  # the ends of steps 0..4
    first, warmup_ms, timed_ms = recorder._measured_ms()
    assert (first, len(warmup_ms), len(timed_ms)) == (2, 1, 3)  # step 1; steps 2, 3, 4


def _stepped(tmp_path: Path, config: ProfileConfig, cuda: bool,
             monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """A recorder that saw 12 steps, step i taking 10 + i ms on either clock."""
    recorder = Recorder(tmp_path, config)
    step_ms = [10.0 + i for i in range(12)]
    recorder.host_marks[:] = list(itertools.accumulate([0.0, *(ms / 1e3 for ms in step_ms)]))
    recorder.cuda = cuda
    if cuda:  # events at the ends of the warm-up and timed steps: step i is events[i-1] -> [i]
        ends = config.warmup + config.timed
        monkeypatch.setattr(recorder, "_step_ms", lambda: step_ms[1:ends])
    return recorder


@pytest.mark.parametrize("cuda", [False, True], ids=["host-clock", "cuda-events"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_the_timed_steps_are_the_schedules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           cuda: bool, warmup: int) -> None:
    config = ProfileConfig(warmup=warmup, timed=4, evidence_steps=2)
    first, warmup_ms, timed_ms = _stepped(tmp_path, config, cuda, monkeypatch)._measured_ms()
    # On CUDA events step 0 has no time: a schedule without warm-up times from step 1.
    first_timed = max(warmup, 1) if cuda else warmup
    assert first == first_timed
    assert timed_ms == pytest.approx([10.0 + i for i in range(first_timed, warmup + 4)])
    assert warmup_ms == pytest.approx([10.0 + i for i in range(1 if cuda else 0, first_timed)])


@pytest.mark.parametrize("cuda", [False, True], ids=["host-clock", "cuda-events"])
def test_the_window_is_held_against_the_timed_steps_pace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: bool) -> None:
    """The profiler window's overhead is its step time over the timed steps' pace: those
    steps' on either clock (on CUDA events this once took steps W+1..W+T, one of them
    profiled)."""
    config = ProfileConfig(warmup=3, timed=4, evidence_steps=2)
    recorder = _stepped(tmp_path, config, cuda, monkeypatch)

    class Window:
        open, annotate = True, True
        step_ms = (40.0, 42.0)
        device = torch.device("cpu")

        def stop(self, closing_step: bool, export_to: Path | None = None) -> None:
            self.open = False
            if export_to is not None:
                export_to.write_text('{"traceEvents": []}')

    recorder.window = Window()  # type: ignore[assignment]
    recorder._stop_profiler(keep=True, at_boundary=True)
    # Left for gpudiag's process to analyse (launching/windows.py), against that pace.
    trace = recorder.window_trace
    assert trace is not None and (trace.steps, trace.step_ms) == (2, 41.0)
    assert trace.timed_step_ms == pytest.approx(TimingStats.of([13.0, 14.0, 15.0, 16.0]).p25_ms)
    assert (recorder.out / trace.trace).is_file()


def test_the_ranks_of_a_job_close_their_windows_together(tmp_path: Path) -> None:
    """Each rank votes at the end of a profiled step; the window goes on only where every
    rank wants it to, the same answer for all; a vote that never comes (a rank on another
    machine) gives every rank None after the same wait: all then profile whole."""
    from concurrent.futures import ThreadPoolExecutor

    from gpudiag.measure.profile.inscript.ranksagree import window_goes_on
    from gpudiag.measure.profile.launching.session import _clear

    def vote(step: int, wants: list[bool], world: int | None = None,
             timeout_s: float = 10.0) -> list[bool | None]:
        with ThreadPoolExecutor(len(wants)) as pool:
            return list(pool.map(lambda r: window_goes_on(
                tmp_path, step, r, world or len(wants), wants[r], timeout_s=timeout_s),
                range(len(wants))))

    assert vote(10, [True, True]) == [True, True]
    assert vote(11, [True, False]) == [False, False]  # one rank's budget is spent: all close
    assert vote(12, [False, False, False]) == [False, False, False]
    assert vote(13, [True], world=2, timeout_s=0.05) == [None]  # rank 1 never votes
    # A later run in the same parts folder (--force) starts without them: a stale vote of
    # rank 1 at step 10 would be read as this run's.
    assert list(tmp_path.glob("window-vote-*"))
    _clear(tmp_path)
    assert not list(tmp_path.glob("window-vote-*"))
