"""Where a command meets the terminal: its two consoles, and how it ends.

Exit codes: gpudiag.model.errors.ExitCode, each with its meaning (README's "Exit codes and
guarantees" table is generated from it: `gpudiag exit-codes --markdown`). Every error ends a
command with one line on stderr, never a traceback (`OneLineErrors`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import typer
from rich.console import Console

from gpudiag.measure.interrupts import (
    STOP_SAID_BY_PARENT,
    HungUp,
    Terminated,
    signal_name,
    signal_of,
)
from gpudiag.model.errors import ExitCode, GpudiagError, internal_error_line

# Logs and pipes get the whole table; an interactive terminal gets what fits its width.
stdout = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
stderr = Console(stderr=True, highlight=False)


# Typer >= 0.29 carries its own copy of click; older ones use click itself. Find the exception
# classes the running Typer raises through its public BadParameter.
# Any: which of the two clicks it is is known only at run time.
_ClickException: Any = next(c for c in typer.BadParameter.__mro__
                            if c.__name__ == "ClickException")
_click_errors = sys.modules[_ClickException.__module__]
_NoArgsIsHelp: type[Exception] = (getattr(_click_errors, "NoArgsIsHelpError", None)
                                  or type("_N", (Exception,), {}))
_Aborts: tuple[type[BaseException], ...] = tuple(
    {typer.Abort, getattr(_click_errors, "Abort", typer.Abort)})


def say_stopped(signal_said: str) -> None:
    """A stop's one line, unless this process is a trial whose gate says it
    (STOP_SAID_BY_PARENT)."""
    if not os.environ.get(STOP_SAID_BY_PARENT):
        typer.echo(f"gpudiag: stopped by {signal_said}", err=True)


class _StopEscaped(Exception):
    """A stop (Ctrl-C, SIGTERM, SIGHUP) that left a command before it could write anything.
    Newer Typers (0.29) turn a KeyboardInterrupt into a silent exit 130 (SIGTERM's too), so the
    group carries it past Typer in this, which Typer does not catch."""

    def __init__(self, stop: KeyboardInterrupt) -> None:
        super().__init__(signal_name(signal_of(stop)))
        self.stop = stop


class _Escaped(Exception):
    """A BaseException neither a stop nor an Exception that left a command: a SystemExit of a
    dependency's (its code would pass for one of gpudiag's own: 3 reads "undecided"), a
    GeneratorExit. A bug, as any exception is; carried past Typer in this."""

    def __init__(self, escaped: BaseException) -> None:
        super().__init__(type(escaped).__name__)
        self.escaped = escaped


class OneLineErrors(typer.core.TyperGroup):
    """Turns usage errors, gpudiag's own errors and any other exception (a bug: its traceback
    goes to a file) into one line and a documented exit code."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            raise _StopEscaped(exc) from exc
        except Exception:
            raise
        except BaseException as exc:  # gpudiag's own ends are typer.Exit, an Exception
            raise _Escaped(exc) from exc

    # windows_expand_args (newer click only) travels in **extra, so older Typers work too.
    def main(self, args: Sequence[str] | None = None,  # type: ignore[override]
             prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        argv = sys.argv[1:] if args is None else list(args)  # what a bug's report names
        try:
            code = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                                standalone_mode=False, **extra)
        except _NoArgsIsHelp as exc:
            ctx = getattr(exc, "ctx", None)
            typer.echo(ctx.get_help() if ctx else "", err=True)
            code = ExitCode.BAD_INPUT
        except _ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            command = ctx.command_path if ctx else "gpudiag"
            typer.echo(f"{command}: error: {exc.format_message()}", err=True)
            code = ExitCode.BAD_INPUT
        except GpudiagError as exc:
            typer.echo(f"gpudiag: error: {exc}", err=True)
            code = exc.exit_code
        except BrokenPipeError:  # `gpudiag rules | head`: the reader left; nothing to say
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115, PTH123 (Python's own advice)
            code = ExitCode.OK
        except OSError as exc:  # a path the user gave that cannot be read or written
            code = _path_error(exc) if exc.filename else _internal_error(exc, argv)
        except _StopEscaped as exc:
            say_stopped(str(exc))
            code = _stopped_by(exc.stop)
        except _Aborts as exc:  # older Typers' wrapper of a KeyboardInterrupt while parsing
            code = _stopped_by(exc.__cause__ or exc.__context__)
        except Exception as exc:  # a bug in gpudiag (typer.Exit's code came back as `code`)
            code = _internal_error(exc.escaped if isinstance(exc, _Escaped) else exc, argv)
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)


def _path_error(exc: OSError) -> ExitCode:
    typer.echo(f"gpudiag: error: {exc.filename}: {exc.strerror or exc}", err=True)
    return ExitCode.BAD_INPUT


def _internal_error(exc: BaseException, argv: Sequence[str]) -> ExitCode:
    """One line, never a traceback on the terminal: the traceback goes to a new file."""
    typer.echo(f"gpudiag: {internal_error_line(exc, argv)}", err=True)
    return ExitCode.INTERNAL_ERROR


def _stopped_by(stop: BaseException | None) -> ExitCode:
    """130, 143 or 129, by the stop's class (gpudiag.measure.interrupts)."""
    if isinstance(stop, HungUp):
        return ExitCode.HUNG_UP
    return ExitCode.TERMINATED if isinstance(stop, Terminated) else ExitCode.INTERRUPTED
