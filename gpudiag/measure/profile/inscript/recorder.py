"""Inside a profiled script: step boundaries, step times, telemetry and one profiler window,
written as a stage (a part) when the process exits; what the script's frameworks did (its
DataLoaders' waits, saves, DDP, FSDP, optimizers, torch.compile) is each watch's to record
(watches/), and to fill into the stage.

Made at interpreter start-up by install.py (which the bootstrap's sitecustomize calls), and
written at exit by lifecycle.py's handlers. Steps end at each `optimizer.step()` of the first
optimizer that steps (a global post-hook), or at each `gpudiag.step()` / end of
`with gpudiag.watch():` once the script uses those. Which steps warm up, are timed, run under
the profiler or come after is schedule.py's to say.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import nvtx
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from gpudiag.measure.env import collect_env, device_identity
from gpudiag.measure.evidence.profiler_window import ProfilerWindow
from gpudiag.measure.profile.inscript.hostsampler import HostSampler, loop_frame, stack
from gpudiag.measure.profile.inscript.outofmemory import oom_device
from gpudiag.measure.profile.inscript.planned import planned_steps
from gpudiag.measure.profile.inscript.ranksagree import window_goes_on
from gpudiag.measure.profile.inscript.remedies import Applied, LossLog
from gpudiag.measure.profile.inscript.schedule import Phase, Schedule
from gpudiag.measure.profile.inscript.timeline import TIMELINE_STEPS, build_timeline
from gpudiag.measure.profile.inscript.watches import StageDraft, discover
from gpudiag.measure.profile.protocol import (
    ENV_PARENT,
    ENV_TRACE_DIR,
    part_name,
    part_text,
    window_done_name,
    window_trace_name,
)
from gpudiag.measure.telemetry import open_sampler
from gpudiag.measure.timed_window import Window, fill_timed
from gpudiag.model.atomic import write_text_atomic
from gpudiag.model.config import GPM_PERIOD_S, SAMPLE_PERIOD_S, ProfileConfig
from gpudiag.model.facts import (
    HostSamples,
    MemoryTimeline,
    ScriptFacts,
    StageFacts,
    StepTimeline,
)
from gpudiag.model.profilepart import ProfilePart, WindowTrace
from gpudiag.model.remedies import LargerBatchRecord
from gpudiag.model.results import Env, MemoryStats, StageResult, TimingStats

NO_GPM_PERIOD_S = 1e9
MAX_STEPS = 100_000  # steps recorded at most: bounds the event list of a long run
# A part is written at the end of warm-up and every PART_EVERY_S after the window: a process
# killed outright keeps its steps up to then.
PART_EVERY_S = 60.0
CRASH_LINES = 12  # of an uncaught exception's traceback, kept on the stage


@dataclass
class Stop:
    """A stop under way in this process, as lifecycle.py's signal handlers saw it; the
    recorder acts on it at its next step boundary."""

    # This process (the script's, or a DataLoader worker forked with a copy of the recorder)
    # had a SIGINT or SIGTERM.
    seen: bool = False
    signal: int | None = None  # a SIGTERM waiting for the next step boundary
    interrupt: bool = False  # a SIGINT came: a step boundary after it stops

    def at_boundary(self) -> None:
        """A stop waiting for this step boundary: a SIGTERM, or a Ctrl-C the script went on
        after."""
        if self.signal is not None:
            raise SystemExit(128 + self.signal)
        if self.interrupt:
            raise KeyboardInterrupt


class Recorder:
    """One process's record of the script: its step boundaries (an optimizer step post-hook,
    or gpudiag.step()), the profiler window the schedule (schedule.py) places, and its part
    (gpudiag.model.profilepart.ProfilePart), written at the end of warm-up, at the window's
    close, every PART_EVERY_S after and at exit (lifecycle.py). Its watches (watches/) record
    the frameworks the script uses, each hearing of the steps and the window from here, and
    fill in their facts.
    """

    def __init__(self, out: Path, config: ProfileConfig, started: float | None = None) -> None:
        self.out, self.config = out, config
        self.schedule = Schedule.of(config)
        self.pid = os.getpid()
        # Step 0 runs from the interpreter's start (`started`, before the script imported
        # torch and with it this recorder) to the first step's end.
        self.host_marks: list[float] = [time.perf_counter() if started is None else started]
        self.events: list[Any] = []
        self.cuda: bool | None = None  # decided at the first step
        self.clock: int | None = None  # id of the optimizer whose steps are the step clock
        self.manual = False
        # Past MAX_STEPS steps are only counted: how many, and when the last one ended.
        self.extra_steps = 0
        self.end_mark: float | None = None
        self.exit_mark: float | None = None
        trace_dir = os.environ.get(ENV_TRACE_DIR)  # where gpudiag keeps a copy of the trace
        self.trace_dir = Path(trace_dir) if trace_dir else None
        self.sampler: Any = None
        self.host_sampler: HostSampler | None = None
        self.host: HostSamples | None = None
        self.first_stack: list[FrameType] = []  # at the first step's end, to find the loop
        self.loop_code: CodeType | None = None  # the training loop's, found at the second
        self.telemetry: Any = None
        self.window: ProfilerWindow | None = None
        self.window_trace: WindowTrace | None = None  # the closed window, for the parent
        self.part_at = self.host_marks[0]  # when this process last wrote its part
        self.nvtx_range: Any = None
        self.finished = False
        self.error: str | None = None
        self.watches = discover(self)  # installed (their patches) by install()
        self.planned: tuple[int, str] | None = None  # (steps the script means to make, from)
        self.cut_short = False  # gpudiag ended the script after its window
        self.window_whole = False  # the window closed on its own, not at the script's end
        self.fitted_to_plan = False  # the schedule was shrunk to the steps the script plans
        self.env: Env | None = None
        self.crash: list[str] = []  # the last lines of an uncaught exception's traceback
        # It died of an allocation that failed: its stage is written even before a first step
        # (the commonest out-of-memory: the first step does not fit), for what held memory.
        self.out_of_memory = False
        self.stop = Stop()  # lifecycle.py's signal handlers ask; each step boundary acts
        # --try-fixes (remedies.py, beside this one): remedies applied, first losses.
        self.applied = Applied(config.remedies, LargerBatchRecord(
            factor=config.batch_factor, training_site=config.batch_site))
        self.losses = LossLog(config.losses)

    @property
    def steps(self) -> int:
        return len(self.host_marks) - 1

    def install(self) -> None:
        """Every watch's patches, then the step clock: the watches' own optimizer step
        post-hooks run before it, so a step is theirs before it ends (or the run does)."""
        for watch in self.watches:
            watch.install()
        register_optimizer_step_post_hook(self.optimizer_stepped)

    # --- step boundaries ---------------------------------------------------------------

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if self.planned is None:
            self.planned = (0, "")
            # A loader's len() runs its sampler's: never an error in the script's step.
            with contextlib.suppress(Exception):
                self.planned = planned_steps(sys._getframe(1)) or self.planned
            self._fit_to_plan(self.planned[0])
        if self.manual:
            return
        if self.clock is None:
            self.clock = id(optimizer)
        if id(optimizer) == self.clock:
            self.boundary()

    def _fit_to_plan(self, planned: int) -> None:
        """A script that says it makes fewer steps than the schedule needs gets the schedule
        fitted to them now, at its first step, rather than a second run after the first fell
        short (issue 39). Where it says nothing, or makes fewer steps than it said, the launcher
        re-runs it as before (session.py)."""
        fitted = self.config.fitted(planned) if 0 < planned < self.schedule.end else None
        if fitted is not None:
            self.schedule = Schedule.of(fitted)
            self.fitted_to_plan = True

    def manual_step(self) -> None:
        self.manual = True
        self.boundary()

    def boundary(self) -> None:
        self.stop.at_boundary()
        if self.finished:
            return
        if self.steps >= MAX_STEPS:
            self.extra_steps, self.end_mark = self.extra_steps + 1, time.perf_counter()
            return
        if self.cuda is None:
            self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            self._open_telemetry()
        # Device-clock step times are the timed window's (warm-up included, for its spread):
        # an event ends each warm-up and timed step. Later steps are on the host clock only:
        # an event costs ~12 us of the step's host time on an H100 host
        # (benchmarks/host_sampler.py), 0.6% of a 2 ms step.
        if self.cuda and self.schedule.phase(self.steps) in (Phase.WARMUP, Phase.TIMED):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        now = time.perf_counter()
        self._keep_steps(now)
        self.host_marks.append(now)
        done = self.steps
        self._sample_host(done)
        for watch in self.watches:
            watch.step_ended()
        if self.nvtx_range is not None:
            nvtx.end_range(self.nvtx_range)
        self.nvtx_range = nvtx.start_range(f"step {done}", domain="gpudiag")
        try:
            self._windows(done)
        except Exception as exc:  # evidence is optional; the script must go on
            self.error = f"{type(exc).__name__}: {exc}"
            self._stop_profiler(keep=False)

    def _keep_steps(self, now: float) -> None:
        """What a SIGKILL (or an out-of-memory kill) would otherwise lose: every step so far,
        written at the end of warm-up, every PART_EVERY_S after the profiler window, and where
        a watch sees a kill near (the host's memory near its limit: memory.py) (the window's
        part and the exit's replace it). Never among the timed or profiled steps:
        writing costs tens of ms. Runs before the step's end mark, so that time is the ending
        step's, a warm-up or later step."""
        ending = self.steps  # the step this boundary ends (0-based)
        ends_warmup = ending + 1 == self.schedule.timed_steps.start
        if ending and ending not in self.schedule.quiet_steps and (
                ends_warmup or now - self.part_at >= PART_EVERY_S
                or any([watch.keep_now() for watch in self.watches])):
            self.part_at = now
            self._write_part()

    def _sample_host(self, done: int) -> None:
        """The training thread's sampler, told of each step's end: started over the first two
        steps, its rate fitted as the timed steps begin."""
        if self.host_sampler is not None:
            self.host_sampler.watch(self.host_marks[-1])
        if done <= 2 and self.config.host_sample_hz > 0:
            self._start_host_sampler(done)
        elif done == self.schedule.timed_steps.start and self.host_sampler is not None:
            self._fit_host_rate()

    def _start_host_sampler(self, done: int) -> None:
        """The training loop is the frame on the stack at both of the first two step ends:
        sampling starts at the second, in the thread that steps."""
        if done == 1:
            self.first_stack = stack(sys._getframe())
            return
        loop = loop_frame(self.first_stack, sys._getframe())
        self.first_stack = []  # frames hold their locals: let them go
        self.loop_code = loop.f_code if loop is not None else None
        self.host_sampler = HostSampler(
            self.host_marks, thread_id=threading.get_ident(),
            loop_code=self.loop_code, cuda=bool(self.cuda),
            warmup=self.schedule.warmup, skip=self.schedule.unsampled_steps,
            max_steps=TIMELINE_STEPS,
            period_s=1 / self.config.host_sample_hz)
        self.host_sampler.start()

    def _fit_host_rate(self) -> None:
        """The warm-up's steps (but the first two: compilation, caches) set the sampling rate
        for the steps that count (hostsampler.py's fit)."""
        marks = self.host_marks[2:] if len(self.host_marks) > 4 else self.host_marks[1:]
        steps = [(b - a) * 1e3 for a, b in itertools.pairwise(marks)]
        if steps:
            assert self.host_sampler is not None
            self.host_sampler.fit(statistics.median(steps), len(self.schedule.timed_steps))

    def _windows(self, done: int) -> None:
        """At the boundary before step `done`: the timed steps' telemetry begins with them and
        ends after them; the profiler window opens with the profiled steps, marks each one's
        end, and closes after them."""
        timed, profiled = self.schedule.timed_steps, self.schedule.profiled_steps
        if done == timed.start and self.sampler is not None:
            self.sampler.begin("timed")
        if done == timed.stop:
            if self.sampler is not None and self.telemetry is None:
                self.telemetry = self.sampler.end()
            if profiled:
                annotate = all(watch.annotates() for watch in self.watches)
                self.window = ProfilerWindow(self._device(), annotate=annotate,
                                             budget_s=self.config.evidence_budget_s)
                self.window.start()
        elif self.window is not None and self.window.open:
            if done != profiled.stop and self._window_goes_on(done):
                return
            self.window_whole = True
            self._stop_profiler(keep=True, at_boundary=True)
            for watch in self.watches:
                watch.window_closed()
            self._window_closed()

    def _window_goes_on(self, done: int) -> bool:
        """At the end of profiled step `done` (not the last planned): whether the window
        profiles another, the next step then open. The ranks of a job decide together
        (ranksagree.py): a rank closing its window a step before another would be waited for
        by it, which reads as communication or a straggler."""
        assert self.window is not None
        wants = self.window.wants_another_step()
        rank, world = _rank()
        if world == 1 or self.window.budget_s is None:
            if wants:
                self.window.next_step()
            return wants
        self.window.end_step()  # the wait for the others' votes is no step's time
        agreed = window_goes_on(self.out, done, rank or 0, world, wants)
        if agreed is None:  # a vote did not come: every rank waited alike, all go on whole
            self.window.budget_s = None
        if agreed is not False:
            self.window.begin_step()
        return agreed is not False

    def _window_closed(self) -> None:
        """The diagnosis can be made now: write the part (the parent renders an early report),
        and end the script if asked to."""
        self._write_part()
        (self.out / window_done_name(os.getpid())).touch()
        if self.config.stop_after_window:
            print(f"gpudiag profile: the profiler window closed at step {self.steps}; ending "
                  "the script (--stop-after-window)", file=sys.stderr, flush=True)
            self.cut_short = True
            self.finish()
            raise SystemExit(0)

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.cuda else \
            torch.device("cpu")

    def _stop_profiler(self, keep: bool, at_boundary: bool = False) -> None:
        """Close the window, keeping its evidence when `keep`. The step in progress counts only
        at a step boundary: when the script ends mid-window, that part-step is not a step."""
        if self.window is None or not self.window.open:
            return
        if not keep:
            self.window.stop(closing_step=at_boundary)
            self.window.trace_json = b""
            return
        # Exported into the parts folder: gpudiag's own process parses and analyses it
        # (launching/windows.py), beside the script rather than in it.
        name = window_trace_name(self.pid)
        self.window.stop(closing_step=at_boundary, export_to=self.out / name)
        if not self.window.step_ms:  # no step closed: nothing to read
            (self.out / name).unlink(missing_ok=True)
            return
        timed = self._measured_ms()[2]
        trace = WindowTrace(
            trace=name, steps=len(self.window.step_ms),
            step_ms=statistics.fmean(self.window.step_ms),
            backend="cuda" if self.window.device.type == "cuda" else "cpu",
            timed_step_ms=TimingStats.of(timed).p25_ms if timed else None,
            roots=[str(Path.cwd()), *sys.path],
            save_as=(str(self.trace_dir / f"profile-{_stage_name()}.json.gz")
                     if self.trace_dir is not None else None))
        for watch in self.watches:
            watch.trace_made(trace, self.window.annotate)
        self.window_trace = trace

    # --- telemetry ----------------------------------------------------------------------

    def _open_telemetry(self) -> None:
        mode = self.config.telemetry
        if not self.cuda or mode == "off":
            return
        try:
            device = torch.device("cuda", torch.cuda.current_device())
            uuid, index = device_identity(device)
            self.sampler = open_sampler(
                "cuda", uuid, index, period_s=SAMPLE_PERIOD_S,
                gpm_period_s=NO_GPM_PERIOD_S if mode == "basic" else GPM_PERIOD_S)
            self.sampler.__enter__()
        except Exception as exc:
            self.sampler, self.error = None, f"telemetry: {type(exc).__name__}: {exc}"

    # --- the result ----------------------------------------------------------------------

    def _step_ms(self) -> list[float]:
        if self.cuda and self.events:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in itertools.pairwise(self.events)]
        return [(b - a) * 1e3 for a, b in itertools.pairwise(self.host_marks)]

    def _measured_ms(self) -> tuple[int, list[float], list[float]]:
        """(the first timed step measured, the warm-up steps' ms, the timed steps' ms). CUDA
        events start at the first boundary: step i's time is events[i-1] -> events[i], and step
        0 has none; on the host clock step i is marks[i] -> marks[i+1]."""
        all_ms = self._step_ms()
        offset = 1 if self.cuda else 0  # all_ms[j] is step j + offset
        timed = self.schedule.timed_steps
        first = max(timed.start, offset)
        return first, all_ms[:first - offset], all_ms[first - offset:timed.stop - offset]

    def stage(self) -> StageResult:
        first, warmup_ms, timed = self._measured_ms()
        draft = self._draft(range(first, first + len(timed)))
        result = StageResult(name=_stage_name(), status="ok", title=" ".join(sys.argv),
                             workload=f"{' '.join(sys.argv)} (profiled)", facts=draft.facts)
        if self.crash:
            # The steps before the crash stay measured; the stage says the script failed.
            result.status, result.error = "error", f"the script raised {self.crash[-1]}"
            result.traceback = "".join(self.crash)
            if not timed:
                return result
        if not timed:
            result.status = "error"
            timed_steps = self.schedule.timed_steps
            result.error = (f"no timed steps: the script made {self.steps} step(s); gpudiag "
                            f"times steps {timed_steps.start}..{timed_steps.stop - 1}")
            result.advice = ("lower --warmup, or mark steps: call gpudiag.step() once per "
                             "step, or wrap the loop body in `with gpudiag.watch():`")
            return result
        window = Window(warmup_ms=warmup_ms, iter_ms=timed,
                        timer="cuda-events" if self.cuda else "host-clock",
                        telemetry=self.telemetry or result.telemetry, phases_ms=draft.phases_ms,
                        memory=_device_peaks(draft.script.memory))
        status = result.status
        fill_timed(result, window, samples_per_step=self.config.samples_per_step or
                   draft.samples_per_step)
        result.status = status
        return result

    def _draft(self, timed: range) -> StageDraft:
        """The stage's facts: the step clock's, then each watch's."""
        timeline = self._timeline()
        script = ScriptFacts(
            steps=self.steps, warmup=self.schedule.warmup, timed=len(timed),
            fitted_schedule=((self.schedule.warmup, self.schedule.timed,
                              self.schedule.evidence_steps) if self.fitted_to_plan else None),
            step_clock="gpudiag.step()" if self.manual else "optimizer.step()",
            device=torch.cuda.get_device_name() if self.cuda else None,
            losses=list(self.losses.values), remedies=self.applied.observe(),
            timeline=timeline, host=self.host)
        draft = StageDraft(facts=StageFacts(script=script), script=script, timeline=timeline,
                           timed=timed)
        for watch in self.watches:
            watch.fill(draft)
        if self.window_trace is None:  # else gpudiag's process reads the window's evidence
            draft.facts.evidence_missing = self._why_no_evidence()
        return draft

    def _timeline(self) -> StepTimeline:
        profiled = self.schedule.profiled_steps
        # The steps the window profiled: fewer than planned where they took its budget.
        window = ((profiled.start, profiled.start + self.window_trace.steps)
                  if self.window_trace is not None else None)
        timeline = build_timeline(self.host_marks, extra_steps=self.extra_steps,
                                  end_mark=self.end_mark, exit_mark=self.exit_mark,
                                  window=window)
        if self.planned is not None and self.planned[0] > 0:
            timeline.planned_steps, timeline.planned_from = self.planned
        timeline.cut_short, timeline.window_whole = self.cut_short, self.window_whole
        return timeline

    def _why_no_evidence(self) -> str:
        if not self.schedule.profiled_steps:
            return "--evidence-steps 0: no profiler window was asked for"
        window_at = self.schedule.profiled_steps.start
        if self.steps <= window_at:
            ended = (f"the script ended after {self.steps} steps, before the profiler window "
                     f"at step {window_at}")
            fitted = self.config.fitted(self.steps)
            if fitted is None:
                return (f"{ended}, too few to time and profile: mark shorter steps with "
                        "gpudiag.step(), or run it longer")
            return (f"{ended}: profile it with --warmup {fitted.warmup} --timed {fitted.timed} "
                    f"--evidence-steps {fitted.evidence_steps}, or let gpudiag re-run it with "
                    "that schedule (the default, --rerun)")
        return f"the profiler window failed: {self.error}" if self.error else \
            "the script ended inside the profiler window"

    def finish(self, *, shutdown: bool = True) -> None:
        """The run's end: the window closed, samplers stopped, the part written; `shutdown`
        False for an exit without Python's shutdown (os._exit), which the part says."""
        if self.finished:
            return
        self.finished = True
        self.exit_mark = time.perf_counter()  # the run's end: after its last step, at exit
        try:
            self._stop_profiler(keep=True)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        if self.host_sampler is not None:
            self.host = self.host_sampler.stop()
        for watch in self.watches:
            try:
                watch.finish()
            except Exception as exc:  # a framework's internals moved: the rest of the run stands
                self.error = self.error or f"{watch.label}: {type(exc).__name__}: {exc}"
        if self.sampler is not None:
            try:
                if self.telemetry is None and self.steps > self.schedule.timed_steps.start:
                    self.telemetry = self.sampler.end()
                self.sampler.__exit__(None, None, None)
            except Exception as exc:
                self.error = f"telemetry: {type(exc).__name__}: {exc}"
        self._write_part(final=shutdown)

    def crashed(self, exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        """An exception the script did not catch (sys.excepthook; atexit's finish follows).
        Ctrl-C is a stop, not a crash: the run says it was interrupted."""
        if issubclass(exc_type, KeyboardInterrupt):
            return
        lines = traceback.format_exception(exc_type, exc, tb)
        self.crash = [line for chunk in lines[-CRASH_LINES:] for line in chunk.splitlines(True)
                      ][-CRASH_LINES:]
        self.out_of_memory = oom_device(exc) is not None
        for watch in self.watches:
            try:
                watch.crashed(exc)
            except Exception as error:  # a watch never hides the script's crash
                self.error = f"{watch.label}: {type(error).__name__}: {error}"

    def _environment(self) -> Env:
        """The machine and the settings the script trains with (its TF32 flags, say), read in
        the script's own process once its steps have run; the parent never imports torch."""
        if self.env is None:
            self.env = collect_env(self._device(), None,
                                   "telemetry is sampled inside the profiled processes")
        return self.env

    def _write_part(self, *, final: bool = False) -> None:
        """This process's stage, atomically (the parent may read it while the script runs);
        `final` once the process is exiting normally (a part without it, from a process that
        ended, means the process died without Python's shutdown)."""
        root = os.environ.get(ENV_PARENT) == str(os.getppid())
        if self.steps == 0 and not root:
            return  # a helper process (torchrun's agent, a spawned worker): nothing to say
        part = ProfilePart(pid=os.getpid(), argv=list(sys.argv), steps=self.steps,
                           rank=_rank()[0], cuda=bool(self.cuda), error=self.error,
                           final=final, crash="".join(self.crash) or None,
                           stage=self.stage() if self.steps or self.out_of_memory else None,
                           env=self._environment(), window=self.window_trace)
        self.out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.out / part_name(os.getpid()), part_text(part))


def _rank() -> tuple[int | None, int]:
    """(this process's rank, the job's size): the process group's once it exists (Lightning's
    own launcher sets no RANK), else torchrun's RANK/WORLD_SIZE, else LOCAL_RANK."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK"))
    return (int(rank) if rank is not None and rank.isdigit() else None,
            int(os.environ.get("WORLD_SIZE", "1") or 1))


def _device_peaks(memory: MemoryTimeline | None) -> MemoryStats | None:
    """The stage's device memory summary (the run table's peak) from its per-step counters."""
    if memory is None or memory.device != "cuda" or not memory.peak_mib:
        return None
    return MemoryStats(peak_allocated_mib=max(memory.peak_mib),
                       peak_reserved_mib=max(memory.reserved_mib),
                       device_total_mib=memory.device_total_mib)


def _stage_name() -> str:
    """The script's name, with its rank in a multi-process job: `train.py[rank1]`."""
    name = Path(sys.argv[0]).name or "script"
    rank, world = _rank()
    if rank is not None and world > 1:
        name = f"{name}[rank{rank}]"
    return name

