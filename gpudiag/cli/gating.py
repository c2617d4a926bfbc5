"""`gpudiag gate`: two recorded runs judged, or with --base-ref both sides measured here
(gpudiag.measure.gatejob) and judged (gpudiag.diagnose.gate); the decision shown, written to
gate.md and the CI step summary, and exited with."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gpudiag.cli.edges import say_stopped, stderr
from gpudiag.cli.flags import with_options
from gpudiag.diagnose.trials import load_run_set
from gpudiag.measure.confine import ConfinementPolicy
from gpudiag.measure.gatejob import Interleaved, command_note, gate_job, gate_trial, trials_policy
from gpudiag.measure.interrupts import signal_name, signals_ignored, stop_on_signals
from gpudiag.model.errors import ExitCode
from gpudiag.model.options import (
    ConfineOptions,
    GateOptions,
    GateRequest,
    RunOptions,
    check_gate_options,
)

if TYPE_CHECKING:
    from gpudiag.diagnose.gate import GateRules

# Imports inside the functions below are of modules that pull in scipy or pandas (each says
# which): `gpudiag --help` starts without them (tests/test_cli.py checks).


@with_options(RunOptions, GateOptions, ConfineOptions)
def gate(
    options: RunOptions,
    own: GateOptions,
    confine: ConfineOptions,
    given: Annotated[list[str] | None, typer.Argument(
        metavar="BASELINE CURRENT | -- COMMAND",
        help="Two runs (run directory, run.json, trial folder, or a saved baseline file: the "
             "baseline, then the run to check); or, with --base-ref, the command to measure "
             "after --: python train.py ..., torchrun ...")] = None,
    markdown: Annotated[Path | None, typer.Option(help="Also write the decision as markdown.")]
    = None,
    out: Annotated[Path | None, typer.Option(help="With --base-ref: where the trials go "
                                             "(default: reports/<UTC time>-gate/).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --markdown file, "
                                        "or an --out holding an earlier gate.")] = False,
) -> None:
    """CI gate: exit 1 on a regression, 5 when the head's run broke, 0 on pass (or an undecided
    gate under --on-inconclusive pass), 3 when undecided under --on-inconclusive fail."""
    from gpudiag.diagnose.gate import gate_rules, judge, judge_trials  # noqa: PLC0415  (scipy)
    from gpudiag.present import writable_output_file, write_output_file  # noqa: PLC0415  (pandas)
    from gpudiag.present.compare import gate_lines, gate_markdown  # noqa: PLC0415  (scipy)

    request = check_gate_options(own, given or [], options, confine)
    policy = trials_policy(confine, request.command, "gate --base-ref")
    rules = gate_rules(own)
    if markdown is not None:
        writable_output_file(markdown, "--markdown", force=force)
    if request.runs is None:
        done = _measure_both(options, own, request, policy, rules, out=out, force=force)
        decision, comparison = judge_trials(done.base, done.head, rules, labels=request.labels,
                                            max_trials=own.max_trials)
        markdown = markdown or done.out_dir / "gate.md"
    else:
        before, after = (load_run_set(path) for path in request.runs)
        decision, comparison = judge(before, after, rules, labels=request.labels)
    text = gate_markdown(decision, comparison, request.on_inconclusive)
    if markdown is not None:
        write_output_file(markdown, text, "--markdown")
    _append_summary(text)
    for line in gate_lines(decision, request.on_inconclusive):
        typer.echo(line)
    raise typer.Exit(decision.exit_code(request.on_inconclusive))


def _measure_both(options: RunOptions, own: GateOptions, request: GateRequest,
                  policy: ConfinementPolicy | None, rules: GateRules, *, out: Path | None,
                  force: bool) -> Interleaved:
    """Base and head measured here, interleaved, with trials added while the gate cannot tell
    (up to --max-trials a side), each round judged as it ends. A stop before both sides ran
    ends the command, gate.md saying what stopped it."""
    from gpudiag.diagnose.gate import judge_trials  # noqa: PLC0415  (scipy)
    from gpudiag.present import (  # noqa: PLC0415  (pandas)
        default_run_dir,
        prepare_run_dir,
        write_output_file,
    )
    from gpudiag.present.compare import (  # noqa: PLC0415  (scipy)
        gate_round_line,
        stopped_gate_markdown,
    )

    assert request.base_ref is not None  # no runs given: --base-ref measures them
    trial = gate_trial(options, own, request.command, policy, Path.cwd())

    def next_count(done: Interleaved) -> int:
        k = min(len(done.base), len(done.head))
        if not k:
            return 0
        decision, _ = judge_trials(done.base, done.head, rules, labels=request.labels,
                                   max_trials=own.max_trials)
        wanted = decision.trials_wanted(k, own.max_trials)
        stderr.print(gate_round_line(decision, k, wanted), soft_wrap=True)
        return wanted

    def started(out_dir: Path) -> None:
        stderr.print(f"gate: {request.base_ref} (base) against this checkout (head), "
                     f"{own.trials} to {own.max_trials} trials a side, in {out_dir}",
                     soft_wrap=True)
        if policy is not None:  # the user's command: where it runs, what it may write
            stderr.print(command_note(own.share, policy, program=trial.program),
                         soft_wrap=True)

    # SIGTERM (a CI job's timeout) and SIGHUP stop the gate as Ctrl-C does: the running trial
    # gets the signal and its grace, the base's worktree is removed, the exit says which.
    with stop_on_signals() as stop:
        done = gate_job(trial, request.base_ref, Path.cwd(), share=own.share, first=own.trials,
                        out_dir=lambda: prepare_run_dir(out, default_run_dir("gate"),
                                                        force=force),
                        next_count=next_count, on_start=started,
                        on_trial=lambda side, k: stderr.print(f"trial {k}: {side}"))
    if done.interrupted or not done.base or not done.head:
        code = stop.exit_code or ExitCode.INTERRUPTED
        # The job's artifact says why there is no verdict (a CI timeout leaves only this).
        text = stopped_gate_markdown(code, len(done.base), len(done.head))
        with signals_ignored():
            write_output_file(done.out_dir / "gate.md", text, "--out")
            _append_summary(text)
            if code > 128:  # stopped by a signal: one line, the gate's (its trials say none)
                say_stopped(signal_name(code - 128))
        raise typer.Exit(code)
    return done


def _append_summary(text: str) -> None:
    """GitHub's step summary, when the job has one; failing to write it is a warning, never a
    gate outcome."""
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if not summary:
        return
    try:
        with Path(summary).open("a") as fh:
            fh.write(text + "\n")
    except OSError as exc:
        stderr.print(f"[yellow]warning:[/] GITHUB_STEP_SUMMARY {summary}: "
                     f"{exc.strerror or exc}", soft_wrap=True)
