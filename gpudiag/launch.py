"""The `gpudiag` command's entry point. gpudiag.cli takes a second or two to import (typer,
pydantic, the rules): a Ctrl-C then, or a second one while gpudiag is already stopping,
would otherwise end the process by SIGINT with a traceback. Both end with 130 and one line,
as a first Ctrl-C does (README, exit codes)."""

from __future__ import annotations

import sys

# gpudiag.model.errors.ExitCode's, not imported: that is the slow part. By the stop's class
# (gpudiag.measure.interrupts: Terminated, HungUp), by name: a SIGTERM forwarded to a trial
# while it loads is a SIGTERM, not a Ctrl-C.
STOPPED = {"KeyboardInterrupt": (130, "SIGINT (Ctrl-C)"), "Terminated": (143, "SIGTERM"),
           "HungUp": (129, "SIGHUP")}


def main() -> None:
    try:
        from gpudiag.cli.program import main as cli_main  # noqa: PLC0415  (the import is what is guarded)

        cli_main()
    except KeyboardInterrupt as exc:
        code, name = STOPPED.get(type(exc).__name__, STOPPED["KeyboardInterrupt"])
        sys.stderr.write(f"gpudiag: stopped by {name}\n")
        raise SystemExit(code) from None
