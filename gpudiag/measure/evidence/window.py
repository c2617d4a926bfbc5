"""The evidence window: a few extra steps under torch.profiler, after the timed steps.

Profiling every step would cost a third or more of the step time (REFERENCE.md: +33%, +66% with
stacks), so it never overlaps the timed steps; its own step time is recorded, and its ratio to
the timed median is the window's overhead.
"""

from __future__ import annotations

import gzip
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from gpudiag.measure.evidence.source import SourceAnnotator
from gpudiag.measure.evidence.trace import STEP_RANGE, analyze
from gpudiag.measure.timing import synchronize
from gpudiag.model.results import Evidence


def capture_trace(step: Callable[[], object], *, device: torch.device,
                  steps: int) -> tuple[list[dict[str, Any]], float]:
    """Profile `steps` steps; return the trace events and the mean profiled step time (ms)."""
    with SourceAnnotator():
        step()  # one untraced step with the annotator: its caches and first-call costs
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            with record_function(STEP_RANGE), SourceAnnotator():
                step()
        synchronize(device)
        step_ms = (time.perf_counter() - start) * 1e3 / steps
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return events, step_ms


def collect_evidence(step: Callable[[], object], *, device: torch.device, steps: int,
                     timed_step_ms: float | None, save_to: Path | None = None) -> Evidence:
    """The window's evidence; with `save_to`, its Chrome trace too (gzipped JSON, which
    ui.perfetto.dev and chrome://tracing open as is)."""
    events, step_ms = capture_trace(step, device=device, steps=steps)
    if save_to is not None:
        with gzip.open(save_to, "wt") as f:
            json.dump({"traceEvents": events}, f)
    return analyze(events, steps=steps, step_ms=step_ms,
                   backend="cuda" if device.type == "cuda" else "cpu",
                   timed_step_ms=timed_step_ms)
