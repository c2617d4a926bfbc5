"""The ladder on the tiny preset: every stage runs, is timed, and carries telemetry."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import EXAMPLES, ladder_run, tiny_config

from gpudiag.measure.runner import RunOutput, run_stages
from gpudiag.measure.stages import DEFAULT_LADDER
from gpudiag.measure.telemetry.fake import fake_spec
from gpudiag.model.runfile import load_run
from gpudiag.present import render_markdown, write_run_dir

TRAINING_STAGES = ("train", "train-fp16", "data-train", "full-loop", "full-vectorized")


def test_every_ladder_stage_runs(tiny_ladder: RunOutput) -> None:
    run = tiny_ladder.run
    assert [s.name for s in run.stages] == list(DEFAULT_LADDER)
    for stage in run.stages:
        assert stage.status == "ok", (stage.name, stage.error, stage.traceback)
        assert len(stage.iter_ms) >= 4 and len(stage.warmup_ms) == 1
        assert stage.ms_per_iter and stage.ms_per_iter > 0
        assert stage.samples_per_s == pytest.approx(8 / stage.ms_per_iter * 1e3)
        assert stage.timer == "host-clock"
    assert not run.interrupted and run.duration_s


def test_training_stages_split_their_steps(tiny_ladder: RunOutput) -> None:
    for name in TRAINING_STAGES:
        stage = tiny_ladder.run.stage(name)
        assert stage is not None
        assert {"forward", "backward", "optimizer"} <= stage.phases_ms.keys()
        assert all(len(v) == len(stage.iter_ms) for v in stage.phases_ms.values())
    data_train = tiny_ladder.run.stage("data-train")
    assert data_train is not None and "data_wait" in data_train.phases_ms


def test_each_stage_carries_the_role_it_was_registered_with(tiny_ladder: RunOutput) -> None:
    """Rules and renderers find the reference and the loader-only stage by role, not name."""
    roles = {s.name: s.role for s in tiny_ladder.run.stages}
    assert roles["train-fp16"] == "reference" and roles["dataloader"] == "loader"
    assert {r for n, r in roles.items() if n not in ("train-fp16", "dataloader")} == {"step"}
    assert tiny_ladder.run.stage_in_role("reference") is tiny_ladder.run.stage("train-fp16")


def test_runs_from_before_roles_get_them_from_the_built_in_names(tmp_path: Path) -> None:
    data = json.loads((EXAMPLES / "h100-dgca" / "run.json").read_text())
    assert data["schema_version"] == 1 and "role" not in data["stages"][0]
    (tmp_path / "run.json").write_text(json.dumps(data))
    run = load_run(tmp_path)
    assert {s.name: s.role for s in run.stages if s.role != "step"} == {
        "train-fp16": "reference", "dataloader": "loader"}


def test_dataloader_stage_reports_its_configuration(tiny_ladder: RunOutput) -> None:
    stage = tiny_ladder.run.stage("dataloader")
    assert stage is not None
    assert stage.facts.loader is not None
    assert stage.facts.loader.num_workers == 1 and stage.facts.loader.pin_memory is False
    assert stage.facts.step_statistic == "mean"


def test_stages_carry_fake_gpu_telemetry(tiny_ladder: RunOutput) -> None:
    for stage in tiny_ladder.run.stages:
        t = stage.telemetry
        assert t.available and t.energy_source == "counter"
        assert t.power_mean_w == pytest.approx(250.0, rel=0.01)
        assert stage.energy_per_sample_j is not None
    assert tiny_ladder.run.env.nvml == "available"
    labels = set(tiny_ladder.samples["stage"])
    # Stages shorter than the 50 ms sampling period may get no row; the long ones do.
    assert labels <= {"", *DEFAULT_LADDER} and "full-loop" in labels


def test_stage_names_and_workloads_are_described(tiny_ladder: RunOutput) -> None:
    loop = tiny_ladder.run.stage("full-loop")
    assert loop is not None and "prompt: loop" in loop.workload
    assert "BertForMaskedLM" in (tiny_ladder.run.stage("infer") or loop).workload


def test_run_directory_round_trip(tiny_ladder: RunOutput, tmp_path: Path) -> None:
    write_run_dir(tmp_path, tiny_ladder.run, tiny_ladder.samples)
    assert load_run(tmp_path) == tiny_ladder.run
    samples = pd.read_csv(tmp_path / "samples.csv")
    assert {"t_s", "stage", "power_instant_w"} <= set(samples.columns)
    report = (tmp_path / "report.md").read_text()
    drawn = [p for p in ("throughput.png", "timeline.png", "step-times.png")
             if (tmp_path / p).is_file()]
    assert drawn and report == render_markdown(tiny_ladder.run, drawn)
    for name in DEFAULT_LADDER:
        assert f"| {name} |" in report
    assert "## How it was measured" in report and "## Environment" in report


def test_bert_has_no_prompt_variants() -> None:
    output = run_stages(tiny_config("bert", stages=["full-loop"]))
    full_loop = output.run.stage("full-loop")
    assert full_loop is not None and full_loop.status == "skipped"
    assert "no 'loop' variant" in (full_loop.error or "")
    assert not full_loop.telemetry.available


FAILING_MODEL = '''
import torch
from gpudiag.measure.models import ModelBundle

class Exploding(torch.nn.Module):
    def __init__(self, error):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.error = error

    def forward(self, x):
        if self.training:
            raise self.error
        return {"loss": self.lin(x).sum()}

def bundle(error):
    return ModelBundle(model=Exploding(error), make_example=lambda i: {"x": torch.ones(4)})

def shape_error(options):
    return bundle(RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x4 and 5x1)\\nmore"))

def oom(options):
    return bundle(torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB"))
'''


@pytest.mark.parametrize(("factory", "error", "advice"), [
    ("shape_error", "RuntimeError: mat1 and mat2 shapes cannot be multiplied", "traceback"),
    ("oom", "out of device memory: CUDA out of memory. Tried to allocate 2.00 GiB",
     "--batch-size (now 8)"),
])
def test_a_failing_stage_is_recorded_and_the_rest_still_run(
        tmp_path: Path, factory: str, error: str, advice: str) -> None:
    path = tmp_path / "failing.py"
    path.write_text(FAILING_MODEL)
    output = run_stages(tiny_config(f"{path}:{factory}", stages=["train", "infer"]))
    train, infer = output.run.stages
    assert train.status == "error" and train.error is not None
    assert train.error.startswith(error) and "\n" not in train.error
    assert advice in (train.advice or "") and train.traceback
    assert infer.ok


def test_step_times_use_cuda_events_on_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    output = run_stages(tiny_config(device="cuda", stages=["train"]))
    assert output.run.stage("train").timer == "cuda-events"  # type: ignore[union-attr]


def test_unavailable_telemetry_does_not_stop_the_run() -> None:
    """(And the caller's objects leave the cyclic collector's view only while stages run.)"""
    frozen: list[int] = []
    output = run_stages(tiny_config(stages=["infer"]),
                        telemetry_spec=fake_spec(unavailable="no NVIDIA driver"),
                        on_stage_done=lambda _: frozen.append(gc.get_freeze_count()))
    assert frozen and all(count > 10_000 for count in frozen) and gc.get_freeze_count() == 0
    stage = output.run.stages[0]
    assert stage.ok and not stage.telemetry.available
    assert stage.telemetry.reason == "no NVIDIA driver"
    assert output.run.env.nvml == "unavailable: no NVIDIA driver"


def test_a_stop_while_the_run_waits_for_a_window_says_so_on_its_stage() -> None:
    """A Ctrl-C while the run waits for a window's reading: the run is interrupted, the reader
    abandoned, and that stage says its trace was not read (it does not lose the reading)."""
    from gpudiag.measure.evidence.reader import WindowRead, WindowReader
    from gpudiag.measure.runner import _Session
    from gpudiag.model.results import StageResult

    class Interrupted:
        """A reading whose first wait is cut by a stop; then the reader's abandoned answer."""

        waits = 0

        def done(self) -> bool:
            return False

        def result(self) -> WindowRead:
            Interrupted.waits += 1
            if Interrupted.waits == 1:
                raise KeyboardInterrupt
            return WindowRead(None, error="the run was interrupted before its trace was read")

    run = ladder_run(device="cpu", config=tiny_config())
    stage = StageResult(name="train", status="ok", iter_ms=[1.0] * 4)
    session = _Session(run, None, None, None, lambda: None,  # type: ignore[arg-type]
                       reader=WindowReader())
    session.readings.append((stage, Interrupted()))  # type: ignore[arg-type]
    session.finish_reading()
    assert run.interrupted and not session.readings and stage.evidence is None
    assert stage.facts.evidence_missing == ("the profiler window failed: the run was "
                                            "interrupted before its trace was read")
