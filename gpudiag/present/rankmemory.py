"""Memory by rank: a multi-rank job's ranks' peaks side by side (diagnose.ranks.job_memory),
where each peaked, and the largest over the smallest, for report.md and the terminal."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from gpudiag.diagnose.ranks import JobMemory, RankPeak, job_memory
from gpudiag.model.results import RunResult
from gpudiag.present.rows import DASH, fmt
from gpudiag.present.tables import markdown_table


def _header(job: JobMemory, *, terminal: bool) -> list[str]:
    """The columns' names; the terminal's short (its title says MiB at each rank's peak)."""
    if terminal:
        return ["rank", "stage", "allocated", "reserved", "resident", "at step", "of largest"]
    return ["rank", "stage", "peak allocated MiB", "peak reserved MiB", "peak resident MiB",
            f"{job.series} peaked at step", f"of the largest rank's {job.series}"]


STAGE = 1  # the stage column: only where the ranks are stages of their own (profiled)
STEP = 5  # the step each peaked at: only where counted step by step (profiled)


def _row(job: JobMemory, peak: RankPeak) -> list[str]:
    largest = job.largest
    top = largest.measure(job.series) if largest else None
    mine = peak.measure(job.series)
    share = f"{mine / top:.0%}" if mine is not None and top else DASH
    return [str(peak.rank), peak.stage, fmt(peak.allocated_mib, ",.0f"),
            fmt(peak.reserved_mib, ",.0f"), fmt(peak.resident_mib, ",.0f"),
            DASH if peak.step is None else str(peak.step), share]


def _shown(job: JobMemory, *, terminal: bool) -> tuple[list[str], list[list[str]]]:
    """The header and rows shown: the stage column only where the ranks are stages of their
    own (a ddp stage's are one stage, the heading's), the step only where counted; the
    terminal's only what was measured (a CPU has no allocator's figures)."""
    header = _header(job, terminal=terminal)
    rows = [_row(job, peak) for peak in job.ranks]
    keep = [i for i in range(len(header))
            if (i != STAGE or len({p.stage for p in job.ranks}) > 1)
            and (not (terminal or i == STEP) or any(row[i] != DASH for row in rows))]
    return [header[i] for i in keep], [[row[i] for i in keep] for row in rows]


def _what(job: JobMemory) -> str:
    """What the ranks are compared by, and what that measure holds."""
    if job.series == "allocated":
        return "what its tensors held at their highest (the CUDA allocator's peak)"
    return ("its process's resident set at its highest (a CPU's only measure: torch keeps no "
            "count there; each includes what its process imported)")


def spread_line(job: JobMemory) -> str:
    """What the ranks are compared by, the largest (where it peaked) and its multiple of the
    smallest."""
    high, low, spread = job.largest, job.smallest, job.spread
    if high is None or low is None or spread is None:
        return "No rank's peak was measured."
    at = f" at step {high.step}" if high.step is not None else ""
    return (f"Each rank compared by {_what(job)}: the largest, rank {high.rank} "
            f"({fmt(high.measure(job.series), ',.0f')} MiB{at}), holds {spread:.2f}x the "
            f"smallest, rank {low.rank} ({fmt(low.measure(job.series), ',.0f')} MiB).")


def rank_memory_markdown(run: RunResult) -> list[str]:
    """A section per multi-rank job whose ranks' memory was read."""
    out: list[str] = []
    for job in job_memory(run):
        header, rows = _shown(job, terminal=False)
        out += [f"### Memory by rank: {job.job}", "",
                *markdown_table(header, rows, right=[h != "stage" for h in header]), "",
                spread_line(job), ""]
    return out


def rank_memory_tables(run: RunResult) -> list[Group]:
    """The terminal's memory by rank, a table per job and the spread below it (a line of the
    console's width: a caption would wrap to the narrow table's)."""
    tables = []
    for job in job_memory(run):
        header, rows = _shown(job, terminal=True)
        title = f"Memory by rank: {job.job} (MiB at each rank's peak)"
        table = Table(title=Text(title), title_justify="left", header_style="bold",
                      box=box.SIMPLE_HEAD, pad_edge=False)
        table.min_width = len(title)  # rich wraps a title to its table's width otherwise
        for name in header:
            stage = name == "stage"
            table.add_column(name, justify="left" if stage else "right", no_wrap=stage)
        for row in rows:
            # Cells are text, not markup: a stage named train.py[rank0] keeps its brackets.
            table.add_row(*(Text(cell) for cell in row))
        tables.append(Group(table, Text(spread_line(job))))
    return tables
