"""Exact counters: what a step does, counted rather than timed, and how two builds differ in them.

Device ops, kernel launches, kernels, host-device syncs, host<->device copies and their bytes
come from the evidence window (the profiler's record of whole steps), FLOPs from FlopCounterMode,
peak memory from the caching allocator, compiled graphs and graph breaks from Dynamo. For the
same code and inputs they are the same in every fresh process, which is what lets a gate judge
them with one trial a side where step time needs many (noise on a shared GPU is 3-5% between
processes). That is checked, not assumed: a side with several trials whose values differ marks
the counter as varying, and the gate then only reports a change outside the range it saw.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from gpudiag.model.results import LineCount, StageResult

# Two per-step values closer than this (relative) are the same count: per-step values are
# totals divided by the window's steps, so only float rounding separates equal counts.
SAME_COUNT_REL = 1e-9


def _evidence(attribute: str, *, cuda_only: bool = False,
              ) -> Callable[[StageResult], float | None]:
    def read(stage: StageResult) -> float | None:
        ev = stage.evidence
        if ev is None or (cuda_only and ev.backend != "cuda"):
            return None
        value = getattr(ev, attribute)
        return float(sum(value[k] for k in value if k.startswith(("HtoD", "DtoH")))
                     if isinstance(value, dict) else value)
    return read


def _flops(stage: StageResult) -> float | None:
    return stage.facts.flops_per_step


def _memory(stage: StageResult) -> float | None:
    return stage.memory.peak_allocated_mib if stage.memory else None


def _script(attribute: str) -> Callable[[StageResult], float | None]:
    def read(stage: StageResult) -> float | None:
        script = stage.facts.script
        value = getattr(script, attribute) if script is not None else None
        return float(value) if value is not None else None
    return read


@dataclass(frozen=True)
class CounterSpec:
    name: str  # as the gate's --max-regression NAME=PCT spells it
    label: str
    unit: str
    read: Callable[[StageResult], float | None]


COUNTERS: tuple[CounterSpec, ...] = (
    CounterSpec("ops", "device ops", "/step", _evidence("ops_per_step")),
    CounterSpec("launches", "kernel launches", "/step",
                _evidence("launches_per_step", cuda_only=True)),
    CounterSpec("kernels", "kernels", "/step", _evidence("kernels_per_step", cuda_only=True)),
    CounterSpec("syncs", "host-device syncs", "/step", _evidence("syncs_per_step")),
    CounterSpec("copies", "host<->device copies", "/step",
                _evidence("memcpy_per_step", cuda_only=True)),
    CounterSpec("copy-bytes", "bytes copied host<->device", "B/step",
                _evidence("copy_bytes_per_step", cuda_only=True)),
    CounterSpec("flops", "FLOPs", "/step", _flops),
    CounterSpec("memory", "peak memory", "MiB", _memory),
    CounterSpec("graphs", "compiled graphs", "", _script("compiled_graphs")),
    CounterSpec("graph-breaks", "graph breaks", "", _script("graph_breaks")),
)
COUNTER_NAMES = tuple(c.name for c in COUNTERS)


def read_counters(stage: StageResult) -> dict[str, float]:
    """The counters this stage measured (those it could not measure are absent)."""
    if not stage.ok:
        return {}
    values = {c.name: c.read(stage) for c in COUNTERS}
    return {k: v for k, v in values.items() if v is not None and math.isfinite(v)}


def same_count(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=SAME_COUNT_REL, abs_tol=1e-12)


@dataclass
class LineDelta:
    """A line whose counts grew (or that is new) in the after build."""

    location: str
    function: str
    ops: float
    kernels: float
    syncs: float
    copies: float
    device_ms: float  # the line's device time per step, after
    sync_idle_ms: float  # device idle after the line's syncs, per step, after

    @property
    def cost_ms(self) -> float:
        """What the line's work costs a step, measured: its kernels' time and the idle time its
        syncs leave on the device."""
        return self.device_ms + self.sync_idle_ms


@dataclass
class CounterChange:
    name: str
    label: str
    unit: str
    before: tuple[float, float]  # (lowest, highest) over the side's trials
    after: tuple[float, float]
    lines: list[LineDelta] = field(default_factory=list)

    @property
    def varies(self) -> bool:
        """Trials of one side disagreed: the counter is not exact for this workload."""
        return not (same_count(*self.before) and same_count(*self.after))

    @property
    def changed(self) -> bool:
        """Outside everything the other side showed (for exact counters: a different count)."""
        above = self.after[0] > self.before[1] and not same_count(self.after[0], self.before[1])
        below = self.after[1] < self.before[0] and not same_count(self.after[1], self.before[0])
        return above or below

    @property
    def increase(self) -> float:
        """Relative growth past the before side's highest value (inf from zero; <= 0: none)."""
        low, high = self.after[0], self.before[1]
        if low <= high or same_count(low, high):
            return 0.0
        return math.inf if high == 0 else low / high - 1


def _key(line: LineCount) -> tuple[str, str, float, float, float, float]:
    path = line.location.rsplit(":", 1)[0]
    return (path, line.function, round(line.ops, 6), round(line.kernels, 6),
            round(line.syncs, 6), round(line.copies, 6))


def line_deltas(before: list[LineCount], after: list[LineCount]) -> list[LineDelta]:
    """Lines of `after` whose counts no line of `before` in the same file and function has:
    new or changed lines, with their growth over the unmatched before line of that function
    they replace. Matching on counts, not line numbers, keeps an insertion above a line from
    making it look changed."""
    pool = Counter(_key(b) for b in before)
    unmatched = []
    for a in after:
        if pool[_key(a)] > 0:
            pool[_key(a)] -= 1
        else:
            unmatched.append(a)
    replaced: dict[tuple[str, ...], list[LineCount]] = defaultdict(list)
    for b in before:
        if pool[_key(b)] > 0:
            pool[_key(b)] -= 1
            replaced[_key(b)[:2]].append(b)
    deltas = []
    for a in unmatched:
        olds = replaced[_key(a)[:2]]
        base = olds.pop(0) if olds else LineCount(a.location, a.function)
        delta = LineDelta(location=a.location, function=a.function, ops=a.ops - base.ops,
                          kernels=a.kernels - base.kernels, syncs=a.syncs - base.syncs,
                          copies=a.copies - base.copies, device_ms=a.device_ms,
                          sync_idle_ms=a.sync_idle_ms)
        if max(delta.ops, delta.kernels, delta.syncs, delta.copies) > 0:
            deltas.append(delta)
    return sorted(deltas, key=lambda d: (d.syncs, d.ops + d.kernels + d.copies), reverse=True)


# The line count that explains a change in each counter (new FLOPs come with new operators).
_LINE_FIELD = {"ops": "ops", "flops": "ops", "launches": "kernels", "kernels": "kernels",
               "syncs": "syncs", "copies": "copies", "copy-bytes": "copies"}


def compare_counters(before: list[dict[str, float]], after: list[dict[str, float]],
                     before_lines: list[LineCount], after_lines: list[LineCount],
                     ) -> list[CounterChange]:
    """Every counter both sides measured (each side a list of trials' counters), with the lines
    that explain a change where the evidence can tell."""
    changes = []
    for spec in COUNTERS:
        a = [c[spec.name] for c in before if spec.name in c]
        b = [c[spec.name] for c in after if spec.name in c]
        if not a or not b:
            continue
        change = CounterChange(spec.name, spec.label, spec.unit, (min(a), max(a)),
                               (min(b), max(b)))
        attribute = _LINE_FIELD.get(spec.name)
        if change.increase > 0 and attribute is not None:
            change.lines = [d for d in line_deltas(before_lines, after_lines)
                            if getattr(d, attribute) > 0]
        changes.append(change)
    return changes
