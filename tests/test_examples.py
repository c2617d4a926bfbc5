"""Every run committed under reports/examples/ stays readable by today's gpudiag: it loads,
compares with itself, re-renders to the committed report.md (the renderers are pure), and
today's rules find on it what it recorded, but where a rule named below changed since."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import invoke

from gpudiag.diagnose import evaluate
from gpudiag.diagnose.compare import compare_runs
from gpudiag.model.results import Finding
from gpudiag.model.runfile import load_run
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


# Runs recorded before a rule changed: (findings recorded, today's rules no longer find them;
# findings today's rules add), as "ID severity location". Any other difference fails: a change
# to a rule, the window or its analysis that moves a committed run's finding says so here.
RULES_CHANGED_SINCE: dict[str, tuple[list[str], list[str]]] = {
    # Recorded 2026-11-23; info-level GD501 and GD601 from what today's rules read of it.
    "h100-dgca-earlier-commit": ([], ["GD501 info None", "GD601 info None"]),
    # Periodic work named by its line (aa33ab6); its findings' severity since raised.
    "h100-periodic/eval10-save7": (["GD201 critical None", "GD701 warning None"],
                                   ["GD201 critical periodic_eval.py:56", "GD701 critical None"]),
    "h100-periodic/eval10-tensor": (
        ["GD201 critical None", "GD703 warning periodic_eval.py:69"],
        ["GD201 critical periodic_eval.py:56", "GD703 critical periodic_eval.py:69"]),
    "h100-periodic/eval20": (["GD201 critical None", "GD703 warning periodic_eval.py:69"],
                             ["GD201 critical periodic_eval.py:56",
                              "GD703 critical periodic_eval.py:69"]),
    "h100-two-processes/blocking_save-try-fixes": (["GD701 warning None"],
                                                   ["GD701 critical None"]),
    # GD304 at information level from a tenth of the step (e71e766).
    "h200-memory-bound-compile/nanogpt-gpt2-small": ([], ["GD304 info model.py:27"]),
    "h200-memory-bound-compile/nanogpt-gpt2-small/fixes/without-fixes-1": (
        [], ["GD304 info model.py:27"]),
    "h200-memory-bound-compile/nanogpt-gpt2-small/fixes/without-fixes-2": (
        [], ["GD304 info model.py:27"]),
    # fp32 matmuls without autocast named on a rank of a profiled job (after 875f23e).
    "h200x2-knobs/ddp": ([], ["GD301 warning None"]),
    "h200x2-knobs/ddp/fixes/ddp-no-sync": ([], ["GD301 warning None"]),
    "h200x2-knobs/ddp/fixes/without-fixes-1": ([], ["GD301 warning None"]),
    "h200x2-knobs/ddp/fixes/without-fixes-2": ([], ["GD301 warning None"]),
    # A saving step's whole spike is the save's, priced once by GD701 (issue 55): the part of
    # it beyond the torch.save call is no longer "work that is not a checkpoint save".
    "h200-watches/blocking_save": (["GD703 warning examples/blocking_save.py:29"], []),
    "h100-try-fixes/blocking_save-small-steps/fixes/async-save": (["GD703 critical None"], []),
    # gpudiag's own steps are not the script's work (issue 55): the end of its warm-up (step
    # 5) was one of two "every 45 steps" at `opt.step()`; three irregular slow steps at the
    # every-step `loss.backward()` have no period.
    "h100-recorder-with-torch/omp": (["GD703 critical omp.py:9"], []),
    "h200-watches/tiny_ddp": (["GD703 warning examples/tiny_ddp.py:46"], []),
}


def _said(findings: list[Finding]) -> set[str]:
    return {f"{f.id} {f.severity} {f.location}" for f in findings}


@pytest.mark.parametrize("run_dir", RUNS, ids=_id)
def test_todays_rules_find_what_the_example_recorded(run_dir: Path) -> None:
    run = load_run(run_dir)
    recorded, today = _said(run.findings), _said(evaluate(run))
    gone, added = RULES_CHANGED_SINCE.get(_id(run_dir), ([], []))
    assert (sorted(recorded - today), sorted(today - recorded)) == (gone, added)


def test_the_rule_changes_listed_are_committed_runs() -> None:
    assert set(RULES_CHANGED_SINCE) <= {_id(r) for r in RUNS}


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
