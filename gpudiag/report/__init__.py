"""Renderers: pure functions of a RunResult (terminal tables, markdown) and the run directory."""

from gpudiag.report.files import (
    default_run_dir,
    prepare_run_dir,
    rerender_run_dir,
    write_run_dir,
)
from gpudiag.report.findings import (
    findings_panel,
    rule_panel,
    rules_markdown,
    rules_table,
)
from gpudiag.report.markdown import render_markdown
from gpudiag.report.terminal import env_table, problems, stage_table

__all__ = [
    "default_run_dir",
    "env_table",
    "findings_panel",
    "prepare_run_dir",
    "problems",
    "render_markdown",
    "rerender_run_dir",
    "rule_panel",
    "rules_markdown",
    "rules_table",
    "stage_table",
    "write_run_dir",
]
