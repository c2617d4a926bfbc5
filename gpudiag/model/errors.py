"""Domain errors. The CLI turns each into a one-line message and its documented exit code."""

from __future__ import annotations

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_BAD_INPUT = 2
EXIT_INCONCLUSIVE = 3
EXIT_NOTHING_MEASURED = 4  # `run`: every stage failed or was skipped (run.json says why)
# `gate`: the head's run broke (a stage crashed, was skipped where the base ran, or the run was
# interrupted): it fails, whatever the limits.
EXIT_HEAD_FAILED = 5
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it; partial results written
EXIT_TERMINATED = 143  # 128 + SIGTERM; partial results written


class GpudiagError(Exception):
    """An error the user can fix; its message is one line."""

    exit_code = EXIT_BAD_INPUT


class NothingMeasured(GpudiagError):
    """Every trial (or stage) ended without a result; what each said was printed above."""

    exit_code = EXIT_NOTHING_MEASURED


class BadInput(GpudiagError):
    """An unknown name, an impossible size, a device that is not there, an unusable path."""
