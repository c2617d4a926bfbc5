"""Trials: one fresh process's measurement of a stage, and the samples comparisons are made of.

Consecutive step times are autocorrelated (0.3-0.8 on an H100), so steps are not independent
samples; fresh processes are. A trial's score is its throughput from the median of its
steady-state steps. With one trial per side, medians of contiguous blocks of steps stand in,
and anything built on them is marked optimistic.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass
from pathlib import Path

from gpudiag.diagnose.counters import read_counters
from gpudiag.model.results import Finding, RunResult, StageResult, Trial
from gpudiag.model.runfile import RunFileError, load_run

SETTLE_REL = 0.02  # a step within 2% (or 3 MADs) of the steady median counts as settled
SETTLE_RUN = 3  # ... for this many steps in a row
MAX_TRIM = 0.5  # never discard more than half of a stage's steps as warm-up
BLOCK_STEPS = 5  # steps per block when one trial must be split into blocks
MAX_BLOCKS = 8
# Throttle reasons that make a trial's timing depend on the room, not the code.
INVALIDATING_THROTTLE = ("sw_thermal", "hw_thermal", "hw_slowdown", "power_brake")
INVALID_THROTTLE_SHARE = 0.05


def steady_state(times_ms: list[float]) -> list[float]:
    """The steps after times settle: leading steps far from the second half's median go."""
    if len(times_ms) < 2 * SETTLE_RUN:
        return list(times_ms)
    tail = times_ms[len(times_ms) // 2:]
    median = statistics.median(tail)
    mad = statistics.median(abs(t - median) for t in tail)
    tolerance = max(3 * mad, SETTLE_REL * median)
    limit = int(len(times_ms) * MAX_TRIM)
    for start in range(limit + 1):
        window = times_ms[start:start + SETTLE_RUN]
        if all(abs(t - median) <= tolerance for t in window):
            return times_ms[start:]
    return times_ms[limit:]


def throttled(stage: StageResult) -> bool:
    shares = stage.telemetry.throttle_share
    return any(shares.get(r, 0.0) > INVALID_THROTTLE_SHARE for r in INVALIDATING_THROTTLE)


def per_step(stage: StageResult) -> int:
    """What a step's rate counts: its samples where known (gpudiag's workloads; a profiled
    script's DataLoader batch or --samples-per-step), else the step itself, so that throughput
    is steps per second and its ratio the inverse of step time's."""
    return stage.samples_per_step or 1


def rate_name(stage: StageResult | None) -> str:
    """What a stage's throughput is a rate of, for messages."""
    return "throughput" if stage is None or stage.samples_per_step else \
        "step rate (samples per step unknown)"


def trial_of(stage: StageResult) -> Trial | None:
    """The stage's score as one trial, or None if it did not run."""
    if not stage.ok or not stage.iter_ms:
        return None
    steady = steady_state(stage.iter_ms)
    # Bursty stages (a prefetching DataLoader) are scored by their mean, as everywhere else.
    ms = statistics.fmean(steady) if stage.facts.bursty else statistics.median(steady)
    device = stage.evidence.device_ms_by_step if stage.evidence is not None else []
    return Trial(ms_per_iter=ms, iters=len(steady), samples_per_step=per_step(stage),
                 throttled=throttled(stage), energy_per_sample_j=stage.energy_per_sample_j,
                 counters=read_counters(stage), device_ms_by_step=list(device))


def block_scores(stage: StageResult) -> list[float]:
    """Throughput of contiguous blocks of steady-state steps (for a single trial)."""
    steady = steady_state(stage.iter_ms)
    blocks = min(MAX_BLOCKS, len(steady) // BLOCK_STEPS)
    if blocks < 2:
        return []
    size = len(steady) // blocks
    return [per_step(stage) / statistics.median(steady[i * size:(i + 1) * size]) * 1e3
            for i in range(blocks)]


@dataclass
class StageSamples:
    """What a comparison sees of one stage on one side."""

    scores: list[float]  # throughput samples, samples/s
    kind: str  # "trials" or "blocks" (blocks: one trial split up; intervals are optimistic)
    invalid: int  # trials dropped because the GPU throttled
    iters: int  # timed steps behind the scores (steady state, summed over trials)


def stage_samples(stage: StageResult) -> StageSamples:
    valid = [t for t in stage.trials if not t.throttled]
    if len(stage.trials) >= 2:
        return StageSamples(scores=[t.samples_per_s for t in valid], kind="trials",
                            invalid=len(stage.trials) - len(valid),
                            iters=sum(t.iters for t in valid))
    trial = trial_of(stage)
    invalid = int(trial is not None and trial.throttled)
    return StageSamples(scores=[] if invalid else block_scores(stage), kind="blocks",
                        invalid=invalid, iters=trial.iters if trial else 0)


def _trials_or_own(stage: StageResult) -> list[Trial]:
    if stage.trials:
        return stage.trials
    own = trial_of(stage)
    return [own] if own is not None else []


def device_samples(stage: StageResult) -> StageSamples | None:
    """Device time (kernel time per step) as throughput samples, like `stage_samples`: one per
    trial with two or more trials, else one per profiled step of the single trial (blocks).
    Trials without kernel times (a CPU, no evidence window, a trial cut short before it) are
    left out; None when none has them."""
    trials = [t for t in _trials_or_own(stage) if not t.throttled and t.device_ms]
    samples = per_step(stage)
    if not trials:
        return None
    steps = sum(len(t.device_ms_by_step) for t in trials)
    if len(trials) >= 2:
        return StageSamples(scores=[samples / t.device_ms * 1e3 for t in trials
                                    if t.device_ms], kind="trials",
                            invalid=len(stage.trials) - len(trials), iters=steps)
    return StageSamples(scores=[samples / ms * 1e3 for ms in trials[0].device_ms_by_step
                                if ms > 0], kind="blocks", invalid=0, iters=steps)


def side_counters(stage: StageResult) -> list[dict[str, float]]:
    """Each trial's exact counters (the stage's own for a single run)."""
    return [t.counters for t in _trials_or_own(stage) if t.counters]


def merge_trials(runs: list[RunResult]) -> RunResult:
    """One run from several runs of the same configuration (fresh processes): each stage keeps
    the first run's facts and telemetry, the first evidence any trial recorded, and one Trial
    per run; its ms/iter and throughput are then the median over trials
    (StageResult.merged_trials)."""
    if not runs:
        raise ValueError("no runs to merge")
    merged = copy.deepcopy(runs[0])
    for stage in merged.stages:
        same = [s for run in runs if (s := run.stage(stage.name)) is not None]
        trials = [t for s in same for t in ([*s.trials] if s.trials else [trial_of(s)])
                  if t is not None]
        stage.trials = trials
        stage.evidence = next((s.evidence for s in same if s.evidence is not None), None)
    _split_findings(merged, runs)
    merged.notes.append(f"{len(runs)} trials, each a fresh process; per-stage figures are "
                        "medians over trials.")
    merged.interrupted = any(r.interrupted for r in runs)
    return merged


def _split_findings(merged: RunResult, runs: list[RunResult]) -> None:
    """The merged run's findings: those every trial showed; those only some showed (a value
    near its rule's threshold, on one side of it in one process and the other in the next)
    are kept apart as unsteady, with those the trials were merged with already."""
    places = [{f.place: f for f in (*run.findings, *run.unsteady_findings)} for run in runs]
    steady = {f.place for f in runs[0].findings}
    for run in runs[1:]:
        steady &= {f.place for f in run.findings}
    seen: dict[tuple[str, str | None, str | None], Finding] = {}
    for found in places:
        for place, finding in found.items():
            seen.setdefault(place, finding)
    merged.findings = [f for f in runs[0].findings if f.place in steady]
    merged.unsteady_findings = [f for place, f in seen.items() if place not in steady]


def load_run_set(path: Path) -> RunResult:
    """A run directory (its run.json, merged trials included), a run.json file, or a folder of
    run directories taken as trials of one configuration (e.g. interleaved A/B runs)."""
    if path.is_file() or (path / "run.json").is_file():
        return load_run(path)
    if path.is_dir():
        found = [(p / "run.json", load_run(p)) for p in sorted(path.iterdir())
                 if (p / "run.json").is_file()]
        if found:
            _check_one_configuration(found)
            return merge_trials([run for _, run in found])
    raise RunFileError(f"{path}: neither a run.json, a run directory, nor a folder of runs")


def _identity(run: RunResult) -> dict[str, object]:
    """What every trial of one configuration shares: the workload and its precision, the
    device, GPU and the software that ran it."""
    return {**{f"config.{k}": v for k, v in run.config.identity().items()},
            **{f"env.{k}": getattr(run.env, k) for k in ("device", "gpu_name", "torch_version",
                                                          "driver_version", "cuda_runtime")},
            **{f"stage {s.name} precision": s.facts.precision for s in run.stages if s.ok},
            "config.amp_dtype": run.config.settings().get("amp_dtype")}


def _check_one_configuration(found: list[tuple[Path, RunResult]]) -> None:
    """A folder of trials must hold runs of one configuration on one kind of device, each a
    separate measurement."""
    first_file, first = found[0]
    expected = _identity(first)
    for file, run in found[1:]:
        for key, value in _identity(run).items():
            if value != expected.get(key):
                raise RunFileError(f"{file}: {key} {value!r} differs from {first_file} "
                                   f"({expected.get(key)!r}); a folder of trials must hold "
                                   "runs of one configuration")
    seen: dict[tuple[tuple[str, tuple[float, ...]], ...], Path] = {}
    for file, run in found:
        steps = tuple((s.name, tuple(s.iter_ms)) for s in run.stages if len(s.iter_ms) >= 3)
        if steps and steps in seen:
            raise RunFileError(f"{file}: a copy of {seen[steps]} (the same step times): "
                               "trials must be separate processes")
        seen[steps] = file


def baseline_of(run: RunResult) -> RunResult:
    """A small, stable copy of a run for a repository: what compare and gate read (timings,
    trials, the exact counters and each line's counts), without the evidence's per-line
    detail, traces or per-step phases."""
    small = copy.deepcopy(run)
    for stage in small.stages:
        if not stage.trials and (trial := trial_of(stage)) is not None:
            stage.trials = [trial]  # the counters live on the trial once evidence is slimmed
        if stage.evidence is not None:
            stage.evidence.source_lines = []
            stage.evidence.top_ops_by_count = []
            stage.evidence.top_ops_by_time = []
        stage.traceback = None
        stage.phases_ms = {}
        stage.warmup_ms = []
    return small
