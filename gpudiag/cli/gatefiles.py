"""What `gpudiag gate` reads from the repository, made: `gpudiag calibrate` records this
machine's between-process spread (measuring it with trials of gpudiag's workload or of the
user's command, gpudiag.measure.gatejob), `gpudiag baseline save` a run to gate against."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpudiag.cli.edges import say_stopped, stderr
from gpudiag.cli.flags import with_options
from gpudiag.cli.runs import run_ladder
from gpudiag.diagnose.trials import baseline_of, load_run_set
from gpudiag.measure.confine import ConfinementPolicy
from gpudiag.measure.gatejob import (
    calibration_job,
    command_note,
    command_trial,
    trials_policy,
)
from gpudiag.measure.interrupts import signal_name, stop_on_signals
from gpudiag.model.atomic import named_by_user
from gpudiag.model.calibration import (
    DEFAULT_CALIBRATION,
    MIN_CALIBRATION_TRIALS,
    Calibration,
    load_calibration,
    plausible,
    save_calibration,
)
from gpudiag.model.errors import BadInput, ExitCode
from gpudiag.model.options import ConfineOptions, RunOptions, check_calibrate_options
from gpudiag.model.runfile import run_json_text, save_run

# Imports inside the functions below are of modules that pull in scipy or pandas (each says
# which): `gpudiag --help` and `baseline save` start without them.


@with_options(RunOptions, ConfineOptions)
def calibrate(
    options: RunOptions,
    confine: ConfineOptions,
    command: Annotated[list[str] | None, typer.Argument(
        metavar="-- COMMAND", help="Your training command, after --, to calibrate a gate of "
        "it (`gate --base-ref REF -- COMMAND`): each trial a gpudiag profile of it, run in a "
        "temporary checkout of this one.")] = None,
    share: Annotated[list[str] | None, typer.Option(
        "--share", help="With a COMMAND: a path git does not hold (data), linked into the "
        "temporary checkout for it to read. Repeat.")] = None,
    trials: Annotated[int, typer.Option(help="Fresh-process trials to measure the spread "
                                        f"from (at least {MIN_CALIBRATION_TRIALS}).")] = 8,
    from_run: Annotated[Path | None, typer.Option(
        "--from", help="Use this `run --trials N` directory (or trial folder) instead of "
                       "measuring.")] = None,
    file: Annotated[Path, typer.Option(help="The calibration file (one record per device, GPU "
                                       "and workload; others are kept).")]
    = DEFAULT_CALIBRATION,
    out: Annotated[Path | None, typer.Option(help="Where the trials go (default: reports/<UTC "
                                             "time>-calibrate/).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it holds an earlier "
                                        "run.")] = False,
) -> None:
    """Record how much fresh processes of the same code differ on this machine, per stage, for
    `gpudiag gate` (its prior, instead of the device kind's built-in floor). Commit the file."""
    from gpudiag.diagnose.noise import calibration_record  # noqa: PLC0415  (scipy)
    from gpudiag.present import default_run_dir  # noqa: PLC0415  (pandas)

    existing = load_calibration(file) if file.exists() else Calibration()
    check_calibrate_options(options, confine, command or [], share=share or [], trials=trials,
                            from_run=from_run, out=out)
    policy = trials_policy(confine, command or [], "calibrate")
    if from_run is None:
        from_run = out or default_run_dir("calibrate")
        if policy is not None:  # the user's command
            _command_trials(command or [], share or [], from_run, trials, policy, force=force)
        else:
            run_ladder(options, out=from_run, as_json=False, trials=trials, quiet=True,
                       force=force, plots=False)  # the trials are its evidence, not a report
    record = calibration_record(load_run_set(from_run), str(from_run))
    for warning in plausible(record):
        typer.echo(warning, err=True)
    save_calibration(existing.with_record(record), file)
    for spread in record.stages:
        device = (f", device time {spread.device_sd:.3%}" if spread.device_sd is not None
                  else "")
        typer.echo(f"{spread.stage}: wall time {spread.wall_sd:.2%}{device} between "
                   f"processes ({spread.trials} trials)")
    typer.echo(f"calibration written: {file} ({record.gpu_name or record.device}; commit it, "
               "`gpudiag gate` reads it from there)")


def _command_trials(command: list[str], share: list[str], out: Path, trials: int,
                    policy: ConfinementPolicy, *, force: bool) -> None:
    """`trials` gpudiag profiles of the user's command, one after another, in a temporary
    checkout of this one (the user's files untouched), into out/trial-K."""
    from gpudiag.present import prepare_run_dir  # noqa: PLC0415  (pandas)

    trial = command_trial(command, policy, Path.cwd(), who="calibrate")
    with stop_on_signals() as stop:
        runs = calibration_job(
            trial, Path.cwd(), trials, share=share,
            out_dir=lambda: prepare_run_dir(out, out, force=force),
            on_start=lambda _: stderr.print(
                command_note(share, policy, who="calibrate: the trials run",
                             program=trial.program), soft_wrap=True),
            on_trial=lambda k: stderr.print(f"trial {k}/{trials}"))
    if len(runs) < trials:
        code = stop.exit_code or ExitCode.INTERRUPTED
        if code > 128:  # stopped by a signal: one line, calibrate's (its trials say none)
            say_stopped(signal_name(code - 128))
        raise typer.Exit(code)


def baseline_save(
    run_path: Annotated[Path, typer.Argument(metavar="RUN", help="Run directory, run.json or "
                                             "trial folder.")],
    name: Annotated[str, typer.Option(help="Baseline name (file name).")] = "default",
    directory: Annotated[Path, typer.Option("--dir", help="Where baselines live.")]
    = Path(".gpudiag/baselines"),
    force: Annotated[bool, typer.Option("--force", help="Replace a different baseline of the "
                                        "same name.")] = False,
) -> None:
    """Save a small, stable copy of a run (no traces, no evidence) as a gate baseline."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise BadInput(f"--name {name!r}: use a plain file name")
    target = named_by_user(directory) / f"{name}.json"  # a linked --dir is the user's
    if target.is_dir():
        raise BadInput(f"{target}: is a directory")
    baseline = baseline_of(load_run_set(run_path))
    if target.exists() and not force and target.read_bytes() != run_json_text(baseline).encode():
        raise BadInput(f"{target}: a different baseline is there; pass --force to replace it")
    save_run(baseline, target)
    typer.echo(f"baseline written: {target} (commit it; gate with `gpudiag gate {target} RUN`)")
