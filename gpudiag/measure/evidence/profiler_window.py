"""The evidence window: a few extra steps under torch.profiler, after the timed steps.

Profiled steps run 2.3-2.8x slower than timed ones on an H100 (docs/performance.md), so the
window never overlaps the timed steps; its own step time is recorded, and its ratio to the timed
median is the window's overhead.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from gpudiag.measure.evidence.reader import Reading, WindowReader
from gpudiag.measure.evidence.source import SourceAnnotator
from gpudiag.measure.evidence.trace import STEP_RANGE, analyze
from gpudiag.measure.evidence.tracefile import collector_paused, parse_trace
from gpudiag.measure.timing import synchronize
from gpudiag.model.profilepart import WindowTrace
from gpudiag.model.results import Evidence


class ProfilerWindow:
    """torch.profiler over a few steps, each inside a STEP_RANGE, with every torch call charged
    to its source line. Steps are marked from outside: `collect_evidence` calls the step
    function itself, `gpudiag profile`'s recorder marks the script's own step boundaries."""

    def __init__(self, device: torch.device, *, annotate: bool = True,
                 budget_s: float | None = None) -> None:
        self.device = device
        # The host time after which no further step is profiled (at least one is); None: as
        # many as the caller steps (model/config.py, WINDOW_BUDGET_S).
        self.budget_s = budget_s
        # Off under torch.compile: the annotator is a TorchFunctionMode, which Dynamo guards on
        # (a recompile when it appears) and cannot trace through (a graph break per call).
        self.annotate = annotate
        self.step_ms: list[float] = []  # host time of each closed step
        # The closed window's Chrome trace as torch.profiler exported it: what is saved, since
        # the analysis links the parsed events to each other in place (trace.py), and those
        # links, serialised, made a 3-step trace 97 MB of JSON instead of 7.
        self.trace_json = b""
        self._profiler: profile | None = None
        self._annotator: SourceAnnotator | None = None
        self._range: record_function | None = None
        self._mark = 0.0
        # Seconds each phase of the window took (start, steps, collect, export, parse,
        # analyze): what the window costs, where (benchmarks/window_cost.py).
        self.phase_s: dict[str, float] = {}
        self._opened = 0.0

    @property
    def open(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        begin = time.perf_counter()
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        # Shapes: each operator's dtype, bytes and FLOPs (evidence/shapes.py); host-side cost
        # only, in a window whose steps are not timed.
        self._profiler = profile(activities=activities, record_shapes=True)
        with warnings.catch_warnings():
            # A window is one cycle: torch's "Profiler clears events at the end of each
            # cycle" (printed by every trial of a gate, torch 2.11) says nothing about it.
            warnings.filterwarnings("ignore", message="Warning: Profiler clears events",
                                    category=UserWarning)
            with _inductor_left_unloaded():
                self._profiler.__enter__()
        if self.annotate:
            self._annotator = SourceAnnotator()
            self._annotator.__enter__()
        self._opened = time.perf_counter()
        self.phase_s = {"start": self._opened - begin}
        self._open_step()

    def _open_step(self) -> None:
        self._range = record_function(STEP_RANGE)
        self._range.__enter__()
        self._mark = time.perf_counter()

    def _close_step(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
            self.step_ms.append((time.perf_counter() - self._mark) * 1e3)

    def wants_another_step(self) -> bool:
        """Whether a further step is worth profiling, asked as the open step ends: no, once
        the window's steps took its budget on the host. Not synchronised (a sync would be in
        the trace): a GPU-bound step's host time is its launches, so such steps are profiled
        to the caller's count, as their trace is small."""
        spent = sum(self.step_ms) / 1e3 + time.perf_counter() - self._mark
        return self.budget_s is None or spent < self.budget_s

    def next_step(self) -> None:
        """A step ended and the next one begins, inside the window."""
        self._close_step()
        self._open_step()

    def end_step(self) -> None:
        """The open step ended; what follows until `begin_step` (or `stop`) is no step's."""
        self._close_step()

    def begin_step(self) -> None:
        self._open_step()

    def stop(self, *, closing_step: bool = True, export_to: Path | None = None) -> None:
        """Close the window (the open step counts when `closing_step`) and export its trace:
        to `export_to`, or into `trace_json`; the device is synchronised first so that every
        kernel is in the trace."""
        if self._profiler is None:
            return
        synchronize(self.device)  # the last step ends when its device work does
        if closing_step:
            self._close_step()
        elif self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._annotator is not None:
            self._annotator.__exit__(None, None, None)
            self._annotator = None
        mark = time.perf_counter()
        self.phase_s["steps"] = mark - self._opened
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        mark = self._phase("collect", mark)
        if export_to is not None:
            profiler.export_chrome_trace(str(export_to))
        else:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "trace.json"
                profiler.export_chrome_trace(str(path))
                self.trace_json = path.read_bytes()
        self._phase("export", mark)

    def events(self) -> list[dict[str, Any]]:
        """The closed window's trace events (from `trace_json`)."""
        begin = time.perf_counter()
        events = parse_trace(self.trace_json)
        self._phase("parse", begin)
        return events

    def _phase(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.phase_s[name] = now - since
        return now

    def evidence(self, events: list[dict[str, Any]], timed_step_ms: float | None,
                 kernel_lines: dict[str, list[str]] | None = None) -> Evidence | None:
        """The window's evidence, against the timed steps' pace; None without a closed step.
        `kernel_lines`: compiled kernels' source lines
        (gpudiag/measure/profile/inscript/watches/compiled.py)."""
        if not self.step_ms:
            return None
        begin = time.perf_counter()
        with collector_paused():
            found = analyze(events, steps=len(self.step_ms),
                            step_ms=statistics.fmean(self.step_ms),
                            backend="cuda" if self.device.type == "cuda" else "cpu",
                            timed_step_ms=timed_step_ms, kernel_lines=kernel_lines)
        self._phase("analyze", begin)
        return found


@contextlib.contextmanager
def _inductor_left_unloaded() -> Iterator[None]:
    """torch.profiler's start asks `hasattr(torch, "_inductor")` to read Inductor's CUDA-graphs
    setting (torch/profiler/profiler.py, prepare_trace, torch 2.11-2.13), and torch answers by
    importing Inductor, Dynamo with it: 2.7 s of CPU on a 2-core VM, in a script that never
    compiled, inside its run. A script that has not loaded Inductor has captured no graph with
    it, so meanwhile torch does not offer it for lazy import (its `_lazy_modules`)."""
    lazy = vars(torch).get("_lazy_modules")  # not getattr: torch's __getattr__ imports
    if "torch._inductor" in sys.modules or not isinstance(lazy, set) or "_inductor" not in lazy:
        yield
        return
    lazy.discard("_inductor")
    try:
        yield
    finally:
        lazy.add("_inductor")


def _profiled(step: Callable[[], object], *, device: torch.device, steps: int,
              budget_s: float | None, export_to: Path | None = None) -> ProfilerWindow:
    """Up to `steps` calls of `step` profiled (fewer once they took `budget_s`), after one
    untraced call with the annotator (its caches and first-call costs); the closed window, its
    trace exported to `export_to` or kept in `trace_json`."""
    with SourceAnnotator():
        step()
    synchronize(device)
    window = ProfilerWindow(device, budget_s=budget_s)
    window.start()
    for k in range(steps):
        step()
        if k == steps - 1 or not window.wants_another_step():
            break
        window.next_step()
    window.stop(export_to=export_to)
    return window


def capture_trace(step: Callable[[], object], *, device: torch.device, steps: int,
                  budget_s: float | None = None) -> tuple[ProfilerWindow, list[dict[str, Any]]]:
    """Profile up to `steps` calls of `step` (fewer once they took `budget_s`); return the
    window and its trace events."""
    window = _profiled(step, device=device, steps=steps, budget_s=budget_s)
    return window, window.events()


def collect_evidence(step: Callable[[], object], *, device: torch.device, steps: int,
                     timed_step_ms: float | None, budget_s: float | None = None) -> Evidence:
    """The window's evidence over up to `steps` steps (fewer once they took `budget_s`),
    analysed here."""
    window, events = capture_trace(step, device=device, steps=steps, budget_s=budget_s)
    window.trace_json = b""
    evidence = window.evidence(events, timed_step_ms)
    assert evidence is not None  # steps >= 1 closed steps
    return evidence


def record_window(step: Callable[[], object], *, device: torch.device, steps: int,
                  timed_step_ms: float | None, budget_s: float | None, reader: WindowReader,
                  name: str, save_as: Path | None, last: bool = False) -> Reading:
    """Profile as `collect_evidence` does and hand the exported trace to `reader`: a large
    one is parsed and analysed in its process while the caller records what comes next. With
    `save_as`, the trace is kept there gzipped (ui.perfetto.dev and chrome://tracing open it
    as is). The `last` window is read here (WindowReader.read)."""
    exported = reader.folder / f"{name}.trace.json"
    window = _profiled(step, device=device, steps=steps, budget_s=budget_s, export_to=exported)
    trace = WindowTrace(trace=exported.name, steps=len(window.step_ms),
                        step_ms=statistics.fmean(window.step_ms),
                        backend="cuda" if device.type == "cuda" else "cpu",
                        timed_step_ms=timed_step_ms,
                        save_as=None if save_as is None else str(save_as))
    return reader.read(exported, trace, last=last)
