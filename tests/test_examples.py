"""Every run committed under reports/examples/ stays readable by today's gpudiag: it loads,
compares with itself, and re-renders to the committed report.md (the renderers are pure)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import invoke

from gpudiag.diagnose.compare import compare_runs
from gpudiag.model.results import load_run
from gpudiag.present.markdown import PLOT_CAPTIONS, render_markdown

EXAMPLES = Path(__file__).resolve().parent.parent / "reports" / "examples"
RUNS = sorted(p.parent for p in EXAMPLES.rglob("run.json"))


def _id(path: Path) -> str:
    return str(path.relative_to(EXAMPLES))


def test_the_examples_are_there() -> None:
    assert len(RUNS) >= 10


@pytest.mark.parametrize("run_dir", RUNS, ids=_id)
def test_example_loads_and_compares_with_itself(run_dir: Path) -> None:
    run = load_run(run_dir)
    assert run.stages
    comparison = compare_runs(run, run)
    assert not comparison.mismatches


@pytest.mark.parametrize("run_dir", [r for r in RUNS if (r / "report.md").is_file()], ids=_id)
def test_example_report_re_renders_as_committed(run_dir: Path) -> None:
    plots = [p for p in PLOT_CAPTIONS if (run_dir / p).is_file()]
    assert render_markdown(load_run(run_dir), plots) == (run_dir / "report.md").read_text()


def test_gpudiag_report_re_renders_a_committed_run(tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(EXAMPLES / "h100-dgca", copy)
    result = invoke(["report", str(copy)])
    assert result.exit_code == 0, result.output
    text = (copy / "report.md").read_text()
    assert "**full-loop: " in text and "| full-vectorized |" in text


@pytest.mark.parametrize("width", [100, 200])
def test_the_stage_tables_title_takes_the_terminals_width(width: int) -> None:
    """A few narrow columns once squeezed the table's title (what ran, on what, how) into a
    27-column block, broken mid-word, beside a full-width diagnosis."""
    from io import StringIO

    from rich.console import Console

    from gpudiag.present import stage_table

    run = load_run(EXAMPLES / "h100-compile" / "recompiles")
    console = Console(file=StringIO(), width=width, color_system=None)
    console.print(stage_table(run, width=width))
    first = console.file.getvalue().splitlines()[0].strip()  # type: ignore[attr-defined]
    title = "python3 /work/main/examples/compile_shapes.py --steps 40 on NVIDIA H100 80GB " \
            "HBM3 - profiled: warm-up 5, timed 30, evidence 3 steps"
    # On one line where it fits; else wrapped at the terminal's width, between words.
    assert first == title if len(title) <= width else len(first) >= width - 20, first


def test_the_waterfalls_are_readable_at_100_columns() -> None:
    """At 100 columns the steady step's busiest lines broke mid-token
    ("periodic_eval.py:5|6 2.47") and "priced by" was cut: every committed run's waterfalls
    keep each `path:line ms` entry and the headers whole, within 100 columns."""
    from rich.console import Console

    from gpudiag.diagnose.host import step_account
    from gpudiag.present import waterfall_tables
    from gpudiag.present.waterfall import MAX_LINE_WIDTH, shown, step_rows

    seen = 0
    for run_dir in RUNS:
        run = load_run(run_dir)
        tables = waterfall_tables(run)
        if not tables:
            continue
        console = Console(width=100, record=True, color_system=None)
        for table in tables:
            console.print(table)
        printed = console.export_text().splitlines()
        assert max(len(line.rstrip()) for line in printed) <= 100, run_dir
        for stage in run.ok_stages():
            step = step_account(stage)
            if step is None:
                continue
            seen += 1
            assert any("busiest lines" in line for line in printed), run_dir
            for row in shown(step_rows(step, {})):
                for entry in filter(None, row.lines.split(", ")):
                    if len(entry) <= MAX_LINE_WIDTH:
                        assert any(entry in line for line in printed), (run_dir, entry)
    assert seen >= 5
