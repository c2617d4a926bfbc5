"""The run directory's derived files: trace.json from recorded runs, and `gpudiag report`."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

from conftest import invoke, script_run

from gpudiag.model.runfile import load_run
from gpudiag.present.files import read_samples
from gpudiag.present.trace import build_trace

EXAMPLES = Path(__file__).resolve().parent.parent / "reports" / "examples"


def test_trace_of_a_recorded_h100_run() -> None:
    run_dir = EXAMPLES / "h100-checkpoint"
    run = load_run(run_dir)
    trace = build_trace(run, read_samples(run_dir))
    events = trace["traceEvents"]
    stages = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    assert [e["name"] for e in stages] == [s.name for s in run.stages]
    steps = [e for e in events if e["ph"] == "X" and e["tid"] == 2]
    assert len(steps) == sum(len(s.iter_ms) for s in run.stages)
    power = [e for e in events if e["ph"] == "C" and e["name"] == "power W"]
    assert len(power) > 100 and all(e["args"]["power W"] > 0 for e in power)
    assert {e["name"] for e in events if e["ph"] == "i"} >= {"GD701 critical"}
    # Steps lie inside their stage's slice (the window opens just before the first step).
    first = stages[1]
    sync_steps = [e for e in steps if e["name"].startswith("checkpoint-sync ")]
    assert first["ts"] <= sync_steps[0]["ts"] < first["ts"] + first["dur"]
    json.dumps(trace)  # serialisable as is


def test_report_rerenders_a_saved_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(EXAMPLES / "h100-checkpoint", run_dir)
    (run_dir / "report.md").unlink()
    result = invoke(["report", str(run_dir), "--rules"])
    assert result.exit_code == 0, result.output
    text = (run_dir / "report.md").read_text()
    assert "checkpoint-sync" in text and "[trace.json](trace.json)" in text
    trace = json.loads((run_dir / "trace.json").read_text())
    assert any(e["ph"] == "C" for e in trace["traceEvents"])
    assert invoke(["report", str(tmp_path / "none")]).exit_code == 2


def test_cpu_run_trace_is_laid_out_from_wall_times(tmp_path: Path) -> None:
    result = invoke(["run", "--device", "cpu", "--preset", "tiny", "--stages",
                                 "infer,train-fp16", "--iters", "3", "--evidence-steps", "0",
                                 "--quiet", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace["otherData"]["clock"].startswith("approximate")
    stages = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 1]
    assert [e["name"] for e in stages] == ["infer", "train-fp16"]
    assert stages[1]["ts"] >= stages[0]["ts"] + stages[0]["dur"]


def test_plots_from_a_recorded_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(EXAMPLES / "h100-checkpoint", run_dir)
    for png in run_dir.glob("*.png"):
        png.unlink()
    result = invoke(["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    text = (run_dir / "report.md").read_text()
    for name in ("throughput.png", "timeline.png", "step-times.png"):
        png = run_dir / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert f"]({name})" in text


def test_cpu_run_draws_what_it_has(tmp_path: Path) -> None:
    """No telemetry on a CPU: throughput and step times, no timeline, and no broken links."""
    result = invoke(["run", "--device", "cpu", "--preset", "tiny", "--stages",
                                 "train-fp16", "--iters", "4", "--evidence-steps", "0",
                                 "--quiet", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "report.md").read_text()
    assert (tmp_path / "throughput.png").is_file() and "](throughput.png)" in text
    assert not (tmp_path / "timeline.png").exists() and "timeline.png" not in text


def test_profiler_windows_are_kept_as_traces(tmp_path: Path) -> None:
    result = invoke(["run", "--device", "cpu", "--preset", "tiny", "--stages",
                                 "train-fp16", "--iters", "3", "--evidence-steps", "1",
                                 "--quiet", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    with gzip.open(tmp_path / "profile-train-fp16.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name") == "gpudiag.step" for e in events)
    assert any(str(e.get("name", "")).startswith("gpudiag.src|") for e in events)
    assert "profile-<stage>.json.gz" in (tmp_path / "report.md").read_text()


def test_a_diagnosis_without_evidence_is_no_clean_bill_of_health() -> None:
    """"No rule saw a material cost" only where every stage that was to run ran and was seen:
    a stage without a window, or one that failed (a script too short for a timed step), says
    the diagnosis could not see it; a stage skipped by design (ddp on one GPU) does not."""
    from gpudiag.model.results import StageResult
    from gpudiag.present.findings import diagnosis_markdown

    def said(*stages: StageResult) -> str:
        return "\n".join(diagnosis_markdown(script_run(*stages)))

    seen = StageResult(name="train.py", status="ok", iter_ms=[10.0] * 30)
    skipped = StageResult(name="ddp", status="skipped", error="needs 2 GPUs")
    assert "no rule saw a material cost" in said(seen, skipped)
    unseen = StageResult(name="train.py", status="ok", iter_ms=[10.0] * 30)
    unseen.facts.evidence_missing = "the script ended after 12 steps, before the window"
    failed = StageResult(name="train.py", status="error",
                         error="no timed steps: the script made 4 step(s)")
    for stage, why in ((unseen, "the script ended after 12 steps"),
                       (failed, "the stage failed (no timed steps: the script made 4 step(s))")):
        text = said(stage)
        assert "no rule saw a material cost" not in text and "not a clean bill" in text
        assert f"No evidence for train.py: {why}" in text
