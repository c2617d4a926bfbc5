"""trace.json: the run as a Chrome/Perfetto trace (chrome://tracing, ui.perfetto.dev).

Stages and their timed steps as slices, telemetry as counter tracks, findings as instant events,
on one clock: seconds since the sampler started (samples.csv's t_s). A stage's slice spans its
telemetry window; its steps are laid end to end from the window's start (the window opens just
before the first timed step). Without telemetry (a CPU run) stages are laid out one after the
other from their wall times, and the trace says the clock is approximate.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from gpudiag.model.atomic import write_text_atomic
from gpudiag.model.results import RunResult

TRACE_FILE = "trace.json"
PID = 1
MEMORY_PID = 100  # a process per profiled stage: its memory on the script's own clock
TID_STAGES, TID_STEPS, TID_FINDINGS = 1, 2, 3
COUNTERS = {"power_instant_w": "power W", "kernel_active_pct": "kernel-active %",
            "sm_active_pct": "SM active %", "tensor_active_pct": "tensor %",
            "sm_clock_mhz": "SM clock MHz"}


def _windows(run: RunResult, samples: pd.DataFrame) -> tuple[dict[str, tuple[float, float]], bool]:
    """Each stage's (start, end) in seconds, and whether they come from telemetry."""
    spans: dict[str, tuple[float, float]] = {}
    if not samples.empty and {"t_s", "stage"} <= set(samples.columns):
        for name, rows in samples.dropna(subset=["stage"]).groupby("stage"):
            spans[str(name)] = (float(rows["t_s"].min()), float(rows["t_s"].max()))
    if spans:
        return spans, True
    t = 0.0
    for stage in run.stages:
        length = (stage.wall_s or sum(stage.iter_ms) / 1e3) if stage.iter_ms else 0.0
        spans[stage.name] = (t, t + length)
        t += length + 0.1
    return spans, False


def build_trace(run: RunResult, samples: pd.DataFrame) -> dict[str, Any]:
    spans, measured = _windows(run, samples)
    us = 1e6
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": PID, "name": "process_name", "args": {"name": "gpudiag run"}},
        {"ph": "M", "pid": PID, "tid": TID_STAGES, "name": "thread_name",
         "args": {"name": "stages"}},
        {"ph": "M", "pid": PID, "tid": TID_STEPS, "name": "thread_name",
         "args": {"name": "timed steps"}},
        {"ph": "M", "pid": PID, "tid": TID_FINDINGS, "name": "thread_name",
         "args": {"name": "findings"}},
    ]
    for stage in run.stages:
        if stage.name not in spans:
            continue
        start, end = spans[stage.name]
        events.append({"ph": "X", "pid": PID, "tid": TID_STAGES, "name": stage.name,
                       "ts": start * us, "dur": max(end - start, 1e-6) * us,
                       "args": {"status": stage.status, "ms_per_iter": stage.ms_per_iter,
                                "samples_per_s": stage.samples_per_s}})
        offsets = itertools.accumulate(stage.iter_ms, initial=0.0)
        for i, (offset, ms) in enumerate(zip(offsets, stage.iter_ms, strict=False)):
            events.append({"ph": "X", "pid": PID, "tid": TID_STEPS,
                           "name": f"{stage.name} step {i}", "ts": (start + offset / 1e3) * us,
                           "dur": ms * 1e3, "args": {"ms": ms}})
    for finding in run.findings:
        start = spans.get(finding.stage or "", (0.0, 0.0))[0]
        events.append({"ph": "i", "s": "t", "pid": PID, "tid": TID_FINDINGS, "ts": start * us,
                       "name": f"{finding.id} {finding.severity}",
                       "args": {"title": finding.title, "location": finding.location,
                                "fix": finding.fix}})
    if not samples.empty and "t_s" in samples.columns:
        for column, label in COUNTERS.items():
            if column not in samples.columns:
                continue
            for t, value in zip(samples["t_s"], samples[column], strict=True):
                if value is not None and not (isinstance(value, float) and math.isnan(value)):
                    events.append({"ph": "C", "pid": PID, "name": label, "ts": float(t) * us,
                                   "args": {label: float(value)}})
    events += _memory_counters(run)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock": "seconds since the telemetry sampler started" if measured
                          else "approximate: stages laid end to end from their wall times",
                          "gpu": run.env.gpu_name, "created_utc": run.created_utc}}


def _memory_counters(run: RunResult) -> list[dict[str, Any]]:
    """A profiled script's memory at each step's end, as counter tracks of a process of its
    own on the script's clock (from its start, step by step: the timeline's steps, not the
    timed window the stages above are laid out on)."""
    events: list[dict[str, Any]] = []
    for k, stage in enumerate(run.stages):
        script = stage.facts.script
        if script is None or script.memory is None or script.timeline is None:
            continue
        pid = MEMORY_PID + k
        events.append({"ph": "M", "pid": pid, "name": "process_name",
                       "args": {"name": f"{stage.name}: memory at each step's end (MiB)"}})
        memory = script.memory
        ends = itertools.accumulate(script.timeline.step_ms)
        for i, end_ms in enumerate(ends):
            values = {name: series[i] for name, series in (
                ("allocated", memory.allocated_mib), ("reserved", memory.reserved_mib),
                ("peak", memory.peak_mib), ("resident", memory.resident_mib))
                if i < len(series)}
            if values:
                events.append({"ph": "C", "pid": pid, "name": "memory MiB",
                               "ts": end_ms * 1e3, "args": values})
    return events


def write_trace(path: Path, run: RunResult, samples: pd.DataFrame) -> None:
    write_text_atomic(path, json.dumps(build_trace(run, samples)))
