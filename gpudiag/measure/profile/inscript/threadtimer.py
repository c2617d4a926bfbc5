"""A periodic signal to one thread: a Linux POSIX timer (`timer_create(2)` with
SIGEV_THREAD_ID) on the monotonic clock, driven through ctypes; no library wraps it, and the
standard library's `signal.setitimer` signals the whole process (any thread's blocking call
could be interrupted) on SIGALRM, which the script's own `signal.alarm()` shares.

The signal is SIGURG, unless the process has claimed it (its handler is the default one
when gpudiag starts), handled with SA_RESTART so that the training thread's system calls resume
rather than fail with EINTR (signal(7) lists the few that never do: sleeps and polls, which
CPython retries itself, PEP 475). SIGURG because its default action is to ignore it
(signal(7)): a handler put back to the default by someone else costs samples, never the
process. Lightning's `_SignalConnector.teardown` does exactly that at the end of `fit()` (it
restores every signal's handler as it was at fit's start), and with the real-time signal
gpudiag first used, the next expiry killed the finished script (1 profile in 5). Go's runtime
preempts goroutines with SIGURG for the same reason (golang/proposal, design
24543-non-cooperative-preemption.md).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import CodeType, FrameType

from gpudiag.measure.interrupts import signal_name

SIGEV_THREAD_ID = 4  # <asm-generic/siginfo.h>: deliver to the thread named in the event
CLOCK_MONOTONIC = 1  # <linux/time.h>: time.perf_counter's clock on Linux


class _Sigevent(ctypes.Structure):
    """struct sigevent on Linux (64 bytes): the thread id sits where the union starts."""

    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("thread_id", ctypes.c_int), ("_pad", ctypes.c_int * 11)]


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval", _Timespec), ("value", _Timespec)]


def _timespec(seconds: float) -> _Timespec:
    whole, fraction = divmod(seconds, 1.0)
    return _Timespec(int(whole), max(1, round(fraction * 1e9)))


Handler = Callable[[int, FrameType | None], None]


def _library_names() -> Iterator[str | None]:
    """glibc's sonames first; find_library (which runs ldconfig) only if they fail."""
    yield "libc.so.6"
    yield "librt.so.1"
    yield ctypes.util.find_library("c")
    yield ctypes.util.find_library("rt")


@functools.cache
def _posix_timers() -> ctypes.CDLL | None:
    """The C library holding timer_create (glibc >= 2.34; librt before). Looked up once:
    find_library runs ldconfig, tens of ms on the training thread."""
    for name in _library_names():
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError:
            continue
        if hasattr(lib, "timer_create"):
            lib.timer_create.argtypes = [ctypes.c_int, ctypes.POINTER(_Sigevent),
                                         ctypes.POINTER(ctypes.c_void_p)]
            lib.timer_settime.argtypes = [ctypes.c_void_p, ctypes.c_int,
                                          ctypes.POINTER(_Itimerspec),
                                          ctypes.POINTER(_Itimerspec)]
            lib.timer_delete.argtypes = [ctypes.c_void_p]
            return lib
    return None


def timer_signal() -> int | None:
    return signal.SIGURG if hasattr(signal, "SIGURG") else None


def unavailable() -> str | None:
    """Why the calling thread cannot be signalled by a timer (None: it can)."""
    if not sys.platform.startswith("linux"):
        return f"no POSIX thread timers on {sys.platform}"
    if threading.current_thread() is not threading.main_thread():
        return "the training thread is not the main thread (only it runs signal handlers)"
    signum = timer_signal()
    if signum is None or _posix_timers() is None:
        return "the C library has no timer_create"
    if signal.getsignal(signum) is not signal.SIG_DFL and not handled(signum):
        return f"{signal_name(signum)} is the script's own"
    return None


def handled(signum: int) -> bool:
    """Whether the signal's handler is still one gpudiag installed (a script, or a library
    restoring the handlers it saw earlier, may have put another back)."""
    current = signal.getsignal(signum)
    return any(current is ours for ours in _INSTALLED)


# Timers not closed by the end of the interpreter are closed then, before CPython's
# finalisation puts the signal's default action back.
_LIVE: dict[int, ThreadTimer] = {}


@atexit.register
def _close_live() -> None:
    """At exit: every timer of this process deleted, and its signal ignored from here on. An
    expiry the kernel queued before the delete can still come; CPython's finalisation puts
    the default action back for a signal with a Python handler, and a real-time signal's
    default action ends the process: a Lightning script was killed by signal 60 after its
    last step (1 profile in 5). A signal set to SIG_IGN is left ignored by the finalisation
    (Modules/signalmodule.c, _PySignal_Fini)."""
    for timer in list(_LIVE.values()):
        if timer.pid == os.getpid():  # (a forked child has none of its parent's timers)
            timer.close()
    for signum in sorted(_SIGNALS):
        if handled(signum):  # ours still: the script has not put a handler of its own there
            with contextlib.suppress(ValueError, OSError):
                signal.signal(signum, signal.SIG_IGN)


# The handler stays installed once set: a signal already on its way when a timer is deleted
# finds one that takes no sample.
_HANDLERS: dict[int, Handler] = {}


_INSTALLED: list[Handler] = []
_SIGNALS: set[int] = set()  # the signals gpudiag ever set a handler on
# Wrappers' code around _dispatch (they wrap others too), by id: a code object hashes its
# whole bytecode and constants, microseconds in a handler that runs 100 times a second.
_WRAPPER_CODES: dict[int, CodeType] = {}
HANDLING_DEPTH = 3  # frames a signal's handling runs through before the handler proper


def _dispatch(signum: int, frame: FrameType | None) -> None:
    handler = _HANDLERS.get(signum)
    if handler is not None:
        handler(signum, frame)


def in_handling(frame: FrameType) -> bool:
    """Whether a signal interrupted the handling of the one before: the frame, or one just
    above it, is _dispatch or a wrapper around it (a wrapper such as torch.compiler.disable's
    holds the function it wraps as `fn`; it wraps the script's own functions too)."""
    f: FrameType | None = frame
    for _ in range(HANDLING_DEPTH):
        if f is None:
            return False
        code = f.f_code
        if code is _dispatch.__code__ or (id(code) in _WRAPPER_CODES
                                          and f.f_locals.get("fn") is _dispatch):
            return True
        f = f.f_back
    return False


def _install(signum: int, handler: Handler) -> None:
    signal.signal(signum, handler)
    signal.siginterrupt(signum, False)  # SA_RESTART
    _INSTALLED.append(handler)
    _SIGNALS.add(signum)


class ThreadTimer:
    """Signals the calling (main) thread every `period_s`, until closed; `handler` runs in it
    between two bytecodes, with the frame it was running."""

    def __init__(self, period_s: float, handler: Handler) -> None:
        reason = unavailable()
        if reason is not None:
            raise OSError(reason)
        lib, signum = _posix_timers(), timer_signal()
        assert lib is not None and signum is not None
        self.lib, self.signum, self.period_s = lib, signum, period_s
        self.timer = ctypes.c_void_p()
        event = _Sigevent(signo=signum, notify=SIGEV_THREAD_ID,
                          thread_id=threading.get_native_id())
        if lib.timer_create(CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(self.timer)):
            raise OSError(ctypes.get_errno(), "timer_create failed")
        self.created = True  # (the first timer's id is 0: its handle's value reads None)
        self.pid = os.getpid()
        _LIVE[id(self)] = self
        _HANDLERS[signum] = handler
        if signal.getsignal(signum) is signal.SIG_DFL:
            _install(signum, _dispatch)

    def wrap(self, wrapper: Callable[[Handler], Handler]) -> None:
        """Install the signal's handler as `wrapper(handler)`; from the thread signalled."""
        wrapped = wrapper(_dispatch)
        _install(self.signum, wrapped)
        code = getattr(wrapped, "__code__", None)
        if code is not None:
            _WRAPPER_CODES[id(code)] = code

    def start(self, first_after_s: float | None = None) -> float:
        """Arm the timer, its first expiry `first_after_s` from now (default: one period);
        returns the perf_counter time its period counts from (at or before the kernel's: its
        n-th expiry is at or after start + n x period)."""
        first = self.period_s if first_after_s is None else first_after_s
        spec = _Itimerspec(interval=_timespec(self.period_s), value=_timespec(first))
        start = time.perf_counter()
        if self.lib.timer_settime(self.timer, 0, ctypes.byref(spec), None):
            self.close()
            raise OSError(ctypes.get_errno(), "timer_settime failed")
        return start + first - self.period_s

    def pause(self) -> None:
        """Disarm the timer until the next start (benchmarks/host_sampler.py --toggle)."""
        if self.lib.timer_settime(self.timer, 0, ctypes.byref(_Itimerspec()), None):
            raise OSError(ctypes.get_errno(), "timer_settime failed")

    def close(self) -> None:
        if self.created:
            self.lib.timer_delete(self.timer)
            self.created = False
        _LIVE.pop(id(self), None)
        _HANDLERS.pop(self.signum, None)
