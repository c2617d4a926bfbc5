"""Ceilings: FLOP counts against hand-computed values, MFU against measured and datasheet
peaks, and the peak stage on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import invoke, ladder_run

from gpudiag.diagnose.ceilings import compute_dtype, utilisation
from gpudiag.measure.flops import count_flops
from gpudiag.measure.plan import cpu_bf16_native
from gpudiag.model.facts import PeakFacts, StageFacts
from gpudiag.model.hardware import datasheet_tflops
from gpudiag.model.results import Env, RunResult, StageResult
from gpudiag.model.runfile import load_run


def test_flops_of_a_linear_layer_by_hand() -> None:
    """y = x W^T: forward 2*B*I*O; backward for W alone (x needs no grad) 2*B*I*O more."""
    batch, fan_in, fan_out = 8, 64, 32
    layer = torch.nn.Linear(fan_in, fan_out, bias=False)
    x = torch.randn(batch, fan_in)
    forward = 2 * batch * fan_in * fan_out
    assert count_flops(lambda: layer(x)) == forward
    assert count_flops(lambda: layer(x).sum().backward()) == 2 * forward
    x.requires_grad_(True)
    assert count_flops(lambda: layer(x).sum().backward()) == 3 * forward


def test_flops_of_a_two_layer_mlp_step() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    x = torch.randn(10, 16)
    # Layer 1: forward + weight grad (its input needs no grad); layer 2: forward, weight grad
    # and input grad.
    expected = 2 * (2 * 10 * 16 * 32) + 3 * (2 * 10 * 32 * 4)
    assert count_flops(lambda: model(x).sum().backward()) == expected


def _run(gpu: str | None, flops: float, ms: float, precision: str,
         peak: dict[str, float] | None = None) -> RunResult:
    stage = StageResult(name="train-fp16", status="ok", iter_ms=[ms] * 5,
                        facts=StageFacts(flops_per_step=flops, precision=precision))
    stages = [stage]
    if peak is not None:
        stages.append(StageResult(name="peak", status="ok", role="ceiling",
                                  facts=StageFacts(peak=PeakFacts(
            matmul_n=8192, matmul_tflops=peak, copy_gbps=3000.0, copy_bytes=2**30))))
    return ladder_run(*stages, env=Env(device="cuda", gpu_name=gpu, tf32_matmul=False))


def test_mfu_against_measured_then_datasheet_peaks() -> None:
    run = _run("NVIDIA H100 80GB HBM3", 33e12, 100.0, "fp16-autocast")  # 330 TFLOP/s
    use = utilisation(run, run.stages[0])
    assert use is not None and use["tflops"] == pytest.approx(330.0)
    assert use["ceiling"] == "datasheet" and use["mfu"] == pytest.approx(330 / 989)
    measured = _run("NVIDIA H100 80GB HBM3", 33e12, 100.0, "fp16-autocast",
                    peak={"fp16": 800.0})
    use = utilisation(measured, measured.stages[0])
    assert use is not None and use["ceiling"] == "measured"
    assert use["mfu"] == pytest.approx(330 / 800)
    unknown = _run("Some GPU", 33e12, 100.0, "fp16-autocast")
    assert utilisation(unknown, unknown.stages[0])["mfu"] is None  # type: ignore[index]


def test_compute_dtype_and_datasheet() -> None:
    assert compute_dtype("bf16-autocast", tf32=False) == "bf16"
    assert compute_dtype("fp32", tf32=True) == "tf32"
    assert compute_dtype(None, tf32=False) == "fp32"
    assert datasheet_tflops("NVIDIA H200", "tf32") == 495.0
    assert datasheet_tflops(None, "fp16") is None


@pytest.mark.slow
def test_peak_stage_and_mfu_on_a_cpu_run(tmp_path: Path) -> None:
    result = invoke(["run", "--no-plots", "--device", "cpu", "--preset", "tiny", "--stages",
                                 "peak,train-fp16", "--iters", "4", "--evidence-steps", "1",
                                 "--quiet", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    run = load_run(tmp_path)
    peak = run.stage("peak")
    assert peak is not None and peak.ok
    assert peak.facts.peak is not None
    rates = peak.facts.peak.matmul_tflops
    assert set(rates) == {"fp32", "tf32", "fp16", "bf16"} and all(v > 0 for v in rates.values())
    assert peak.facts.peak.copy_gbps > 0
    train = run.stage("train-fp16")
    assert train is not None and (train.facts.flops_per_step or 0) > 0
    use = utilisation(run, train)
    dtype = "bf16" if cpu_bf16_native() else "fp32"  # the CPU's mixed precision
    assert use is not None and use["ceiling"] == "measured" and use["dtype"] == dtype
    assert f"of measured {dtype} peak" in (tmp_path / "report.md").read_text()
