"""Before/after statistics, verdicts, and the CI gate's decision. Pure functions of runs.

The throughput ratio (after over before) is estimated on log throughput: Welch's t interval for
few samples, a bootstrap over samples for many. With one trial per side the samples are medians
of contiguous blocks of steps; those are autocorrelated, so such intervals are flagged
optimistic. Every comparison states the smallest change it could have detected (80% power,
5% two-sided), and no verdict claims more than its data can show.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from scipy import stats

from gpudiag.diagnose.counters import CounterChange, compare_counters
from gpudiag.diagnose.trials import (
    StageSamples,
    device_samples,
    side_counters,
    stage_samples,
)
from gpudiag.model.results import Finding, RunResult, StageResult

ALPHA = 0.05  # compare shows 95% intervals
POWER = 0.80
BOOTSTRAP_FROM = 10  # samples per side from which the bootstrap replaces Welch's t
BOOTSTRAP_RESAMPLES = 10_000
DEFAULT_MARGIN = 0.05  # changes inside +-5% with a tight interval read "no significant change"
# Blocks of one process's steps cannot show how much fresh processes of the same code differ
# (allocator layout, clocks, host load). This floor per side, in log throughput, stands in for
# that spread. Measured: BERT fp16 training on a shared H100 VM ran 50.2-59.6 ms across six
# fresh processes (about 5%; quieter machines report 0.2%); with a 1% floor, 7 of 20
# single-trial A/A pairs on that H100 gated as regressions, with 5% none. Tiny models on a
# shared 2-core CPU: 6.5% over 12 fresh runs, one of them 20% slow; with a 5% floor 9 of 132
# ordered A/A pairs gated as regressions, so the CPU floor is 8%.
PROCESS_NOISE_FLOOR = {"cuda": 0.05, "cpu": 0.08}
# The same floor for device time (kernel time per step, from the evidence window): kernels do
# not wait on the host, so only the GPU's own state (clocks, memory placement) separates fresh
# processes. Measured on two H100 hosts (reports/examples/benchmarks/h100-gate-regressions.json):
# fresh processes of one build differ by 0.09% (coefficient of variation, 8 trials; wall time
# 3.4%), the two hosts' medians by 0.15%; the floor is three times the former.
DEVICE_NOISE_FLOOR = 0.003

Verdict = Literal["faster", "slower", "no significant change", "inconclusive"]
GateOutcome = Literal["pass", "regression", "inconclusive"]


@dataclass
class RatioEstimate:
    ratio: float  # after / before throughput (>1: faster)
    low: float
    high: float
    method: str  # "welch" or "bootstrap"
    n_before: int
    n_after: int
    sample_kind: str  # "trials" or "blocks"
    min_detectable: float  # smallest relative change detectable at 80% power
    confidence: float = 1 - ALPHA

    @property
    def optimistic(self) -> bool:
        return self.sample_kind == "blocks"

    @property
    def significant(self) -> bool:
        return self.low > 1 or self.high < 1


def _welch(before: list[float], after: list[float],
           alpha: float) -> tuple[float, float, float, float]:
    """(difference of mean logs, its standard error, degrees of freedom, t quantile)."""
    a, b = np.log(before), np.log(after)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return float(b.mean() - a.mean()), 0.0, math.inf, 0.0
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return float(b.mean() - a.mean()), se, df, float(stats.t.ppf(1 - alpha / 2, df))


def estimate_ratio(before: StageSamples, after: StageSamples,
                   noise_floor: float = PROCESS_NOISE_FLOOR["cuda"],
                   alpha: float = ALPHA) -> RatioEstimate | None:
    """The throughput ratio's interval, or None with fewer than two samples on a side.
    `noise_floor` is the between-process spread assumed when samples are blocks of one trial."""
    if len(before.scores) < 2 or len(after.scores) < 2:
        return None
    diff, se, df, t_crit = _welch(before.scores, after.scores, alpha)
    kind = "blocks" if "blocks" in (before.kind, after.kind) else "trials"
    if kind == "blocks":
        # The floor is an assumed, known variance: by Welch-Satterthwaite it adds no
        # uncertainty of its own, so the effective degrees of freedom grow with its share.
        variance = se ** 2 + 2 * noise_floor ** 2
        df = variance ** 2 / (se ** 4 / df) if se > 0 and math.isfinite(df) else math.inf
        se = math.sqrt(variance)
        t_crit = float(stats.t.ppf(1 - alpha / 2, df) if math.isfinite(df)
                       else stats.norm.ppf(1 - alpha / 2))
    t_power = float(stats.t.ppf(POWER, df)) if math.isfinite(df) else float(stats.norm.ppf(POWER))
    min_detectable = 1 - math.exp(-(t_crit + t_power) * se)
    if kind == "trials" and min(len(before.scores), len(after.scores)) >= BOOTSTRAP_FROM:
        rng = np.random.default_rng(0)
        a, b = np.log(before.scores), np.log(after.scores)
        draws = (rng.choice(b, (BOOTSTRAP_RESAMPLES, len(b))).mean(axis=1)
                 - rng.choice(a, (BOOTSTRAP_RESAMPLES, len(a))).mean(axis=1))
        low, high = np.percentile(draws, [100 * alpha / 2, 100 * (1 - alpha / 2)])
        method = "bootstrap"
    else:
        low, high, method = diff - t_crit * se, diff + t_crit * se, "welch"
    return RatioEstimate(ratio=math.exp(diff), low=math.exp(low), high=math.exp(high),
                         method=method, n_before=len(before.scores), n_after=len(after.scores),
                         sample_kind=kind, min_detectable=min_detectable, confidence=1 - alpha)


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
                          alpha: float) -> None:
    """The stage's exact counters side by side, and its device-time interval where both sides
    measured kernel time."""
    stage.counters = compare_counters(
        side_counters(a), side_counters(b),
        a.evidence.line_counts if a.evidence else [], b.evidence.line_counts if b.evidence else [])
    da, db = device_samples(a), device_samples(b)
    if da is not None and db is not None:
        stage.device_samples = (da, db)
        stage.device = estimate_ratio(da, db, DEVICE_NOISE_FLOOR, alpha)


def _differences(before: dict[str, object], after: dict[str, object]
                 ) -> list[tuple[str, object, object]]:
    """(name, before, after) for each setting that differs, either side's missing as None."""
    names = list(dict.fromkeys([*before, *after]))
    return [(n, before.get(n), after.get(n)) for n in names if before.get(n) != after.get(n)]


def _finding_key(f: Finding) -> tuple[str, str | None, str | None]:
    return f.id, f.stage, f.location


def compare_runs(before: RunResult, after: RunResult, *, before_label: str = "before",
                 after_label: str = "after", margin: float = DEFAULT_MARGIN,
                 alpha: float = ALPHA) -> Comparison:
    """Stage-by-stage comparison; intervals at confidence 1 - alpha (the gate uses 99%)."""
    names = list(dict.fromkeys([s.name for s in before.stages] + [s.name for s in after.stages]))
    floor = max(PROCESS_NOISE_FLOOR["cuda" if run.env.device.startswith("cuda") else "cpu"]
                for run in (before, after))
    stages = []
    for name in names:
        a, b = before.stage(name), after.stage(name)
        note = ""
        sa = stage_samples(a) if a is not None and a.ok else None
        sb = stage_samples(b) if b is not None and b.ok else None
        estimate = (estimate_ratio(sa, sb, floor, alpha) if sa is not None and sb is not None
                    else None)
        if a is None or b is None:
            note = f"only in the {'after' if a is None else 'before'} run"
        elif not (a.ok and b.ok):
            note = "did not run on both sides"
        elif estimate is None:
            note = "too few samples for an interval (need 2 trials, or 10+ steady steps each)"
        elif estimate.optimistic:
            note = ("one trial per side: interval from blocks of steps, optimistic (steps are "
                    "autocorrelated); use --trials for a trustworthy one")
        stage = StageComparison(stage=name, before=a, after=b, throughput=estimate,
                                verdict=verdict(estimate, margin), metrics=_metrics(a, b),
                                before_samples=sa, after_samples=sb, note=note)
        if sa is not None and sb is not None and a is not None and b is not None:
            _add_exact_and_device(stage, a, b, alpha)
        stages.append(stage)
    env_diff = [(f, getattr(before.env, f), getattr(after.env, f)) for f in _ENV_FIELDS
                if getattr(before.env, f) != getattr(after.env, f)]
    config_diff = _differences(before.config.settings(), after.config.settings())
    identity = {*before.config.identity(), *after.config.identity()}
    mismatches = [f"{f}: {a!r} vs {b!r}" for f, a, b in config_diff if f in identity]
    if before.env.gpu_name != after.env.gpu_name:
        mismatches.append(f"GPU: {before.env.gpu_name!r} vs {after.env.gpu_name!r}")
    only = sorted({s.name for s in before.stages} ^ {s.name for s in after.stages})
    if only:
        mismatches.append(f"stages in one run only: {', '.join(only)}")
    before_keys = {_finding_key(f): f for f in before.findings}
    after_keys = {_finding_key(f): f for f in after.findings}
    return Comparison(
        before_label=before_label, after_label=after_label, stages=stages,
        env_differences=env_diff, config_differences=config_diff, mismatches=mismatches,
        confidence=1 - alpha,
        findings_resolved=[f for k, f in before_keys.items() if k not in after_keys],
        findings_new=[f for k, f in after_keys.items() if k not in before_keys],
        findings_persisting=[f for k, f in after_keys.items() if k in before_keys],
    )
