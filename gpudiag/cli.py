"""The `gpudiag` command line. Parses arguments, calls into the package, renders; nothing else.

Exit codes: gpudiag.model.errors.ExitCode, each with its meaning (README's "Exit codes and
guarantees" table is generated from it: `gpudiag exit-codes --markdown`). Every error ends a
command with one line on stderr, never a traceback (`_OneLineErrors`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import sys
import typing
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gpudiag.diagnose import all_rules, evaluate, find_rule
from gpudiag.diagnose.trials import baseline_of, load_run_set, merge_trials
from gpudiag.measure.confine import (
    ConfinementPolicy,
    confinement_policy,
    how_kept,
)
from gpudiag.measure.gatejob import (
    Interleaved,
    TrialCommand,
    base_checkout,
    head_checkout,
    repository_top,
    run_interleaved,
    run_repeated,
    share_into,
)
from gpudiag.measure.interrupts import (
    HungUp,
    Terminated,
    signal_name,
    signal_of,
    signals_ignored,
    stop_deferred,
    stop_on_signals,
)
from gpudiag.measure.profile.launching.scratch import SCRATCH_DIR
from gpudiag.measure.profile.launching.session import (
    ProfileOutput,
    ProfileRequest,
    check_command,
    profile_command,
)
from gpudiag.measure.profile.launching.tryfixes import SCRATCH_PATTERN, run_fixes
from gpudiag.model.calibration import (
    DEFAULT_CALIBRATION,
    MIN_CALIBRATION_TRIALS,
    Calibration,
    load_calibration,
    plausible,
    save_calibration,
)
from gpudiag.model.config import ProfileConfig, RunConfig
from gpudiag.model.errors import (
    BadInput,
    ExitCode,
    GpudiagError,
    internal_error_line,
)
from gpudiag.model.options import (
    ConfineOptions,
    GateOptions,
    OptionsT,
    ProfileOptions,
    RunOptions,
    check_gate_options,
    option_fields,
    options_of,
    profile_config,
)
from gpudiag.model.remedies import BASELINE_RUNS, REMEDIES
from gpudiag.model.results import Rerun, RunResult
from gpudiag.model.runfile import load_run, run_json_text, save_run, to_jsonable

if TYPE_CHECKING:
    from gpudiag.diagnose.gate import GateDecision
    from gpudiag.measure.runner import RunOutput

# Imports inside the commands below are of modules that pull in torch, scipy or pandas (each
# says which): `gpudiag --help`, `rules` and `baseline save` start without them
# (tests/test_cli.py checks --help).

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


class _StopEscaped(Exception):
    """A stop (Ctrl-C, SIGTERM, SIGHUP) that left a command before it could write anything.
    Newer Typers (0.29) turn a KeyboardInterrupt into a silent exit 130 (SIGTERM's too), so the
    group carries it past Typer in this, which Typer does not catch."""

    def __init__(self, stop: KeyboardInterrupt) -> None:
        super().__init__(signal_name(signal_of(stop)))
        self.stop = stop


class _OneLineErrors(typer.core.TyperGroup):
    """Turns usage errors, gpudiag's own errors and any other exception (a bug: its traceback
    goes to a file) into one line and a documented exit code."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            raise _StopEscaped(exc) from exc

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
            typer.echo(f"gpudiag: stopped by {exc}", err=True)
            code = _stopped_by(exc.stop)
        except _Aborts as exc:  # older Typers' wrapper of a KeyboardInterrupt while parsing
            code = _stopped_by(exc.__cause__ or exc.__context__)
        except Exception as exc:  # a bug in gpudiag (typer.Exit's code came back as `code`)
            code = _internal_error(exc, argv)
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)


def _path_error(exc: OSError) -> ExitCode:
    typer.echo(f"gpudiag: error: {exc.filename}: {exc.strerror or exc}", err=True)
    return ExitCode.BAD_INPUT


def _internal_error(exc: Exception, argv: Sequence[str]) -> ExitCode:
    """One line, never a traceback on the terminal: the traceback goes to a new file."""
    typer.echo(f"gpudiag: {internal_error_line(exc, argv)}", err=True)
    return ExitCode.INTERNAL_ERROR


def _stopped_by(stop: BaseException | None) -> ExitCode:
    """130, 143 or 129, by the stop's class (gpudiag.measure.interrupts)."""
    if isinstance(stop, HungUp):
        return ExitCode.HUNG_UP
    return ExitCode.TERMINATED if isinstance(stop, Terminated) else ExitCode.INTERRUPTED


app = typer.Typer(
    cls=_OneLineErrors,
    help="Tells you why your GPU training is slow, and proves it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _split(value: str | None) -> list[str] | None:
    return [s.strip() for s in value.split(",") if s.strip()] if value else None


def _option_parameters(cls: type[OptionsT]) -> list[inspect.Parameter]:
    """A command's options, from their one definition (gpudiag.model.options)."""
    params = []
    for f, spec, hint in option_fields(cls):
        # A tuple option (stages, fixes) is a repeatable flag, each value comma-separated.
        cli_hint = list[str] | None if _is_tuple(hint) else hint
        choices = f" One of: {', '.join(spec.choices)}." if spec.choices else ""
        params.append(inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
            annotation=Annotated[cli_hint, typer.Option(
                spec.flag, *spec.aliases, help=spec.help + choices,
                # "<list[str]>" widened the type column until an 80-column --help cut option
                # names ("--evidence-steps,--st…")
                metavar="<list>" if _is_tuple(hint) else None)]))
    return params


def _is_tuple(hint: Any) -> bool:
    return typing.get_origin(hint) is tuple or tuple in {
        typing.get_origin(a) for a in typing.get_args(hint)}


def options_from_params(cls: type[OptionsT], params: dict[str, Any]) -> OptionsT:
    """`cls` from parsed parameters (a list of strings for a tuple, each comma-separated where
    its option allows; click's own tuple where the parameters come from its context)."""
    values = {}
    for f, spec, hint in option_fields(cls):
        value = params[f.name]
        if isinstance(value, (list, tuple)) and _is_tuple(hint):
            value = (tuple(_split(",".join(value)) or ()) if spec.commas else tuple(value)
                     ) or f.default
        values[f.name] = value
    return cls(**values)


def _with_options(*classes: type[Any]) -> Callable[[Callable[..., None]],
                                                   Callable[..., None]]:
    """`command(*options, **own)` as a Typer command taking every option of each of `classes`
    as a flag: the command's first parameters get an instance of each, in order."""

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        own: list[inspect.Parameter] = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in list(inspect.signature(command, eval_str=True).parameters.values())
            [len(classes):]]
        names = {f.name for cls in classes for f, _, _ in option_fields(cls)}
        declared = [f.name for cls in classes for f, _, _ in option_fields(cls)]
        assert len(declared) == len(names) and not names & {p.name for p in own}, (
            f"{command.__name__}: an option declared twice")

        @functools.wraps(command)
        def wrapper(**params: Any) -> None:
            command(*(options_from_params(cls, params) for cls in classes),
                    **{k: v for k, v in params.items() if k not in names})

        parameters = [*(p for cls in classes for p in _option_parameters(cls)), *own]
        wrapper.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        del wrapper.__wrapped__  # Typer must read the new signature, not the wrapped one's
        return wrapper

    return decorate


@app.command()
@_with_options(RunOptions)
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
    _run(options, out=out, as_json=as_json, trials=trials, quiet=quiet, force=force,
         plots=plots)


def _run(options: RunOptions, *, out: Path | None, as_json: bool, trials: int, quiet: bool,
         force: bool, plots: bool = True) -> None:
    from gpudiag.measure.plan import build_config  # noqa: PLC0415  (torch)
    from gpudiag.present import (  # noqa: PLC0415  (pandas)
        default_run_dir,
        prepare_run_dir,
        write_run_dir,
    )

    if trials < 1:
        raise BadInput(f"--trials must be positive (got {trials})")
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
        _print_run(run)
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


def _print_run(run: RunResult) -> None:
    """The terminal view of a run: the stage table, stages that did not run, the diagnosis."""
    from gpudiag.present import (  # noqa: PLC0415  (pandas)
        findings_panel,
        problems,
        stage_table,
        waterfall_tables,
    )

    stdout.print(stage_table(run, width=stdout.width))
    for line in problems(run):
        stdout.print(line)
    for table in waterfall_tables(run):
        stdout.print(table)
    stdout.print(findings_panel(run))


def _load_pair(before: Path, after: Path) -> tuple[RunResult, RunResult]:
    return load_run_set(before), load_run_set(after)


@app.command(context_settings={"ignore_unknown_options": True})
@_with_options(ProfileOptions, ConfineOptions)
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
    if options.try_fixes and output.exit_code == 0 and not output.run.interrupted:
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
        _print_run(output.run)
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
        run_dir, run.config, [r.name for r in plan.remedies], policy=policy,
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


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (holding run.json).")],
    rules: Annotated[bool, typer.Option("--rules", help="Apply this gpudiag's rules again "
                                        "(and save the findings into run.json).")] = False,
) -> None:
    """Re-render a saved run: the terminal view and report.md."""
    from gpudiag.present import rerender_run_dir  # noqa: PLC0415  (pandas)

    if not (run_dir / "run.json").is_file():
        raise BadInput(f"{run_dir}: no run.json there")
    run = load_run(run_dir)
    if rules:
        run.findings = evaluate(run)
        fix_runs = run_dir / "fixes"  # a profile --try-fixes: its fixes assessed anew too
        if fix_runs.is_dir():
            from gpudiag.diagnose.tryfix import reassess  # noqa: PLC0415  (scipy)

            run.fixes = reassess(run, {p.name: load_run(p) for p in sorted(fix_runs.iterdir())
                                       if (p / "run.json").is_file()})
    rerender_run_dir(run_dir, run, save=rules)
    _print_run(run)
    if run.fixes:
        from gpudiag.present import fixes_table  # noqa: PLC0415  (pandas)

        stdout.print(fixes_table(run))
    stderr.print(f"Report: {run_dir / 'report.md'}", soft_wrap=True)


@app.command()
def compare(
    before: Annotated[Path, typer.Argument(help="Run directory, run.json, or folder of trial "
                                           "runs.")],
    after: Annotated[Path, typer.Argument(help="The same, after the change.")],
    markdown: Annotated[Path | None, typer.Option(help="Also write the comparison as markdown "
                                                  "(for a pull-request comment).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON.")]
    = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --markdown "
                                        "file.")] = False,
) -> None:
    """Compare two runs stage by stage: ratios with intervals, verdicts, findings."""
    from gpudiag.diagnose.compare import compare_runs  # noqa: PLC0415  (scipy)
    from gpudiag.present import writable_output_file, write_output_file  # noqa: PLC0415  (pandas)
    from gpudiag.present.compare import (  # noqa: PLC0415  (scipy, pandas)
        comparison_markdown,
        comparison_table,
        grouped_notes,
    )

    if markdown is not None:
        writable_output_file(markdown, "--markdown", force=force)
    a, b = _load_pair(before, after)
    comparison = compare_runs(a, b, before_label=str(before), after_label=str(after))
    if markdown is not None:
        write_output_file(markdown, comparison_markdown(comparison), "--markdown")
    if as_json:
        stdout.print_json(json.dumps(to_jsonable(comparison)))
        return
    for name, x, y in [*comparison.env_differences, *comparison.config_differences]:
        stderr.print(f"[bold yellow]setup differs:[/] {name}: {x!r} vs {y!r}", soft_wrap=True)
    stdout.print(comparison_table(comparison))
    for line in grouped_notes(comparison):
        stdout.print(f"  {line}", soft_wrap=True)
    for title, findings in (("resolved", comparison.findings_resolved),
                            ("new", comparison.findings_new)):
        for f in findings:
            stdout.print(f"  finding {title}: {f.id} {f.stage}: {f.title}", soft_wrap=True)


def _gate_runs(options: RunOptions, gate: GateOptions, command: list[str], out: Path | None,
               force: bool, decide_now: Callable[[RunResult, RunResult], GateDecision],
               policy: ConfinementPolicy | None) -> tuple[RunResult, RunResult, Path, int]:
    """Base and head measured here, interleaved, with trials added while the gate cannot tell
    (up to --max-trials a side); both sides merged, and the directory holding the trials. A
    user's command runs on both sides in worktrees (gpudiag/measure/gatejob.py)."""
    from gpudiag.diagnose.gate import TIME_METRICS  # noqa: PLC0415  (scipy)
    from gpudiag.measure.plan import check_run_options  # noqa: PLC0415  (torch)
    from gpudiag.present import (  # noqa: PLC0415  (pandas)
        default_run_dir,
        prepare_run_dir,
        write_output_file,
    )
    from gpudiag.present.compare import stopped_gate_markdown  # noqa: PLC0415  (scipy)

    base_ref, trials, max_trials = gate.base_ref, gate.trials, gate.max_trials
    assert base_ref is not None  # only called with --base-ref
    if command:
        trial = TrialCommand(command=tuple(command), top=repository_top(Path.cwd()),
                             samples_per_step=gate.samples_per_step, policy=policy)
    else:
        check_run_options(options)  # before anything is checked out or created
        trial = TrialCommand(options=options)

    def next_count(done: Interleaved) -> int:
        k = min(len(done.base), len(done.head))
        if not k:
            return 0
        decision = decide_now(merge_trials(done.base), merge_trials(done.head))
        wanted = decision.trials_wanted(k, max_trials)
        states = ", ".join(f"{g.stage} {g.metric} time {g.outcome}" for g in decision.stages
                           if g.metric in TIME_METRICS)
        stderr.print(f"gate: {k} a side: {states}"
                     + (f"; going to {wanted}" if wanted > k else "; stopping"), soft_wrap=True)
        return wanted

    # SIGTERM (a CI job's timeout) and SIGHUP stop the gate as Ctrl-C does: the running trial
    # gets the signal and its grace, the base's worktree is removed, the exit says which.
    with stop_on_signals() as stop, ExitStack() as checkouts:
        base = checkouts.enter_context(base_checkout(base_ref, Path.cwd()))
        head = checkouts.enter_context(head_checkout(Path.cwd())) if command else Path.cwd()
        if command:
            share_into([Path(p) for p in gate.share], Path.cwd(), [base, head])
        # Only once the base exists: a bad ref must leave no empty run directory behind.
        out_dir = prepare_run_dir(out, default_run_dir("gate"), force=force)
        stderr.print(f"gate: {base_ref} (base) against this checkout (head), {trials} to "
                     f"{max_trials} trials a side, in {out_dir}", soft_wrap=True)
        if command:
            assert policy is not None  # a command's trials always have one
            stderr.print(_command_note(gate.share, policy), soft_wrap=True)
        done = run_interleaved(trial, base=base, head=head, out_dir=out_dir,
                               first=trials, next_count=next_count,
                               on_trial=lambda side, k: stderr.print(f"trial {k}: {side}"))
    if done.interrupted or not done.base or not done.head:
        code = stop.exit_code or ExitCode.INTERRUPTED
        # The job's artifact says why there is no verdict (a CI timeout leaves only this).
        text = stopped_gate_markdown(code, len(done.base), len(done.head))
        with signals_ignored():
            write_output_file(out_dir / "gate.md", text, "--out")
            _append_summary(text)
        raise typer.Exit(code)
    return (merge_trials(done.base), merge_trials(done.head), out_dir,
            min(len(done.base), len(done.head)))


def _a_run(path: Path) -> bool:
    """Whether a gate's argument names a run (a directory or a .json file), not a command."""
    return path.is_dir() or (path.suffix == ".json" and path.is_file())


def _command_note(shared: tuple[str, ...], policy: ConfinementPolicy, *,
                  who: str = "gate: each side runs") -> str:
    """What running the user's command does with the user's files, said before it runs."""
    note = (f"{who} in a temporary checkout (this checkout with its uncommitted changes and "
            "untracked files, for the head); what the command writes there is removed with "
            f"it{how_kept(policy, 'its checkout', watched=False)}")
    if not shared:
        return note
    return note + (f"; {', '.join(shared)} linked into it read-only (--share)" if policy.confined
                   else f"; {', '.join(shared)} linked into it (--share): what the command "
                   "writes there reaches your files")


def _trials_policy(confine: ConfineOptions, command: list[str],
                   who: str) -> ConfinementPolicy | None:
    """How the trials of the user's `command` may write, checked before any checkout is made;
    None for gpudiag's own workload (it writes only its run folders)."""
    if not command:
        _check_sources(confine == ConfineOptions(), "--rerun-writable and --unconfined-reruns "
                       "go with a COMMAND")
        return None
    # A trial's writes outside its checkout are not watched (a profile's re-runs' are).
    return confinement_policy(confine.rerun_writable, unconfined=confine.unconfined_reruns,
                              isolated=f"{who} runs your command in temporary checkouts",
                              watched=False)


def _calibration_for_gate(path: Path | None) -> Calibration | None:
    """--calibration's file, else the repository's default one where it exists."""
    if path is not None:
        return load_calibration(path)
    return load_calibration(DEFAULT_CALIBRATION) if DEFAULT_CALIBRATION.is_file() else None


def _check_sources(ok: bool, message: str) -> None:
    if not ok:
        raise BadInput(message)


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


@app.command()
@_with_options(RunOptions, GateOptions, ConfineOptions)
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
    from gpudiag.diagnose.gate import GateRules, judge, parse_limits  # noqa: PLC0415  (scipy)
    from gpudiag.present import writable_output_file, write_output_file  # noqa: PLC0415  (pandas)
    from gpudiag.present.compare import gate_lines, gate_markdown  # noqa: PLC0415  (scipy)

    given = given or []
    if own.base_ref is not None and len(given) == 2 and all(_a_run(Path(g)) for g in given):
        raise BadInput("give either BASELINE and CURRENT or --base-ref, not both (a command "
                       "to measure goes after --)")
    command = given if own.base_ref is not None else []
    baseline, current = (None, None) if command else (
        Path(given[0]) if given else None, Path(given[1]) if len(given) > 1 else None)
    if not command and len(given) > 2:
        raise BadInput(f"expected BASELINE and CURRENT, got {len(given)} paths; a command to "
                       "measure goes after --base-ref REF --")
    when_undecided = check_gate_options(own, (baseline, current), options, command)
    policy = _trials_policy(confine, command, "gate --base-ref")
    rules = GateRules(parse_limits(list(own.max_regression)), own.min_iters,
                      own.allow_mismatch, _calibration_for_gate(own.calibration))
    if markdown is not None:
        writable_output_file(markdown, "--markdown", force=force)
    labels = (str(baseline or own.base_ref), str(current or "this checkout"))
    interleaved, per_side = own.base_ref is not None, 0
    if interleaved:
        a, b, trials_dir, per_side = _gate_runs(
            options, own, command, out, force,
            lambda x, y: judge(x, y, rules, labels=labels, interleaved=True)[0], policy)
        markdown = markdown or trials_dir / "gate.md"
    else:
        assert baseline is not None and current is not None  # check_gate_options saw to it
        a, b = _load_pair(baseline, current)
    decision, comparison = judge(a, b, rules, labels=labels, interleaved=interleaved)
    if interleaved:
        decision.stopped = decision.why_stopped(per_side, own.max_trials)
    text = gate_markdown(decision, comparison, when_undecided)
    if markdown is not None:
        write_output_file(markdown, text, "--markdown")
    _append_summary(text)
    for line in gate_lines(decision, when_undecided):
        typer.echo(line)
    raise typer.Exit(decision.exit_code(when_undecided))


@app.command()
@_with_options(RunOptions, ConfineOptions)
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
    _check_sources(not (command and options != RunOptions()), "run options (--model, ...) "
                   "measure gpudiag's workload; a command is profiled with its defaults")
    _check_sources(bool(command) or not share, "--share goes with a COMMAND")
    policy = _trials_policy(confine, command or [], "calibrate")
    if from_run is None:
        if trials < MIN_CALIBRATION_TRIALS:
            raise BadInput(f"--trials {trials}: a spread needs at least "
                           f"{MIN_CALIBRATION_TRIALS} trials")
        from_run = out or default_run_dir("calibrate")
        if command:
            assert policy is not None  # a command's trials always have one
            _calibrate_command(command, share or [], from_run, trials, policy, force=force)
        else:
            _run(options, out=from_run, as_json=False, trials=trials, quiet=True, force=force,
                 plots=False)  # the trials are the calibration's evidence, not a report
    else:
        _check_sources(options == RunOptions() and out is None and not command,
                       "run options, a command and --out only apply without --from")
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


def _calibrate_command(command: list[str], share: list[str], out: Path, trials: int,
                       policy: ConfinementPolicy, *, force: bool) -> None:
    """`trials` gpudiag profiles of the user's command, one after another, in a temporary
    checkout of this one (the user's files untouched), into out/trial-K."""
    from gpudiag.present import prepare_run_dir  # noqa: PLC0415  (pandas)

    trial = TrialCommand(command=tuple(command), top=repository_top(Path.cwd(), "calibrate"),
                         policy=policy)
    with stop_on_signals() as stop, head_checkout(Path.cwd()) as checkout:
        share_into([Path(p) for p in share], Path.cwd(), [checkout])
        out_dir = prepare_run_dir(out, out, force=force)
        stderr.print(_command_note(tuple(share), policy, who="calibrate: the trials run"),
                     soft_wrap=True)
        runs = run_repeated(trial, checkout, out_dir, trials,
                            on_trial=lambda k: stderr.print(f"trial {k}/{trials}"))
    if len(runs) < trials:
        raise typer.Exit(stop.exit_code or ExitCode.INTERRUPTED)


baseline_app = typer.Typer(help="Keep baselines in the repository for `gpudiag gate`.",
                           no_args_is_help=True)
app.add_typer(baseline_app, name="baseline")


@baseline_app.command("save")
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
    target = directory / f"{name}.json"
    if target.is_dir():
        raise BadInput(f"{target}: is a directory")
    baseline = baseline_of(load_run_set(run_path))
    if target.exists() and not force and target.read_bytes() != run_json_text(baseline).encode():
        raise BadInput(f"{target}: a different baseline is there; pass --force to replace it")
    save_run(baseline, target)
    typer.echo(f"baseline written: {target} (commit it; gate with `gpudiag gate {target} RUN`)")


@app.command()
def env(
    device: Annotated[str | None, typer.Option(help="cpu, cuda or cuda:N.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """Show what gpudiag sees: GPU, driver, CUDA, torch, power limit, NVML/GPM, TF32 flags."""
    from gpudiag.measure.env import describe_environment  # noqa: PLC0415  (torch)
    from gpudiag.measure.plan import resolve_device  # noqa: PLC0415  (torch)
    from gpudiag.present import env_table  # noqa: PLC0415  (pandas)

    environment = describe_environment(resolve_device(device))
    if as_json:
        stdout.print_json(json.dumps(dataclasses.asdict(environment)))
    else:
        stdout.print(env_table(environment))


@app.command()
def rules(
    rule: Annotated[str | None, typer.Argument(help="A rule code (GD101) or name.")] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print every rule's "
                                           "documentation as markdown (docs/rules.md).")] = False,
) -> None:
    """List the diagnosis rules, or explain one: what it detects, thresholds, why, fix."""
    from gpudiag.present import rule_panel, rules_markdown, rules_table  # noqa: PLC0415  (pandas)

    if markdown:
        typer.echo(rules_markdown(all_rules()), nl=False)
    elif rule is None:
        stdout.print(rules_table(all_rules()))
    else:
        found = find_rule(rule)
        if found is None:
            known = ", ".join(r.code for r in all_rules())
            raise BadInput(f"unknown rule {rule!r} (known: {known})")
        stdout.print(rule_panel(found))


@app.command("exit-codes")
def exit_codes(
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the table as markdown "
                                           "(README's \"Exit codes and guarantees\").")]
    = False,
) -> None:
    """List the exit codes gpudiag's commands end with, and what each means."""
    from gpudiag.present import (  # noqa: PLC0415  (pandas)
        exit_codes_markdown,
        exit_codes_table,
    )

    if markdown:
        typer.echo(exit_codes_markdown(), nl=False)
    else:
        stdout.print(exit_codes_table())


@app.command()
def models() -> None:
    """List the models `gpudiag run --model` accepts."""
    from gpudiag.measure.models import model_specs  # noqa: PLC0415  (torch)

    table = Table(title="Models", title_justify="left", header_style="bold")
    for column in ("name", "variants", "summary", "source"):
        table.add_column(column)
    for spec in model_specs():
        table.add_row(spec.name, ", ".join(spec.variants) or "-", spec.summary, spec.source)
    stdout.print(table)
    stdout.print("Your own: --model path/to/file.py:factory, or an entry point in the "
                 "'gpudiag.models' group (see README).")


def main() -> None:
    # Kineto (the profiler's engine) prints "USDT: ... profiler_start" and "STAGE:" lines on
    # every window, and CUPTI errors on a machine without a GPU: gpudiag reads the profiler's
    # results itself. A level above every one it logs at silences it (5 did before kineto's
    # USDT messages, pytorch/pytorch#101942; they need 6 in torch 2.13: 9 leaves room). The
    # user's own setting wins; processes gpudiag starts inherit it (profile's script, trials,
    # ranks).
    os.environ.setdefault("KINETO_LOG_LEVEL", "9")
    app()
