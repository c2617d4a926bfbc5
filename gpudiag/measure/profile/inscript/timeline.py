"""A profiled script's whole run, step by step (gpudiag.model.facts.StepTimeline): every step's
host-clock time, the training loader's wait, the saves, and the other DataLoader loops
(evaluation) with the steps they ran on. The timed window sees 30 steps; work that recurs
every N steps is priced on this.

Which loader feeds training is told from when it serves batches: the training loader serves
(nearly) every step of its life; an evaluation loop serves all its batches between two steps,
and, when its iterator is reused (persistent workers), only every N-th step.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from gpudiag.model.facts import OtherLoop, SaveRecord, StepTimeline

TIMELINE_STEPS = 20_000  # steps kept one by one in run.json; later ones only counted
# An iterator that served batches on less than half the steps between its first and last is
# not the training loader (which serves every step), and neither is one that served more than
# two batches all on one step.
TRAINING_COVERAGE = 0.5
ONE_STEP_BATCHES = 2

Site = tuple[str, str, str | None]  # (location, function, caller)


def training_loaders(calls: Mapping[int, Sequence[int]]) -> set[int]:
    """The iterators (by key) that feed training, from the step each of their batches came on."""
    training = set()
    for key, served in calls.items():
        steps = set(served)
        span = max(steps) - min(steps) + 1
        one_step_loop = len(steps) == 1 and len(served) > ONE_STEP_BATCHES
        if not one_step_loop and len(steps) >= TRAINING_COVERAGE * span:
            training.add(key)
    return training


def training_waits(waits: Mapping[tuple[int, int], float], training: set[int],
                   steps: int) -> list[float]:
    """Per step (0..steps-1), the time spent waiting for the training loaders' batches."""
    per_step = [0.0] * steps
    for (step, key), ms in waits.items():
        if key in training and 0 <= step < steps:
            per_step[step] += ms
    return per_step


def other_loops(calls: Mapping[int, Sequence[int]], training: set[int],
                sites: Mapping[int, Site], steps: int) -> list[OtherLoop]:
    """The loaders that are not training's, one per line of the script that iterates them (an
    evaluation makes a new iterator each time: they are one loop)."""
    loops: dict[Site, OtherLoop] = {}
    for key, served in calls.items():
        if key in training:
            continue
        site = sites.get(key, ("unknown", "?", None))
        loop = loops.setdefault(site, OtherLoop(location=site[0], function=site[1],
                                                caller=site[2]))
        loop.batches += len(served)
        loop.steps = sorted({*loop.steps, *(s for s in served if s < steps)})
    return sorted(loops.values(), key=lambda loop: -loop.batches)


def build_timeline(marks: Sequence[float], *, extra_steps: int, end_mark: float | None,
                   exit_mark: float | None, waits: Mapping[tuple[int, int], float],
                   calls: Mapping[int, Sequence[int]], sites: Mapping[int, Site],
                   saves: Sequence[SaveRecord],
                   window: tuple[int, int] | None) -> StepTimeline:
    """The timeline from the recorder's step marks (perf_counter seconds: the start, then each
    step's end) and what it saw meanwhile; at most TIMELINE_STEPS steps listed. `end_mark`:
    the last counted step's end past MAX_STEPS; `exit_mark`: the process's exit (None while
    it runs)."""
    step_ms = [(b - a) * 1e3 for a, b in itertools.pairwise(marks[:TIMELINE_STEPS + 1])]
    listed = len(step_ms)
    last = end_mark if end_mark is not None else (marks[-1] if marks else 0.0)
    tail = max(0.0, exit_mark - last) * 1e3 if exit_mark is not None and marks else 0.0
    training = training_loaders(calls)
    return StepTimeline(
        step_ms=step_ms, steps=len(marks) - 1 + extra_steps if marks else 0,
        total_ms=(last - marks[0]) * 1e3 + tail if marks else 0.0, tail_ms=tail,
        data_wait_ms=training_waits(waits, training, listed),
        saves=[s for s in saves if s.step < listed],
        loops=other_loops(calls, training, sites, listed),
        window_start=window[0] if window else None, window_end=window[1] if window else None)

