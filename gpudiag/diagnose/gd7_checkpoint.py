"""Checkpoint rules: saves that stall training, and asynchronous saves that still get in its way
(docs/field-cases.md#case-4)."""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

from gpudiag.diagnose.common import pct, reference_stage
from gpudiag.diagnose.gd2_input import worker_restarts
from gpudiag.diagnose.ledger import LoopParts, NoPart
from gpudiag.diagnose.registry import Draft, Threshold, rule, severity_for
from gpudiag.diagnose.spikes import (
    MIN_SPIKE_EXCESS,
    SPIKE_MADS,
    detect_period,
    find_spikes,
    lost_share,
)
from gpudiag.diagnose.timeline import (
    ASYNC_RATIO,
    SAVE_ELSEWHERE,
    STEP_LINE,
    PeriodicWork,
    RunAccount,
    describe,
    stage_account,
)
from gpudiag.model.facts import OtherLoop, SaveRecord
from gpudiag.model.results import RunResult, StageResult

MIN_STEPS = 20
INFO_LOST = 0.01  # below 1% of wall time a stall is not worth a line
WARNING_LOST = 0.05
CRITICAL_LOST = 0.20
TARGET_OVERHEAD = 0.03  # the checkpoint overhead the advised interval aims for
CONTENTION_SLOWDOWN = 0.10  # steps during a write this much slower than steps without one
MIN_STEPS_PER_SIDE = 3
WAIT_NOISE_MS = 1.0  # waits shorter than this are bookkeeping, not a queue
VALIDATION_HOOKS = ("val_dataloader", "test_dataloader")  # Lightning's evaluation loaders
OTHER_WORK_SHARE = 0.1  # other work on saving steps worth naming, against the save's stall


def _saves(stage: StageResult) -> tuple[str | None, int | None, list[SaveRecord]]:
    """(mode, every, saves) from the stage's save records, if it has them."""
    info = stage.facts.checkpoint
    if info is None:
        return None, None, []
    saves = [r for r in info.saves if 0 <= r.step < len(stage.iter_ms)]
    return info.mode, info.every, saves


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


@dataclass
class Stalls:
    source: str  # "save records" or "step times alone"
    period_steps: int | None
    saves: int
    baseline_ms: float  # the step without a save
    stall_ms: float  # extra time per save, on the steps the save held up
    lost: float  # that extra time over the time steady steps would take
    checkfreq_lost: float  # CheckFreq's overhead over the stage's median: all slow steps
    other_ms: float = 0.0  # per saving step: extra time beyond the saves' own blocking

    @property
    def interval_for_target(self) -> int:
        """Steps between saves that would keep the overhead at TARGET_OVERHEAD."""
        return max(1, math.ceil(self.stall_ms / (TARGET_OVERHEAD * self.baseline_ms)))


# What makes recurring spikes a stall and how its loss grades: GD701's and GD703's.
PERIODIC_STALL_THRESHOLDS = (
    Threshold("min_steps", MIN_STEPS, "steps needed to see a period"),
    Threshold("spike_mads", SPIKE_MADS, "a spike is above median + 5 MAD ..."),
    Threshold("spike_excess", MIN_SPIKE_EXCESS, "... and 20% above the median"),
    Threshold("info_lost", INFO_LOST, "share of wall time lost: info"),
    Threshold("warning_lost", WARNING_LOST, "share of wall time lost: warning"),
    Threshold("critical_lost", CRITICAL_LOST, "share of wall time lost: critical"),
)


def _periodic_spikes(times: list[float], source: str) -> Stalls | None:
    """Spikes over the median step that recur with one period, priced by their excess."""
    spikes = find_spikes(times)
    period = detect_period(spikes.indices, len(times))
    if period is None:
        return None
    excess = sum(e for i, e in zip(spikes.indices, spikes.excess_ms, strict=True)
                 if i % period.steps == period.phase)
    return Stalls(source, period.steps, period.hits, spikes.median_ms, excess / period.hits,
                  excess / (spikes.median_ms * len(times)), lost_share(times))


def _timeline_evidence(run_wall: RunAccount, work: PeriodicWork) -> dict[str, Any]:
    return {"source": "the whole run's steps", "period_steps": work.period,
            "occurrences": work.occurrences,
            "extra_ms_per_occurrence": round(work.per_occurrence_ms, 1),
            "baseline_step_ms": round(run_wall.step_ms, 2),
            "wall_share": round(run_wall.share(work.extra_ms), 4),
            "loop_share": round(run_wall.loop_share(work.extra_ms), 4),
            "run_wall_ms": round(run_wall.wall_ms, 1), "loop_ms": round(run_wall.loop_ms, 1)}


def saves_are_seen(stage: StageResult) -> bool:
    """Whether every save would be on record: a checkpoint stage, or a profiled script (whose
    torch.save calls gpudiag times). Then periodic spikes without a save are something else."""
    return stage.facts.checkpoint is not None or stage.facts.script is not None


def measure_stalls(run: RunResult, stage: StageResult) -> Stalls | None:
    """With save records: the excess of the saving steps over the median step without a save
    (signed, so noise cancels), but no more than the time the saves held the training thread:
    other work on those steps (an evaluation on the step that saves) is not the save's, and
    is measured apart (`other_ms`; GD703 prices it). A profiled script's blocking save is
    priced whole: what its saving step spent beyond the save call (building the state it
    writes, safetensors' files beside torch.save's) is the save's. For async saves, what the
    writer costs beyond that (the GIL, cores, copies competing with training) is contention,
    priced by checkpoint-async-contention. Without records, where saves would not be seen:
    the excess of spikes that recur with one period over the median step."""
    times = stage.iter_ms
    mode, every, saves = _saves(stage)
    if saves:
        held = {s.step for s in saves}
        baseline = _median([t for i, t in enumerate(times) if i not in held])
        if baseline is None:  # a save every step: hold it against the same model's step
            ref = reference_stage(run, stage)
            baseline = ref.ms_per_iter if ref is not None else None
        if not baseline:
            return None
        excess = sum(times[i] - baseline for i in held)
        blocking = sum(s.blocking_ms for s in saves)
        # A blocking save's whole step is the save's (its after-effects, the state it builds);
        # an asynchronous one holds the step only for its own call.
        mine = mode == "async"
        stall = min(excess, blocking) if mine else excess
        return Stalls("save records", every, len(saves), baseline, stall / len(saves),
                      stall / (baseline * len(times)), lost_share(times),
                      other_ms=max(0.0, excess - blocking) / len(saves) if mine else 0.0)
    if stage.facts.bursty or saves_are_seen(stage):
        return None  # bursty by nature (a prefetching DataLoader), or spikes are not saves
    waits = stage.phases_ms.get("data_wait", [])
    if len(waits) == len(times):  # periodic data stalls belong to the input rules
        times = [t - w for t, w in zip(times, waits, strict=True)]
    return _periodic_spikes(times, "step times alone")


@rule(
    "GD701", "checkpoint-stall", concern="checkpoint",
    summary="Periodic step-time spikes at checkpoint saves: training waits for its saves.",
    why=("A blocking save copies the whole training state to the host and writes it while the "
         "GPU idles. Per save it looks cheap; over a run the stalls add up, and a save that is "
         "made faster but still blocks (or runs too often) can lower throughput further "
         "(docs/field-cases.md#case-4: 277 -> 64 ms per save, yet 121 -> 83 samples/s)."),
    fix=("Save asynchronously: stage a device-to-pinned-host copy on a side stream and write from "
         "a background thread or process (torch.distributed.checkpoint.async_save), with one "
         "save in flight; save on one rank (or sharded with DCP); and space saves so that the "
         "overhead stays within 3-5%."),
    prices=LoopParts(("save",)),
    thresholds=(*PERIODIC_STALL_THRESHOLDS,
                Threshold("target_overhead", TARGET_OVERHEAD,
                          "overhead the advised save interval aims for"),
                Threshold("wait_noise_ms", WAIT_NOISE_MS,
                          "other work on saving steps shorter than this is noise ..."),
                Threshold("other_work_share", OTHER_WORK_SHARE,
                          "... or than this share of the save's own stall")),
    references=("CheckFreq (FAST '21): checkpoint overhead = (sum(t) - median * n) / "
                "(median * n)", "https://pytorch.org/docs/stable/distributed.checkpoint.html"),
)
def checkpoint_stall(run: RunResult) -> Iterator[Draft]:
    """A profiled script with its whole run's timeline: the time its saves held the training
    thread beyond the steady step, as a share of the run's wall time (the account of
    gpudiag/diagnose/timeline.py). Other stages of at least 20 steps: with save records, the
    excess of the steps saves held up over the median step without a save; without them,
    spikes that recur with one period (random spikes are not stalls). Severity by that time
    lost as a share of the steady time; CheckFreq's overhead over all slow steps is reported
    beside it."""
    for stage in run.ok_stages():
        whole = stage_account(stage)
        if whole is not None:
            yield from _timeline_save_stalls(stage, whole)
            continue
        if len(stage.iter_ms) < MIN_STEPS:
            continue
        stalls = measure_stalls(run, stage)
        if stalls is None or stalls.lost < INFO_LOST:
            continue
        mode, _, saves = _saves(stage)
        share = stalls.lost / (1 + stalls.lost)  # of wall time
        every = (f"every {stalls.period_steps} steps" if stalls.period_steps
                 else f"{stalls.saves} times")
        evidence: dict[str, Any] = {
            "source": stalls.source, "period_steps": stalls.period_steps,
            "saves": stalls.saves, "stall_ms_per_save": round(stalls.stall_ms, 1),
            "baseline_step_ms": round(stalls.baseline_ms, 2),
            "lost_share": round(stalls.lost, 4), "wall_share": round(share, 4),
            "checkfreq_overhead": round(stalls.checkfreq_lost, 4),
            "interval_for_3pct": stalls.interval_for_target,
        }
        if stalls.other_ms > max(WAIT_NOISE_MS, OTHER_WORK_SHARE * stalls.stall_ms):
            evidence["other_work_ms_per_saving_step"] = round(stalls.other_ms, 1)
        if saves:
            blocking = statistics.median(s.blocking_ms for s in saves)
            totals = [s.total_ms for s in saves if s.total_ms is not None]
            rates = [s.write_gbps for s in saves if s.write_gbps]
            evidence.update({
                "mode": mode, "blocking_ms_median": round(blocking, 1),
                "save_total_ms_median": round(statistics.median(totals), 1) if totals else None,
                "bytes_per_save": max((s.bytes or 0) for s in saves) or None,
                "write_gb_per_s": round(statistics.median(rates), 2) if rates else None,
                "files_per_save": max(s.files for s in saves),
            })
        interval = stalls.interval_for_target
        what = ("Checkpoint stalls" if saves else
                "Periodic stalls, as checkpoint saves make them")
        if mode == "async":
            fix = (f"The saves are asynchronous yet still cost {stalls.stall_ms:.0f} ms each: "
                   "see checkpoint-async-contention for where that time goes; keep one save in "
                   f"flight and save every >= {interval} steps to stay within 3%.")
        else:
            fix = (f"Save asynchronously (pinned-host staging on a side stream, a background "
                   "writer, one save in flight: torch.distributed.checkpoint.async_save, or "
                   "gpudiag's checkpoint-async stage as a template), only on rank 0 or sharded "
                   f"with DCP; at {stalls.stall_ms:.0f} ms per save, a 3% overhead needs a save "
                   f"every >= {interval} steps (now {every}).")
        if "other_work_ms_per_saving_step" in evidence:
            fix += (f" The saving steps also spend {stalls.other_ms:.0f} ms on other work "
                    "(evaluation, logging): not the save's, see GD703.")
        yield Draft(
            severity=severity_for(stalls.lost, warning=WARNING_LOST, critical=CRITICAL_LOST),
            stage=stage.name,
            title=(f"{what}: {stalls.stall_ms:.0f} ms lost per save {every} "
                   f"({pct(share)} of wall time, step {stalls.baseline_ms:.1f} ms without a "
                   "save)"),
            evidence=evidence, impact=min(1.0, share), fix=fix)


def _timeline_save_stalls(stage: StageResult, whole: RunAccount) -> Iterator[Draft]:
    """GD701 on a profiled script's whole run: what its saves held the training thread beyond
    the steady step, as a share of the training loop."""
    work = next((w for w in whole.works if w.kind == "save"), None)
    if work is None or whole.loop_share(work.extra_ms) < INFO_LOST:
        return
    share = whole.loop_share(work.extra_ms)
    interval = max(1, math.ceil(work.per_occurrence_ms / (TARGET_OVERHEAD * whole.step_ms)))
    every = f"every {work.period} steps" if work.period else f"{work.occurrences} times"
    script = stage.facts.script
    blocking = [s.blocking_ms for s in script.timeline.saves] if (
        script is not None and script.timeline is not None) else []
    evidence = {**_timeline_evidence(whole, work), "saves": work.occurrences,
                "stall_ms_per_save": round(work.per_occurrence_ms, 1),
                "blocking_ms_median": round(statistics.median(blocking), 1) if blocking
                else None, "interval_for_3pct": interval}
    yield Draft(
        severity=severity_for(share, warning=WARNING_LOST, critical=CRITICAL_LOST),
        stage=stage.name,
        title=(f"Checkpoint stalls: {work.per_occurrence_ms:.0f} ms lost per save {every} "
               f"({pct(share)} of the training loop, step {whole.step_ms:.1f} ms without a "
               "save)"),
        evidence=evidence, impact=min(1.0, share),
        fix=(f"Save asynchronously (pinned-host staging, a background writer, one save in "
             "flight: torch.distributed.checkpoint.async_save), only on rank 0 or sharded with "
             f"DCP; at {work.per_occurrence_ms:.0f} ms per save, a 3% overhead needs a save "
             f"every >= {interval} steps (now {every})."))


def _in_flight_steps(times: list[float], saves: list[SaveRecord]) -> set[int]:
    """Steps that started while an asynchronous write was still running (the step that
    started the save excluded)."""
    starts = [0.0, *itertools.accumulate(times)]
    busy: set[int] = set()
    for save in saves:
        if save.total_ms is None:
            continue
        begin = starts[save.step + 1]
        last = bisect.bisect_left(starts, begin + save.total_ms, lo=save.step + 1)
        busy.update(range(save.step + 1, min(last, len(times))))
    return busy


@rule(
    "GD702", "checkpoint-async-contention", concern="checkpoint",
    summary="Asynchronous saves that queue behind each other or slow the steps they overlap.",
    why=("Async saving only hides a save if it finishes before the next one starts and does not "
         "compete with training for host cores, the GIL, PCIe or memory bandwidth. Saves that "
         "take longer than the interval between them queue up, and a writer that competes "
         "slows every step it overlaps (docs/field-cases.md#case-4: 3 chunks behind "
         "max_async=2 queued for ~180 ms; GPU->CPU copies competed with training)."),
    fix=("Keep exactly one save in flight and space saves wider than a save takes; make the "
         "write cheaper (a faster local disk, several writer threads with DCP) or move it out of "
         "the training process; give the writer spare cores or fewer intra-op threads to "
         "training."),
    prices=NoPart("a background save slows whatever the steps it overlaps do, no one part of "
                  "them"),
    thresholds=(Threshold("slowdown", CONTENTION_SLOWDOWN,
                          "steps during a write slower than steps without one"),
                Threshold("min_steps", MIN_STEPS, "timed steps needed"),
                Threshold("min_steps_per_side", MIN_STEPS_PER_SIDE,
                          "steps with and without a write in flight, each"),
                Threshold("info_lost", INFO_LOST, "share of wall time lost: info"),
                Threshold("warning_lost", WARNING_LOST, "share of wall time lost: warning"),
                Threshold("critical_lost", CRITICAL_LOST, "share of wall time lost: critical"),
                Threshold("wait_noise_ms", WAIT_NOISE_MS, "shorter waits are not a queue")),
    references=("docs/field-cases.md#case-4 (pipelined writes that blocked and queued)",
                "https://pytorch.org/docs/stable/distributed.checkpoint.html"),
)
def checkpoint_async_contention(run: RunResult) -> Iterator[Draft]:
    """Stages that save asynchronously (save records with mode "async"): the time saves spent
    waiting for the previous save, and the mean step a write overlapped (the saving step less
    its blocking call, and the steps that started while the write ran) against the mean step
    with no save activity; losses as shares of the stage's steady time (median idle step)."""
    for stage in run.ok_stages():
        mode, every, saves = _saves(stage)
        if mode != "async" or not saves or len(stage.iter_ms) < MIN_STEPS:
            continue
        times = stage.iter_ms
        busy = _in_flight_steps(times, saves)
        blocking = {s.step: s.blocking_ms for s in saves}
        idle = [t for i, t in enumerate(times) if i not in busy and i not in blocking]
        # A write starts inside the saving step: that step, less the time the save call held
        # it (checkpoint-stall's share), overlaps the write too.
        during = [times[i] - blocking.get(i, 0.0) for i in sorted(busy | set(blocking))]
        baseline = _median(idle) or statistics.median(times)
        steady_total = baseline * len(times)
        waits = [s.waited_ms for s in saves if s.waited_ms > WAIT_NOISE_MS]
        wait_lost = sum(waits) / steady_total
        slowdown, contention_lost = 0.0, 0.0
        if len(idle) >= MIN_STEPS_PER_SIDE and len(during) >= MIN_STEPS_PER_SIDE:
            # Means, not medians: a writer that stalls a few steps for hundreds of ms (seen on
            # an H100 host) costs as much as one that slows every step a little.
            slowdown = statistics.fmean(during) / statistics.fmean(idle) - 1
            contention_lost = max(0.0, sum(during) - baseline * len(during)) / steady_total
        queued = bool(waits) and wait_lost >= INFO_LOST
        competing = slowdown >= CONTENTION_SLOWDOWN and contention_lost >= INFO_LOST
        if not (queued or competing):
            continue
        lost = wait_lost + (contention_lost if competing else 0.0)
        totals = [s.total_ms for s in saves if s.total_ms is not None]
        save_ms = statistics.median(totals) if totals else None
        interval_ms = (every or 0) * baseline
        parts, fixes = [], []
        if queued:
            parts.append(f"{len(waits)} of {len(saves)} saves waited "
                         f"{statistics.median(waits):.0f} ms for the previous one")
            needed = math.ceil((save_ms or 0) / baseline) + 1
            fixes.append(f"a save takes {save_ms or 0:.0f} ms but saves start every {every} "
                         f"steps ({interval_ms:.0f} ms): save every >= {needed} steps, or write "
                         "faster (local NVMe, DCP with several writer threads)")
        if competing:
            parts.append(f"steps during a write run {pct(slowdown)} slower on average "
                         f"({statistics.fmean(during):.1f} vs {statistics.fmean(idle):.1f} ms, "
                         f"worst {max(during):.0f} ms)")
            fixes.append("the writer competes with training: give it spare cores (fewer "
                         "torch intra-op threads), write from a separate process, or stage "
                         "less often")
        yield Draft(
            severity=severity_for(lost, warning=WARNING_LOST, critical=CRITICAL_LOST,
                                  cap="warning"),
            stage=stage.name,
            title=f"Async checkpointing still costs {pct(lost)} of steady time: "
                  + "; ".join(parts),
            evidence={"saves": len(saves), "saves_waited": len(waits),
                      "wait_ms_median": round(statistics.median(waits), 1) if waits else 0.0,
                      "save_total_ms_median": None if save_ms is None else round(save_ms, 1),
                      "interval_ms": round(interval_ms, 1), "steps_during_write": len(during),
                      "step_ms_during_write": round(statistics.fmean(during), 2)
                      if during else None,
                      "worst_step_ms_during_write": round(max(during), 1) if during else None,
                      "step_ms_without_save": round(statistics.fmean(idle), 2)
                      if idle else None,
                      "slowdown_during_write": round(slowdown, 4),
                      "lost_share": round(lost, 4)},
            impact=min(1.0, lost / (1 + lost)),
            fix="; ".join(fixes) + "; keep exactly one save in flight.")


# What the whole run's account (gpudiag/diagnose/timeline.py) reads to tell work from the host
# waiting for the device, from a slow step, and from a save's own statement.
ACCOUNT_THRESHOLDS = (
    Threshold("async_ratio", ASYNC_RATIO,
              "host's steady step below this share of the device's: the device's clock judges"),
    Threshold("step_line", STEP_LINE,
              "a line holding this share of the ordinary step is the step, not work beside it"),
    Threshold("save_elsewhere", SAVE_ELSEWHERE,
              "a saving step's extra is other work only with this share of the save elsewhere"),
)


def periodic_work(stage: StageResult, named: Collection[int] = ()) -> Stalls | None:
    """Step-time spikes that recur with one period and that no save explains: each step's
    time less its training data wait, a saving step (or a `named` one: timed steps whose work
    is priced already, an evaluation's loop) as the median step (its whole excess is the
    save's, GD701's), then spikes and their period (as for step times alone), priced by
    their excess over the median step. The timed steps are the device's clock (CUDA events)
    on a GPU: the judge of an asynchronous step."""
    times = list(stage.iter_ms)
    waits = stage.phases_ms.get("data_wait", [])
    if len(waits) == len(times):
        times = [t - w for t, w in zip(times, waits, strict=True)]
    _, _, saves = _saves(stage)
    held = {s.step for s in saves} | {i for i in named if 0 <= i < len(times)}
    usual = _median([t for i, t in enumerate(times) if i not in held])
    for i in held:
        times[i] = usual if usual is not None else times[i]
    return _periodic_spikes(times, "step times less saves and data waits")


@rule(
    "GD703", "periodic-step-work", concern="checkpoint",
    summary="Every N steps a step takes much longer, and it is not a checkpoint save.",
    why=("Evaluation, metric computation or logging every N steps stops training for as long "
         "as it takes; in a step-time plot it looks like a checkpoint stall, and advice for "
         "saves (asynchronous writers) does not help it. In a profiled script gpudiag times "
         "every save, so what recurs beyond the saves is this work."),
    fix=("Run the periodic work less often, on fewer batches, or off the training process "
         "(another rank, a separate evaluation job on saved checkpoints); keep its DataLoader "
         "persistent so it does not restart workers each time."),
    prices=LoopParts(("loop", "other")),
    thresholds=(*PERIODIC_STALL_THRESHOLDS, *ACCOUNT_THRESHOLDS),
    references=("docs/field-cases.md#case-4 (stalls that were not the save)",),
)
def periodic_step_work(run: RunResult) -> Iterator[Draft]:
    """Profiled scripts (their every torch.save and safetensors save is on record). With the
    whole run's timeline: each other DataLoader loop (an evaluation, named at its call) and
    each periodic spike no save, loop or data wait explains, as a share of the run's wall
    time; gpudiag's own steps (its warm-up's end, its window) are none of them. Where the step
    is asynchronous (the host's steady step below 0.5 of the device's timed step), the host
    clock's spikes are waits for the device's launch queue: the timed steps, on the device's
    clock, judge instead. Without a timeline (older runs), over at least 20 timed steps: the
    step times less the saving steps and the training data wait still spike with one period.
    Severity by the time lost as a share, as for checkpoint stalls."""
    for stage in run.ok_stages():
        whole = stage_account(stage)
        if whole is not None:
            yield from _timeline_periodic_work(stage, whole)
            if not whole.asynchronous:
                continue
        yield from _timed_periodic_work(stage, whole)


def _timed_periodic_work(stage: StageResult, whole: RunAccount | None) -> Iterator[Draft]:
    """GD703 on the timed steps: spikes with one period that no save or data wait explains,
    nor (an asynchronous step's, `whole`) a DataLoader loop the run's account priced."""
    # A profiled script, whose every save gpudiag times: the ladder's own stages do no
    # other periodic work (a checkpoint stage's after-effects are its saves').
    script = stage.facts.script
    if len(stage.iter_ms) < MIN_STEPS or stage.facts.bursty or script is None:
        return
    on_device = whole is not None
    first = script.warmup  # the timed steps' first on the timeline's clock
    work = periodic_work(stage, {s - first for w in (whole.works if whole else [])
                                 if w.kind == "loop" for s in w.steps})
    if work is None or work.lost < INFO_LOST:
        return
    share = work.lost / (1 + work.lost)
    _, _, saves = _saves(stage)
    clock = " on the device's timed steps" if on_device else ""
    yield Draft(
        severity=severity_for(work.lost, warning=WARNING_LOST, critical=CRITICAL_LOST),
        stage=stage.name,
        title=(f"Every {work.period_steps} steps a step takes {work.stall_ms:.0f} ms longer "
               f"({pct(share)} of wall time{clock}) for work that is not a checkpoint save"),
        evidence={"period_steps": work.period_steps, "occurrences": work.saves,
                  "extra_ms_per_occurrence": round(work.stall_ms, 1),
                  "baseline_step_ms": round(work.baseline_ms, 2),
                  "lost_share": round(work.lost, 4), "wall_share": round(share, 4),
                  "saves_on_record": len(saves), "device_clock": on_device},
        impact=min(1.0, share),
        fix=(f"This is periodic work in the training loop (metrics, logging, an evaluation): "
             f"{work.stall_ms:.0f} ms every {work.period_steps} steps. Run it less often or "
             "on fewer batches, or make it cheaper; its price is this time per occurrence."))


def _timeline_periodic_work(stage: StageResult, whole: RunAccount) -> Iterator[Draft]:
    """GD703 on a profiled script's whole run: each other DataLoader loop (an evaluation) and
    each periodic spike that no save, loop or data wait explains, priced as a share of the
    training loop (its part of the run's wall is the ledger's)."""
    restarts = worker_restarts(stage)
    restarting = restarts.loader.iterated_at if restarts is not None else None
    for work in whole.works:
        share = whole.loop_share(work.extra_ms)
        if work.kind not in ("loop", "other") or share < INFO_LOST:
            continue
        if work.kind == "other" and work.line is not None and work.line == restarting:
            continue  # the training loader's own line: its workers restarting (GD204)
        what = describe(work, period=False)
        often = f"every {work.period} steps" if work.period else f"{work.occurrences} times"
        loop = work.loop
        if loop is not None:
            where = (f" It runs at {loop.location} in {loop.function}()"
                     + (f", called at {loop.caller}" if loop.caller else "") + ".")
        elif work.line is not None:
            where = (f" It runs at {work.line}" + (f" `{work.line_text}`" if work.line_text else "")
                     + f": {work.line_share:.0%} of those steps' extra time in the host samples"
                       f" of {work.sampled_steps} of them.")
        else:
            where = (" What runs there is neither a save nor a DataLoader loop, and no host "
                     "samples of those steps name its line (--host-sample-hz 0, or too few).")
        knob = _evaluation_knob(stage, loop) if loop is not None else None
        if knob is not None:
            where += f" {knob}"
        yield Draft(
            severity=severity_for(share, warning=WARNING_LOST, critical=CRITICAL_LOST),
            stage=stage.name,
            title=(f"{what[0].upper()}{what[1:]}: {work.per_occurrence_ms:.0f} ms {often} "
                   f"({pct(share)} of the training loop)"),
            evidence={**_timeline_evidence(whole, work), "kind": work.kind},
            impact=min(1.0, share),
            location=(loop.caller or loop.location) if loop is not None else work.line,
            fix=(f"Periodic work beside training: {work.per_occurrence_ms:.0f} ms {often}."
                 f"{where} "
                 + ("Run it less often or on fewer batches, or move it off the training "
                    "process (a separate evaluation job on saved checkpoints); keep the "
                    "evaluation DataLoader's workers persistent so they do not restart each "
                    "time." if loop is not None else
                    "Run it less often, or make it cheaper; its price is this time per "
                    "occurrence.")))


def _evaluation_knob(stage: StageResult, loop: OtherLoop) -> str | None:
    """The framework setting that runs an evaluation loop this often, where a framework's
    Trainer runs it: the loader it iterates was built by transformers' Trainer
    (get_eval_dataloader, from TrainingArguments) or by the script's Lightning hook."""
    script = stage.facts.script
    use = next((u for u in (script.loaders if script is not None else [])
                if not u.training and u.iterated_at == loop.location), None)
    if use is None:
        return None
    if use.framework == "transformers":
        at = f" at {use.edit_at}" if use.edit_at else ""
        return ("It is the Trainer's evaluation: TrainingArguments(..., eval_steps=<more "
                "steps>, or eval_strategy=\"epoch\"; a smaller eval_dataset, a larger "
                f"per_device_eval_batch_size){at} sets how often and how much.")
    hook = (use.hook or "").rpartition(".")[2]  # "Model.val_dataloader"
    if use.framework in ("lightning", "pytorch_lightning") or hook in VALIDATION_HOOKS:
        return ("It is Lightning's validation loop: Trainer(val_check_interval=<more "
                "steps>, check_val_every_n_epoch=..., limit_val_batches=<fewer>) sets how "
                "often and how much.")
    return None
