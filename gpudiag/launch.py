"""The `gpudiag` command's entry point. gpudiag.cli takes a second or two to import (typer,
pydantic, the rules): a Ctrl-C then, or a second one while gpudiag is already stopping,
would otherwise end the process by SIGINT with a traceback. Both end with 130 and one line,
as a first Ctrl-C does (README, exit codes)."""

from __future__ import annotations

import sys

INTERRUPTED = 130  # gpudiag.model.errors.ExitCode.INTERRUPTED, not imported: it is the slow part


def main() -> None:
    try:
        from gpudiag.cli import main as cli_main  # noqa: PLC0415  (the import is what is guarded)

        cli_main()
    except KeyboardInterrupt:
        sys.stderr.write("gpudiag: stopped by SIGINT (Ctrl-C)\n")
        raise SystemExit(INTERRUPTED) from None
