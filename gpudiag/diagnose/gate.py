"""The CI gate's decision: the user's limits, a verdict per stage and instrument, what the data
could not see, and whether more trials would settle it. Pure functions of a Comparison.

Three instruments, each for what it resolves (see docs/performance.md for the measurements):
- exact counters (device ops, launches, kernels, syncs, copies, FLOPs, peak memory, compiled
  graphs, graph breaks) are the same in every fresh process, so one trial a side shows a change;
  they fail the gate only where the user set a limit (a bigger model legitimately adds work);
- device time (kernel time per step) hardly depends on the host, so a small between-process
  floor lets it resolve GPU-side slowdowns of a few percent;
- wall-clock step time catches host-side regressions; on a shared machine fresh processes
  differ by several percent, so it needs trials, and says what it could not resolve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from scipy import stats

from gpudiag.diagnose.compare import Comparison, RatioEstimate, StageComparison, compare_runs
from gpudiag.diagnose.counters import COUNTER_NAMES, CounterChange
from gpudiag.model.errors import EXIT_INCONCLUSIVE, EXIT_OK, EXIT_REGRESSION, BadInput
from gpudiag.model.results import SEVERITY_RANK, Finding, RunResult

GATE_ALPHA = 0.01  # a gate fails builds: it decides on 99% intervals
DEFAULT_LIMIT = 0.05  # wall-clock throughput, when the user sets none
# Trials beyond this multiple of --max-trials are out of reach: stop adding them.
OUT_OF_REACH = 2

GateOutcome = Literal["pass", "regression", "inconclusive"]
OnInconclusive = Literal["pass", "fail"]
TIME_METRICS = ("wall", "device")
METRICS = (*TIME_METRICS, "energy", *COUNTER_NAMES)


@dataclass
class GateLimits:
    """Allowed loss per (stage or None for every stage, metric), as fractions. Wall time has a
    default; device time falls back to the stage's wall limit; energy and counters are gated
    only where set."""

    limits: dict[tuple[str | None, str], float] = field(default_factory=dict)

    def get(self, stage: str, metric: str) -> float | None:
        for key in ((stage, metric), (None, metric)):
            if key in self.limits:
                return self.limits[key]
        if metric == "device":
            return self.get(stage, "wall")
        return DEFAULT_LIMIT if metric == "wall" else None

    def counters(self, stage: str) -> set[str]:
        """The counters with a limit on this stage."""
        return {m for st, m in self.limits if m in COUNTER_NAMES and st in (None, stage)}

    @property
    def stages(self) -> set[str]:
        return {stage for stage, _ in self.limits if stage is not None}


def parse_limits(values: list[str]) -> GateLimits:
    """`PCT` (wall time, every stage), `STAGE=PCT`, `METRIC=PCT` or `STAGE:METRIC=PCT`, where
    METRIC is wall, device, energy or a counter (ops, syncs, flops, memory, ...). Counters take
    0 ("no increase at all")."""
    limits: dict[tuple[str | None, str], float] = {}
    for value in values:
        name, _, number = value.rpartition("=")
        try:
            pct = float(number)
        except ValueError:
            raise BadInput(f"--max-regression {value!r}: expected PCT, STAGE=PCT, METRIC=PCT "
                           f"or STAGE:METRIC=PCT (metrics: {', '.join(METRICS)})") from None
        stage, _, metric = name.rpartition(":")
        if metric not in METRICS:
            stage, metric = name, "wall"
        lowest = 0 if metric in COUNTER_NAMES else math.ulp(0)
        if not (lowest <= pct < 100) or not math.isfinite(pct):
            bound = "[0, 100)" if lowest == 0 else "(0, 100)"
            raise BadInput(f"--max-regression {value!r}: the percentage must be in {bound}")
        limits[(stage or None, metric)] = pct / 100
    return GateLimits(limits)


@dataclass
class StageGate:
    stage: str
    metric: str  # "wall", "device", "energy" or a counter's name
    outcome: GateOutcome
    limit: float
    estimate: RatioEstimate | None
    reason: str
    trials_needed: int | None = None


@dataclass
class GateDecision:
    outcome: GateOutcome
    stages: list[StageGate]
    new_findings: list[Finding]
    changes: list[tuple[str, CounterChange]]  # (stage, change) for every changed counter
    unseen: list[str]  # what the gate could not see, one line each

    def exit_code(self, on_inconclusive: OnInconclusive = "pass") -> int:
        if self.outcome == "inconclusive":
            return EXIT_OK if on_inconclusive == "pass" else EXIT_INCONCLUSIVE
        return EXIT_REGRESSION if self.outcome == "regression" else EXIT_OK

    def trials_wanted(self, per_side: int, max_trials: int) -> int:
        """Trials per side the next round should reach to settle an inconclusive gate: 0 when
        decided, at --max-trials, or when what would settle it is far beyond it."""
        if self.outcome != "inconclusive" or per_side >= max_trials:
            return 0
        needed = max((g.trials_needed or per_side + 1 for g in self.stages
                      if g.outcome == "inconclusive"), default=0)
        if needed > OUT_OF_REACH * max_trials:
            return 0
        return min(max_trials, max(per_side + 1, needed))


def _trials_needed(estimate: RatioEstimate, limit: float) -> int:
    """Samples per side for the interval to clear 1 - limit (if no slower than it looks) or to
    lie below 1 (if slower), assuming the same spread: the standard error shrinks with the
    square root of n and the t quantile with the degrees of freedom (about 2n - 2) that n
    samples a side give; a projection from two trials a side would be far too pessimistic
    with the t quantile of two."""
    n = min(estimate.n_before, estimate.n_after)
    half = (math.log(estimate.high) - math.log(estimate.low)) / 2
    diff = math.log(estimate.ratio)
    room = diff - math.log(1 - limit) if diff > math.log(1 - limit) else -diff
    if room <= 0 or half <= 0:
        return n * 4
    alpha = 1 - estimate.confidence
    se = half / _t(alpha, max(1, 2 * n - 2))
    for more in range(n + 1, 100 * n + 1):
        if _t(alpha, 2 * more - 2) * se * math.sqrt(n / more) <= room:
            return more
    return 100 * n


def _t(alpha: float, df: float) -> float:
    return float(stats.t.ppf(1 - alpha / 2, df))


def _unusable(comparison: StageComparison, limit: float, min_iters: int) -> StageGate | None:
    """An inconclusive wall-time verdict when the data cannot be judged at all, else None."""
    est, name = comparison.throughput, comparison.stage
    samples = [s for s in (comparison.before_samples, comparison.after_samples) if s]
    if comparison.before is None or comparison.after is None:
        return StageGate(name, "wall", "inconclusive", limit, None, comparison.note)
    if any(s.invalid for s in samples) and est is None:
        return StageGate(name, "wall", "inconclusive", limit, None,
                         "every trial on a side throttled (thermal/hardware slowdown)")
    if any(s.iters < min_iters for s in samples):
        return StageGate(name, "wall", "inconclusive", limit, est,
                         f"fewer than {min_iters} steady-state steps on a side")
    if est is None:
        return StageGate(name, "wall", "inconclusive", limit, None,
                         comparison.note or "no samples", trials_needed=2)
    return None


def interval_gate(stage: str, metric: str, est: RatioEstimate, limit: float) -> StageGate:
    """Regression when the interval lies below 1 and the estimate is worse than the limit; pass
    when the interval's low end clears 1 - limit, or nothing changed and the data could have
    shown a change of the limit's size; inconclusive otherwise."""
    what = "throughput" if metric == "wall" else "device-time throughput"
    change = (f"{est.ratio - 1:+.1%} {what} ({est.confidence:.0%} CI "
              f"{est.low - 1:+.1%} .. {est.high - 1:+.1%})")
    if est.high < 1 and est.ratio < 1 - limit:
        return StageGate(stage, metric, "regression", limit, est,
                         f"{change}: slower beyond the {limit:.0%} limit")
    if est.low > 1 - limit:
        return StageGate(stage, metric, "pass", limit, est,
                         f"{change}: within the {limit:.0%} limit")
    # "No significant change" only counts when the data could have shown a change of the
    # limit's size; otherwise absence of evidence is not evidence of absence.
    if not est.significant and est.ratio > 1 - limit and est.min_detectable <= limit:
        return StageGate(stage, metric, "pass", limit, est,
                         f"{change}: no significant change, and not a large one")
    return StageGate(stage, metric, "inconclusive", limit, est,
                     f"{change}: the interval reaches past the {limit:.0%} limit; "
                     f"this data could only detect a {est.min_detectable:.1%} change",
                     trials_needed=_trials_needed(est, limit))


def gate_stage(comparison: StageComparison, limit: float, min_iters: int) -> StageGate:
    """The wall-clock throughput verdict of one stage."""
    unusable = _unusable(comparison, limit, min_iters)
    if unusable is not None:
        return unusable
    assert comparison.throughput is not None
    return interval_gate(comparison.stage, "wall", comparison.throughput, limit)


def _count(value: float, unit: str) -> str:
    if unit == "MiB":
        return f"{value:,.1f} MiB"
    if value >= 1e6:
        return f"{value:.4g}"
    return f"{value:,.2f}".rstrip("0").rstrip(".")


def _span(values: tuple[float, float], unit: str) -> str:
    low, high = values
    return _count(low, unit) if low == high else f"{_count(low, unit)}..{_count(high, unit)}"


def describe_change(change: CounterChange) -> str:
    """'host-device syncs 768 -> 769 (+0.1%), from model.py:130 (+1 syncs, 0.42 ms)'."""
    before, after = change.before, change.after
    if not change.changed:
        return f"{change.label} {_span(after, change.unit)} (unchanged)"
    text = f"{change.label} {_span(before, change.unit)} -> {_span(after, change.unit)}"
    if change.increase == math.inf:
        text += " (new)"
    elif before[1]:
        text += f" ({after[0] / before[1] - 1:+.1%})"
    if change.varies:
        text += " (varied between trials: compared as ranges)"
    for line in change.lines[:3]:
        grew = ", ".join(f"+{_count(v, '')} {k}" for k, v in
                         (("ops", line.ops), ("kernels", line.kernels), ("syncs", line.syncs),
                          ("copies", line.copies)) if v > 0)
        cost = (f", costing {line.cost_ms:.2f} ms of device time and idling"
                if line.cost_ms > 0 else "")
        text += f"; from {line.location} in {line.function}() ({grew} per step{cost})"
    return text


def counter_gate(stage: str, change: CounterChange, limit: float) -> StageGate:
    text = describe_change(change)
    if change.increase > limit:
        allowed = "any increase" if limit == 0 else f"the {limit:.0%} limit"
        return StageGate(stage, change.name, "regression", limit, None,
                         f"{text}: beyond {allowed}")
    return StageGate(stage, change.name, "pass", limit, None, f"{text}: within the limit")


def energy_gate(comparison: StageComparison, limit: float) -> StageGate:
    """Energy per sample, a comparison of medians (one counter window per trial)."""
    change = next(m for m in comparison.metrics if m.name == "energy/sample")
    name = comparison.stage
    if change.ratio is None:
        return StageGate(name, "energy", "inconclusive", limit, None, "no energy on both sides")
    text = f"energy {change.ratio - 1:+.1%} ({change.before:,.4g} -> {change.after:,.4g} J)"
    if change.ratio > 1 + limit:
        return StageGate(name, "energy", "regression", limit, None,
                         f"{text}: beyond the {limit:.0%} limit")
    return StageGate(name, "energy", "pass", limit, None, f"{text}: within the {limit:.0%} limit")


def _stage_gates(s: StageComparison, limits: GateLimits, min_iters: int) -> list[StageGate]:
    wall = limits.get(s.stage, "wall")
    assert wall is not None
    gates = [gate_stage(s, wall, min_iters)]
    if s.before is None or s.after is None:
        return gates
    device = limits.get(s.stage, "device")
    if s.device is not None and device is not None:
        gates.append(interval_gate(s.stage, "device", s.device, device))
    measured = {c.name: c for c in s.counters}
    for name in sorted(limits.counters(s.stage)):
        limit = limits.get(s.stage, name)
        assert limit is not None
        if name in measured:
            gates.append(counter_gate(s.stage, measured[name], limit))
        else:
            gates.append(StageGate(s.stage, name, "inconclusive", limit, None,
                                   f"no {name} counter measured on both sides"))
    energy = limits.get(s.stage, "energy")
    if energy is not None:
        gates.append(energy_gate(s, energy))
    return gates


def _unseen(comparison: Comparison, gates: list[StageGate]) -> list[str]:
    """What this gate could not see, stage by stage: no device time, no counters, or an
    instrument whose smallest detectable change was above its limit."""
    lines = []
    for s in comparison.stages:
        if s.before is None or s.after is None or not (s.before.ok and s.after.ok):
            continue
        if s.device is None:
            lines.append(f"{s.stage}: no device time (no kernel times on both sides: a CPU, "
                         "or no evidence window); GPU-side changes are judged by wall time")
        if not s.counters:
            lines.append(f"{s.stage}: no exact counters on both sides (run with "
                         "--evidence-steps 1 or more)")
        else:
            varying = [c.name for c in s.counters if c.varies]
            if varying:
                lines.append(f"{s.stage}: {', '.join(varying)} varied between trials of a "
                             "side: not exact here, compared as ranges")
    for g in gates:
        if g.outcome == "inconclusive" and g.estimate is not None:
            what = "wall time" if g.metric == "wall" else f"{g.metric} time"
            lines.append(f"{g.stage}: {what} could only detect a change of "
                         f"{g.estimate.min_detectable:.1%} or more (limit {g.limit:.0%})")
    return lines


def decide(comparison: Comparison, limits: GateLimits | None = None, *,
           min_iters: int = 10) -> GateDecision:
    """The gate: regression if any stage regressed on any gated instrument, else inconclusive
    if any could not tell, else pass. Changed counters and new findings travel with it."""
    limits = limits or GateLimits()
    gates = [g for s in comparison.stages for g in _stage_gates(s, limits, min_iters)]
    outcomes = {g.outcome for g in gates}
    outcome: GateOutcome = ("regression" if "regression" in outcomes else
                            "inconclusive" if "inconclusive" in outcomes or not gates else "pass")
    new = sorted(comparison.findings_new,
                 key=lambda f: (SEVERITY_RANK[f.severity], f.impact), reverse=True)
    changes = [(s.stage, c) for s in comparison.stages for c in s.counter_changes]
    return GateDecision(outcome=outcome, stages=gates, new_findings=new, changes=changes,
                        unseen=_unseen(comparison, gates))


@dataclass(frozen=True)
class GateRules:
    """What the user asked the gate to hold two runs to (`gpudiag gate`'s options)."""

    limits: GateLimits = field(default_factory=GateLimits)
    min_iters: int = 10
    allow_mismatch: bool = False


def judge(before: RunResult, after: RunResult, rules: GateRules, *,
          labels: tuple[str, str] = ("before", "after")) -> tuple[GateDecision, Comparison]:
    """Compare two runs on the gate's 99% intervals and decide. BadInput when they cannot be
    compared (different model, batch or GPU, unless allowed) or a limit names a stage neither
    run has."""
    comparison = compare_runs(before, after, before_label=labels[0], after_label=labels[1],
                              alpha=GATE_ALPHA)
    if comparison.mismatches and not rules.allow_mismatch:
        raise BadInput("runs are not comparable (" + "; ".join(comparison.mismatches)
                       + "); pass --allow-mismatch to gate anyway")
    unknown = sorted(rules.limits.stages - {s.stage for s in comparison.stages})
    if unknown:
        raise BadInput(f"--max-regression names unknown stage(s): {', '.join(unknown)}")
    return decide(comparison, rules.limits, min_iters=rules.min_iters), comparison
