"""The busiest source lines against the roofline: what each line's operators computed (matmul
FLOPs) and moved (bytes, a floor: gpudiag/measure/evidence/shapes.py) per step, over its
device time, against the GPU's matmul rate in the stage's matmul dtype and its memory
bandwidth (gpudiag/diagnose/ceilings.py). A line's roof is the lower of the two at its
arithmetic intensity (FLOPs per byte); its share of the roof is then the larger of
achieved/peak FLOP/s and achieved/peak bytes/s (Williams, Waterman and Patterson, "Roofline",
CACM 2009)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpudiag.diagnose.ceilings import bandwidth, ceiling
from gpudiag.model.results import RunResult, StageResult

TOP_LINES = 5


@dataclass
class LineRoofline:
    location: str
    device_ms: float  # per step (on a CPU: its operators' time)
    tflops: float | None  # achieved; None where the line ran no counted matmul
    gbps: float | None  # achieved, at least (bytes are a floor); None: no shapes recorded
    flops_per_byte: float | None
    bound: Literal["compute", "memory"] | None  # which roof holds it; None without peaks
    of_roof: float | None  # its share of that roof


@dataclass
class Roofline:
    dtype: str | None  # the stage's matmul dtype, whose peak the FLOP/s are held against
    peak_tflops: float | None
    peak_gbps: float | None
    source: str  # where the peaks come from
    lines: list[LineRoofline]


def _matmul_dtype(stage: StageResult) -> str | None:
    """The dtype most matmul time ran in; None when not recorded (a compiled model's)."""
    by_dtype = stage.evidence.matmul_ms_by_dtype if stage.evidence else {}
    known = {k: v for k, v in by_dtype.items() if k != "unknown"}
    return max(known, key=lambda k: known[k]) if known else None


def roofline(run: RunResult, stage: StageResult) -> Roofline | None:
    """The stage's busiest lines by device time; rates where the line's shapes were recorded
    (a compiled kernel's line has its time, not its shapes)."""
    ev = stage.evidence
    if ev is None:
        return None
    dtype = _matmul_dtype(stage)
    peak_tflops, flops_from = (ceiling(run, dtype) if ev.backend == "cuda" and dtype
                               else (None, None))
    peak_gbps, bytes_from = bandwidth(run) if ev.backend == "cuda" else (None, None)
    lines = []
    busiest = sorted(ev.line_counts, key=lambda c: -sum(c.kind_ms.values()))
    for count in busiest:
        ms = sum(count.kind_ms.values())
        if ms <= 0:
            break
        seconds = ms / 1e3
        tflops = count.flops / seconds / 1e12 if count.flops else None
        # No bytes recorded: a compiled kernel's line (Inductor's provenance; no shapes).
        gbps = count.bytes / seconds / 1e9 if count.bytes else None
        compute = tflops / peak_tflops if tflops and peak_tflops else 0.0
        memory = gbps / peak_gbps if gbps and peak_gbps else None
        bound: Literal["compute", "memory"] | None = (
            None if memory is None else "compute" if compute > memory else "memory")
        lines.append(LineRoofline(
            location=count.location, device_ms=ms, tflops=tflops, gbps=gbps,
            flops_per_byte=count.flops / count.bytes if count.flops and count.bytes else None,
            bound=bound, of_roof=None if memory is None else max(compute, memory)))
        if len(lines) == TOP_LINES:
            break
    sources = {s for s in (flops_from, bytes_from) if s}
    return Roofline(dtype=dtype, peak_tflops=peak_tflops, peak_gbps=peak_gbps,
                    source=" and ".join(sorted(sources)) or "none", lines=lines)
