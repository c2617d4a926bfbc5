"""Each rank's memory, labelled, and the ranks' peaks side by side (issue 57): a profiled
torchrun job (a stage per rank) and `gpudiag run`'s ddp stage (its ranks in DdpFacts), built
here from recorded-like figures; the real two-rank run is tests/test_ddp.py's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import pytest
from conftest import ladder_run, script_run
from rich.console import Console

from gpudiag.diagnose import evaluate
from gpudiag.diagnose.ranks import job_and_rank, job_memory
from gpudiag.measure.stages.ddp.launch import largest_rank_memory
from gpudiag.model.facts import (
    DdpFacts,
    MemoryTimeline,
    RankFacts,
    ScriptFacts,
    StageFacts,
    StepTimeline,
)
from gpudiag.model.results import MemoryStats, StageResult
from gpudiag.present import plots, rank_memory_tables, render_markdown
from gpudiag.present.trace import build_trace

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STEPS = 40


def _rank_stage(rank: int, resident: list[float], *, job: str = "train.py",
                cuda: list[float] | None = None, total_mib: float = 80_000.0) -> StageResult:
    """A profiled rank of `job`: its resident set at each step's end; `cuda`: what its tensors
    held then (reserved 512 MiB above, the allocator's peak the highest so far)."""
    peak = [max(cuda[: i + 1]) for i in range(len(cuda))] if cuda else []
    memory = MemoryTimeline(
        device="cuda" if cuda else "cpu", allocated_mib=cuda or [],
        reserved_mib=[m + 512 for m in cuda] if cuda else [], peak_mib=peak,
        resident_mib=resident, device_total_mib=total_mib if cuda else None,
        host_total_mib=None if cuda else total_mib)
    steps = len(resident)
    script = ScriptFacts(steps=steps, warmup=5, timed=30, step_clock="optimizer.step()",
                         memory=memory, timeline=StepTimeline(step_ms=[10.0] * steps,
                                                              steps=steps))
    return StageResult(name=f"{job}[rank{rank}]", status="ok", iter_ms=[10.0] * 30,
                       facts=StageFacts(script=script))


def _flat(mib: float, *, spike_at: int | None = None, spike: float = 0.0) -> list[float]:
    return [mib + (spike if i == spike_at else 0.0) for i in range(STEPS)]


def test_stage_names_give_the_job_and_the_rank() -> None:
    assert job_and_rank("train.py[rank1]") == ("train.py", 1)
    assert job_and_rank("train.py") == ("train.py", None)
    assert job_and_rank("a[rank0]b") == ("a[rank0]b", None)


def test_cpu_ranks_compared_by_their_resident_sets_where_rank_0_gathers() -> None:
    """Rank 0 alone gathering a full state dict at step 30: its resident set peaks there,
    1.5x the other's."""
    run = script_run(_rank_stage(0, _flat(1000.0, spike_at=30, spike=500.0)),
                     _rank_stage(1, _flat(1000.0)))
    (job,) = job_memory(run)
    assert job.job == "train.py" and job.device == "cpu" and job.series == "resident"
    assert [r.rank for r in job.ranks] == [0, 1]
    assert job.largest is not None and job.largest.rank == 0 and job.largest.step == 30
    assert job.smallest is not None and job.smallest.rank == 1
    assert job.spread == 1.5
    report = render_markdown(run)
    section = report[report.index("### Memory by rank: train.py"):]
    assert "| 0 | train.py[rank0] | - | - | 1,500 | 30 | 100% |" in section
    assert "| 1 | train.py[rank1] | - | - | 1,000 | 0 | 67% |" in section
    assert ("the largest, rank 0 (1,500 MiB at step 30), holds 1.50x the smallest, rank 1 "
            "(1,000 MiB)") in section
    console = Console(width=200, record=True)
    for table in rank_memory_tables(run):
        console.print(table)
    shown = console.export_text()
    assert "Memory by rank: train.py" in shown and "train.py[rank1]" in shown
    assert "holds 1.50x" in shown


def test_cuda_ranks_compared_by_what_tensors_held_at_the_allocators_peak() -> None:
    rank0 = _rank_stage(0, _flat(3000.0), cuda=_flat(2000.0, spike_at=12, spike=1000.0))
    rank1 = _rank_stage(1, _flat(3100.0), cuda=_flat(2000.0))
    (job,) = job_memory(script_run(rank0, rank1, device="cuda"))
    assert job.series == "allocated"
    top = job.largest
    assert top is not None and top.rank == 0 and top.step == 12
    assert (top.allocated_mib, top.reserved_mib, top.resident_mib) == (3000.0, 3512.0, 3000.0)
    assert job.spread == 1.5


def test_one_process_and_jobs_of_one_rank_get_no_memory_by_rank() -> None:
    single = dataclasses.replace(_rank_stage(0, _flat(1000.0)), name="train.py")
    assert job_memory(script_run(single)) == []
    assert job_memory(script_run(_rank_stage(0, _flat(1000.0)))) == []
    assert "Memory by rank" not in render_markdown(script_run(single))


def test_growth_on_one_rank_is_named_as_that_rank_s() -> None:
    """Rank 1 keeps 8 MiB a step (its evaluation's outputs, say); rank 0 does not grow: one
    GD403 finding, from rank 1's data, saying rank 1."""
    growing = [1000.0 + 8.0 * i for i in range(STEPS)]
    run = script_run(_rank_stage(0, _flat(1000.0)), _rank_stage(1, growing))
    (found,) = [f for f in evaluate(run) if f.id == "GD403"]
    assert found.stage == "train.py[rank1]" and found.evidence["rank"] == 1
    assert found.title.startswith("Rank 1: Memory grows 8.0 MiB a step")


def test_a_process_of_no_rank_keeps_its_finding_as_it_was() -> None:
    growing = [1000.0 + 8.0 * i for i in range(STEPS)]
    stage = dataclasses.replace(_rank_stage(0, growing), name="train.py")
    (found,) = [f for f in evaluate(script_run(stage)) if f.id == "GD403"]
    assert "rank" not in found.evidence and found.title.startswith("Memory grows")


def _part(rank: int, allocated: float | None, reserved: float | None,
          resident: float) -> dict[str, Any]:
    return {"rank": rank,
            "variants": [{"peak_allocated_mib": allocated, "peak_reserved_mib": reserved,
                          "device_total_mib": 10_000.0 if allocated is not None else None,
                          "peak_resident_mib": resident}]}


def test_a_ddp_stage_s_memory_is_its_most_reserved_rank_s() -> None:
    parts = [_part(0, 8000.0, 9000.0, 2000.0), _part(1, 8500.0, 9500.0, 2100.0)]
    assert largest_rank_memory(parts) == MemoryStats(
        peak_allocated_mib=8500.0, peak_reserved_mib=9500.0, device_total_mib=10_000.0)
    assert largest_rank_memory([_part(0, None, None, 900.0)]) is None  # a CPU's ranks


def _ddp_stage(ranks: list[RankFacts], memory: MemoryStats | None) -> StageResult:
    return StageResult(name="ddp", status="ok", iter_ms=[10.0] * 8, memory=memory,
                       facts=StageFacts(ddp=DdpFacts(world_size=len(ranks), ranks=ranks)))


def test_a_ddp_stage_near_capacity_names_its_rank_and_shows_every_rank() -> None:
    ranks = [RankFacts(rank=0, peak_allocated_mib=8000.0, peak_reserved_mib=8600.0,
                       peak_resident_mib=2000.0),
             RankFacts(rank=1, peak_allocated_mib=8800.0, peak_reserved_mib=9400.0,
                       peak_resident_mib=2000.0)]
    run = ladder_run(_ddp_stage(ranks, MemoryStats(peak_allocated_mib=8800.0,
                                                   peak_reserved_mib=9400.0,
                                                   device_total_mib=10_000.0)))
    (found,) = [f for f in evaluate(run) if f.id == "GD401"]
    assert found.evidence["rank"] == 1
    assert found.title.startswith("Rank 1 (the most reserved of ddp's ranks): Peak reserved")
    report = render_markdown(run)
    assert "| 8.6 (rank 1) |" in report  # the run table's peak: the stage's, rank 1's
    assert "### Memory by rank: ddp" in report
    # One stage, no steps counted: no stage column, no step column.
    assert "| 1 | 8,800 | 9,400 | 2,000 | 100% |" in report
    assert "holds 1.10x the smallest, rank 0 (8,000 MiB)" in report


def test_a_cpu_ddp_stage_s_ranks_are_compared_by_their_processes() -> None:
    ranks = [RankFacts(rank=r, peak_resident_mib=mib) for r, mib in ((0, 900.0), (1, 870.0))]
    run = ladder_run(_ddp_stage(ranks, None), device="cpu")
    (job,) = job_memory(run)
    assert job.device == "cpu" and job.largest is not None and job.largest.rank == 0
    assert not [f for f in evaluate(run) if f.id == "GD401"]


def test_memory_png_draws_each_rank_its_own_line_labelled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[Figure] = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig))
    run = script_run(_rank_stage(0, _flat(1000.0)), _rank_stage(1, _flat(990.0)))
    assert plots.memory_plot(run, tmp_path / "memory.png")
    lines = drawn[0].axes[0].get_lines()
    assert [line.get_label() for line in lines] == [
        "train.py[rank0]: process resident", "train.py[rank1]: process resident"]
    assert lines[0].get_linestyle() != lines[1].get_linestyle()


def test_trace_counters_are_a_process_per_rank() -> None:
    run = script_run(_rank_stage(0, _flat(1000.0)), _rank_stage(1, _flat(990.0)))
    trace = build_trace(run, pd.DataFrame())
    named = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert {f"train.py[rank{r}]: memory at each step's end (MiB)" for r in (0, 1)} <= named
