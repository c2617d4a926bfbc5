"""Renderers: pure functions of a RunResult (terminal tables, markdown) and the run directory."""

from gpudiag.present.exitcodes import exit_codes_markdown, exit_codes_table
from gpudiag.present.files import (
    default_run_dir,
    prepare_run_dir,
    rerender_run_dir,
    writable_output_file,
    write_output_file,
    write_run_dir,
)
from gpudiag.present.findings import (
    findings_panel,
    rule_panel,
    rules_markdown,
    rules_table,
)
from gpudiag.present.fixes import fixes_table
from gpudiag.present.markdown import render_markdown
from gpudiag.present.rankmemory import rank_memory_tables
from gpudiag.present.terminal import env_table, problems, stage_table
from gpudiag.present.waterfall import terminal_tables as waterfall_tables

__all__ = [
    "default_run_dir",
    "env_table",
    "exit_codes_markdown",
    "exit_codes_table",
    "findings_panel",
    "fixes_table",
    "prepare_run_dir",
    "problems",
    "rank_memory_tables",
    "render_markdown",
    "rerender_run_dir",
    "rule_panel",
    "rules_markdown",
    "rules_table",
    "stage_table",
    "waterfall_tables",
    "writable_output_file",
    "write_output_file",
    "write_run_dir",
]
