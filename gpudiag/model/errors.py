"""Domain errors and exit codes. The CLI turns each error into a one-line message and its
documented exit code; README's "Exit codes and guarantees" table is generated from `ExitCode`
(`gpudiag exit-codes --markdown`, tests/test_cli.py checks it)."""

from __future__ import annotations

from enum import IntEnum


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
        "overwrite; a run.json that does not fit the schema or contradicts itself; incomparable "
        "runs (other workload, precision, GPU, driver or torch); the same run on both sides; an "
        "interrupted baseline; a command `profile` cannot start")
    INCONCLUSIVE = 3, (
        "the gate is undecided under `--on-inconclusive fail`: it says what it could not see "
        "and how many trials would tell")
    NOTHING_MEASURED = 4, (
        "`run` measured nothing: every stage failed or was skipped (run.json and report.md say "
        "why), or no `--trials` trial wrote a run")
    HEAD_FAILED = 5, (
        "the gate's head broke: a stage the base ran crashed, was skipped or was interrupted, "
        "or the head's run was interrupted (named in the summary)")
    INTERNAL_ERROR = 70, (
        "a bug in gpudiag (EX_SOFTWARE in sysexits.h): one line on stderr names the exception "
        "and a new file in the temporary directory holding its traceback; please report it")
    INTERRUPTED = 130, "stopped by SIGINT (Ctrl-C); the partial run is written"
    TERMINATED = 143, (
        "stopped by SIGTERM (`kill`, a job scheduler, a CI timeout); the partial run is written")


class GpudiagError(Exception):
    """An error the user can fix; its message is one line."""

    exit_code = ExitCode.BAD_INPUT


class NothingMeasured(GpudiagError):
    """Every trial (or stage) ended without a result; what each said was printed above."""

    exit_code = ExitCode.NOTHING_MEASURED


class BadInput(GpudiagError):
    """An unknown name, an impossible size, a device that is not there, an unusable path."""

