"""run.json: the contract in gpudiag/model/results.py, a lossless round trip, and clear errors
on bad files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import ladder_config, ladder_run

from gpudiag.model.results import (
    SCHEMA_VERSION,
    Finding,
    MemoryStats,
    RunResult,
    StageResult,
    TelemetrySummary,
    TimingStats,
)
from gpudiag.model.runfile import RunFileError, load_run, save_run, to_jsonable


def _run() -> RunResult:
    times = [50.0, 51.0, 49.0, 52.0, 50.5]
    stage = StageResult(
        name="train-fp16", status="ok", title="t", iter_ms=times, samples_per_step=128,
        memory=MemoryStats(peak_allocated_mib=11000.0, peak_reserved_mib=12000.0),
        telemetry=TelemetrySummary(available=True, energy_j=1000.0, power_mean_w=550.0,
                                   gpm={"sm_active_pct": 65.0}, throttle_share={"power_cap": 0.1}),
        phases_ms={"forward": [17.0, 17.5]},
    )
    failed = StageResult(name="full-loop", status="error", error="out of device memory",
                         advice="lower --batch-size")
    return ladder_run(stage, failed, device="cuda:0", gpu="H100",
                      config=ladder_config(batch_size=128),
                      findings=[Finding(id="GD101", rule="python-loop-launches",
                                        severity="warning", stage="full-loop", title="x",
                                        evidence={"ops_per_step": 5000}, impact=0.6,
                                        location="dgca.py:119", fix="vectorize")])


def test_round_trip_is_lossless(tmp_path: Path) -> None:
    run = _run()
    save_run(run, tmp_path / "run.json")
    assert load_run(tmp_path) == run
    assert load_run(tmp_path / "run.json") == run


def test_contract_fields_present(tmp_path: Path) -> None:
    save_run(_run(), tmp_path / "run.json")
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert {"tool_version", "env", "config", "stages", "findings"} <= data.keys()
    stage = data["stages"][0]
    contract = {"name", "status", "ms_per_iter", "samples_per_s", "iter_ms", "telemetry"}
    assert contract <= stage.keys()
    assert stage["energy_per_sample_j"] == pytest.approx(1000.0 / (128 * 5))
    assert stage["timing"]["iqr_ms"] == pytest.approx(stage["timing"]["p75_ms"]
                                                     - stage["timing"]["p25_ms"])
    assert data["stages"][1]["error"] == "out of device memory"
    assert {"id", "rule", "severity", "stage", "title", "evidence", "impact", "location",
            "fix"} <= data["findings"][0].keys()


def test_non_finite_numbers_become_null(tmp_path: Path) -> None:
    run = _run()
    run.stages[0].wall_s = math.inf
    save_run(run, tmp_path / "run.json")
    assert json.loads((tmp_path / "run.json").read_text())["stages"][0]["wall_s"] is None


def test_unknown_keys_are_ignored(tmp_path: Path) -> None:
    data = to_jsonable(_run())
    data["stages"][0]["a_future_field"] = 1
    (tmp_path / "run.json").write_text(json.dumps(data))
    assert load_run(tmp_path).stages[0].name == "train-fp16"


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such file"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a gpudiag run"),
    ('{"schema_version": 99}', "schema_version 99"),
    ('{"schema_version": 1, "env": {"device": "cpu"}, "config": {}}',
     "tool_version: field required"),
])
def test_bad_files_raise_one_line_errors(tmp_path: Path, content: str | None,
                                         message: str) -> None:
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(RunFileError, match=message) as info:
        load_run(path)
    assert "\n" not in str(info.value)


def test_timing_stats_are_robust() -> None:
    stats = TimingStats.of([10.0, 10.0, 10.0, 10.0, 100.0])
    assert stats.median_ms == 10.0 and stats.mad_ms == 0.0 and stats.max_ms == 100.0
    assert TimingStats.of([5.0]).iqr_ms == 0.0
    with pytest.raises(ValueError):
        TimingStats.of([])


def test_a_stages_summaries_follow_its_steps() -> None:
    """Time per step, throughput and the timing summary are derived from the steps: change the
    steps and every figure follows (nothing stored can contradict them)."""
    stage = StageResult(name="s", status="ok", iter_ms=[10.0, 12.0, 11.0], samples_per_step=8,
                        tokens_per_step=512)
    assert stage.ms_per_iter == 11.0 and stage.samples_per_s == pytest.approx(8 / 11.0 * 1e3)
    assert stage.tokens_per_s == pytest.approx(512 / 11.0 * 1e3)
    stage.iter_ms = [20.0, 22.0, 21.0, 100.0]
    assert stage.ms_per_iter == 21.5 and stage.samples_per_s == pytest.approx(8 / 21.5 * 1e3)
    assert stage.timing == TimingStats.of([20.0, 22.0, 21.0, 100.0])
    stage.facts.bursty = True  # a prefetching loader: the mean
    assert stage.ms_per_iter == pytest.approx(163.0 / 4)
    stage.iter_ms = []
    assert stage.ms_per_iter is None and stage.samples_per_s is None and stage.timing is None


def test_merged_trials_and_the_ceiling_stage_summarise_what_they_hold() -> None:
    """Merged runs: the medians over their trials. The ceiling stage times no step: its figures
    are of the bf16 matmuls it repeats, which stay out of iter_ms."""
    from gpudiag.model.facts import PeakFacts, StageFacts
    from gpudiag.model.results import Trial

    stage = StageResult(name="s", status="ok", iter_ms=[10.0] * 5, samples_per_step=8, trials=[
        Trial(ms_per_iter=ms, iters=5, samples_per_step=8) for ms in (10.0, 12.0, 16.0)])
    assert stage.ms_per_iter == 12.0 and stage.samples_per_s == pytest.approx(8 / 12.0 * 1e3)
    assert stage.trials[2].samples_per_s == pytest.approx(500.0)
    peak = StageResult(name="peak", status="ok", role="ceiling", facts=StageFacts(
        peak=PeakFacts(matmul_n=8192, matmul_tflops={"bf16": 700.0}, copy_gbps=3000.0,
                       copy_bytes=2**30, bf16_matmul_ms=[1.5, 1.6, 1.7])))
    assert peak.iter_ms == [] and peak.ms_per_iter == 1.6 and peak.samples_per_s is None
    assert peak.timing is not None and peak.timing.n == 3


def test_derived_figures_in_a_file_are_written_and_not_read(tmp_path: Path) -> None:
    """run.json holds ms_per_iter, samples_per_s and timing for its readers; gpudiag derives
    them again from the steps, so a file whose figures disagree with its steps cannot mislead
    it (before, such a file was refused)."""
    data = to_jsonable(_run())
    stage = data["stages"][0]
    assert stage["ms_per_iter"] == 50.5 and stage["samples_per_s"] == pytest.approx(128 / 0.0505)
    stage.update(ms_per_iter=30.0, samples_per_s=1.0, timing={"n": 1})
    (tmp_path / "run.json").write_text(json.dumps(data))
    loaded = load_run(tmp_path).stages[0]
    assert loaded.ms_per_iter == 50.5 and loaded.samples_per_s == pytest.approx(128 / 0.0505)


def test_a_schema_3_trial_takes_its_samples_per_step_from_its_stage(tmp_path: Path) -> None:
    data = to_jsonable(_run())
    data["schema_version"] = 3
    data["stages"][0]["trials"] = [{"samples_per_s": 128 / 0.0505, "ms_per_iter": 50.5,
                                    "iters": 5, "device_ms": None}]
    (tmp_path / "run.json").write_text(json.dumps(data))
    (trial,) = load_run(tmp_path).stages[0].trials
    assert trial.samples_per_step == 128 and trial.samples_per_s == pytest.approx(128 / 0.0505)
