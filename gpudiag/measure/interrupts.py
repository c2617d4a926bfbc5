"""Stopping a measurement: SIGINT and SIGTERM both stop it, and both keep what was measured.

Ctrl-C raises KeyboardInterrupt in the main thread, and every measuring loop already turns that
into "stop, mark the run interrupted, write what was measured". SIGTERM (what `kill`, a job
scheduler or a CI runner sends) kills a Python process outright by default, losing everything;
here it raises `Terminated`, a KeyboardInterrupt, so it takes the same path. The exit code then
says which signal stopped the run, as a shell would: 128 + the signal (130, 143).

Child processes gpudiag starts (`--trials`, the gate's trials, the ddp stage's launcher) are
waited for with `wait_child`: a signal that reached gpudiag alone is passed on to the child,
which writes its own partial results, and the child gets a grace period before it is killed.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

CHILD_GRACE_S = 8.0  # a stopped child writes its partial run well within this
# A signal this soon after the first is the same stop arriving twice, not a second request.
REPEAT_WINDOW_S = 2.0
# SIGHUP too: a closed terminal or a dropped ssh session stops a measurement as SIGTERM does,
# and keeps what was measured (exit 129), instead of ending gpudiag and orphaning its children.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# Set in a gate's or a calibration's trial processes: their stop is the parent's to say, in
# its one line (a trial's own line beside it made two, or, stopped otherwise, none).
STOP_SAID_BY_PARENT = "GPUDIAG_STOP_SAID_BY_PARENT"


def signal_name(signum: int) -> str:
    """SIGTERM, SIGKILL, ...; a real-time signal (which has no name in signal.Signals) as
    the C library describes it, e.g. "signal 60 (Real-time signal 26)"."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        described = signal.strsignal(signum) if hasattr(signal, "strsignal") else None
        return f"signal {signum}" + (f" ({described})" if described else "")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so the same code keeps what was measured."""

    signum = signal.SIGTERM


class HungUp(Terminated):
    """SIGHUP: the terminal closed, or the ssh session dropped."""

    signum = signal.SIGHUP


class Stopped(KeyboardInterrupt):
    """A stop that interrupted a measuring loop, carrying what the loop had measured (its
    steps so far) up to the code that records the stage."""

    def __init__(self, signum: int, partial: Any) -> None:
        super().__init__(signal_name(signum))
        self.signum, self.partial = signum, partial


@dataclass
class Stop:
    """Which signal stopped the run, if one did."""

    signum: int | None = None
    first_at: float = 0.0  # monotonic time of the first signal
    deferring: bool = False  # inside stop_deferred(): the first signal waits

    @property
    def exit_code(self) -> int | None:
        return None if self.signum is None else 128 + self.signum


_ACTIVE: list[Stop] = []  # the open stop_on_signals' Stop, for raise_if_stopped()


def stop_error(signum: int | None) -> KeyboardInterrupt:
    """The exception a stop by `signum` raises: KeyboardInterrupt for SIGINT (or none known),
    HungUp for SIGHUP, Terminated for SIGTERM."""
    if signum == signal.SIGHUP:
        return HungUp()
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _swallows(frame: FrameType | None) -> bool:
    """A frame whose exceptions Python prints as "Exception ignored" and drops: importlib's
    module-lock weakref callback (seen: a SIGTERM during an import in a loaded CI run)."""
    return frame is not None and frame.f_code.co_name == "cb" \
        and frame.f_code.co_filename.startswith("<frozen importlib")


def _raise_for(stop: Stop) -> Callable[[int, FrameType | None], None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if stop.signum is not None and now - stop.first_at < REPEAT_WINDOW_S:
            return  # the same stop arriving twice (the terminal's group and a parent's relay)
        if stop.signum is None:
            stop.signum, stop.first_at = signum, now
            if stop.deferring:
                return  # raise_if_stopped() at the first stage raises it
        if _swallows(frame):
            return  # raise_if_stopped() at the next step or stage raises it
        raise stop_error(signum)
    return handler


def raise_if_stopped() -> None:
    """Raise the stop a signal asked for, where its own raise was lost (a callback whose
    exceptions Python drops): called between steps and stages, it never fires twice for one
    stop, since the runner stops at the first."""
    if _ACTIVE and _ACTIVE[-1].signum is not None:
        raise stop_error(_ACTIVE[-1].signum)


@contextlib.contextmanager
def stop_deferred() -> Iterator[None]:
    """Set-up that a stop would cut short with nothing to show for it (torch's import, the
    sampler's start: a second or two): a first stop while this is open is raised by the next
    raise_if_stopped(), at the first stage, which marks the run interrupted and writes it. A
    second signal, later than REPEAT_WINDOW_S, stops at once (a set-up that hangs)."""
    if not _ACTIVE:
        yield
        return
    stop = _ACTIVE[-1]
    previous, stop.deferring = stop.deferring, True
    try:
        yield
    finally:
        stop.deferring = previous


# A peer that went away mid-handshake, as multiprocessing's resource_sharer thread (how
# DataLoader workers pass file descriptors to the main process) reports it.
_PEER_GONE = (ConnectionResetError, BrokenPipeError, EOFError)
_RESOURCE_SHARER = "multiprocessing/resource_sharer.py"


def sharer_lost_a_peer(exc_type: type[BaseException], tb: TracebackType | None) -> bool:
    """A stop kills the DataLoader's workers, one perhaps in the middle of handing the main
    process a file descriptor: the sharer's background thread then reports an error that is
    the stop, not a failure (the loader itself reports a worker it lost)."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    return issubclass(exc_type, _PEER_GONE) and any(
        f.filename.endswith(_RESOURCE_SHARER) for f in frames)


def _quiet_resource_sharer(
        previous: Callable[[threading.ExceptHookArgs], Any],
) -> Callable[[threading.ExceptHookArgs], None]:
    def hook(args: threading.ExceptHookArgs) -> None:
        if not sharer_lost_a_peer(args.exc_type, args.exc_traceback):
            previous(args)
    return hook


def _quiet_sharer_sys_hook(
        previous: Callable[[type[BaseException], BaseException, TracebackType | None], Any],
) -> Callable[[type[BaseException], BaseException, TracebackType | None], None]:
    # The sharer's thread catches its own errors and hands them to sys.excepthook
    # (multiprocessing/resource_sharer.py, _ResourceSharer._serve), not threading's.
    def hook(exc_type: type[BaseException], exc: BaseException,
             tb: TracebackType | None) -> None:
        if not sharer_lost_a_peer(exc_type, tb):
            previous(exc_type, exc, tb)
    return hook


@contextlib.contextmanager
def stop_on_signals() -> Iterator[Stop]:
    """SIGINT and SIGTERM raise KeyboardInterrupt (Terminated) in the main thread while this is
    open; the yielded Stop says which came first."""
    stop = Stop()
    handler = _raise_for(stop)
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    _ACTIVE.append(stop)
    previous_hook, previous_sys_hook = threading.excepthook, sys.excepthook
    threading.excepthook = _quiet_resource_sharer(previous_hook)
    sys.excepthook = _quiet_sharer_sys_hook(previous_sys_hook)
    try:
        yield stop
    finally:
        _ACTIVE.remove(stop)
        for s, old in previous.items():
            signal.signal(s, old)
        if stop.signum is None:  # a stopped run is ending: its workers' threads may still speak
            threading.excepthook, sys.excepthook = previous_hook, previous_sys_hook


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """No signal may cut what follows (the last write of a stopped run) short."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def signal_of(exc: KeyboardInterrupt) -> int:
    if isinstance(exc, Stopped):
        return exc.signum
    return exc.signum if isinstance(exc, Terminated) else signal.SIGINT


def child_stopped(code: int, signum: int | None) -> bool:
    """Whether a child gpudiag run ended because of a stop: gpudiag passed it a signal, or it
    exited as a stopped gpudiag does (130, 143, 129)."""
    return signum is not None or code in tuple(128 + s for s in STOP_SIGNALS)


def wait_child(process: subprocess.Popen[bytes]) -> tuple[int, int | None]:
    """Wait for a child gpudiag started: (its exit code, the signal that stopped gpudiag or
    None). On a stop the child gets the same signal (it may have had it already, from the
    terminal's process group: a second one changes nothing for a process that is stopping)
    and CHILD_GRACE_S to write its partial results before it is killed."""
    try:
        return process.wait(), None
    except KeyboardInterrupt as exc:
        signum = signal_of(exc)
    with signals_ignored():
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signum)
        try:
            code = process.wait(timeout=CHILD_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
    return code, signum
