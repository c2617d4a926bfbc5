"""The exit codes (gpudiag.model.errors.ExitCode), rendered: README's "Exit codes and
guarantees" table is `exit_codes_markdown()` (`gpudiag exit-codes --markdown`). Pure functions."""

from __future__ import annotations

from rich.table import Table

from gpudiag.model.errors import ExitCode
from gpudiag.present.tables import markdown_table


def exit_codes_markdown() -> str:
    """Every exit code and what it means, as README's markdown table."""
    rows = [(str(code.value), code.description) for code in ExitCode]
    return "\n".join(markdown_table(("exit code", "meaning"), rows, right=(False, False))) + "\n"


def exit_codes_table() -> Table:
    table = Table(title="Exit codes", title_justify="left", header_style="bold")
    for column in ("code", "name", "meaning"):
        table.add_column(column)
    for code in ExitCode:
        table.add_row(str(code.value), code.name, code.description)
    return table
