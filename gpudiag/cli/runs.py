"""`gpudiag run`: the staged ladder measured (here or in fresh processes), diagnosed, written
and shown; and a run's terminal view, which `report` and `profile` show too."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gpudiag.cli.edges import stderr, stdout
from gpudiag.cli.flags import with_options
from gpudiag.diagnose import evaluate
from gpudiag.diagnose.trials import merge_trials
from gpudiag.measure.interrupts import signals_ignored, stop_deferred, stop_on_signals
from gpudiag.model.config import RunConfig
from gpudiag.model.errors import BadInput, ExitCode
from gpudiag.model.options import MAX_TRIALS, RunOptions, check_most, options_of
from gpudiag.model.results import RunResult
from gpudiag.model.runfile import to_jsonable

if TYPE_CHECKING:
    from gpudiag.measure.runner import RunOutput

# Imports inside the functions below are of modules that pull in torch, scipy or pandas (each
# says which): `gpudiag --help` starts without them (tests/test_cli.py checks).


@with_options(RunOptions)
def run(
    options: RunOptions,
    out: Annotated[Path | None, typer.Option(help="Run directory (default: reports/<UTC "
                                             "time>-<model>/).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print run.json to stdout instead of "
                                          "the table.")] = False,
    trials: Annotated[int, typer.Option(help="Repeat the run in N fresh processes (the unit of "
                                        "evidence for compare and gate).")] = 1,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress or table; files only.")]
    = False,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it holds an earlier "
                                        "run (the whole directory).")] = False,
    plots: Annotated[bool, typer.Option(help="Draw the PNG plots report.md links (a second or "
                                        "two; --trials' own processes skip theirs, the merged "
                                        "run draws its own).")] = True,
) -> None:
    """Run the staged benchmark ladder with live GPU telemetry; write run.json and report.md."""
    run_ladder(options, out=out, as_json=as_json, trials=trials, quiet=quiet, force=force,
               plots=plots)


def run_ladder(options: RunOptions, *, out: Path | None, as_json: bool, trials: int,
               quiet: bool, force: bool, plots: bool = True) -> None:
    """`gpudiag run`'s work, which calibrate's trials of gpudiag's workload are too."""
    from gpudiag.measure.plan import build_config  # noqa: PLC0415  (torch)
    from gpudiag.present import (  # noqa: PLC0415  (pandas)
        default_run_dir,
        prepare_run_dir,
        write_run_dir,
    )

    if trials < 1:
        raise BadInput(f"--trials must be positive (got {trials})")
    check_most("--trials", trials, MAX_TRIALS)
    config, notes = build_config(options)
    run_dir = prepare_run_dir(out, default_run_dir(options.model), force=force)
    if config.checkpoint_dir is None:
        config = dataclasses.replace(config, checkpoint_dir=str(run_dir / "checkpoints"))
    if not quiet:
        for note in notes:
            stderr.print(f"[yellow]note:[/] {note}", soft_wrap=True)

    def save(output: RunOutput, *, final: bool = False) -> None:
        # Partial writes (after each stage) keep what was measured; the final one, on a
        # finished or interrupted run, carries the diagnosis. Plots take a second or two: only
        # the last write draws them, so a Ctrl-C lands in a stage, not inside a partial save.
        if final:
            output.run.findings = evaluate(output.run)
        write_run_dir(run_dir, output.run, output.samples, plots=final and plots)

    with stop_on_signals() as stop:
        output = _measure(config, notes, run_dir, trials=trials, quiet=quiet, save=save)
    with signals_ignored():  # no second signal may cut the last write short
        save(output, final=True)
    if not quiet:
        _show_run(output.run, run_dir, as_json=as_json)
    if output.run.interrupted:
        raise typer.Exit(stop.exit_code or ExitCode.INTERRUPTED)
    if output.run.stages and not any(s.ok for s in output.run.stages):
        raise typer.Exit(ExitCode.NOTHING_MEASURED)


def _show_run(run: RunResult, run_dir: Path, *, as_json: bool) -> None:
    if as_json:
        stdout.print_json(json.dumps(to_jsonable(run)))
    else:
        print_run(run)
    stderr.print(f"Report: {run_dir / 'report.md'}  (run.json, samples.csv beside it)",
                 soft_wrap=True)
    if run.interrupted:
        stderr.print("[yellow]Interrupted:[/] partial results written.")


def _measure(config: RunConfig, notes: list[str], run_dir: Path, *, trials: int, quiet: bool,
             save: Callable[[RunOutput], None]) -> RunOutput:
    """The run's stages: in this process (with live progress unless quiet), or `trials` fresh
    processes merged."""
    # A stop while torch loads (a second) lands in the first stage, which writes the run.
    with stop_deferred():
        from gpudiag.measure.runner import RunOutput, run_stages  # noqa: PLC0415  (torch)

    if trials > 1:
        from gpudiag.measure.trialrun import run_trials  # noqa: PLC0415  (pandas)

        done = run_trials(options_of(config), run_dir, trials,
                          on_trial=lambda k, n: stderr.print(f"trial {k}/{n}"))
        merged = merge_trials(done.runs)
        merged.interrupted = merged.interrupted or done.interrupted
        return RunOutput(merged, done.samples)
    if quiet:
        return run_stages(config, notes=notes, on_stage_done=save, trace_dir=run_dir)
    from gpudiag.present.progress import LiveProgress  # noqa: PLC0415  (pandas)

    live = LiveProgress(stderr)
    with live.progress:
        return run_stages(config, notes=notes, listener=live, on_stage_done=save,
                          trace_dir=run_dir)


def print_run(run: RunResult) -> None:
    """The terminal view of a run: the stage table, stages that did not run, the waterfalls, a
    multi-rank job's memory by rank, the diagnosis."""
    from gpudiag.present import (  # noqa: PLC0415  (pandas)
        findings_panel,
        problems,
        rank_memory_tables,
        stage_table,
        waterfall_tables,
    )

    stdout.print(stage_table(run, width=stdout.width))
    for line in problems(run):
        stdout.print(line)
    for table in [*waterfall_tables(run), *rank_memory_tables(run)]:
        stdout.print(table)
    stdout.print(findings_panel(run))
