"""Domain errors and exit codes. The CLI turns each error into a one-line message and its
documented exit code; README's "Exit codes and guarantees" table is generated from `ExitCode`
(`gpudiag exit-codes --markdown`, tests/test_cli.py checks it)."""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import traceback
from collections.abc import Sequence
from enum import IntEnum
from pathlib import Path

from gpudiag._version import __version__

INTERNAL_ERROR_PREFIX = "gpudiag-internal-error-"
# The one line names the exception; a longer message is cut there (the file has it whole).
MAX_MESSAGE_CHARS = 300


class ExitCode(IntEnum):
    """What a gpudiag command exits with; each member's `description` is its row in README."""

    description: str

    def __new__(cls, value: int, description: str) -> ExitCode:
        member = int.__new__(cls, value)
        member._value_ = value
        member.description = description
        return member

    OK = 0, (
        "success (a stage that failed is recorded in the report, the others still run); the "
        "gate passed, or was undecided under `--on-inconclusive pass` (the default)")
    REGRESSION = 1, "the gate found a regression"
    BAD_INPUT = 2, (
        "bad input: an unknown model, stage or rule; a size out of range or too large for the "
        "machine; no such device; an unusable or occupied `--out`; a file gpudiag would "
        "overwrite; a folder in a run folder that is a symbolic link (gpudiag writes through "
        "none); a run.json that does not fit the schema or contradicts itself; incomparable "
        "runs (other workload, precision, GPU, driver or torch); the same run on both sides; an "
        "interrupted baseline; a command `profile` cannot start; a `--rerun-writable` folder "
        "inside the working directory or holding it; a working directory that no longer exists")
    INCONCLUSIVE = 3, (
        "the gate is undecided under `--on-inconclusive fail`: it says what it could not see "
        "and how many trials would tell")
    NOTHING_MEASURED = 4, (
        "`run` measured nothing: every stage failed or was skipped (run.json and report.md say "
        "why), or no `--trials` trial wrote a run; or a gate none of whose stages ran on either "
        "side (a command that fails on both: its error is in the summary)")
    HEAD_FAILED = 5, (
        "the gate's head broke: a stage the base ran crashed, was skipped or was interrupted, "
        "or the head's run was interrupted (named in the summary), or the head could not run "
        "where the base did (its trial's error is above)")
    INTERNAL_ERROR = 70, (
        "a bug in gpudiag (EX_SOFTWARE in sysexits.h): one line on stderr names the exception "
        "(a `SystemExit` or `GeneratorExit` a library raised inside gpudiag included: never "
        "passed on as one of the codes here) and a new file in the temporary directory holding "
        "its traceback; please report it")
    HUNG_UP = 129, (
        "stopped by SIGHUP (the terminal closed, an ssh session dropped); the partial run is "
        "written, and a profiled script is stopped with it")
    INTERRUPTED = 130, "stopped by SIGINT (Ctrl-C); the partial run is written"
    TERMINATED = 143, (
        "stopped by SIGTERM (`kill`, a job scheduler, a CI timeout); the partial run is written")


class GpudiagError(Exception):
    """An error the user can fix; its message is one line."""

    exit_code = ExitCode.BAD_INPUT


class HeadBroke(GpudiagError):
    """The gate's head could not run where its base did (a trial of it wrote no run)."""

    exit_code = ExitCode.HEAD_FAILED


class NothingMeasured(GpudiagError):
    """Every trial (or stage) ended without a result; what each said was printed above."""

    exit_code = ExitCode.NOTHING_MEASURED


class BadInput(GpudiagError):
    """An unknown name, an impossible size, a device that is not there, an unusable path."""


def first_line(text: str) -> str:
    """An error message's first line, for a stage's or a window's one-line error."""
    return text.strip().splitlines()[0] if text.strip() else "(no message)"


def internal_error_line(exc: BaseException, argv: Sequence[str]) -> str:
    """The one line an unexpected exception (a bug in gpudiag) ends a command with: the
    exception, and the new file its traceback went to, or why none could be written."""
    try:
        where = f"traceback written to {write_traceback(exc, argv)}"
    except Exception as err:  # the line must come out, whatever failed
        where = f"its traceback could not be written: {_os_said(err)}"
    return f"internal error: {_said(exc)} (a bug in gpudiag; {where})"


def write_traceback(exc: BaseException, argv: Sequence[str]) -> Path:
    """A new file in the temporary directory (mkstemp: created, never one that was there)
    holding `exc`'s traceback and what gpudiag, Python and the command line were."""
    fd, name = tempfile.mkstemp(prefix=INTERNAL_ERROR_PREFIX, suffix=".txt")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(f"gpudiag {__version__}, Python {sys.version.split()[0]} on "
                     f"{platform.platform()}\n")
            fh.write(f"command: gpudiag {' '.join(argv)}\n\n")
            fh.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    except OSError as err:  # a full disk, a quota: say which file
        raise OSError(err.errno, err.strerror, name) from None
    return Path(name)


def _os_said(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return _said(exc)


def _said(exc: BaseException) -> str:
    """`Type: message` on one line (`Type` alone when it has none), cut to a readable length."""
    try:
        message = " ".join(str(exc).split())
    except Exception:  # a broken __str__ is one more bug to report, not a crash
        message = "(its message could not be read)"
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 3] + "..."
