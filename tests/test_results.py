"""run.json: the contract in gpudiag/model/results.py, a lossless round trip, and clear errors
on bad files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import ladder_config

from gpudiag.model.results import (
    SCHEMA_VERSION,
    Env,
    Finding,
    MemoryStats,
    RunFileError,
    RunResult,
    StageResult,
    TelemetrySummary,
    TimingStats,
    load_run,
    save_run,
)


def _run() -> RunResult:
    times = [50.0, 51.0, 49.0, 52.0, 50.5]
    stage = StageResult(
        name="train-fp16", status="ok", title="t", ms_per_iter=50.5, samples_per_s=2534.6,
        iter_ms=times, timing=TimingStats.of(times), samples_per_step=128,
        memory=MemoryStats(peak_allocated_mib=11000.0, peak_reserved_mib=12000.0),
        telemetry=TelemetrySummary(available=True, energy_j=1000.0, power_mean_w=550.0,
                                   gpm={"sm_active_pct": 65.0}, throttle_share={"power_cap": 0.1}),
        phases_ms={"forward": [17.0, 17.5]},
    )
    failed = StageResult(name="full-loop", status="error", error="out of device memory",
                         advice="lower --batch-size")
    return RunResult(tool_version="0.1.0", env=Env(device="cuda:0", gpu_name="H100"),
                     config=ladder_config(batch_size=128), stages=[stage, failed],
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
    run.stages[0].samples_per_s = math.inf
    save_run(run, tmp_path / "run.json")
    assert json.loads((tmp_path / "run.json").read_text())["stages"][0]["samples_per_s"] is None


def test_unknown_keys_are_ignored(tmp_path: Path) -> None:
    data = _run().to_dict()
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
