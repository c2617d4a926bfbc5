"""`gpudiag profile -- COMMAND`: the user's script run with the recorder injected
(gpudiag.measure.profile.launching), diagnosed, written and shown; with --try-fixes, the fixes
its findings call for measured in runs of their own."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from gpudiag.cli.edges import stderr, stdout
from gpudiag.cli.flags import with_options
from gpudiag.cli.runs import print_run
from gpudiag.diagnose import evaluate
from gpudiag.measure.confine import ConfinementPolicy, confinement_policy, how_kept
from gpudiag.measure.interrupts import signals_ignored, stop_on_signals
from gpudiag.measure.profile.launching.scratch import SCRATCH_DIR
from gpudiag.measure.profile.launching.session import (
    ProfileOutput,
    ProfileRequest,
    check_command,
    profile_command,
)
from gpudiag.measure.profile.launching.tryfixes import SCRATCH_PATTERN, run_fixes
from gpudiag.model.config import ProfileConfig
from gpudiag.model.options import ConfineOptions, ProfileOptions, profile_config
from gpudiag.model.remedies import BASELINE_RUNS, REMEDIES
from gpudiag.model.results import Rerun

# Imports inside the functions below are of modules that pull in scipy or pandas (each says
# which): `gpudiag --help` starts without them (tests/test_cli.py checks).


@with_options(ProfileOptions, ConfineOptions)
def profile(
    options: ProfileOptions,
    confine: ConfineOptions,
    command: Annotated[list[str], typer.Argument(help="The command to profile, after --: "
                                                 "python train.py ..., torchrun ..., "
                                                 "python -m pkg.train.")],
    out: Annotated[Path | None, typer.Option(help="Run directory (default: reports/<UTC "
                                             "time>-profile/).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it holds an earlier "
                                        "run (the whole directory).")] = False,
    plots: Annotated[bool, typer.Option(help="Draw the PNG plots report.md links (a second or "
                                        "two; --try-fixes' runs skip theirs).")] = True,
) -> None:
    """Diagnose an unmodified training script: gpudiag profile -- python train.py ..."""
    from gpudiag.present import (  # noqa: PLC0415  (pandas)
        default_run_dir,
        fixes_table,
        prepare_run_dir,
    )

    config = profile_config(options, command)
    check_command(command)
    isolating = ("--try-fixes" if options.try_fixes else
                 "--stop-after-window" if config.stop_after_window else None)
    policy = confinement_policy(
        confine.rerun_writable, unconfined=confine.unconfined_reruns,
        isolated=isolating and f"{isolating} runs the script in a scratch copy of this folder")
    # Absolute before launch: the script may change directory.
    run_dir = prepare_run_dir(out, default_run_dir("profile"), force=force).resolve()

    def early(output: ProfileOutput) -> None:
        _write_profile(run_dir, output, plots=False)  # the final write draws them
        stderr.print(f"[yellow]gpudiag profile:[/] diagnosis written to {run_dir / 'report.md'}"
                     + ("" if config.stop_after_window else " (the script goes on; the "
                        "report is rewritten when it ends)"), soft_wrap=True)

    if options.try_fixes:
        _announce_try_fixes(run_dir, policy, rerun=options.rerun)
    elif config.stop_after_window:
        stderr.print("gpudiag profile: the script is stopped after its profiler window, so it "
                     f"runs in a scratch copy of this folder ({run_dir / SCRATCH_DIR}"
                     f"){how_kept(policy, 'the copy')}: your files stay as they are",
                     soft_wrap=True)
    with stop_on_signals():  # a SIGTERM while a re-run's copy is made stops it as Ctrl-C does
        output = profile_command(
            ProfileRequest(config, run_dir, rerun=options.rerun, policy=policy),
            on_window=early,
            on_rerun=lambda note: stderr.print(f"[yellow]gpudiag profile:[/] {escape(note)}",
                                               soft_wrap=True))
    _warn_reruns(output.run.reruns)
    # A script that died of out-of-memory is tried too: with what frees memory (GD404's fixes).
    if options.try_fixes and not output.run.interrupted and (
            output.exit_code == 0 or output.run.died_of_out_of_memory):
        with stop_on_signals():  # a SIGTERM between the runs stops them as Ctrl-C does
            _try_fixes(run_dir, output, list(dict.fromkeys(options.fixes)), policy)
    elif options.try_fixes:
        stderr.print("[yellow]try-fixes:[/] not tried: the diagnosis run did not end cleanly",
                     soft_wrap=True)
    with signals_ignored():  # no second signal may cut the last write short
        _write_profile(run_dir, output, plots=plots)
    for message in output.messages:
        stderr.print(f"[yellow]gpudiag profile:[/] {escape(message)}", soft_wrap=True)
    if output.run.stages:
        print_run(output.run)
    if output.run.fixes:
        stdout.print(fixes_table(output.run))
    stderr.print(f"Report: {run_dir / 'report.md'}  (run.json beside it)", soft_wrap=True)
    raise typer.Exit(output.exit_code)


def _announce_try_fixes(run_dir: Path, policy: ConfinementPolicy, *, rerun: bool) -> None:
    """Before the first run: how many times the script may run, and where."""
    most = 1 + rerun + len(BASELINE_RUNS) + len(REMEDIES) + 1
    stderr.print(f"try-fixes: the script runs at most {most} times: once for the "
                 "diagnosis" + (" (and once more if it ends before its profiler window)"
                                if rerun else "")
                 + f", then {len(BASELINE_RUNS)} times without fixes, once per fix the "
                 f"diagnosis calls for (at most {len(REMEDIES)}) and once with those that pay "
                 "together; each is stopped after its profiler window and runs in a scratch "
                 f"copy of this folder inside {run_dir}{how_kept(policy, 'the copy')}: your "
                 "files stay as they are", soft_wrap=True)


def _try_fixes(run_dir: Path, first: ProfileOutput, forced: list[str],
               policy: ConfinementPolicy) -> None:
    """The remedies the diagnosis calls for (and `forced` ones), measured
    (gpudiag.measure.profile.launching.tryfixes) and assessed (gpudiag.diagnose.tryfix) into
    `first.run.fixes`."""
    from gpudiag.diagnose.tryfix import assess, passing, plan_fixes  # noqa: PLC0415  (scipy)

    run = first.run
    assert isinstance(run.config, ProfileConfig)  # a profile's run
    run.findings = evaluate(run)
    plan = plan_fixes(run, forced)
    for line in plan.skipped:
        stderr.print(f"[yellow]try-fixes:[/] {line}", soft_wrap=True)
    if not plan.remedies:
        stderr.print("[yellow]try-fixes:[/] no finding calls for a fix gpudiag can apply",
                     soft_wrap=True)
        run.fixes = assess(run, plan, {})
        return
    count = len(plan.remedies) + len(BASELINE_RUNS) + (len(plan.remedies) > 1)
    stderr.print(f"try-fixes: {', '.join(r.name for r in plan.remedies)}: the script runs at "
                 f"most {count} more times ({len(BASELINE_RUNS)} without fixes, one per fix"
                 f"{', one with those that pay together' if len(plan.remedies) > 1 else ''}), "
                 f"each stopped after its profiler window (about "
                 f"{count * (run.duration_s or 0):.0f} s) and run in a scratch copy of "
                 f"{Path.cwd()} at {run_dir / SCRATCH_PATTERN}: what they write there stays "
                 "there", soft_wrap=True)

    def done_one(out_dir: Path, output: ProfileOutput) -> None:
        _write_profile(out_dir, output, plots=False)
        _warn_reruns(output.run.reruns)

    done = run_fixes(
        run_dir, plan.configured(run.config), [r.name for r in plan.remedies], policy=policy,
        paid=lambda runs: passing(assess(run, plan, runs)),
        on_start=lambda label: stderr.print(f"try-fixes: running {label}", soft_wrap=True),
        on_done=done_one)
    if done.interrupted:
        run.interrupted, first.exit_code = True, done.exit_code
    if done.error:
        stderr.print(f"[yellow]try-fixes:[/] stopped: {escape(done.error)}", soft_wrap=True)
        run.notes.append(f"--try-fixes stopped: {done.error}")
    run.reruns += done.reruns
    run.fixes = assess(run, plan, done.runs, done.unmeasured)


def _warn_reruns(reruns: list[Rerun]) -> None:
    """What a re-run reached outside its scratch copy, as soon as it ended."""
    from gpudiag.present.fixes import rerun_warning  # noqa: PLC0415  (pandas, via present)

    for rerun in reruns:
        line = rerun_warning(rerun)
        if line:
            stderr.print(f"[yellow]gpudiag profile:[/] {escape(line)}", soft_wrap=True)


def _write_profile(run_dir: Path, output: ProfileOutput, *, plots: bool = True) -> None:
    from gpudiag.present import write_run_dir  # noqa: PLC0415  (pandas)

    output.run.findings = evaluate(output.run)
    write_run_dir(run_dir, output.run, samples=None, plots=plots)
