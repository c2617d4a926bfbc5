"""Before/after statistics and verdicts. Pure functions of runs.

The throughput ratio (after over before) is estimated on log throughput. Each side's score is
the mean of its trials' (fresh processes'); with a single trial, the mean of blocks of its
steps, whose spread only adds the trial's own measurement noise. How much processes differ is
not learnt from two or three trials but from prior knowledge, pooled with them
(gpudiag/diagnose/noise.py): the interval is a t interval with the pooled spread's degrees of
freedom, so it narrows as trials are added. Every comparison states the smallest change it
could have detected (80% power), and no verdict claims more than its data can show.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from scipy import stats

from gpudiag.diagnose.counters import CounterChange, compare_counters
from gpudiag.diagnose.hostdiff import HostLineChange, host_line_changes
from gpudiag.diagnose.noise import NoiseFloor, floor_for
from gpudiag.diagnose.trials import (
    StageSamples,
    device_samples,
    side_counters,
    stage_samples,
)
from gpudiag.model.calibration import Calibration
from gpudiag.model.results import Finding, RunResult, StageResult

ALPHA = 0.05  # compare shows 95% intervals
POWER = 0.80
DEFAULT_MARGIN = 0.05  # changes inside +-5% with a tight interval read "no significant change"

Verdict = Literal["faster", "slower", "no significant change", "inconclusive"]


@dataclass
class RatioEstimate:
    ratio: float  # after / before throughput (>1: faster)
    low: float
    high: float
    n_before: int  # processes (trials) behind each side
    n_after: int
    min_detectable: float  # smallest relative change detectable at 80% power
    sigma: float  # between-process spread of one trial's log throughput: prior and data pooled
    sigma_df: float  # its degrees of freedom (the prior's plus the trials')
    floor: NoiseFloor  # the prior it started from
    confidence: float = 1 - ALPHA

    @property
    def on_prior_alone(self) -> bool:
        """One trial on a side: its spread between processes is the prior's, not measured."""
        return min(self.n_before, self.n_after) < 2

    @property
    def significant(self) -> bool:
        return self.low > 1 or self.high < 1

    def half_width(self, per_side: int) -> float:
        """The log interval's half-width with `per_side` trials a side at this spread."""
        df = self.floor.df + 2 * per_side - 2
        return _quantile(1 - (1 - self.confidence) / 2, df) * self.sigma * math.sqrt(2 / per_side)


def _quantile(p: float, df: float) -> float:
    return float(stats.t.ppf(p, df) if math.isfinite(df) else stats.norm.ppf(p))


@dataclass
class _Side:
    mean: float  # of log scores: trials, or a single trial's blocks
    n: int  # processes
    ss: float  # sum of squares between trials (0 for a single trial)
    within: float  # a single trial's blocks: the variance of their mean; trials: 0
    within_df: float


def _side(samples: StageSamples) -> _Side:
    logs = np.log(samples.scores)
    if samples.kind == "trials":
        return _Side(float(logs.mean()), len(logs), float(((logs - logs.mean()) ** 2).sum()),
                     0.0, math.inf)
    within = float(logs.var(ddof=1) / len(logs)) if len(logs) >= 2 else 0.0
    return _Side(float(logs.mean()), 1, 0.0, within, max(1, len(logs) - 1))


def estimate_ratio(before: StageSamples, after: StageSamples, floor: NoiseFloor,
                   alpha: float = ALPHA) -> RatioEstimate | None:
    """The throughput ratio's interval, or None when a side has no samples. `floor` is the
    prior between-process spread; the trials' own spread is pooled with it."""
    if not before.scores or not after.scores:
        return None
    a, b = _side(before), _side(after)
    sigma_df = floor.df + (a.n - 1) + (b.n - 1)
    variance = (floor.df * floor.sigma ** 2 + a.ss + b.ss) / sigma_df
    between = variance * (1 / a.n + 1 / b.n)
    se2 = between + a.within + b.within
    # Welch-Satterthwaite over the pooled spread and each single trial's own noise.
    parts = between ** 2 / sigma_df + sum(s.within ** 2 / s.within_df for s in (a, b))
    df = se2 ** 2 / parts if parts > 0 else math.inf
    se = math.sqrt(se2)
    diff = b.mean - a.mean
    t_crit = _quantile(1 - alpha / 2, df)
    min_detectable = 1 - math.exp(-(t_crit + _quantile(POWER, df)) * se)
    return RatioEstimate(ratio=math.exp(diff), low=math.exp(diff - t_crit * se),
                         high=math.exp(diff + t_crit * se), n_before=a.n, n_after=b.n,
                         min_detectable=min_detectable,
                         sigma=math.sqrt(variance), sigma_df=sigma_df, floor=floor,
                         confidence=1 - alpha)


def verdict(estimate: RatioEstimate | None, margin: float = DEFAULT_MARGIN) -> Verdict:
    if estimate is None:
        return "inconclusive"
    if estimate.low > 1:
        return "faster"
    if estimate.high < 1:
        return "slower"
    if estimate.low >= 1 - margin and estimate.high <= 1 + margin:
        return "no significant change"
    return "inconclusive"


@dataclass
class MetricChange:
    name: str
    unit: str
    before: float | None
    after: float | None

    @property
    def ratio(self) -> float | None:
        if self.before is None or self.after is None or self.before == 0:
            return None
        return self.after / self.before


@dataclass
class StageComparison:
    stage: str
    before: StageResult | None
    after: StageResult | None
    throughput: RatioEstimate | None
    verdict: Verdict
    metrics: list[MetricChange]
    before_samples: StageSamples | None = None
    after_samples: StageSamples | None = None
    note: str = ""
    # Device time (kernel time per step): its own interval, beside wall-clock throughput.
    device: RatioEstimate | None = None
    device_samples: tuple[StageSamples, StageSamples] | None = None
    counters: list[CounterChange] = field(default_factory=list)
    # A profiled script's host time per step by line, both sides (gpudiag/diagnose/hostdiff.py)
    host_lines: list[HostLineChange] = field(default_factory=list)

    @property
    def counter_changes(self) -> list[CounterChange]:
        return [c for c in self.counters if c.changed]


@dataclass
class Comparison:
    before_label: str
    after_label: str
    stages: list[StageComparison]
    env_differences: list[tuple[str, Any, Any]]
    config_differences: list[tuple[str, Any, Any]]
    mismatches: list[str]  # what makes the runs not comparable for a gate
    confidence: float
    findings_resolved: list[Finding] = field(default_factory=list)
    findings_new: list[Finding] = field(default_factory=list)
    findings_persisting: list[Finding] = field(default_factory=list)
    # Some trials of a side showed them and others did not: near their thresholds, within the
    # run-to-run noise (RunResult.unsteady_findings); never new or resolved.
    findings_unsteady: list[Finding] = field(default_factory=list)

    def stage(self, name: str) -> StageComparison | None:
        return next((s for s in self.stages if s.stage == name), None)


_ENV_FIELDS = ("gpu_name", "driver_version", "cuda_runtime", "torch_version", "power_limit_w",
               "device")
# Differences that make throughputs incomparable for a gate (unless --allow-mismatch).
_GATE_CONFIG_FIELDS = ("model", "preset", "batch_size", "seq_len")


def _metrics(before: StageResult | None, after: StageResult | None) -> list[MetricChange]:
    def get(stage: StageResult | None, fn: Any) -> float | None:
        return fn(stage) if stage is not None and stage.ok else None

    rows = [
        ("ms/iter", "ms", lambda s: s.ms_per_iter),
        ("samples/s", "1/s", lambda s: s.samples_per_s),
        ("power", "W", lambda s: s.telemetry.power_mean_w),
        ("energy/sample", "J", lambda s: s.energy_per_sample_j),
        ("kernel-active", "%", lambda s: s.telemetry.kernel_active_pct),
        ("SM active", "%", lambda s: s.telemetry.gpm.get("sm_active_pct")),
        ("peak memory", "MiB", lambda s: s.memory.peak_allocated_mib if s.memory else None),
    ]
    return [MetricChange(name, unit, get(before, fn), get(after, fn)) for name, unit, fn in rows]


def _add_exact_and_device(stage: StageComparison, a: StageResult, b: StageResult,
                          alpha: float, floor: NoiseFloor) -> None:
    """The stage's exact counters side by side, and its device-time interval where both sides
    measured kernel time."""
    stage.counters = compare_counters(
        side_counters(a), side_counters(b),
        a.evidence.line_counts if a.evidence else [], b.evidence.line_counts if b.evidence else [])
    stage.host_lines = host_line_changes(a, b)
    da, db = device_samples(a), device_samples(b)
    if da is not None and db is not None:
        stage.device_samples = (da, db)
        stage.device = estimate_ratio(da, db, floor, alpha)


def _differences(before: dict[str, object], after: dict[str, object]
                 ) -> list[tuple[str, object, object]]:
    """(name, before, after) for each setting that differs, either side's missing as None."""
    names = list(dict.fromkeys([*before, *after]))
    return [(n, before.get(n), after.get(n)) for n in names if before.get(n) != after.get(n)]


def _line(f: Finding) -> tuple[str, int]:
    """A finding's file and line number ("" and 0 where it names none)."""
    path, _, number = (f.location or "").rpartition(":")
    return (path, int(number)) if number.isdigit() else (f.location or "", 0)


def match_findings(before: list[Finding], after: list[Finding],
                   ) -> tuple[list[Finding], list[Finding], list[Finding]]:
    """(resolved, new, persisting): the same rule on the same stage at the same place, else in
    the same file at the nearest line (code above it moved it: the same finding, not a new
    one)."""
    olds = {f.place: f for f in before}
    news = {f.place: f for f in after}
    persisting = [f for k, f in news.items() if k in olds]
    left_old = [f for k, f in olds.items() if k not in news]
    new = []
    for f in (f for k, f in news.items() if k not in olds):
        path, number = _line(f)
        same = [o for o in left_old if (o.id, o.stage) == (f.id, f.stage)
                and _line(o)[0] == path and path]
        if same:
            moved = min(same, key=lambda o: abs(_line(o)[1] - number))
            left_old.remove(moved)
            persisting.append(f)
        else:
            new.append(f)
    return left_old, new, persisting


def _note(a: StageResult | None, b: StageResult | None, estimate: RatioEstimate | None) -> str:
    if a is None or b is None:
        return f"only in the {'after' if a is None else 'before'} run"
    if not (a.ok and b.ok):
        return "did not run on both sides"
    if estimate is None:
        return "too few samples for an interval (need 10+ steady steps a side)"
    if estimate.on_prior_alone:
        return (f"one trial on a side: how much processes differ is the prior's, "
                f"{estimate.floor.describe()}; use --trials to measure it")
    return ""


def _mismatches(before: RunResult, after: RunResult,
                config_diff: list[tuple[str, object, object]]) -> list[str]:
    """What makes two runs measure different things (a gate refuses them unless allowed): the
    workload and its precision, the device and GPU, the software that ran it, a stage's batch
    or precision, stages only one side has."""
    identity = {*before.config.identity(), *after.config.identity(), "amp_dtype"}
    found = [f"{f}: {a!r} vs {b!r}" for f, a, b in config_diff if f in identity]
    for label, field_name in (("device", "device"), ("GPU", "gpu_name"),
                              ("torch", "torch_version"), ("driver", "driver_version"),
                              ("CUDA runtime", "cuda_runtime")):
        x, y = getattr(before.env, field_name), getattr(after.env, field_name)
        if field_name == "device":
            x, y = x.split(":")[0], y.split(":")[0]
        if x != y:
            found.append(f"{label}: {x!r} vs {y!r}")
    for a in before.stages:
        b = after.stage(a.name)
        if b is None or not (a.ok and b.ok):
            continue
        if a.facts.precision != b.facts.precision:
            found.append(f"{a.name} precision: {a.facts.precision!r} vs {b.facts.precision!r}")
        if a.samples_per_step != b.samples_per_step:
            found.append(f"{a.name} samples per step: {a.samples_per_step} vs "
                         f"{b.samples_per_step}")
    only = sorted({s.name for s in before.stages} ^ {s.name for s in after.stages})
    if only:
        found.append(f"stages in one run only: {', '.join(only)}")
    return found


def compare_runs(before: RunResult, after: RunResult, *, before_label: str = "before",
                 after_label: str = "after", margin: float = DEFAULT_MARGIN,
                 alpha: float = ALPHA, calibration: Calibration | None = None) -> Comparison:
    """Stage-by-stage comparison; intervals at confidence 1 - alpha (the gate uses 99%), from
    the between-process spread of `calibration` where it has this machine and workload, else
    the device kind's built-in floor."""
    names = list(dict.fromkeys([s.name for s in before.stages] + [s.name for s in after.stages]))
    stages = []
    for name in names:
        a, b = before.stage(name), after.stage(name)
        sa = stage_samples(a) if a is not None and a.ok else None
        sb = stage_samples(b) if b is not None and b.ok else None
        floor = floor_for((before, after), name, "wall", calibration)
        estimate = (estimate_ratio(sa, sb, floor, alpha) if sa is not None and sb is not None
                    else None)
        stage = StageComparison(stage=name, before=a, after=b, throughput=estimate,
                                verdict=verdict(estimate, margin), metrics=_metrics(a, b),
                                before_samples=sa, after_samples=sb, note=_note(a, b, estimate))
        if sa is not None and sb is not None and a is not None and b is not None:
            _add_exact_and_device(stage, a, b, alpha,
                                  floor_for((before, after), name, "device", calibration))
        stages.append(stage)
    env_diff = [(f, getattr(before.env, f), getattr(after.env, f)) for f in _ENV_FIELDS
                if getattr(before.env, f) != getattr(after.env, f)]
    config_diff = _differences(before.config.settings(), after.config.settings())
    mismatches = _mismatches(before, after, config_diff)
    resolved, new, persisting = match_findings(before.findings, after.findings)
    flickering = {f.place: f for f in (*after.unsteady_findings, *before.unsteady_findings)}
    unsteady = set(flickering)
    return Comparison(
        before_label=before_label, after_label=after_label, stages=stages,
        env_differences=env_diff, config_differences=config_diff, mismatches=mismatches,
        confidence=1 - alpha,
        findings_resolved=[f for f in resolved if f.place not in unsteady],
        findings_new=[f for f in new if f.place not in unsteady],
        findings_persisting=persisting, findings_unsteady=list(flickering.values()),
    )
