"""The `gpudiag` command's entry point: how it ends however it ends (README, exit codes).

gpudiag.cli takes a second or two to import (typer, pydantic, the rules). A stop then ends
with one line and its code, as a stop in a command does: Ctrl-C (KeyboardInterrupt) 130, and
SIGTERM and SIGHUP, whose default action would kill gpudiag silently, raise their stops from
here on (143, 129). Once gpudiag knows how it ends, a second stop (a double Ctrl-C) no longer
cuts Python's own shutdown short (killed by SIGINT, or a traceback from an atexit callback).
Anything else that escapes the import, a dependency's SystemExit included, is a bug: one line,
exit 70. A working directory removed under the shell is said as such, before anything runs.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from gpudiag.measure.interrupts import (
    STOP_SAID_BY_PARENT,
    STOP_SIGNALS,
    signal_name,
    signal_of,
    stop_error,
)
from gpudiag.model.errors import ExitCode, internal_error_line

# What a stop is called in its line; a Ctrl-C by what the user pressed.
_SAID: dict[int, str] = {signal.SIGINT: "SIGINT (Ctrl-C)"}


def main() -> None:
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_stop)
    try:
        code = _outcome()
    finally:
        _ignore_stops()
    raise SystemExit(code)


def _outcome() -> int | str | None:
    """The command's exit code (or SystemExit's message, for Python to print), its line
    written."""
    try:
        Path.cwd()
    except FileNotFoundError:  # the shell's folder was removed: every relative path is gone
        sys.stderr.write("gpudiag: error: the working directory no longer exists (it was "
                         "removed after this shell entered it): cd to a folder that exists\n")
        return ExitCode.BAD_INPUT
    try:
        from gpudiag.cli.program import main as cli_main  # noqa: PLC0415  (the import is what is guarded)
    except KeyboardInterrupt as exc:
        return _stopped(exc)
    except BaseException as exc:  # a dependency's SystemExit or import error: not an outcome
        return _internal_error(exc)
    return _ran(cli_main)


def _ran(cli_main: Callable[[], None]) -> int | str | None:
    try:
        cli_main()  # its errors are one line and a code already (cli.edges.OneLineErrors)
    except SystemExit as exc:
        return exc.code
    except KeyboardInterrupt as exc:  # a stop that escaped a command already stopping
        return _stopped(exc)
    except BaseException as exc:  # one that escaped parsing, before any command ran
        return _internal_error(exc)
    return ExitCode.OK


def _stopped(exc: KeyboardInterrupt) -> int:
    _ignore_stops()  # a second stop must not cut this line short
    signum = signal_of(exc)
    if not os.environ.get(STOP_SAID_BY_PARENT):  # a gate's trial: the gate says it
        sys.stderr.write(f"gpudiag: stopped by {_SAID.get(signum, signal_name(signum))}\n")
    return 128 + signum


def _internal_error(exc: BaseException) -> int:
    sys.stderr.write(f"gpudiag: {internal_error_line(exc, sys.argv[1:])}\n")
    return ExitCode.INTERNAL_ERROR


def _raise_stop(signum: int, _frame: FrameType | None) -> None:
    raise stop_error(signum)


def _ignore_stops() -> None:
    """gpudiag has decided how it ends. An ignored signal stays ignored through Python's
    finalization (a handler of Python's would be reset to the default action there)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
