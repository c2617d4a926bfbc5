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
