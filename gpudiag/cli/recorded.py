"""Commands over recorded runs: `gpudiag report` re-renders one (its rules applied again, if
asked), `gpudiag compare` holds two against each other."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from gpudiag.cli.edges import stderr, stdout
from gpudiag.cli.runs import print_run
from gpudiag.diagnose import evaluate
from gpudiag.diagnose.trials import load_run_set
from gpudiag.model.errors import BadInput
from gpudiag.model.runfile import load_run, to_jsonable

# Imports inside the commands below are of modules that pull in scipy or pandas (each says
# which): `gpudiag --help` starts without them (tests/test_cli.py checks).


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
    print_run(run)
    if run.fixes:
        from gpudiag.present import fixes_table  # noqa: PLC0415  (pandas)

        stdout.print(fixes_table(run))
    stderr.print(f"Report: {run_dir / 'report.md'}", soft_wrap=True)


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
    a, b = load_run_set(before), load_run_set(after)
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
