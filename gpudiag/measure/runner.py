"""Runs a list of stages: build, warm up, timed steps under telemetry, errors kept per stage.

Two passes. First every stage is timed; then each is rebuilt for its evidence window (a few
profiled steps). Never the other way round: Kineto leaves CUPTI attached after a profiler
window (pytorch/pytorch#144455), and on an H100 every stage timed after one ran 12-30% slower.

The runner never prints and never exits: it reports progress to a listener and hands the growing
RunResult to `on_stage_done` after every stage and every evidence window, so the caller can write
partial results. Ctrl-C (or SIGTERM, gpudiag.measure.interrupts) stops at once; what was
measured before is kept, and the run and the stage that was running are marked interrupted.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import nvtx
import pandas as pd
import torch

from gpudiag._version import __version__
from gpudiag.measure.env import collect_env, device_identity
from gpudiag.measure.evidence.profiler_window import record_window
from gpudiag.measure.evidence.reader import Reading, WindowReader
from gpudiag.measure.flops import count_flops
from gpudiag.measure.interrupts import (
    Stopped,
    raise_if_stopped,
    signal_name,
    signal_of,
    stop_deferred,
)
from gpudiag.measure.models import resolve_model
from gpudiag.measure.stages import StageContext, StageDef, StageSkipped, Workload, get_stage
from gpudiag.measure.telemetry import Sampler, open_sampler
from gpudiag.measure.timed_window import Window, fill_timed, measure_window
from gpudiag.measure.timing import EarlyEnd, PhaseRecorder, synchronize
from gpudiag.model.config import PRECISE_AFTER_STEPS, RunConfig
from gpudiag.model.errors import first_line
from gpudiag.model.results import RunResult, StageResult


class ProgressListener(Protocol):
    def stage_started(self, name: str, title: str, planned_steps: int) -> None: ...
    def step_done(self, name: str, done: int) -> None: ...
    def stage_finished(self, result: StageResult) -> None: ...
    def evidence_started(self, name: str) -> None: ...
    def evidence_finished(self, name: str) -> None: ...


# --min-seconds is there for the device's energy counter (100 ms refresh: README); a stage
# with no device work needs only enough steps past its loader's prefetched batches (the
# dataloader stage: ~440 batches of 2.2 ms on an H100, where 3 s timed 1,150-1,450;
# reports/examples/benchmarks/h100-ladder-ab-issue39.json).
HOST_ONLY_MIN_SECONDS = 1.0


@dataclass
class RunOutput:
    run: RunResult
    samples: pd.DataFrame  # the telemetry timeline, one row per sampler tick


def run_stages(
    config: RunConfig,
    *,
    notes: list[str] | None = None,
    listener: ProgressListener | None = None,
    on_stage_done: Callable[[RunOutput], None] | None = None,
    telemetry_spec: dict[str, Any] | None = None,
    trace_dir: Path | None = None,
) -> RunOutput:
    """Time every stage, then profile each; `trace_dir` keeps each profiler window's trace
    there as profile-<stage>.json.gz."""
    started = time.perf_counter()
    with stop_deferred():  # nothing to keep yet: a stop lands in the first stage
        device = torch.device(config.device)
        if device.type == "cuda":
            device = torch.device("cuda", device.index or 0)  # an explicit index for set_device
            torch.cuda.set_device(device)
        spec = resolve_model(config.model)
        uuid, index = device_identity(device) if device.type == "cuda" else (None, 0)
        sampler = open_sampler(device.type, uuid, index, period_s=config.sample_period_s,
                               gpm_period_s=config.gpm_period_s, spec=telemetry_spec)
        run = RunResult(
            tool_version=__version__,
            env=collect_env(device, sampler.reader, sampler.unavailable_reason),
            config=config,
            created_utc=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            notes=list(notes or []),
        )
        ctx = StageContext(config=config, device=device, spec=spec, phases=PhaseRecorder(device))

    def checkpoint() -> None:
        run.duration_s = time.perf_counter() - started
        if on_stage_done is not None:
            try:
                on_stage_done(RunOutput(run, sampler.samples()))
            except KeyboardInterrupt:  # during a partial write: stop, the final write follows
                run.interrupted = True

    session = _Session(run, ctx, sampler, listener, checkpoint)
    with sampler, _collector_sees_only_the_stages():
        profiled = [result for name in config.stages
                    if (result := session.time_stage(name)) is not None]
        try:
            for k, result in enumerate(profiled, 1):
                if run.interrupted:
                    result.facts.evidence_missing = ("the run was interrupted before this "
                                                     "stage's profiler window")
                    continue
                session.profile(result, trace_dir, last=k == len(profiled))
        finally:  # the traces' files are the run's: written before it is
            session.finish_reading()
        samples = sampler.samples()
    run.duration_s = time.perf_counter() - started
    return RunOutput(run, samples)


@dataclass
class _Session:
    """One run in progress: each stage timed, then each profiled, the run reported after each."""

    run: RunResult
    ctx: StageContext
    sampler: Sampler
    listener: ProgressListener | None
    checkpoint: Callable[[], None]
    # Each window's trace read beside the next window (evidence/reader.py); the readings not
    # yet put on their stage.
    reader: WindowReader = field(default_factory=WindowReader)
    readings: list[tuple[StageResult, Reading]] = field(default_factory=list)

    def time_stage(self, name: str) -> StageResult | None:
        """Time stage `name` into the run; return its result when it wants a profiler window."""
        definition = get_stage(name)
        if self.run.interrupted:
            self.run.stages.append(StageResult(name=name, status="skipped",
                                               title=definition.title, error="run interrupted"))
            return None
        try:
            raise_if_stopped()
            if definition.launch is not None:
                result, host_only = _launch_stage(definition, self.ctx, self.listener), True
            else:
                result, host_only = _run_stage(definition, self.ctx, self.sampler, self.listener)
        except KeyboardInterrupt as exc:
            result, host_only = StageResult(
                name=name, status="error", title=definition.title, interrupted=True,
                error=f"interrupted ({signal_name(signal_of(exc))}) before the stage "
                      "finished"), True
        result.role = definition.role
        self.run.interrupted = self.run.interrupted or result.interrupted
        self.run.stages.append(result)
        if self.listener is not None:
            self.listener.stage_finished(result)
        self.checkpoint()
        if not (result.ok and not host_only):
            return None
        if not self.ctx.config.evidence_steps:
            result.facts.evidence_missing = "--evidence-steps 0: no profiler window was run"
            return None
        return result

    def profile(self, result: StageResult, trace_dir: Path | None, *, last: bool) -> None:
        if self.listener is not None:
            self.listener.evidence_started(result.name)
        try:
            reading = _add_evidence(get_stage(result.name), self.ctx, result, trace_dir,
                                    self.reader, last=last)
            if reading is not None:
                self.readings.append((result, reading))
        except KeyboardInterrupt:
            self.run.interrupted = True
        if self.listener is not None:
            self.listener.evidence_finished(result.name)
        self._take_read(wait=False)
        self.checkpoint()

    def finish_reading(self) -> None:
        """Every window read and put on its stage; after a stop, those not read yet say so."""
        try:
            if not self.run.interrupted:
                self._take_read(wait=True)
        except KeyboardInterrupt:
            self.run.interrupted = True
        if self.run.interrupted:
            self.reader.abandon("the run was interrupted before its trace was read")
        else:
            self.reader.close()
        self._take_read(wait=True)

    def _take_read(self, *, wait: bool) -> None:
        while self.readings and (wait or self.readings[0][1].done()):
            result, reading = self.readings[0]
            read = reading.result()  # a stop while it waits leaves the reading listed
            self.readings.pop(0)
            if read.evidence is not None:
                result.evidence = read.evidence
            else:
                result.facts.evidence_missing = f"the profiler window failed: {read.error}"
            if read.not_kept is not None:
                self.run.notes.append(f"profiler trace {read.not_kept}")


def _add_evidence(definition: StageDef, ctx: StageContext, result: StageResult,
                  trace_dir: Path | None, reader: WindowReader, *, last: bool = False,
                  ) -> Reading | None:
    """Rebuild the stage's workload and record a profiled window of it, handed to `reader`
    for its evidence. A failure here is noted on the stage; its timings stand."""
    workload: Workload | None = None
    try:
        with nvtx.annotate(f"evidence {definition.name}", domain="gpudiag"):
            ctx.phases.clear()
            assert definition.build is not None
            workload = definition.build(ctx)
            # The rebuilt workload's warm-up is the window's own first step, untraced with the
            # annotator (evidence/profiler_window.py): a plain step before it added a step's
            # time to every stage's pass and changed nothing the window recorded.
            # The lower quartile is the pace the stage sustains: interference on a shared host
            # only ever adds time, and would otherwise pass for GPU idleness.
            return record_window(workload.step, device=ctx.device,
                                 steps=ctx.config.evidence_steps,
                                 budget_s=ctx.config.evidence_budget_s,
                                 timed_step_ms=result.timing.p25_ms
                                 if result.timing else result.ms_per_iter,
                                 reader=reader, name=definition.name, last=last,
                                 save_as=None if trace_dir is None else
                                 trace_dir / f"profile-{definition.name}.json.gz")
    except Exception as exc:
        result.facts.evidence_missing = (f"the profiler window failed: {type(exc).__name__}: "
                                         f"{first_line(str(exc))}")
        return None
    finally:
        ctx.phases.clear()
        if workload is not None:
            workload.close()
        del workload
        _release_memory(ctx.device)


def _count_flops_warming_up(workload: Workload, result: StageResult, warmup: int,
                            device: torch.device, counted: dict[tuple[str, ...], int],
                            ) -> list[float]:
    """The first warm-up step, run under torch's FLOP counter: the step's FLOPs (a separate
    step of the evidence pass until issue 39; warm-up steps are never timed). Its time on the
    host clock, as a warm-up step's, when it ran. A stage whose count an earlier one made
    (`counted`, by Workload.flops_key) takes it and counts nothing."""
    key = workload.flops_key
    if key is not None and key in counted:
        result.facts.flops_per_step = counted[key]
        return []
    if workload.host_only or warmup < 1:
        return []
    start = time.perf_counter()
    result.facts.flops_per_step = count_flops(workload.step)
    synchronize(device)
    if key is not None:
        counted[key] = result.facts.flops_per_step
    return [(time.perf_counter() - start) * 1e3]


def _launch_stage(definition: StageDef, ctx: StageContext,
                  listener: ProgressListener | None) -> StageResult:
    """A stage that runs in its own processes (its ranks time, sample and profile themselves,
    so it needs no evidence pass here). Errors are kept on the stage, as for any stage."""
    assert definition.launch is not None
    if listener is not None:
        listener.stage_started(definition.name, definition.title, 1)
    try:
        with nvtx.annotate(f"stage {definition.name}", domain="gpudiag"):
            return definition.launch(ctx)
    except StageSkipped as exc:
        return StageResult(name=definition.name, status="skipped", title=definition.title,
                           error=str(exc))
    except Exception as exc:
        return StageResult(name=definition.name, status="error", title=definition.title,
                           error=f"{type(exc).__name__}: {first_line(str(exc))}",
                           advice="the full traceback is in run.json (stages[].traceback)",
                           traceback=traceback.format_exc())


def _run_stage(definition: StageDef, ctx: StageContext, sampler: Sampler,
               listener: ProgressListener | None) -> tuple[StageResult, bool]:
    """The stage's timed result, and whether it is host-only (nothing to profile)."""
    config, name = ctx.config, definition.name
    result = StageResult(name=name, status="ok", title=definition.title)
    if listener is not None:
        listener.stage_started(name, definition.title, config.warmup + config.iters)
    workload: Workload | None = None
    try:
        with nvtx.annotate(f"stage {name}", domain="gpudiag"):
            ctx.phases.clear()
            assert definition.build is not None
            workload = definition.build(ctx)
            result.workload, result.facts = workload.description, workload.facts
            first = _count_flops_warming_up(workload, result, config.warmup, ctx.device,
                                            ctx.flops_counted)
            counted = len(first)
            window = measure_window(
                workload.step, device=ctx.device, sampler=sampler, phases=ctx.phases,
                label=name, warmup=config.warmup - counted,
                iters=max(config.iters, workload.min_iters),
                min_seconds=(min(config.min_seconds, HOST_ONLY_MIN_SECONDS)
                             if workload.host_only else config.min_seconds),
                early=(None if config.timed_precision is None else
                       EarlyEnd(after=max(PRECISE_AFTER_STEPS, workload.min_iters),
                                precision=config.timed_precision)),
                host_only=workload.host_only,
                on_step=(None if listener is None else
                         lambda d: listener.step_done(name, d + counted)),
                on_timed_start=workload.on_timed_start)
            window.warmup_ms[:0] = first
            fill_timed(result, window, samples_per_step=workload.samples_per_step,
                       tokens_per_step=workload.tokens_per_step)
            workload.record_timed(result.facts)
    except KeyboardInterrupt as exc:
        _mark_interrupted(result, exc, workload)
    except StageSkipped as exc:
        result.status, result.error = "skipped", str(exc)
    except torch.OutOfMemoryError as exc:
        result.status = "error"
        result.error = f"out of device memory: {_first_sentences(str(exc))}"
        result.advice = (f"lower --batch-size (now {config.batch_size}) or --seq-len "
                         f"(now {config.seq_len}), or run this stage alone with --stages {name}")
        result.traceback = traceback.format_exc()
    except Exception as exc:
        result.status = "error"
        result.error = f"{type(exc).__name__}: {first_line(str(exc))}"
        result.advice = "the full traceback is in run.json (stages[].traceback)"
        result.traceback = traceback.format_exc()
    finally:
        host_only = workload is not None and workload.host_only
        if workload is not None:
            workload.close()
        del workload
        _release_memory(ctx.device)
    return result, host_only


def _mark_interrupted(result: StageResult, exc: KeyboardInterrupt,
                      workload: Workload | None) -> None:
    """A stage a signal stopped: status error, marked interrupted, with the steps it had timed
    (its timings say how far it got; rules do not read stages that are not ok)."""
    result.status, result.interrupted = "error", True
    partial = exc.partial if isinstance(exc, Stopped) else None
    steps = len(partial.iter_ms) if isinstance(partial, Window) else 0
    result.error = (f"interrupted ({signal_name(signal_of(exc))}) after {steps} timed "
                    "step(s)")
    if isinstance(partial, Window) and partial.iter_ms and workload is not None:
        fill_timed(result, partial, samples_per_step=workload.samples_per_step,
                   tokens_per_step=workload.tokens_per_step)


@contextlib.contextmanager
def _collector_sees_only_the_stages() -> Iterator[None]:
    """What exists before the first stage (torch, Dynamo, the caller's own objects: 400,000
    and more) leaves the cyclic collector's view meanwhile (gc.freeze), and so does what
    survives each collection between stages (what a stage imported: transformers, 150,000
    more), so each collection walks what the last stage made: 0.35 s a collection otherwise,
    two a stage, on a 2-core VM. Reference counting frees what it frees either way; all is
    unfrozen after the last stage."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _release_memory(device: torch.device) -> None:
    # Stages must not inherit each other's cached blocks: peak-memory figures and OOM
    # behaviour of a stage should not depend on which stage ran before it.
    gc.collect()
    gc.freeze()  # what survived is the run's own (see _collector_sees_only_the_stages)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _first_sentences(text: str, limit: int = 2) -> str:
    sentences = first_line(text).split(". ")
    return ". ".join(sentences[:limit]).rstrip(".")
