"""How a profiled process ends, and what the recorder writes on the way: at exit (atexit), at an
exception the script did not catch (sys.excepthook), at os._exit (which skips atexit), and at
SIGTERM or SIGINT, which stop the script at its next step boundary (the recorder's `Stop`, set
here) rather than wherever it happens to be. Installed once per interpreter by install.py, with
the one Recorder bound to each handler."""

from __future__ import annotations

import _thread
import atexit
import contextlib
import functools
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from gpudiag.measure.interrupts import sharer_lost_a_peer

if TYPE_CHECKING:
    from gpudiag.measure.profile.inscript.recorder import Recorder

# Where a KeyboardInterrupt raised by the handler is printed as "Exception ignored" and lost:
# multiprocessing's fork of a new process (its at-fork callbacks) and its finalizers
# (util.Finalize: a DataLoader's workers shut down each epoch, closing their pipes).
MULTIPROCESSING_FORK = str(Path("multiprocessing", "popen_fork.py"))
SWALLOWING = (MULTIPROCESSING_FORK, str(Path("multiprocessing", "util.py")))
STOP_AT_STEP_S = 3.0  # a SIGTERM waits this long for the next step boundary
# How long a DataLoader worker's lost file-descriptor handshake waits for the stop that cut it:
# the stop reaches the script's main process first (it drops the handshake) and this worker's
# main thread a moment later (CI saw the traceback printed before it did).
STOP_GRACE_S = 0.5


def install(recorder: Recorder) -> None:
    """The exit, crash and signal handling of this interpreter, for `recorder`. A signal the
    script (or a library it imported at start-up) handles already keeps its handler."""
    atexit.register(recorder.finish)
    _record_crashes(recorder)
    _write_before_os_exit(recorder)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, functools.partial(_exit_on_sigterm, recorder))
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, functools.partial(_interrupt, recorder))


def _record_crashes(recorder: Recorder) -> None:
    """An exception the script did not catch is kept on its stage (atexit's finish follows)."""
    previous_hook = sys.excepthook

    def record_crash(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if sharer_lost_a_peer(exc_type, tb) and _stop_comes(recorder):
            # A DataLoader worker's file-descriptor handshake cut by the stop (the script's
            # main process left mid-batch): the stop itself, as in gpudiag's own stages
            # (gpudiag/measure/interrupts.py), not a failure to print.
            return
        recorder.crashed(exc_type, exc, tb)
        if issubclass(exc_type, KeyboardInterrupt) and previous_hook is sys.__excepthook__:
            # A stop gpudiag passed on (or the user's Ctrl-C): where it stopped, in one line,
            # instead of a traceback of whatever the loop happened to be doing.
            where = _users_frame(traceback.extract_tb(tb)) if tb is not None else None
            print(f"KeyboardInterrupt{f' at {where.filename}:{where.lineno}' if where else ''}",
                  file=sys.stderr)
            return
        previous_hook(exc_type, exc, tb)

    sys.excepthook = record_crash


_PACKAGE = str(Path(__file__).resolve().parents[3]) + os.sep  # gpudiag/
_LIBRARIES = tuple({str(Path(p) / "lib") + os.sep for p in (sys.prefix, sys.base_prefix)})


def _users_frame(frames: traceback.StackSummary) -> traceback.FrameSummary | None:
    """Where the script was when stopped: its own deepest line, not a library's or gpudiag's
    (a stop raised at gpudiag's step hook would name recorder.py); the deepest line outside
    gpudiag where the script's own is not on the stack."""
    outside = [f for f in frames if not str(Path(f.filename).resolve()).startswith(_PACKAGE)]
    own = [f for f in outside if not f.filename.startswith(_LIBRARIES)]
    return own[-1] if own else outside[-1] if outside else None


def _stop_comes(recorder: Recorder) -> bool:
    """Whether a stop signal reached this process, or reaches it within STOP_GRACE_S (waited
    for only outside the main thread, which is the one that handles it: multiprocessing's
    resource sharer reports its errors from a thread of its own)."""
    deadline = time.monotonic() + STOP_GRACE_S
    while not recorder.stop.seen and threading.current_thread() is not threading.main_thread() \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    return recorder.stop.seen


def _write_before_os_exit(recorder: Recorder) -> None:
    """os._exit skips atexit: in the script's own process, what was recorded is written
    first (a forked child calling os._exit, a DataLoader worker, is not the script)."""
    real_exit = os._exit

    def exit_after_writing(status: int) -> NoReturn:
        if recorder.pid == os.getpid():
            with contextlib.suppress(Exception):
                recorder.finish(shutdown=False)  # every step, and that it ended so
        real_exit(status)

    os._exit = exit_after_writing


def _exit_on_sigterm(recorder: Recorder, signum: int, frame: FrameType | None) -> None:
    """torchrun stops the other ranks with SIGTERM when one fails, and gpudiag passes its own
    SIGTERM on: the script exits (SystemExit, so atexit writes what was recorded). A script
    that is stepping exits at its next step boundary, within STOP_AT_STEP_S, not in the middle
    of receiving a batch from its DataLoader workers (which would leave them printing EOFError
    tracebacks); one that is not, or a second SIGTERM, exits at once.

    A process the script started (forked or spawned) inherits this hook. A DataLoader worker
    leaves stopping to the script, whose exit shuts it down, as in gpudiag's own stages
    (gpudiag/measure/stages/base.py): a SystemExit there would print "Exception ignored", and
    a worker killed under its loader makes the script raise; once its parent is gone it stops
    as it would have without gpudiag. Any other child (a Pool's worker the script terminates,
    a process it kills, a daemon it forked) dies at once, as it would without gpudiag."""
    import multiprocessing  # noqa: PLC0415 (the standard library; only on a signal)

    recorder.stop.seen = True
    parent = multiprocessing.parent_process()
    # A signal pending at a fork runs its handler in the new child too, before multiprocessing
    # has set parent_process(): a pid other than the one that installed the hook is a child.
    if parent is None and recorder.pid == os.getpid():
        if not _script_running(frame):
            # Its code has ended and it is exiting (atexit: its own callbacks, then the
            # recorder's finish, which writes the part): a SystemExit raised there would be
            # printed as "Exception ignored" with a traceback, and would cut the part short.
            return
        if recorder.stop.signal is None and recorder.steps and not recorder.finished:
            recorder.stop.signal = signum
            timer = threading.Timer(STOP_AT_STEP_S, _thread.interrupt_main, (signum,))
            timer.daemon = True
            timer.start()
            return
        sys.exit(128 + signum)
    if parent is None and _launching_a_process(frame):
        return  # a fork still on its way in (the signal was pending): the script stops
    loader_worker = torch.utils.data.get_worker_info() is not None
    if not loader_worker or parent is None or not parent.is_alive():
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _script_running(frame: FrameType | None) -> bool:
    """Whether the main module's own code is still on the stack: it is not once the script
    has ended and Python runs its atexit callbacks (`python -m` and `-c` run it as a
    `<module>` frame named __main__ too)."""
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            return True
        frame = frame.f_back
    return False


def _interrupt(recorder: Recorder, signum: int, frame: FrameType | None) -> None:
    """Ctrl-C, or the SIGINT gpudiag passes on: KeyboardInterrupt, as Python's own handler
    raises it, except inside multiprocessing's fork of a new process or its finalizers. There
    Python runs its at-fork callbacks (logging's locks) or a Finalize, and a KeyboardInterrupt
    raised in one is printed as "Exception ignored" and lost: the script trained on until
    gpudiag killed it 30 s later (a DataLoader without persistent workers forks them, and shuts
    them down, every epoch). So in the script's own process a SIGINT is also remembered, and
    its next step boundary raises it again; inside those it is only remembered (a new child
    leaves stopping to the script)."""
    import multiprocessing  # noqa: PLC0415 (the standard library; only on a signal)

    recorder.stop.seen = True
    if recorder.pid == os.getpid() and multiprocessing.parent_process() is None:
        recorder.stop.interrupt = True
    if _swallowed_here(frame):
        return
    signal.default_int_handler(signum, frame)


def _launching_a_process(frame: FrameType | None) -> bool:
    """Inside multiprocessing's fork of a new process, which has not yet set the child's
    parent_process(); a plain os.fork (a daemon's) never is."""
    return _inside(frame, (MULTIPROCESSING_FORK,))


def _inside(frame: FrameType | None, files: tuple[str, ...]) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.endswith(files):
            return True
        frame = frame.f_back
    return False


def _swallowed_here(frame: FrameType | None) -> bool:
    """Inside multiprocessing's fork of a new process (which has not yet set the child's
    parent_process(); a plain os.fork, a daemon's, never is) or one of its finalizers: a
    KeyboardInterrupt raised there is lost (the next step boundary raises it; a CI run's
    SIGINT landed in a DataLoader worker's Finalize: "Exception ignored in: <Finalize
    object>" and its traceback on the script's stderr)."""
    return _inside(frame, SWALLOWING)
