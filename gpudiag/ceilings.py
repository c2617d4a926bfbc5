"""What this GPU can do, and how much of it a stage uses: FLOPs per step, achieved TFLOP/s, MFU.

FLOPs are counted by torch's FlopCounterMode over one real step (after timing, beside the
evidence window); within ~1% of the analytic count on CUDA (TELEMETRY.md). On a CPU the
attention kernel goes uncounted, so CPU figures are a lower bound. MFU is the achieved rate over
a ceiling in the stage's compute dtype: the `peak` stage's measured matmul rate when the run
has one, else the datasheet figure for a known GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpudiag.results import RunResult, StageResult

# Dense datasheet peaks (TFLOP/s, FP32 accumulate) by GPU name fragment (TELEMETRY.md).
DATASHEET_TFLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 495.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 495.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "RTX 4090": {"bf16": 165.0, "fp16": 165.0, "tf32": 82.6, "fp32": 82.6},
}
PEAK_STAGE = "peak"


def count_flops(step: Callable[[], object]) -> int:
    """FLOPs of one call of `step` (forward and backward as run)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return int(counter.get_total_flops())


def compute_dtype(details: dict[str, Any], tf32: bool) -> str:
    """The matmul dtype a stage's precision implies: bf16/fp16 under autocast, else fp32 or
    tf32 (when TF32 matmuls are allowed)."""
    precision = str(details.get("precision") or "fp32")
    if precision.startswith(("fp16", "bf16")):
        return precision[:4]
    return "tf32" if tf32 else "fp32"


def datasheet_tflops(gpu_name: str | None, dtype: str) -> float | None:
    if not gpu_name:
        return None
    for fragment, peaks in DATASHEET_TFLOPS.items():
        if fragment in gpu_name:
            return peaks.get(dtype)
    return None


def ceiling(run: RunResult, dtype: str) -> tuple[float | None, str | None]:
    """(TFLOP/s, where it comes from) for `dtype`: measured by the peak stage, else datasheet."""
    peak = run.stage(PEAK_STAGE)
    if peak is not None and peak.ok:
        measured = peak.details.get("matmul_tflops", {}).get(dtype)
        if measured:
            return float(measured), "measured"
    sheet = datasheet_tflops(run.env.gpu_name, dtype)
    return (sheet, "datasheet") if sheet else (None, None)


def utilisation(run: RunResult, stage: StageResult) -> dict[str, Any] | None:
    """Achieved TFLOP/s of a timed stage and its MFU against the ceiling, or None."""
    flops = stage.details.get("flops_per_step")
    if not flops or not stage.ms_per_iter:
        return None
    achieved = flops / (stage.ms_per_iter / 1e3) / 1e12
    dtype = compute_dtype(stage.details, bool(run.env.tf32_matmul))
    peak, source = ceiling(run, dtype)
    return {"tflops": achieved, "dtype": dtype, "ceiling_tflops": peak, "ceiling": source,
            "mfu": achieved / peak if peak else None}
