"""How much of what this GPU can do a stage uses: achieved TFLOP/s and MFU.

FLOPs per step are measured beside the evidence window (gpudiag.measure.flops). MFU is the
achieved rate over a ceiling in the stage's compute dtype: the `peak` stage's measured matmul
rate when the run has one, else the datasheet figure for a known GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpudiag.model.hardware import datasheet_gbps, datasheet_tflops

if TYPE_CHECKING:
    from gpudiag.model.results import RunResult, StageResult


def compute_dtype(precision: str | None, tf32: bool) -> str:
    """The matmul dtype a stage's precision implies: bf16/fp16 under autocast, else fp32 or
    tf32 (when TF32 matmuls are allowed)."""
    precision = precision or "fp32"
    if precision.startswith(("fp16", "bf16")):
        return precision[:4]
    return "tf32" if tf32 else "fp32"


def ceiling(run: RunResult, dtype: str) -> tuple[float | None, str | None]:
    """(TFLOP/s, where it comes from) for `dtype`: measured by the peak stage, else datasheet."""
    peak = run.stage_in_role("ceiling")
    if peak is not None and peak.ok and peak.facts.peak is not None:
        measured = peak.facts.peak.matmul_tflops.get(dtype)
        if measured:
            return float(measured), "measured"
    sheet = datasheet_tflops(run.env.gpu_name, dtype)
    return (sheet, "datasheet") if sheet else (None, None)


def utilisation(run: RunResult, stage: StageResult) -> dict[str, Any] | None:
    """Achieved TFLOP/s of a timed stage and its MFU against the ceiling, or None."""
    flops = stage.facts.flops_per_step
    if not flops or not stage.ms_per_iter:
        return None
    achieved = flops / (stage.ms_per_iter / 1e3) / 1e12
    dtype = compute_dtype(stage.facts.precision, bool(run.env.tf32_matmul))
    peak, source = ceiling(run, dtype)
    return {"tflops": achieved, "dtype": dtype, "ceiling_tflops": peak, "ceiling": source,
            "mfu": achieved / peak if peak else None}


def bandwidth(run: RunResult) -> tuple[float | None, str | None]:
    """(GB/s, where it comes from): the peak stage's device copy, else the datasheet."""
    peak = run.stage_in_role("ceiling")
    if peak is not None and peak.ok and peak.facts.peak is not None and peak.facts.peak.copy_gbps:
        return float(peak.facts.peak.copy_gbps), "measured"
    sheet = datasheet_gbps(run.env.gpu_name)
    return (sheet, "datasheet") if sheet else (None, None)
