"""Commands that describe gpudiag and this machine: `env`, `rules`, `exit-codes`, `models`."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

import typer
from rich.table import Table

from gpudiag.cli.edges import stdout
from gpudiag.diagnose import all_rules, find_rule
from gpudiag.model.errors import BadInput

# Imports inside the commands below are of modules that pull in torch or pandas (each says
# which): `gpudiag --help` and `rules` start without torch.


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
