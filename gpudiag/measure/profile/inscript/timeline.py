"""A profiled script's whole run, step by step (gpudiag.model.facts.StepTimeline): every step's
host-clock time, and the profiler window's steps. The timed window sees 30 steps; work that
recurs every N steps is priced on this. The watches fill in what they saw on it (the training
loader's wait and the other loops, watches/loaders.py; the saves, watches/saves.py)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from gpudiag.model.facts import StepTimeline

TIMELINE_STEPS = 20_000  # steps kept one by one in run.json; later ones only counted


def build_timeline(marks: Sequence[float], *, extra_steps: int, end_mark: float | None,
                   exit_mark: float | None, window: tuple[int, int] | None) -> StepTimeline:
    """The timeline from the recorder's step marks (perf_counter seconds: the start, then each
    step's end); at most TIMELINE_STEPS steps listed. `end_mark`: the last counted step's end
    past MAX_STEPS; `exit_mark`: the process's exit (None while it runs)."""
    step_ms = [(b - a) * 1e3 for a, b in itertools.pairwise(marks[:TIMELINE_STEPS + 1])]
    last = end_mark if end_mark is not None else (marks[-1] if marks else 0.0)
    tail = max(0.0, exit_mark - last) * 1e3 if exit_mark is not None and marks else 0.0
    return StepTimeline(
        step_ms=step_ms, steps=len(marks) - 1 + extra_steps if marks else 0,
        total_ms=(last - marks[0]) * 1e3 + tail if marks else 0.0, tail_ms=tail,
        window_start=window[0] if window else None, window_end=window[1] if window else None)
