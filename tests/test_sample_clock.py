"""Who takes the host samples (gpudiag/measure/profile/inscript/threadtimer.py, hostsampler.py):
a timer signal handled in the training thread, and what it must never do to the script:
interrupt its system calls, take a signal the script uses, compile in Dynamo, end the process at
exit."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from gpudiag.measure.profile.inscript import hostsampler, threadtimer
from gpudiag.measure.profile.inscript.hostsampler import Clock, HostSampler
from gpudiag.model.facts import HostSamples

pytestmark = pytest.mark.skipif(threadtimer.unavailable() is not None,
                                reason=f"no timer signal here: {threadtimer.unavailable()}")
SIGNUM = threadtimer.timer_signal() or 0


@pytest.fixture(autouse=True)
def _default_handler_after() -> Iterator[None]:
    yield
    if signal.getsignal(SIGNUM) is not signal.SIG_DFL:
        signal.signal(SIGNUM, signal.SIG_DFL)


def _run_steps(step: Callable[[], None], steps: int, *, period_s: float,
               clock: Clock = "auto") -> HostSamples:
    """`steps` steps in this (the main) thread, with the recorder's per-step call."""
    marks = [time.perf_counter()]
    sampler = HostSampler(marks, thread_id=threading.get_ident(), loop_code=None, cuda=False,
                          warmup=0, skip=(), max_steps=10_000, period_s=period_s, clock=clock)
    sampler.start()
    try:
        for _ in range(steps):
            step()
            marks.append(time.perf_counter())
            sampler.watch(marks[-1])
    finally:
        result = sampler.stop()
    return result


def _ms_at(samples: HostSamples, text: str) -> float:
    line = next(n for n, source in enumerate(Path(__file__).read_text().splitlines(), 1)
                if source.strip().startswith(text))
    return sum(entry.ms for entry in samples.lines
               if entry.location.endswith(f"test_sample_clock.py:{line}"))


def test_a_long_call_that_runs_no_bytecode_is_charged_all_its_time() -> None:
    # The handler waits for the C call to return; the sample stands for every timer period
    # since the previous one, spent in that call. A step is one long C call, then a Python
    # part shorter than the period (weighting a sample by the time since the previous handler
    # would give that part only the time since the call returned: a fifth of its time).
    timers = {"c": 0.0, "python": 0.0}
    n = 200_000
    while True:  # a C call of ~20 ms on this machine
        start = time.perf_counter()
        sum(range(n))
        if time.perf_counter() - start > 0.02:
            break
        n *= 2

    def step() -> None:
        t0 = time.perf_counter()
        sum(range(n))  # one C call
        t1 = time.perf_counter()
        end = t1 + 0.002
        while time.perf_counter() < end:  # Python, 2 ms
            pass
        timers["c"] += t1 - t0
        timers["python"] += time.perf_counter() - t1

    samples = _run_steps(step, 60, period_s=0.005)
    assert samples.clock == "signal"
    c_call, python = _ms_at(samples, "sum(range(n))  # one C call"), \
        _ms_at(samples, "while time.perf_counter() < end:")
    # The C call's time, within 15% on a quiet machine; 44% short once with the suite and mypy
    # on both cores. Charging each sample one period (not every period since the previous
    # one) would give it a quarter. The 2 ms Python part reads 4-15% of its time on a
    # machine with more busy processes than cores (samples that wait for the process to run
    # again are charged to wherever it resumes, which is mostly the long call), 25-90% quiet:
    # only that it is seen. The accounting itself is the next test's, on a clock of its own.
    assert 0.4 <= c_call / (timers["c"] * 1e3) <= 1.3
    assert python > 0


def test_a_sample_stands_for_every_period_since_the_previous_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler's accounting on a clock of the test's: a signal handled 21 ms after the
    timer's start (a 5 ms period; the thread was in one C call meanwhile) stands for the four
    periods then ended; one at 26 ms for the fifth; one at 27 ms (no new period) for none."""
    now = [0.0]
    monkeypatch.setattr(hostsampler.time, "perf_counter", lambda: now[0])
    sampler = HostSampler([0.0], thread_id=threading.get_ident(), loop_code=None, cuda=False,
                          warmup=0, skip=(), max_steps=10, period_s=0.005, clock="signal")
    taken: list[tuple[float, str]] = []
    monkeypatch.setattr(sampler, "take", lambda ms, frame: taken.append(
        (round(ms, 6), frame.f_code.co_name)) or True)
    sampler.timer, sampler.timer_start = object(), 0.0  # armed (no real timer needed)

    def c_call() -> None:
        sampler._on_signal(SIGNUM, sys._getframe())

    def python_part() -> None:
        sampler._on_signal(SIGNUM, sys._getframe())

    for at, where in ((0.021, c_call), (0.026, python_part), (0.027, python_part)):
        now[0] = at
        where()
    assert taken == [(20.0, "c_call"), (5.0, "python_part")]


def test_a_blocked_signal_hands_sampling_to_a_thread() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {SIGNUM})
    try:
        samples = _run_steps(lambda: time.sleep(0.01), 30, period_s=0.005)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {SIGNUM})  # the pending one finds a no-op
    assert samples.clock == "thread"
    assert "never came" in samples.clock_note
    assert samples.samples > 10


def test_a_signal_the_script_handles_is_left_to_it() -> None:
    seen: list[int] = []
    signal.signal(SIGNUM, lambda signum, frame: seen.append(signum))
    samples = _run_steps(lambda: time.sleep(0.01), 20, period_s=0.005)
    assert samples.clock == "thread"
    assert "script's own" in samples.clock_note
    assert not seen
    with pytest.raises(OSError, match="script's own"):
        _run_steps(lambda: None, 1, period_s=0.005, clock="signal")


@pytest.mark.slow
def test_system_calls_in_the_training_thread_resume_under_the_signal() -> None:
    # A C library's read(2), as a C extension makes it (Python's own calls retry on EINTR,
    # PEP 475; C code often does not): it must be restarted, not fail, under the signal.
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    read_end, write_end = os.pipe()
    threading.Timer(0.15, os.write, (write_end, b"x")).start()
    got: list[int] = []

    def step() -> None:
        if not got:
            buffer = ctypes.create_string_buffer(1)
            got.append(libc.read(read_end, buffer, 1))  # blocks 150 ms under a 1 kHz signal
        start = time.perf_counter()
        time.sleep(0.05)
        assert time.perf_counter() - start >= 0.05
        done = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.05)"],
                              check=True, capture_output=True)
        assert done.returncode == 0

    samples = _run_steps(step, 3, period_s=0.001)
    os.close(read_end)
    os.close(write_end)
    assert got == [1]
    assert samples.clock == "signal" and samples.samples > 100


def test_compiled_code_sampled_compiles_nothing_more() -> None:
    dynamo = pytest.importorskip("torch._dynamo")
    layer = torch.nn.Linear(32, 32)

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = layer(x)
        if y.sum() > 0:  # a graph break
            y = y * 2
        return y.relu()

    compiled = torch.compile(forward, backend="eager")
    x = torch.randn(8, 32)
    compiled(x)

    def counts() -> dict[str, dict[str, int]]:
        # Every counter: without the handler kept out, Dynamo counts frames it tried to
        # compile (the handler's) and the reasons it could not, not the graphs or breaks.
        return {name: dict(counter) for name, counter in dynamo.utils.counters.items()}

    before = counts()

    def step() -> None:
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            compiled(x)

    samples = _run_steps(step, 60, period_s=0.005)
    # ~240 on a quiet machine; a loaded one delivers fewer timer signals (145 seen): at least
    # one a step is many handler runs inside compiled code.
    assert samples.samples >= 60
    assert counts() == before


def test_a_handler_put_back_to_its_default_costs_samples_not_the_process() -> None:
    """Lightning's fit() ends by restoring every signal's handler it saw at its start (the
    default one, for a timer gpudiag started later): the next expiry must not end the
    process (a real-time signal's default action did, 1 Lightning profile in 5), and the
    sampler hands sampling to a thread and says why."""
    steps = [0]

    def step() -> None:
        steps[0] += 1
        if steps[0] == 5:
            signal.signal(SIGNUM, signal.SIG_DFL)  # as _SignalConnector.teardown does
        end = time.perf_counter() + 0.01
        while time.perf_counter() < end:  # 1 ms expiries land in this loop
            pass

    samples = _run_steps(step, 20, period_s=0.001)
    assert samples.clock == "thread"
    assert samples.clock_note == "the script replaced the timer signal's handler by step 5"
    assert samples.samples > 20


def test_at_exit_every_live_timer_is_deleted() -> None:
    timer = threadtimer.ThreadTimer(0.01, lambda signum, frame: None)
    timer.start()
    try:
        threadtimer._close_live()
        assert not timer.created and not threadtimer._LIVE
    finally:
        timer.close()


def test_a_signal_inside_the_handling_of_the_last_is_no_sample() -> None:
    # Under torch.compiler.disable the handler runs inside torch's wrapper first; a signal
    # handled there would be charged to torch's frames, not the script's.
    seen: list[bool] = []
    wrapped = torch.compiler.disable(threadtimer._dispatch)
    threadtimer._WRAPPER_CODES[id(wrapped.__code__)] = wrapped.__code__
    threadtimer._HANDLERS[SIGNUM] = lambda signum, frame: seen.append(
        threadtimer.in_handling(sys._getframe(1)))
    try:
        wrapped(SIGNUM, None)
    finally:
        threadtimer._HANDLERS.pop(SIGNUM, None)

    @torch.compiler.disable
    def scripts_own() -> bool:  # the same wrapper around the script's function: a sample
        return threadtimer.in_handling(sys._getframe())

    assert seen == [True]
    assert scripts_own() is False
