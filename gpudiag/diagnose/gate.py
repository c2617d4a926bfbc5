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

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from gpudiag.diagnose.compare import Comparison, RatioEstimate, StageComparison, compare_runs
from gpudiag.diagnose.counters import COUNTER_NAMES, CounterChange
from gpudiag.diagnose.gd1_launch import IDLE_WARNING as STARVED_IDLE
from gpudiag.diagnose.hostdiff import describe as describe_host_line
from gpudiag.diagnose.hostdiff import localized_growth
from gpudiag.diagnose.trials import merge_trials, rate_name
from gpudiag.model.calibration import DEFAULT_CALIBRATION, Calibration, load_calibration
from gpudiag.model.errors import BadInput, ExitCode
from gpudiag.model.options import GateOptions, OnInconclusive
from gpudiag.model.results import SEVERITY_RANK, Finding, RunResult
from gpudiag.model.validity import trial_key

GATE_ALPHA = 0.01  # a gate fails builds: it decides on 99% intervals
DEFAULT_LIMIT = 0.05  # wall-clock throughput, when the user sets none
MAX_PROJECTED = 100  # trials a side beyond which a projection stops counting

# "failed": the head's run broke (a stage crashed, was skipped where the base ran, or the run
# was interrupted): nothing to compare, and no build that crashes passes.
GateOutcome = Literal["pass", "regression", "inconclusive", "failed"]
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
    drift: bool = False  # wall time moved while the work did not: the machine changed


@dataclass
class GateDecision:
    outcome: GateOutcome
    stages: list[StageGate]
    new_findings: list[Finding]
    changes: list[tuple[str, CounterChange]]  # (stage, change) for every changed counter
    unseen: list[str]  # what the gate could not see, one line each
    priors: list[str] = field(default_factory=list)  # the spreads assumed, and whence
    stopped: list[str] = field(default_factory=list)  # why trials stopped (--base-ref)
    # No stage ran on either side (a command that fails on both): nothing to be undecided
    # about, and no exit 0 for it whatever --on-inconclusive says.
    measured_nothing: bool = False

    def exit_code(self, on_inconclusive: OnInconclusive = "pass") -> ExitCode:
        if self.outcome == "failed":
            return ExitCode.HEAD_FAILED
        if self.measured_nothing:
            return ExitCode.NOTHING_MEASURED
        if self.outcome == "inconclusive":
            return ExitCode.OK if on_inconclusive == "pass" else ExitCode.INCONCLUSIVE
        return ExitCode.REGRESSION if self.outcome == "regression" else ExitCode.OK

    def trials_wanted(self, per_side: int, max_trials: int) -> int:
        """Trials per side the next round should reach: enough for every undecided instrument
        that can decide within --max-trials; 0 when decided, at the cap, or when none can."""
        if self.outcome != "inconclusive" or per_side >= max_trials:
            return 0
        reachable = [g.trials_needed for g in self.stages if g.outcome == "inconclusive"
                     and g.trials_needed is not None and g.trials_needed <= max_trials]
        return min(max_trials, max(per_side + 1, *reachable)) if reachable else 0

    def why_stopped(self, per_side: int, max_trials: int) -> list[str]:
        """Per timed instrument: decided at how many trials a side, or why not."""
        lines = []
        for g in self.stages:
            if g.metric not in TIME_METRICS:
                continue
            what = f"{g.stage} {'wall' if g.metric == 'wall' else 'device'} time"
            decided_by = next((f"{o.stage} {o.metric}" for o in self.stages
                               if o.outcome == self.outcome), "")
            if g.outcome != "inconclusive":
                lines.append(f"{what}: decided ({g.outcome}) with {per_side} trial(s) a side")
            elif self.outcome in ("regression", "failed"):
                lines.append(f"{what}: undecided with {per_side} trial(s) a side; no more were "
                             f"run, the gate being decided ({self.outcome}: {decided_by})")
            elif g.trials_needed is None:
                lines.append(f"{what}: undecided ({g.reason})")
            elif g.trials_needed > max_trials:
                about = (f"about {g.trials_needed}" if g.trials_needed < MAX_PROJECTED
                         else f"over {MAX_PROJECTED}")
                lines.append(f"{what}: undecided; {about} trials a side would tell, beyond "
                             f"--max-trials {max_trials}: not worth adding trials for")
            else:
                lines.append(f"{what}: undecided at --max-trials {max_trials}")
        return lines


def _trials_needed(estimate: RatioEstimate, limit: float) -> int:
    """Trials a side for the interval to clear 1 - limit (if no slower than it looks) or to
    lie below 1 (if slower), at the spread estimated so far: the standard error shrinks with
    the square root of the trials and the t quantile with the degrees of freedom they add to
    the prior's (RatioEstimate.half_width)."""
    n = min(estimate.n_before, estimate.n_after)
    diff = math.log(estimate.ratio)
    room = diff - math.log(1 - limit) if diff > math.log(1 - limit) else -diff
    if room <= 0 or estimate.sigma <= 0:
        return MAX_PROJECTED
    return next((m for m in range(n + 1, MAX_PROJECTED) if estimate.half_width(m) <= room),
                MAX_PROJECTED)


def _pct(limit: float) -> str:
    """A limit as the user wrote it: 10%, 0.5%."""
    return f"{limit * 100:g}%"


def _head_failed(comparison: StageComparison) -> StageGate | None:
    """A failed verdict when the head did not run a stage the base ran."""
    a, b = comparison.before, comparison.after
    if a is None or not a.ok or b is None or b.ok:
        return None
    how = ("was interrupted" if b.interrupted else "was skipped" if b.status == "skipped"
           else "failed")
    return StageGate(comparison.stage, "wall", "failed", 0.0, None,
                     f"the head's stage {how} where the base's ran"
                     + (f": {b.error}" if b.error else ""))


def _unusable(comparison: StageComparison, limit: float, min_iters: int) -> StageGate | None:
    """An inconclusive wall-time verdict when the data cannot be judged at all, else None."""
    est, name = comparison.throughput, comparison.stage
    samples = [s for s in (comparison.before_samples, comparison.after_samples) if s]
    if comparison.before is None or comparison.after is None:
        return StageGate(name, "wall", "inconclusive", limit, None, comparison.note)
    if not comparison.before.ok:
        return StageGate(name, "wall", "inconclusive", limit, None,
                         "the base did not run this stage: nothing to hold the head to")
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


def interval_gate(stage: str, metric: str, est: RatioEstimate, limit: float,
                  rate: str = "throughput") -> StageGate:
    """Regression when the interval lies below 1 and the estimate is worse than the limit; pass
    when the interval's low end clears 1 - limit, or nothing changed and the data could have
    shown a change of the limit's size; inconclusive otherwise. `rate`: what the ratio is of
    (trials.rate_name)."""
    what = rate if metric == "wall" else f"device-time {rate}"
    change = (f"{est.ratio - 1:+.1%} {what} ({est.confidence:.0%} CI "
              f"{est.low - 1:+.1%} .. {est.high - 1:+.1%})")
    if est.high < 1 and est.ratio < 1 - limit:
        return StageGate(stage, metric, "regression", limit, est,
                         f"{change}: slower beyond the {_pct(limit)} limit")
    if est.low > 1 - limit:
        return StageGate(stage, metric, "pass", limit, est,
                         f"{change}: within the {_pct(limit)} limit")
    # "No significant change" only counts when the data could have shown a change of the
    # limit's size; otherwise absence of evidence is not evidence of absence.
    if not est.significant and est.ratio > 1 - limit and est.min_detectable <= limit:
        return StageGate(stage, metric, "pass", limit, est,
                         f"{change}: no significant change, and not a large one")
    return StageGate(stage, metric, "inconclusive", limit, est,
                     f"{change}: the interval reaches past the {_pct(limit)} limit; "
                     f"this data could only detect a {est.min_detectable:.1%} change",
                     trials_needed=_trials_needed(est, limit))


def gate_stage(comparison: StageComparison, limit: float, min_iters: int) -> StageGate:
    """The wall-clock throughput verdict of one stage."""
    unusable = _head_failed(comparison) or _unusable(comparison, limit, min_iters)
    if unusable is not None:
        return unusable
    assert comparison.throughput is not None
    return interval_gate(comparison.stage, "wall", comparison.throughput, limit,
                         rate_name(comparison.after or comparison.before))


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
        allowed = "any increase" if limit == 0 else f"the {_pct(limit)} limit"
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
                         f"{text}: beyond the {_pct(limit)} limit")
    return StageGate(name, "energy", "pass", limit, None, f"{text}: within the {_pct(limit)} limit")


def _same_work(s: StageComparison) -> bool:
    """Both sides did exactly the same work per step: every exact counter measured, identical
    on both sides and in every trial."""
    names = {c.name for c in s.counters}
    return {"ops", "kernels"} & names != set() and not any(c.changed or c.varies
                                                           for c in s.counters)


def _drift(wall: StageGate, device: StageGate | None, s: StageComparison, *,
           interleaved: bool) -> StageGate:
    """Wall time slower (a regression, or an estimate past the limit) for code that did the
    same work, on the same device time: the machine changed (load, clocks), not the code.
    Trials interleaved in one job (two or more a side) share the machine's changes, so there a
    regression stands: host-side work got slower."""
    est = wall.estimate
    slower = est is not None and (wall.outcome == "regression" or (
        wall.outcome == "inconclusive" and est.ratio < 1 - wall.limit))
    grew_at = localized_growth(s.host_lines) if slower else None
    if grew_at is not None:  # the step grew at a line the head edited, not everywhere
        return dataclasses.replace(wall, reason=wall.reason + f"; the host's step grew at "
                                   f"{describe_host_line(grew_at)}, a line the head changed, "
                                   "and the rest of it did not: the code, not the machine")
    # "Device time unchanged" only where its interval showed it within its limit: one that
    # merely found no significant change over a wide interval (a single trial a side of a
    # script whose steps differ: -100% .. +2,900%) has not shown it unchanged.
    if not slower or est is None or not _same_work(s) or (
            device is not None and device.outcome != "pass"):
        return wall
    unchanged = "device time unchanged" if device is not None else "no device time to check"
    if interleaved and not est.on_prior_alone:
        if wall.outcome != "regression":
            return wall
        return dataclasses.replace(wall, reason=wall.reason + f" (every exact counter "
                                   f"identical and {unchanged}: host-side work got slower, "
                                   "measured interleaved)")
    fix = ("interleaved trials are added" if interleaved else "measure both builds in one job, "
           "interleaved (`gpudiag gate --base-ref`), to tell the two apart")
    n = min(est.n_before, est.n_after)
    return dataclasses.replace(
        wall, outcome="inconclusive", drift=True, trials_needed=max(2, n + 1),
        reason=f"{wall.reason.split(': ')[0]}, with every exact counter identical and "
               f"{unchanged}: the machine changed (load, clocks), not the work; {fix}")


def _host_line_named(wall: StageGate, s: StageComparison) -> StageGate:
    """A wall-time regression of a profiled script names the line whose host time grew most
    (where _drift did not already name the one it grew at)."""
    grown = [c for c in s.host_lines if c.grew_ms > 0]
    if wall.outcome != "regression" or not grown or "the host's step grew at" in wall.reason:
        return wall
    top = max(grown, key=lambda c: c.grew_ms)
    return dataclasses.replace(wall, reason=wall.reason + "; host time grew most at "
                               + describe_host_line(top))


def _stage_gates(s: StageComparison, limits: GateLimits, min_iters: int, *,
                 interleaved: bool) -> list[StageGate]:
    wall_limit = limits.get(s.stage, "wall")
    assert wall_limit is not None
    if not any(x is not None and x.ok for x in (s.before, s.after)) and \
            s.before is not None and s.after is not None:
        return []  # skipped or failed on both sides alike (a ddp stage on one GPU): unseen
    wall = gate_stage(s, wall_limit, min_iters)
    if s.before is None or s.after is None or wall.outcome == "failed":
        return [wall]
    device_limit = limits.get(s.stage, "device")
    device = (interval_gate(s.stage, "device", s.device, device_limit,
                            rate_name(s.after or s.before))
              if s.device is not None and device_limit is not None else None)
    gates = [_host_line_named(_drift(wall, device, s, interleaved=interleaved), s)]
    if device is not None:
        gates.append(device)
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
    """What this gate could not see, stage by stage: a stage neither side ran, no device time,
    no counters, or an instrument whose smallest detectable change was above its limit."""
    lines = []
    for s in comparison.stages:
        if s.before is not None and s.after is not None and not (s.before.ok or s.after.ok):
            why = s.after.error or s.before.error or s.after.status
            lines.append(f"{s.stage}: ran on neither side ({why})")
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
        lines += _uncalibrated_host_bound(s)
    for g in gates:
        if g.outcome == "inconclusive" and g.estimate is not None:
            what = "wall time" if g.metric == "wall" else f"{g.metric} time"
            lines.append(f"{g.stage}: {what} could only detect a change of "
                         f"{g.estimate.min_detectable:.1%} or more (limit {_pct(g.limit)})")
    return lines


def _uncalibrated_host_bound(s: StageComparison) -> list[str]:
    """A wall-time prior that is only the built-in floor, on a script whose GPU waits on the
    host as long as GD102 warns of (STARVED_IDLE): such scripts' processes can differ far
    more than the floor (nanoGPT's eager step by 25% on an H200,
    reports/examples/h200-gate-nanogpt), and the verdict leans on it."""
    est, b = s.throughput, s.after
    idle = b.evidence.idle_fraction if b is not None and b.evidence is not None else None
    if est is None or not est.floor.source.startswith("built-in") or b is None or \
            b.facts.script is None or b.evidence is None or b.evidence.backend != "cuda" or \
            idle is None or idle < STARVED_IDLE:
        return []
    return [f"{s.stage}: wall time's spread between processes is the built-in floor "
            f"({est.floor.sigma:.0%}), and the GPU idles {idle:.0%} of the step: a host-bound "
            "script's processes can differ far more; record this machine's with `gpudiag "
            "calibrate -- COMMAND` before trusting a wall-time verdict"]


def _priors(comparison: Comparison) -> list[str]:
    lines = []
    for s in comparison.stages:
        parts = [f"{what} {e.floor.describe()}, pooled with the trials' own: {e.sigma:.2%}"
                 for what, e in (("wall time", s.throughput), ("device time", s.device))
                 if e is not None]
        if parts:
            lines.append(f"{s.stage}: " + "; ".join(parts))
    return lines


_PRECEDENCE: tuple[GateOutcome, ...] = ("failed", "regression", "inconclusive")


def decide(comparison: Comparison, limits: GateLimits | None = None, *,
           min_iters: int = 10, interleaved: bool = False) -> GateDecision:
    """The gate: failed if the head broke a stage the base ran, regression if any stage
    regressed on any gated instrument, else inconclusive if any could not tell, else pass.
    `interleaved`: the trials of both sides alternated in one job (`--base-ref`), so a wall
    time change of the same work is the code's, not the machine's. Changed counters and new
    findings travel with it."""
    limits = limits or GateLimits()
    gates = [g for s in comparison.stages
             for g in _stage_gates(s, limits, min_iters, interleaved=interleaved)]
    outcomes = {g.outcome for g in gates}
    outcome: GateOutcome = next((o for o in _PRECEDENCE if o in outcomes),
                                "pass" if gates else "inconclusive")
    new = sorted(comparison.findings_new,
                 key=lambda f: (SEVERITY_RANK[f.severity], f.impact), reverse=True)
    changes = [(s.stage, c) for s in comparison.stages for c in s.counter_changes]
    ran = [side for s in comparison.stages for side in (s.before, s.after)
           if side is not None and side.ok]
    return GateDecision(outcome=outcome, stages=gates, new_findings=new, changes=changes,
                        unseen=_unseen(comparison, gates), priors=_priors(comparison),
                        measured_nothing=bool(comparison.stages) and not ran)


@dataclass(frozen=True)
class GateRules:
    """What the user asked the gate to hold two runs to (`gpudiag gate`'s options)."""

    limits: GateLimits = field(default_factory=GateLimits)
    min_iters: int = 10
    allow_mismatch: bool = False
    calibration: Calibration | None = None


def gate_rules(options: GateOptions) -> GateRules:
    """The rules a gate's options ask for: the limits parsed, and the between-process spread
    it starts from: --calibration's file, else the repository's default one where it exists."""
    limits = parse_limits(list(options.max_regression))
    path = options.calibration
    if path is None and DEFAULT_CALIBRATION.is_file():
        path = DEFAULT_CALIBRATION
    return GateRules(limits, options.min_iters, options.allow_mismatch,
                     None if path is None else load_calibration(path))


def _same_measurement(before: RunResult, after: RunResult) -> str | None:
    """The stage whose steps both runs share (one run given twice, or copied), if any."""
    for a in before.stages:
        b = after.stage(a.name)
        if b is None:
            continue
        if len(a.iter_ms) >= 3 and a.iter_ms == b.iter_ms:
            return a.name
        if {trial_key(t) for t in a.trials} & {trial_key(t) for t in b.trials}:
            return a.name
    return None


def judge(before: RunResult, after: RunResult, rules: GateRules, *,
          labels: tuple[str, str] = ("before", "after"),
          interleaved: bool = False) -> tuple[GateDecision, Comparison]:
    """Compare two runs on the gate's 99% intervals and decide. BadInput when they cannot be
    judged: different model, batch, precision, software or GPU (unless allowed), an
    interrupted base, the same measurement on both sides, a limit on a stage neither run has.
    An interrupted head fails the gate."""
    if before.interrupted:
        raise BadInput(f"{labels[0]}: the base run was interrupted; record a complete one")
    shared = _same_measurement(before, after)
    if shared is not None:
        raise BadInput(f"{labels[0]} and {labels[1]} hold the same measurement (stage "
                       f"{shared!r}: identical step times): give two separate runs")
    comparison = compare_runs(before, after, before_label=labels[0], after_label=labels[1],
                              alpha=GATE_ALPHA, calibration=rules.calibration)
    if comparison.mismatches and not rules.allow_mismatch:
        raise BadInput("runs are not comparable (" + "; ".join(comparison.mismatches)
                       + "); pass --allow-mismatch to gate anyway")
    unknown = sorted(rules.limits.stages - {s.stage for s in comparison.stages})
    if unknown:
        raise BadInput(f"--max-regression names unknown stage(s): {', '.join(unknown)}")
    decision = decide(comparison, rules.limits, min_iters=rules.min_iters,
                      interleaved=interleaved)
    if after.interrupted and decision.outcome != "failed":
        decision.outcome = "failed"
        decision.stages.insert(0, StageGate("(run)", "wall", "failed", 0.0, None,
                                            "the head's run was interrupted"))
    return decision, comparison


def judge_trials(base: list[RunResult], head: list[RunResult], rules: GateRules, *,
                 labels: tuple[str, str], max_trials: int) -> tuple[GateDecision, Comparison]:
    """`gate --base-ref`'s interleaved trials judged, each side's merged (so far: the gate asks
    after every round whether to go on), and why its trials stopped where they did."""
    decision, comparison = judge(merge_trials(base), merge_trials(head), rules, labels=labels,
                                 interleaved=True)
    decision.stopped = decision.why_stopped(min(len(base), len(head)), max_trials)
    return decision, comparison
