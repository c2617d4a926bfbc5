"""Where a profiled script's time went, as waterfalls: its steady step by what the training
thread did (gpudiag/diagnose/host.py), and its whole run by part (gpudiag/diagnose/timeline.py).
Each waterfall's parts add up to its whole. Rows are shared by report.md and the terminal."""

from __future__ import annotations

from dataclasses import dataclass

from rich import box
from rich.table import Table
from rich.text import Text

from gpudiag.diagnose.host import KIND_LABELS, StepAccount, step_account
from gpudiag.diagnose.ledger import findings_by_part
from gpudiag.diagnose.timeline import RunAccount, describe, stage_account
from gpudiag.model.results import RunResult, StageResult
from gpudiag.present.tables import markdown_table

LINES_PER_PART = 3
BAR_WIDTH = 24
LINES_BAR_WIDTH = 16  # beside the busiest lines: the table still fits 100 columns
PART_WIDTH = 22
MIN_SHARE = 0.001  # parts below this share are summed into one row


@dataclass
class Row:
    part: str
    ms: float
    share: float
    lines: str = ""  # the busiest lines of this part, with ms each
    findings: str = ""  # the findings that price this part (gpudiag/diagnose/ledger.py)


def step_rows(step: StepAccount, priced: dict[str, list[str]] | None = None) -> list[Row]:
    """The steady step: one row per kind of host work, then what the samples missed."""
    rows = []
    for kind, ms in sorted(step.parts.items(), key=lambda kv: -kv[1]):
        named = step.lines_of(kind)[:LINES_PER_PART]
        lines = ", ".join(f"{x.location} {x.ms(kind):.2f}" for x in named)
        # Without a profiler window, host-only work is among the unresolved calls.
        codes = (priced or {}).get(kind, []) + ((priced or {}).get("python", [])
                                               if kind == "call" else [])
        rows.append(Row(KIND_LABELS[kind], ms, step.share(ms), lines, ", ".join(codes)))
    if step.unsampled_ms > 0:
        rows.append(Row("not sampled", step.unsampled_ms, step.share(step.unsampled_ms)))
    return rows


def run_rows(whole: RunAccount, priced: dict[str, list[str]] | None = None) -> list[Row]:
    by_work = {describe(w): w for w in whole.works}
    return [Row(name, ms, whole.share(ms),
                findings=", ".join((priced or {}).get(name, []) if name in by_work else []))
            for name, ms in whole.parts()]


def shown(rows: list[Row]) -> list[Row]:
    """The rows worth a line; parts under MIN_SHARE each are summed into one, so that what is
    shown still adds up to the whole."""
    big = [row for row in rows if row.share >= MIN_SHARE]
    small = [row for row in rows if row.share < MIN_SHARE]
    if sum(row.share for row in small) >= MIN_SHARE:
        big.append(Row(f"{len(small)} smaller part(s)", sum(r.ms for r in small),
                       sum(r.share for r in small)))
    return big


# How the samples were taken (gpudiag/measure/profile/inscript/hostsampler.py).
_CLOCKS = {"signal": "taken in the training thread at a timer signal",
           "thread": "read from a sampling thread, each delaying the training thread ~0.1 ms"}


def _step_intro(stage: StageResult, step: StepAccount) -> str:
    busy = (f" On the device side, the profiler window saw the GPU busy "
            f"{step.gpu_busy_share:.0%} of its step." if step.gpu_busy_share is not None else "")
    top = step.lines[0].ms_per_step if step.lines else 0.0
    how = _CLOCKS.get(step.clock, "")
    how = f" ({how}{': ' + step.clock_note if step.clock_note else ''})" if how else ""
    return (f"The training thread's time in a steady step ({step.step_ms:.2f} ms, mean of "
            f"{step.steps:,} steps on the host clock, slow steps and the profiler window left "
            f"out), from {step.samples:,} stack samples every {step.period_ms:g} ms{how}: each "
            f"part is a share of that step. A line's figure is a count of samples: one of "
            f"{top:.2f} ms/step is known to about +-{step.error(top):.2f} ms.{busy}")


def _span(ms: float) -> str:
    seconds = ms / 1e3
    if seconds < 120:
        return f"{seconds:,.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds / 3600:,.1f} h"


def projection(whole: RunAccount) -> str | None:
    """What a run cut short after gpudiag's window would have taken at the steps the script
    means to make, and what its start-up is of that."""
    projected = whole.projected_ms
    if projected is None or whole.planned is None:
        return None
    steps, source = whole.planned
    loop = projected - whole.setup_ms - whole.tail_ms
    return (f"gpudiag ended the script after its window, at step {whole.steps:,}; it means to "
            f"make {steps:,} steps ({source}). At this run's cost per step "
            f"({whole.loop_ms_per_step:,.1f} ms, its periodic work included) the whole run "
            f"would take about {_span(projected)}, the training loop {loop / projected:.1%} "
            f"of it (start-up {_span(whole.setup_ms)}): a finding's share of the training "
            "loop is that much of the whole run.")


def markdown_sections(run: RunResult) -> list[str]:
    """report.md: for each profiled process, the run's parts and the step's."""
    out: list[str] = []
    for stage in run.ok_stages():
        script = stage.facts.script
        whole = stage_account(stage)
        priced = findings_by_part(run, stage)
        if whole is not None and script is not None and script.timeline is not None:
            out += [f"### Where the run's time went: `{stage.name}`", "",
                    f"All {script.timeline.steps:,} steps of the run, "
                    f"{whole.wall_ms / 1e3:,.1f} s of wall time (host clock), not only the "
                    "timed ones; each part is a share of that whole"
                    + (", and the findings that price a part are named beside it: each "
                       "finding's share of wall time is of this whole." if priced else "."),
                    ""]
            out += _markdown_table(run_rows(whole, priced), "ms", whole.wall_ms, lines=False)
            projected = projection(whole)
            if projected is not None:
                out += [projected, ""]
        step = step_account(stage)
        if step is not None:
            out += [f"### Where each step's time went: `{stage.name}`", "",
                    _step_intro(stage, step), ""]
            out += _markdown_table(step_rows(step, priced), "ms/step", step.step_ms,
                                   lines=True)
    return out


def _markdown_table(rows: list[Row], unit: str, total: float, *, lines: bool) -> list[str]:
    kept = shown(rows)
    priced = any(row.findings for row in kept)

    def cells(row: Row) -> list[str]:
        base = [row.part, f"{row.ms:,.2f}" if unit == "ms/step" else f"{row.ms:,.0f}",
                f"{row.share:.1%}"]
        if lines:
            base.append(row.lines or "-")
        return [*base, row.findings or "-"] if priced else base

    header = ["part", unit, "share", *(["busiest lines (ms/step)"] if lines else []),
              *(["priced by"] if priced else [])]
    body = [cells(row) for row in kept]
    body.append(["**all**", f"{total:,.2f}" if unit == "ms/step" else f"{total:,.0f}", "100%",
                 *([""] if lines else []), *([""] if priced else [])])
    return [*markdown_table(header, body, right=[False, True, True, False, False][:len(header)]),
            ""]


def terminal_tables(run: RunResult) -> list[Table]:
    """The terminal's waterfalls, one per account, with a bar per part."""
    tables = []
    for stage in run.ok_stages():
        whole = stage_account(stage)
        priced = findings_by_part(run, stage)
        if whole is not None and len(whole.parts()) > 2:
            projected = whole.projected_ms
            planned = (f" (cut short; about {_span(projected)} projected for its "
                       f"{whole.planned[0]:,} steps)"
                       if projected is not None and whole.planned is not None else "")
            tables.append(_table(f"{stage.name}: the run's {whole.wall_ms / 1e3:,.1f} s"
                                 + planned, run_rows(whole, priced), "ms", lines=False))
        step = step_account(stage)
        if step is not None:
            tables.append(_table(f"{stage.name}: a steady step's {step.step_ms:.2f} ms "
                                 f"({step.samples:,} host samples)", step_rows(step, priced),
                                 "ms/step", lines=True))
    return tables


MAX_LINE_WIDTH = 48  # a longer `path:line ms` entry is folded, not the table squeezed


TERMINAL_WIDTH, MIN_BAR_WIDTH, RICH_SLACK = 100, 3, 3


def _lines_bar_width(rows: list[Row], unit: str, priced: bool) -> int:
    """The bar beside the busiest lines, narrowed so that a `path:line ms` entry up to
    MAX_LINE_WIDTH long and the "priced by" column still fit TERMINAL_WIDTH whole."""
    longest = min(MAX_LINE_WIDTH, max((len(e) for row in rows for e in row.lines.split(", ")),
                                      default=0))
    ms = max([len(unit)] + [len(f"{row.ms:,.2f}") for row in rows])
    columns = 6 if priced else 5
    # A space of padding each side of each cell, the table's edges' included.
    fixed = PART_WIDTH + ms + len("100.0%") + 2 * columns \
        + (len("priced by") if priced else 0) + longest
    # Rich shares out a few columns more than the cells ask for: kept as slack.
    return max(MIN_BAR_WIDTH, min(LINES_BAR_WIDTH, TERMINAL_WIDTH - fixed - RICH_SLACK))


def _table(title: str, rows: list[Row], unit: str, *, lines: bool) -> Table:
    kept = shown(rows)
    priced = any(row.findings for row in kept)
    table = Table(title=Text(title), title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  header_style="bold")
    # Beside the busiest lines the part's name wraps (between words) rather than squeeze them.
    table.add_column("part", overflow="fold", max_width=PART_WIDTH if lines else None)
    table.add_column(unit, justify="right")
    table.add_column("share", justify="right")
    table.add_column("", no_wrap=True)
    if lines:
        # One line per entry, the column as wide as the longest: a narrow terminal wraps
        # the parts' names between words, never a path mid-token.
        longest = max((len(e) for row in kept for e in row.lines.split(", ")), default=0)
        table.add_column("busiest lines", min_width=min(longest, MAX_LINE_WIDTH),
                         overflow="fold")
    if priced:
        table.add_column("priced by", no_wrap=True, min_width=len("priced by"))
    bar_width = _lines_bar_width(kept, unit, priced) if lines else BAR_WIDTH
    start = 0.0
    for row in kept:
        # A waterfall: each bar starts where the previous part ended.
        lead = round(start * bar_width)
        width = max(1, round((start + row.share) * bar_width) - lead) if row.share > 0 else 0
        bar = " " * lead + "█" * width
        start += row.share
        ms = f"{row.ms:,.2f}" if unit == "ms/step" else f"{row.ms:,.0f}"
        cells: list[Text | str] = [Text(row.part), ms, f"{row.share:.1%}",
                                   Text(bar.ljust(bar_width))]
        if lines:
            cells.append(Text("\n".join(row.lines.split(", "))))
        if priced:
            cells.append(row.findings)
        table.add_row(*cells)
    return table
