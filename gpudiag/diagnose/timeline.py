"""One accounting of a profiled script's whole run: where its wall time went, step by step.

The run's wall time is every step's time (gpudiag.model.facts.StepTimeline). Step 0 is the
start-up (imports, set-up, the first step). Every later step is the steady step (the median of
the steps where nothing else ran) plus, on some steps, extra time, and that extra time is
charged to what ran there, in this order: torch.compile's compilations on that step (Dynamo's
own times; step 0's come out of the start-up), the script's saves (no more than the time they
held the training thread), the training DataLoader's wait beyond its usual, another DataLoader loop
(an evaluation) that ran on that step, and otherwise work that is none of these: periodic when
its spikes recur with one period, irregular when they do not. A step that holds a save is a
save step: its whole extra is the save's, unless the host samples put the save at one line and
the rest at another (an evaluation on the saving step). gpudiag's own steps (the end of its
warm-up, its profiler window and the steps either side, which carry its start and close) are
slowed by gpudiag itself: their extra, less any save's, is its own part. Where the step is
asynchronous (the host's steady step far below the device's), the host clock's spikes that no
hook names are the host waiting for the device's full launch queue, not work: their own part,
and periodic work is judged on the device's timed steps instead. Steps past those listed are
one part.
Each step's time goes to exactly one part, or is split between them, so the parts add up to
the wall time: every share a finding prices is of the same whole.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from gpudiag.diagnose.spikes import PERIODIC_SHARE, find_spikes
from gpudiag.model.facts import CompileFacts, HostSamples, HostStep, OtherLoop, StepTimeline
from gpudiag.model.results import StageResult

WorkKind = Literal["compile", "save", "data", "loop", "other"]
# The order extra is charged in: a step that compiled spent its extra compiling.
KINDS: tuple[WorkKind, ...] = ("compile", "save", "data", "loop", "other")
WORK_LABELS: dict[WorkKind, str] = {
    "compile": "torch.compile compiling", "save": "checkpoint saves",
    "data": "the training DataLoader's stalls", "loop": "another DataLoader loop (an evaluation)",
    "other": "other periodic work"}
MIN_TIMELINE_STEPS = 20  # fewer steps than this show no period
MIN_OCCURRENCES = 2  # a part recurring fewer times has no period
# Each occurrence of a period's work holds this many times the extra of the average other
# step: on a loaded machine a third of all steps may spike, and some period then catches most
# of its few slots.
STANDOUT = 5.0
ALIKE = 0.25  # an occurrence is at least this share of the typical one
MIN_PERIOD_HITS = 4  # occurrences a period needs: three fall on one phase by chance too often
FALSE_PERIOD = 0.01  # chance of a period found in jitter alone, at most
LINE_HOLDS = 0.5  # of a slow step's sampled extra, at one line: that line's work
# ... unless the step's other lines grew too, by at least this share of that line's own growth
# (each against its ordinary time): a step the machine slowed (another process on the CPU)
# stretches every line alike, and its extra then sits most at the busiest line.
STRETCHED_ALIKE = 0.5
# The host runs ahead of the device when its steady step is below this share of the device's
# (CUDA-event-timed) step: it then blocks wherever the launch queue is full.
ASYNC_RATIO = 0.5
STEP_LINE = 0.5  # a line holding this share of the ordinary step is the step itself
# A saving step's extra beyond its save is other work only where the host samples put at least
# this share of the save's blocking at one line other than the extra's (the save ran there).
SAVE_ELSEWHERE = 0.5


@dataclass
class PeriodicWork:
    """Work beside the training step on some of its steps: what, where, how often, what extra."""

    kind: WorkKind
    steps: list[int]  # the steps it ran on (for "other": the ones that spiked)
    extra_ms: float  # over the run, above the steady step
    period: int | None = None  # steps between occurrences, when regular
    loop: OtherLoop | None = None  # for "loop": the DataLoader loop
    # The training loop's line that held those steps beyond their usual (the host samples of
    # the slow steps), its source, its share of their sampled extra, and on how many steps.
    line: str | None = None
    line_text: str = ""
    line_share: float | None = None
    sampled_steps: int = 0

    @property
    def occurrences(self) -> int:
        return len(self.steps)

    @property
    def per_occurrence_ms(self) -> float:
        return self.extra_ms / len(self.steps) if self.steps else 0.0


@dataclass
class RunAccount:
    wall_ms: float
    startup_ms: float  # step 0, less its torch.compile compilations
    steady_ms: float  # every later step's own work, at most the steady step each
    step_ms: float  # the steady step: median of the steps where nothing else ran
    window_ms: float = 0.0  # gpudiag's own steps' extra: its warm-up's end, its window
    device_wait_ms: float = 0.0  # an asynchronous step's host blocked on a full launch queue
    device_step_ms: float | None = None  # the device's (timed) step, where it is known
    irregular_ms: float = 0.0  # slow steps no cause or period explains
    unlisted_ms: float = 0.0  # steps past the listed ones: not itemised
    tail_ms: float = 0.0  # after the last step, to the exit
    first_compile_ms: float = 0.0  # torch.compile's compilations in step 0
    works: list[PeriodicWork] = field(default_factory=list)
    steps: int = 0  # steps the run made, step 0 (the start-up) included
    # A run gpudiag cut short after its window, where the script says how many steps it
    # means to make: (those steps, where that is said).
    planned: tuple[int, str] | None = None

    def share(self, ms: float) -> float:
        return ms / self.wall_ms if self.wall_ms > 0 else 0.0

    @property
    def asynchronous(self) -> bool:
        """Whether the host runs ahead of the device: its steady step far below the device's
        (ASYNC_RATIO), so that its clock shows where it blocked, not what a step cost."""
        return (self.device_step_ms is not None
                and self.step_ms < ASYNC_RATIO * self.device_step_ms)

    @property
    def loop_ms(self) -> float:
        """The training loop's wall time: the run's less its start-up (and the compilations
        in it), gpudiag's profiler window and what follows the last step. What a loop
        problem costs is a share of this: a short test run's start-up would hide it."""
        return max(0.0, self.wall_ms - self.startup_ms - self.first_compile_ms - self.window_ms
                   - self.tail_ms)

    def loop_share(self, ms: float) -> float:
        return min(1.0, ms / self.loop_ms) if self.loop_ms > 0 else 0.0

    @property
    def projected_ms(self) -> float | None:
        """The whole run's wall time at the planned steps: start-up and exit as measured, the
        loop at what each of its steps cost here (periodic work included, gpudiag's window
        not). None without a plan beyond the steps made."""
        if self.planned is None or self.planned[0] <= self.steps or self.steps < 2:
            return None
        return self.setup_ms + self.loop_ms_per_step * self.planned[0] + self.tail_ms

    @property
    def setup_ms(self) -> float:
        """Step 0: start-up and the compilations in it."""
        return self.startup_ms + self.first_compile_ms

    @property
    def loop_ms_per_step(self) -> float:
        """What each step after the first cost of the training loop, periodic work included."""
        return self.loop_ms / (self.steps - 1) if self.steps > 1 else 0.0

    def parts(self) -> list[tuple[str, float]]:
        """(part, ms) adding up to the wall time."""
        named = [("start-up (step 0: imports, set-up, first step)", self.startup_ms),
                 ("torch.compile compiling in step 0", self.first_compile_ms),
                 (f"training steps at {self.step_ms:.1f} ms", self.steady_ms)]
        named += [(describe(w), w.extra_ms) for w in self.works]
        named += [("irregular slow steps", self.irregular_ms),
                  ("the host waiting for the device (its launch queue full)",
                   self.device_wait_ms),
                  ("gpudiag's own steps (its warm-up's end, its profiler window)",
                   self.window_ms),
                  ("steps past those listed", self.unlisted_ms),
                  ("after the last step, to the exit", self.tail_ms)]
        return [(name, ms) for name, ms in named if ms > 0]


def describe(work: PeriodicWork, *, period: bool = True) -> str:
    every = f" every {work.period} steps" if work.period and period else ""
    if work.kind == "other" and work.line is not None:
        text = f" (`{work.line_text}`)" if work.line_text else ""
        return f"work at {work.line}{text}{every}"
    if work.kind == "compile":
        return f"torch.compile compiling ({work.occurrences} step(s) after the first)"
    if work.kind == "save":
        return f"checkpoint saves{every}"
    if work.kind == "data":
        return f"training DataLoader stalls{every}"
    if work.kind == "loop" and work.loop is not None:
        called = f", called at {work.loop.caller}" if work.loop.caller else ""
        return (f"DataLoader loop at {work.loop.location} ({work.loop.function}(){called})"
                f"{every}")
    return f"other work{every} (not a save, not a DataLoader loop)"


def _period(steps: Sequence[int]) -> int | None:
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    if len(steps) < MIN_OCCURRENCES or not gaps:
        return None
    common = statistics.mode(gaps)
    return common if gaps.count(common) >= PERIODIC_SHARE * len(gaps) else None


def stage_account(stage: StageResult) -> RunAccount | None:
    """A profiled script's whole run, when it recorded its timeline (with its host samples,
    to name the line of periodic work; its schedule, for gpudiag's own steps; its timed
    steps, the device's clock where the step is asynchronous). Only CUDA events time a
    device's step: a CPU's timed steps are host-clock steps like the timeline's, and a loaded
    machine's differ from them by chance, not by a launch queue (a CPU has none)."""
    script = stage.facts.script
    if script is None or script.timeline is None:
        return None
    device = statistics.median(stage.iter_ms) if stage.iter_ms \
        and stage.timer == "cuda-events" else None
    return account(script.timeline, script.host, script.compiles, warmup=script.warmup,
                   device_step_ms=device)


def gpudiags_steps(timeline: StepTimeline, warmup: int | None = None) -> set[int]:
    """The steps gpudiag slows itself, as its schedule (gpudiag/measure/profile/inscript/
    schedule.py) places them: the profiler window's, the one after it that carries its close
    (to the last step, where the script ended inside it), and the end of the warm-up (where
    its timing starts); each with a step either side, where that start or close may land."""
    n = len(timeline.step_ms)
    own: set[int] = set()
    if timeline.window_start is not None:
        last = timeline.window_end if timeline.window_end is not None else n - 1
        own.update(range(timeline.window_start - 1, last + 2))
    if warmup is not None:
        own.update(range(warmup - 1, warmup + 2))
    return {s for s in own if 1 <= s < n}


@dataclass
class _Causes:
    """What each step of a timeline is known to have done beside training."""

    own: set[int]  # gpudiag's
    compiled: dict[int, float]
    blocking: dict[int, float]  # the saves' time holding the training thread
    loop_of: dict[int, OtherLoop]
    waits: list[float]
    spiked: set[int] = field(default_factory=set)
    usual_wait: float = 0.0

    def caps(self, i: int, extra: float) -> tuple[float, ...]:
        """The most each kind (KINDS' order) may take of step i's extra."""
        return (self.compiled.get(i, 0.0), self.blocking.get(i, 0.0),
                max(0.0, self.waits[i] - self.usual_wait) if i in self.spiked else 0.0,
                extra if i in self.loop_of else 0.0, extra if i in self.spiked else 0.0)


def account(timeline: StepTimeline, host: HostSamples | None = None,
            compiles: CompileFacts | None = None, *, warmup: int | None = None,
            device_step_ms: float | None = None) -> RunAccount | None:
    """The run's wall time in parts, or None for a timeline too short to tell. With `host`,
    each periodic work is named by the line that held its steps; with `compiles`, the steps
    that compiled are charged their compilations first (step 0's from the start-up); with
    `warmup`, the end of gpudiag's warm-up is its own; with `device_step_ms`, an asynchronous
    step's unnamed host spikes are waits for the device."""
    times = timeline.step_ms
    n = len(times)
    if n < MIN_TIMELINE_STEPS + 1:
        return None
    blocking: dict[int, float] = defaultdict(float)
    for save in timeline.saves:
        blocking[save.step] += save.blocking_ms
    causes = _Causes(gpudiags_steps(timeline, warmup), _compile_ms(compiles, n), blocking,
                     {s: loop for loop in timeline.loops for s in loop.steps},
                     timeline.data_wait_ms if len(timeline.data_wait_ms) == n else [0.0] * n)
    candidates = [i for i in range(1, n) if i not in causes.own]
    spikes = find_spikes([times[i] for i in candidates])
    causes.spiked = {candidates[k] for k in spikes.indices}
    plain = [i for i in candidates if i not in causes.spiked and i not in blocking
             and i not in causes.loop_of and i not in causes.compiled]
    step = statistics.median([times[i] for i in plain] or [times[i] for i in candidates])
    causes.usual_wait = statistics.median([causes.waits[i] for i in plain] or [0.0])
    first_compile = min(times[0], causes.compiled.get(0, 0.0))
    planned = (timeline.planned_steps, timeline.planned_from or "") if (
        timeline.cut_short and timeline.planned_steps) else None
    result = RunAccount(wall_ms=max(timeline.total_ms, sum(times) + timeline.tail_ms),
                        startup_ms=times[0] - first_compile, steady_ms=0.0, step_ms=step,
                        tail_ms=timeline.tail_ms, first_compile_ms=first_compile,
                        steps=max(timeline.steps, n), planned=planned,
                        device_step_ms=device_step_ms)
    result.unlisted_ms = result.wall_ms - sum(times) - timeline.tail_ms
    charged = _charge(result, times, causes)
    callers: dict[int, set[str]] = defaultdict(set)
    for save in timeline.saves:
        callers[save.step].update(save.stack)
    for i, held in blocking.items():  # a saving step's extra is the save's, unless elsewhere
        if i in charged["other"] and _save_holds_rest(i, host, held, callers[i]):
            charged["save"][i] = charged["save"].get(i, 0.0) + charged["other"].pop(i)
    if result.asynchronous:  # the host blocked on a full launch queue: no work of its own
        result.device_wait_ms = sum(charged["other"].values())
        charged["other"] = {}
    _works(result, charged, timeline.loops, n, host, causes.own)
    return result


def _charge(result: RunAccount, times: Sequence[float],
            causes: _Causes) -> dict[WorkKind, dict[int, float]]:
    """Each step's time above the steady step, charged to what ran there (KINDS' order);
    gpudiag's own steps' extra less their saves to its part; the rest is the step's own."""
    charged: dict[WorkKind, dict[int, float]] = {k: {} for k in KINDS}
    step = result.step_ms
    for i in range(1, len(times)):
        extra = times[i] - step
        result.steady_ms += min(times[i], step)
        if extra <= 0:
            continue
        if i in causes.own:  # a save there is still the script's
            saved = min(extra, causes.blocking.get(i, 0.0))
            if saved > 0:
                charged["save"][i] = saved
            result.window_ms += extra - saved
            continue
        for kind, cap in zip(KINDS, causes.caps(i, extra), strict=True):
            part = min(extra, cap)
            if part > 0:
                charged[kind][i] = charged[kind].get(i, 0.0) + part
                extra -= part
        result.steady_ms += extra  # jitter on an ordinary step: the step's own
    return charged


def _line_extra(step: HostStep, host: HostSamples) -> dict[str, float]:
    """Each training-loop line's time on a slow step beyond its ordinary time per step."""
    return {line: ms - host.per_step(host.loop_ms.get(line, 0.0))
            for line, ms in step.loop_ms.items()}


def _save_holds_rest(step: int, host: HostSamples | None, blocking_ms: float,
                     callers: set[str]) -> bool:
    """Whether a saving step's extra beyond its save's blocking is the save's too (building
    the state it writes, the same statement). Where the saves recorded their callers, exactly:
    yes when the training-loop line holding the most extra on that step is one the save ran
    from (HF Trainer's `_maybe_log_save_evaluate(`), no when it is another (an evaluation on
    the saving step). Runs before that record: yes, unless that step's host samples put the
    most extra at one line and at least SAVE_ELSEWHERE of the save's blocking at one other
    line. One line, not the others' sum: a loaded machine's jitter spreads over every line of
    the step (HF Trainer's save was split off by the sum on a loaded 2-core machine)."""
    sampled = next((s for s in host.slow_steps if s.step == step), None) if host else None
    if host is None or sampled is None or not host.steady_steps:
        return True
    extra = _line_extra(sampled, host)
    if not extra:
        return True
    top = max(extra, key=lambda line: extra[line])
    if callers:
        return top in callers
    elsewhere = max((ms for line, ms in extra.items() if line != top), default=0.0)
    return elsewhere < SAVE_ELSEWHERE * blocking_ms


def _compile_ms(compiles: CompileFacts | None, n: int) -> dict[int, float]:
    """Step -> ms its torch.compile compilations took (Dynamo's own times)."""
    compiled: dict[int, float] = defaultdict(float)
    for event in compiles.events if compiles is not None else []:
        if event.step is not None and event.step < n:
            compiled[event.step] += event.seconds * 1e3
    return compiled


def _attribute(work: PeriodicWork, host: HostSamples) -> None:
    """The training loop's line whose time on the work's steps most exceeds its usual: the
    call that does the work (an evaluation, a save, a log). Only slow steps keep their
    samples (gpudiag/measure/profile/inscript/hostsampler.py), which the work's steps are."""
    slow = {s.step: s for s in host.slow_steps}
    covered = [slow[step] for step in work.steps if step in slow]
    if not covered or not host.steady_steps:
        return
    extra: dict[str, float] = defaultdict(float)
    for step in covered:
        for line, ms in step.loop_ms.items():
            extra[line] += ms - host.per_step(host.loop_ms.get(line, 0.0))
    positive = {line: ms for line, ms in extra.items() if ms > 0}
    if not positive:
        return
    line = max(positive, key=lambda k: positive[k])
    work.line, work.line_text = line, host.text.get(line, "")
    work.line_share, work.sampled_steps = positive[line] / sum(positive.values()), len(covered)


def _stretched(step: HostStep, line: str, host: HostSamples) -> bool:
    """Whether the step's other lines grew alike with `line` (STRETCHED_ALIKE), each against
    its ordinary time: the machine slowed the whole step. False where nothing else ran."""
    def growth(lines: Collection[str]) -> float:
        usual = sum(host.per_step(host.loop_ms.get(k, 0.0)) for k in lines)
        return (sum(step.loop_ms.get(k, 0.0) for k in lines) - usual) / usual if usual else 0.0

    others = (set(host.loop_ms) | set(step.loop_ms)) - {line}
    own = growth([line])
    return own > 0 and growth(others) >= STRETCHED_ALIKE * own


class PeriodGroup(NamedTuple):
    period: int
    steps: list[int]  # the work's occurrences
    after: list[int]  # steps right after them that spiked too: the same work's after-effect


def periodic_groups(extra: Mapping[int, float], n: int,
                    unseen: Collection[int] = ()) -> list[PeriodGroup]:
    """Each periodic work among the spiking steps (step -> extra ms) of a
    run of `n` steps, largest first: the period and phase whose steps hold the most extra
    time, where at least PERIODIC_SHARE of the steps at that phase spiked (the `unseen` ones,
    the profiler window's, are not counted) with work alike and standing out from the other
    steps (ALIKE, STANDOUT), MIN_PERIOD_HITS times at least. A spike on the step right after
    one of them is the same work's after-effect (a restarted iterator, a cold cache) and
    joins it. The hits must be unlikely by chance, given how often other steps stand out as
    much, over all the periods and phases tried (FALSE_PERIOD). Repeated on what is left,
    so an evaluation every N and a save every M are two works; jitter that no period
    explains stays out."""
    left = dict(extra)
    groups: list[PeriodGroup] = []
    tried = sum(range(2, n // MIN_PERIOD_HITS + 1))  # (period, phase) pairs looked at
    while len(left) >= MIN_PERIOD_HITS:
        best: tuple[float, int, int] | None = None  # (extra ms, period, phase)
        for p in range(2, n // MIN_PERIOD_HITS + 1):
            by_phase: dict[int, float] = defaultdict(float)
            for step, ms in left.items():
                by_phase[step % p] += ms
            phase = max(by_phase, key=lambda r: by_phase[r])
            on_phase = [ms for step, ms in left.items() if step % p == phase]
            slots = sum(1 for i in range(phase, n, p) if i >= 1 and i not in unseen)
            elsewhere = (sum(left.values()) - by_phase[phase]) / max(1, n - 1 - slots)
            # Occurrences of one work are alike, and each stands out from the other steps:
            # jitter that falls on the phase does not fill its slots.
            floor = max(ALIKE * statistics.median(on_phase), STANDOUT * elsewhere)
            hits = sum(1 for ms in on_phase if ms >= floor)
            if (hits >= MIN_PERIOD_HITS and hits >= PERIODIC_SHARE * slots
                    and (best is None or by_phase[phase] > best[0])):
                others = sum(1 for step, ms in left.items() if step % p != phase and ms >= floor)
                rate = others / max(1, n - 1 - slots)
                if _tail(hits, slots, rate) * tried > FALSE_PERIOD:
                    continue
                best = (by_phase[phase], p, phase)
        if best is None:
            break
        _, period, phase = best
        steps = sorted(s for s in left if s % period == phase)
        after = [s + 1 for s in steps if s + 1 in left]
        groups.append(PeriodGroup(period, steps, after))
        for step in steps + after:
            del left[step]
    return groups


def _tail(hits: int, slots: int, rate: float) -> float:
    """P(at least `hits` of `slots` steps stand out) when each does with probability `rate`."""
    return sum(math.comb(slots, k) * rate**k * (1 - rate) ** (slots - k)
               for k in range(hits, slots + 1))


def _works(result: RunAccount, charged: dict[WorkKind, dict[int, float]],
           loops: Sequence[OtherLoop], n: int, host: HostSamples | None,
           own: Collection[int]) -> None:
    for kind in KINDS[:3]:
        steps = sorted(charged[kind])
        if steps:
            result.works.append(PeriodicWork(kind, steps, sum(charged[kind].values()),
                                             _period(steps)))
    for loop in loops:
        steps = [s for s in loop.steps if s in charged["loop"]]
        if steps:
            extra = sum(charged["loop"][s] for s in steps)
            result.works.append(PeriodicWork("loop", steps, extra, _period(steps), loop))
    other = dict(charged["other"])
    for group in periodic_groups(other, n, own):
        result.works.append(PeriodicWork("other", group.steps,
                                         sum(other.pop(s) for s in group.steps + group.after),
                                         group.period))
    if host is not None:
        result.works += _works_by_line(other, host, result.step_ms)
    result.irregular_ms = sum(other.values())
    result.works.sort(key=lambda w: -w.extra_ms)
    if host is not None:
        for work in result.works:
            if work.kind == "other" and work.line is None:  # saves, loops: named by hooks
                _attribute(work, host)


def _works_by_line(other: dict[int, float], host: HostSamples,
                   step_ms: float) -> list[PeriodicWork]:
    """Slow steps too few for a period (an evaluation every 20 steps of a 60-step run) that
    the host samples put at one line of the training loop: one work per line, run at least
    MIN_OCCURRENCES times at one period, each at least doubling the step, the line holding
    most of each one's extra while the step's other lines kept their time (not `_stretched`),
    and not the line that is the step itself (`_step_line`: Lightning's
    `self.advance(...)`, a slow step rather than work beside it). Taken out of `other` (what
    stays there is irregular)."""
    by_line: dict[str, list[int]] = defaultdict(list)
    slow = {s.step: s for s in host.slow_steps}
    for step, extra in other.items():
        if extra < step_ms:
            continue
        probe = PeriodicWork("other", [step], extra)
        _attribute(probe, host)
        if (probe.line is not None and (probe.line_share or 0.0) >= LINE_HOLDS
                and not _stretched(slow[step], probe.line, host)
                and not _step_line(probe.line, host)):
            by_line[probe.line].append(step)
    works = []
    for steps in by_line.values():
        period = _period(sorted(steps))
        if len(steps) < MIN_OCCURRENCES or period is None or period <= 1:
            continue  # once, or at irregular steps: not work that recurs
        work = PeriodicWork("other", sorted(steps), sum(other.pop(s) for s in steps), period)
        _attribute(work, host)
        works.append(work)
    return works


def _step_line(line: str, host: HostSamples) -> bool:
    """Whether `line` holds at least STEP_LINE of the ordinary step's sampled loop time: the
    call that runs the step itself, whose slow occurrences are slow steps, not other work."""
    total = sum(host.loop_ms.values())
    return total > 0 and host.loop_ms.get(line, 0.0) >= STEP_LINE * total
