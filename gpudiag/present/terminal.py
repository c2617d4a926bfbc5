"""Rich renderables for the terminal. Pure: they build tables, the CLI prints them."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from gpudiag.model.results import Env, RunResult
from gpudiag.present.rows import TERMINAL_DROP_ORDER, Column, fmt, run_subject, table_cells

_STATUS_STYLE = {"ok": "", "error": "red", "skipped": "yellow"}


def stage_table(run: RunResult, width: int | None = None) -> Table:
    """The stage table; with `width`, the least important columns go until it fits."""
    columns, rows = table_cells(run, terminal=True)
    table = _build(run, columns, rows)
    for key in TERMINAL_DROP_ORDER:
        if width is None or _natural_width(table) <= width:
            break
        keep = [i for i, c in enumerate(columns) if c.key != key]
        columns = [columns[i] for i in keep]
        rows = [[row[i] for i in keep] for row in rows]
        table = _build(run, columns, rows)
    # Rich wraps a title to its table's width: a few narrow columns squeezed the title (what
    # ran, on what, how) into a 27-column block. The table is at least as wide as its title,
    # where the terminal allows.
    title = len(_title(run))
    table.min_width = min(title, width) if width is not None else title
    return table


def _natural_width(table: Table) -> int:
    console = Console(width=10_000)
    return Measurement.get(console, console.options, table).maximum


def _build(run: RunResult, columns: list[Column], rows: list[list[str]]) -> Table:
    table = Table(title=Text(_title(run)), title_justify="left", header_style="bold",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for column in columns:
        table.add_column(column.short, justify="left" if column.key == "stage" else "right",
                         no_wrap=column.key == "stage")
    for stage, cells in zip(run.stages, rows, strict=True):
        # Cells are text, not markup: a stage named train.py[rank0] keeps its brackets.
        table.add_row(*(Text(cell) for cell in cells), style=_STATUS_STYLE.get(stage.status, ""))
    return table


def _title(run: RunResult) -> str:
    subject, setting = run_subject(run)
    return f"{subject} on {run.env.gpu_name or run.env.device} - {setting}"


def problems(run: RunResult) -> list[Text]:
    """One line per stage that did not run: what happened and what to do."""
    lines = []
    for stage in run.stages:
        if stage.ok:
            continue
        style = _STATUS_STYLE.get(stage.status, "")
        advice = f" ({stage.advice})" if stage.advice else ""
        lines.append(Text(f"{stage.name}: {stage.status}: {stage.error}{advice}", style=style))
    return lines


def env_table(env: Env) -> Table:
    table = Table(title="What gpudiag sees", title_justify="left", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for label, value in env_rows(env):
        table.add_row(label, value)
    return table


def env_rows(env: Env) -> list[tuple[str, str]]:
    rows = [
        ("device", env.device),
        ("GPU", env.gpu_name or "none"),
        ("GPUs visible", str(env.gpu_count)),
        ("compute capability", env.compute_capability or "-"),
        ("GPU memory", fmt(env.gpu_memory_mib / 1024 if env.gpu_memory_mib else None, ".1f",
                           " GiB")),
        ("driver", env.driver_version or "-"),
        ("CUDA (torch build / driver)", f"{env.cuda_runtime or '-'} / {env.cuda_driver or '-'}"),
        ("power limit", fmt(env.power_limit_w, ".0f", " W")),
        ("torch", env.torch_version),
        ("transformers", env.transformers_version or "-"),
        ("python", env.python_version),
        ("NVML", env.nvml),
        ("GPM", env.gpm),
        ("TF32 matmul / cuDNN", f"{env.tf32_matmul} / {env.tf32_cudnn}"),
        ("cuDNN benchmark", str(env.cudnn_benchmark)),
        ("CPU", f"{env.cpu_model or '-'} ({env.cpu_count} usable)"),
        ("host", env.hostname),
    ]
    refused = {m: why for m, why in env.telemetry_metrics.items() if why != "ok"}
    if refused:
        rows.append(("telemetry refused", "; ".join(f"{m}: {w}" for m, w in refused.items())))
    return rows
