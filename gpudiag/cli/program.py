"""The `gpudiag` program: its commands, in the order `gpudiag --help` lists them, each from the
module of its family; and `main`, what the console script runs (through gpudiag.launch)."""

from __future__ import annotations

import os

import typer

from gpudiag.cli.edges import OneLineErrors
from gpudiag.cli.gatefiles import baseline_save, calibrate
from gpudiag.cli.gating import gate
from gpudiag.cli.info import env, exit_codes, models, rules
from gpudiag.cli.profiling import profile
from gpudiag.cli.recorded import compare, report
from gpudiag.cli.runs import run

app = typer.Typer(
    cls=OneLineErrors,
    help="Tells you why your GPU training is slow, and proves it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command()(run)
# The profiled command's own options (after --) are its arguments, not gpudiag's.
app.command(context_settings={"ignore_unknown_options": True})(profile)
app.command()(report)
app.command()(compare)
app.command()(gate)
app.command()(calibrate)
baseline_app = typer.Typer(help="Keep baselines in the repository for `gpudiag gate`.",
                           no_args_is_help=True)
baseline_app.command("save")(baseline_save)
app.add_typer(baseline_app, name="baseline")
app.command()(env)
app.command()(rules)
app.command("exit-codes")(exit_codes)
app.command()(models)


def main() -> None:
    # Kineto (the profiler's engine) prints "USDT: ... profiler_start" and "STAGE:" lines on
    # every window, and CUPTI errors on a machine without a GPU: gpudiag reads the profiler's
    # results itself. A level above every one it logs at silences it (5 did before kineto's
    # USDT messages, pytorch/pytorch#101942; they need 6 in torch 2.13: 9 leaves room). The
    # user's own setting wins; processes gpudiag starts inherit it (profile's script, trials,
    # ranks).
    os.environ.setdefault("KINETO_LOG_LEVEL", "9")
    app()
