"""The frameworks the recorder watches in the script's process, one module each, as pytest's
plugins are: each installs its own patches, keeps its own state, and fills its own facts into
the stage the recorder writes. The recorder (recorder.py) keeps the step clock, the profiler
window and the part, and calls every watch's hooks in its course.

A watch is a module of this package whose `WATCH` is a `Watch` subclass; every module here is
one (`discover`), so a new framework is a new module (and, if it records a new kind of fact, its
type in gpudiag/model/facts.py). A watch reads the recorder only through the `StepClock` it is
given and imports no other watch (import-linter contracts in pyproject.toml).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, Protocol

from gpudiag.measure.profile.inscript.schedule import Schedule
from gpudiag.model.facts import ScriptFacts, StageFacts, StepTimeline
from gpudiag.model.profilepart import WindowTrace


class StepClock(Protocol):
    """What a watch reads of the recorder: the steps ended so far (so the step in progress,
    counted from 0), the step marks (perf_counter seconds: the start, then each step's end),
    the schedule (which steps warm up, are timed, profiled) and the training loop's code
    (found at the second step's end; None before, or where the host is not sampled)."""

    @property
    def steps(self) -> int: ...

    @property
    def host_marks(self) -> Sequence[float]: ...

    @property
    def schedule(self) -> Schedule: ...

    @property
    def loop_code(self) -> CodeType | None: ...


@dataclass
class StageDraft:
    """The stage the recorder is writing, as the watches fill it in: its facts (the script's,
    and their timeline, made already), the timed steps it measured (empty: none), and what
    the timed window takes besides their times."""

    facts: StageFacts
    script: ScriptFacts
    timeline: StepTimeline
    timed: range
    phases_ms: dict[str, list[float]] = field(default_factory=dict)  # by phase, per timed step
    samples_per_step: int | None = None  # where the script does not say (--samples-per-step)


class Watch:
    """One watched framework. The recorder calls each hook in its course; all but `fill` do
    nothing unless a watch needs them."""

    label = "watch"  # what it reads, as an error of its `finish` is named in the part

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def install(self) -> None:
        """Its patches into the interpreter (`patch`; `afterimport.when_imported` for a module
        the script may import later), once the script has imported torch."""

    def step_ended(self) -> None:
        """At each step boundary, the step's mark taken (`clock.steps` steps ended)."""

    def annotates(self) -> bool:
        """Whether the profiler window may annotate each call with its source line, as it
        opens (not under code the annotation would disturb)."""
        return True

    def trace_made(self, trace: WindowTrace, annotated: bool) -> None:
        """The profiler window closed with steps: what it adds to the trace's record."""

    def window_closed(self) -> None:
        """The window closed at a step boundary, every rank of a job at the same one: a
        collective may run here."""

    def keep_now(self) -> bool:
        """Whether the steps so far should be written now, at this boundary, where a kill
        is near (the host's memory near its limit): asked at each step boundary outside the
        timed and profiled steps."""
        return False

    def crashed(self, exc: BaseException) -> None:
        """The script raised `exc` and did not catch it (its `finish` and `fill` follow)."""

    def finish(self) -> None:
        """The run's end: what it reads once. An error is named in the part, with `label`."""

    def fill(self, draft: StageDraft) -> None:
        """Its facts into the stage being written (at the end of warm-up, the window's close,
        every minute after and at exit)."""
        raise NotImplementedError(f"{type(self).__name__} fills in no facts")


def discover(clock: StepClock) -> list[Watch]:
    """One of each watch of this package, reading `clock`, in the order of their names."""
    found = []
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        kind = getattr(importlib.import_module(f"{__name__}.{module.name}"), "WATCH", None)
        if not (isinstance(kind, type) and issubclass(kind, Watch)):
            raise TypeError(f"{__name__}.{module.name} has no WATCH, a Watch subclass")
        found.append(kind(clock))
    return found


def patch(owner: Any, name: str, around: Callable[[Callable[..., Any]], Callable[..., Any]],
          ) -> None:
    """`owner.name` replaced by `around(owner.name)`, once: what a watch patched already is
    left as it is. The replacement keeps the original's name, docstring, signature and
    attributes, and names it as `__wrapped__`: frameworks read a patched function's signature
    (Lightning re-creates a DataLoader from `inspect.signature(DataLoader.__init__)`, and a bare
    `(*args, **kwargs)` there made it rebuild every loader with batch_size 1)."""
    original = getattr(owner, name)
    if getattr(original, "__gpudiag__", False):
        return
    wrapped = functools.update_wrapper(around(original), original)
    wrapped.__gpudiag__ = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapped)
