"""torch.compile as the script ran it: each Dynamo compilation of a frame, in which step, of
which function, called from which of the user's lines, why it was a recompile (the guard that
failed), and what Dynamo gave up on (the recompile limit, graph breaks); the graphs and breaks
counted up to the profiler window's end, and the lines of the kernels Inductor fused
(--compile-lines). The window does not annotate compiled code: Dynamo would recompile.

Everything comes from Dynamo's own interfaces, nothing from its log text: its compilation
metrics (`torch._dynamo.utils.get_compilation_metrics()`, one record per compilation with
`recompile_reason`, `fail_reason`, `restart_reasons` and times), its compile-start callback
(`torch._dynamo.callback.on_compile_start`, where the user's calling line is on the stack) and
its counters. gpudiag imports none of it: Dynamo costs ~0.8 s to import, so the callback is
registered at the first step boundary after the script has loaded it (the first compilation, in
step 0, then has no call site but the compiled function's place).
"""

from __future__ import annotations

import bisect
import json
import re
import sys
import time
from typing import Any

from gpudiag.measure.evidence.source import call_site, display_path, frame_role
from gpudiag.measure.profile.inscript.frameworks import compiled
from gpudiag.measure.profile.inscript.watches import StageDraft, StepClock, Watch
from gpudiag.model.facts import CompileEvent, CompileFacts
from gpudiag.model.profilepart import WindowTrace

MAX_EVENTS = 200  # compilations listed in run.json; Dynamo itself keeps the last 64
# Dynamo names the function that resumes a frame after a graph break by the break's line.
_RESUME = re.compile(r"torch_dynamo_resume_in_(?P<function>.+)_at_(?P<line>\d+)$")


class CompiledWatch(Watch):
    """Watches the script's compilations, placing each in its step by the clock's marks."""

    label = "compile metrics"

    def __init__(self, clock: StepClock) -> None:
        super().__init__(clock)
        self.epoch_offset = time.time() - time.perf_counter()  # Dynamo times are epoch times
        self.call_sites: dict[str, str] = {}  # compile id -> the user's calling line
        self.listening = False
        # (graphs compiled, graph breaks) up to the window's end; None without torch.compile
        self.counts: tuple[int | None, int | None] = (None, None)
        self.compiles: CompileFacts | None = None  # read at the run's end

    def step_ended(self) -> None:
        """Once the script uses torch.compile, hear of each compilation's start (for the line
        that called the compiled code)."""
        if self.listening or "torch._dynamo" not in sys.modules:
            return
        self.listening = True
        try:
            from torch._dynamo.callback import on_compile_start  # noqa: PLC0415  (loaded)
        except ImportError:  # a torch without the callback: no call sites
            return
        on_compile_start(self._started)

    def annotates(self) -> bool:
        return not compiled()

    def trace_made(self, trace: WindowTrace, annotated: bool) -> None:
        """The counts up to here; compiled code, which the window did not annotate, has its
        kernels charged to lines by Inductor's provenance instead, where it was kept."""
        self.counts = _compile_counts()
        if not annotated and compiled():
            trace.kernel_lines = kernel_lines()
            trace.attribution_note = _attribution(bool(trace.kernel_lines))

    def finish(self) -> None:
        self.compiles = self.facts()

    def fill(self, draft: StageDraft) -> None:
        draft.script.compiled_graphs, draft.script.graph_breaks = self.counts
        draft.script.compiles = self.compiles

    def _started(self, args: Any) -> None:
        # Runs inside Dynamo's compilation: it must never raise.
        try:
            compile_id = getattr(args, "compile_id", None)
            if compile_id is None or len(self.call_sites) >= MAX_EVENTS:
                return
            site = call_site(sys._getframe(1))
            if site is not None:
                self.call_sites.setdefault(str(compile_id), site.location)
        except Exception:  # a call site missed loses nothing else
            pass

    def facts(self) -> CompileFacts | None:
        """The run's compilations, or None when the script never compiled."""
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:
            return None
        utils = dynamo.utils
        metrics = list(utils.get_compilation_metrics())
        if not metrics:
            return None
        counters = utils.counters
        frames = int(counters.get("frames", {}).get("total", 0))
        breaks: dict[str, int] = {}
        for reason, n in counters.get("graph_break", {}).items():
            key = _reason(reason) or "?"
            breaks[key] = breaks.get(key, 0) + int(n)
        limit = getattr(dynamo.config, "recompile_limit",
                        getattr(dynamo.config, "cache_size_limit", None))
        events = self._events(metrics)
        return CompileFacts(events=events[:MAX_EVENTS],
                            seconds=round(sum(e.seconds for e in events), 3),
                            recompile_limit=int(limit) if limit is not None else None,
                            graph_breaks=breaks,
                            events_lost=max(0, frames - len(metrics)) + max(
                                0, len(events) - MAX_EVENTS))

    def _events(self, metrics: list[Any]) -> list[CompileEvent]:
        events: list[CompileEvent] = []
        by_frame: dict[str, CompileEvent] = {}  # a frame's id (before "/") -> its first event
        for m in metrics:
            compile_id = str(getattr(m, "compile_id", "") or "")
            frame_id = compile_id.split("/", maxsplit=1)[0]
            known = by_frame.get(frame_id)
            name, filename = getattr(m, "co_name", None), getattr(m, "co_filename", None)
            line = getattr(m, "co_firstlineno", None)
            location = (f"{display_path(filename)}:{line}" if filename else
                        known.location if known is not None else "?")
            seconds = _seconds(m)
            started = getattr(m, "start_time_us", None)
            step = self._step(started / 1e6) if started else None
            restart = sorted(getattr(m, "restart_reasons", None) or [])
            event = CompileEvent(
                function=name or (known.function if known is not None else "?"),
                location=location, compile_id=compile_id, seconds=round(seconds, 4), step=step,
                call_site=self.call_sites.get(compile_id),
                recompile_reason=_first_line(getattr(m, "recompile_reason", None)),
                failure=_first_line(getattr(m, "fail_reason", None)),
                graph_break=_reason(restart[0]) if restart else None)
            resumed = _RESUME.match(name or "")
            if resumed and filename:
                # The frame after a break: its break is the broken frame's.
                at = f"{display_path(filename)}:{resumed['line']}"
                for earlier in reversed(events):
                    if earlier.function == resumed["function"] and earlier.graph_break:
                        earlier.graph_break_at = earlier.graph_break_at or at
                        break
            by_frame.setdefault(frame_id, event)
            events.append(event)
        return events

    def _step(self, epoch_s: float) -> int | None:
        at, marks = epoch_s - self.epoch_offset, self.clock.host_marks
        if not marks or at < marks[0]:
            return None
        return max(0, bisect.bisect_right(marks, at) - 1)


WATCH = CompiledWatch


def _compile_counts() -> tuple[int | None, int | None]:
    """(graphs Dynamo compiled, graph breaks) so far, or (None, None) without torch.compile."""
    if not compiled():
        return None, None
    counters = sys.modules["torch._dynamo"].utils.counters
    return (int(counters.get("stats", {}).get("unique_graphs", 0)),
            int(sum(counters.get("graph_break", {}).values())))


def _attribution(provenance: bool) -> str:
    """How a torch.compile'd script's device work is charged to lines (the annotator is off
    under compile), with Inductor's provenance (--compile-lines) or without."""
    if provenance:
        return ("the script runs torch.compile'd code: Inductor's fused kernels are charged to "
                "the source lines of the operators they fused (its provenance, "
                "--compile-lines); its other device work (library matmuls) and the eager "
                "code's are not charged to lines")
    return ("the script runs torch.compile'd code: device work is not charged to source lines "
            "(gpudiag's per-call annotation would make Dynamo recompile and break the graph; "
            "`gpudiag profile --compile-lines` charges compiled kernels to lines); counts and "
            "times per step are exact")


def _seconds(metrics: Any) -> float:
    duration = getattr(metrics, "duration_us", None)
    if duration:
        return float(duration) / 1e6
    return float(getattr(metrics, "entire_frame_compile_time_s", None) or 0.0)


def _first_line(text: str | None) -> str | None:
    return text.strip().splitlines()[0].strip() if text and text.strip() else None


def _reason(text: str | None) -> str | None:
    """A graph break's reason: Dynamo's headline ("Failed to trace builtin operator"), with
    the first sentence of its explanation, which names the culprit (`print`)."""
    headline = _first_line(text)
    if headline is None or text is None:
        return None
    for raw in text.splitlines()[1:]:
        line = raw.strip()
        if line.startswith("Explanation:"):
            detail = line.removeprefix("Explanation:").strip().split(". ")[0].rstrip(".")
            return f"{headline}: {detail}" if detail else headline
    return headline


# A frame of a stack trace, as Python's traceback module writes it.
_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')
_HANDLE = re.compile(r":\d+$")  # Inductor's debug handle after a kernel's name


def kernel_lines() -> dict[str, list[str]]:
    """Kernel name -> the user's source lines ("path:line") of the operators Inductor fused
    into it, from the compilations' provenance (recorded when Inductor's provenance tracking
    is on: `gpudiag profile --compile-lines`); empty otherwise."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return {}
    found: dict[str, list[str]] = {}
    for metrics in dynamo.utils.get_compilation_metrics():
        for blob in getattr(metrics, "inductor_provenance", None) or ():
            try:
                mapping = json.loads(blob)
            except (TypeError, ValueError):
                continue
            for kernel, stacks in mapping.items():
                lines = [line for stack in stacks if (line := _users_line(str(stack)))]
                if lines:
                    name = _HANDLE.sub("", kernel)
                    found[name] = list(dict.fromkeys(found.get(name, []) + lines))
    return found


def _users_line(stack: str) -> str | None:
    """The innermost frame of the user's own code in one stack trace."""
    for frame in reversed(list(_FRAME.finditer(stack))):
        if frame_role(frame["path"]) == "user":
            return f"{display_path(frame['path'])}:{frame['line']}"
    return None
