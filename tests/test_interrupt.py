"""A stop and the DataLoader workers it kills: their lost peer is the stop, not an error. (A real
run stopped with its workers alive: test_signals.py.)"""

from __future__ import annotations

import sys


def test_a_stop_silences_the_fd_sharers_lost_peer_in_both_hooks() -> None:
    """DataLoader workers killed mid-handshake make multiprocessing's resource sharer report a
    broken pipe through sys.excepthook (its thread catches its own errors): while a stop is
    open that report is the stop, not a failure; any other error still reaches the hook."""
    from gpudiag.measure.interrupts import stop_on_signals

    seen: list[type[BaseException]] = []
    previous = sys.excepthook
    sys.excepthook = lambda t, e, tb: seen.append(t)
    try:
        with stop_on_signals():
            for filename in ("/x/multiprocessing/resource_sharer.py", "/x/train.py"):
                try:
                    exec(compile("raise BrokenPipeError(32, 'Broken pipe')", filename, "exec"))
                except BrokenPipeError:
                    sys.excepthook(*sys.exc_info())
    finally:
        sys.excepthook = previous
    assert seen == [BrokenPipeError]


def test_a_stop_raised_where_python_drops_exceptions_is_raised_at_the_next_step() -> None:
    """A SIGTERM that lands in importlib's module-lock callback (Python prints "Exception
    ignored" and drops what it raises: a loaded CI run finished instead of stopping) is held
    and raised by raise_if_stopped(), which the timing loop calls after each step."""
    import signal
    import sys

    import pytest

    from gpudiag.measure.interrupts import Terminated, raise_if_stopped, stop_on_signals

    namespace: dict[str, object] = {}
    exec(compile("import sys\ndef cb():\n    return sys._getframe()\n",
                 "<frozen importlib._bootstrap>", "exec"), namespace)
    callback_frame = namespace["cb"]()  # type: ignore[operator]
    raise_if_stopped()  # no stop open: nothing
    with stop_on_signals() as stop:
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        raise_if_stopped()  # no signal yet
        handler(signal.SIGTERM, callback_frame)  # held, not raised into the callback
        assert stop.signum == signal.SIGTERM
        with pytest.raises(Terminated):
            raise_if_stopped()
    with stop_on_signals():
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        with pytest.raises(Terminated):
            handler(signal.SIGTERM, sys._getframe())  # anywhere else: raised at once
    raise_if_stopped()  # closed: nothing


def test_the_sigterm_hook_leaves_an_exiting_script_to_end() -> None:
    """In-process: a SIGTERM handled where the main module's code is no longer on the stack
    (an atexit callback; here a thread, whose stack has none either) raises nothing and starts
    no timer; the same SIGTERM while the script runs is left to the step boundary."""
    import os
    import signal
    import threading
    from types import FrameType, SimpleNamespace
    from typing import Any

    import pytest

    from gpudiag.measure.profile.inscript import lifecycle
    from gpudiag.measure.profile.inscript.recorder import Stop

    recorder: Any = SimpleNamespace(pid=os.getpid(), steps=3, finished=True, stop=Stop())
    frames: list[FrameType] = []
    thread = threading.Thread(target=lambda: frames.append(sys._getframe()))
    thread.start()
    thread.join()
    assert lifecycle._script_running(sys._getframe())  # pytest's own __main__ is below
    assert not lifecycle._script_running(frames[0])
    lifecycle._exit_on_sigterm(recorder, signal.SIGTERM, frames[0])  # no SystemExit
    assert recorder.stop.seen and recorder.stop.signal is None
    with pytest.raises(SystemExit):  # finished, yet its own code still running: exit now
        lifecycle._exit_on_sigterm(recorder, signal.SIGTERM, sys._getframe())


def test_a_ctrl_c_inside_multiprocessings_fork_or_finalizers_is_only_remembered() -> None:
    """Where Python would print a KeyboardInterrupt as "Exception ignored" and lose it (the
    at-fork callbacks of multiprocessing's popen_fork, a Finalize in its util: a DataLoader's
    workers shut down each epoch), the handler raises nothing; the script's next step
    boundary does. Elsewhere it raises, as Python's own handler."""
    import types

    from gpudiag.measure.profile.inscript import lifecycle

    def frame_in(path: str) -> types.FrameType:
        namespace: dict[str, object] = {"sys": sys}
        exec(compile("def inner():\n    return sys._getframe()\n", path, "exec"), namespace)
        return namespace["inner"]()  # type: ignore[operator,no-any-return]

    for path in ("/usr/lib/python3.11/multiprocessing/util.py",
                 "/usr/lib/python3.11/multiprocessing/popen_fork.py"):
        assert lifecycle._swallowed_here(frame_in(path)), path
    assert lifecycle._launching_a_process(frame_in("/x/multiprocessing/popen_fork.py"))
    assert not lifecycle._launching_a_process(frame_in("/x/multiprocessing/util.py"))
    assert not lifecycle._swallowed_here(sys._getframe())
