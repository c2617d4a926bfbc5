"""The results gpudiag produces: the types `run.json` holds (its format: runfile.py).

This module is the contract between measuring (runner, stages, telemetry) and everything that
reads measurements (rules, compare, reports). It imports nothing from gpudiag outside
gpudiag.model, so that a recorded `run.json` can be analysed anywhere without torch or a GPU.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from gpudiag.model.config import AnyConfig
from gpudiag.model.facts import StageFacts
from gpudiag.model.remedies import RemedyEvidence

SCHEMA_VERSION = 4  # run.json's version: its history and upgrades are in runfile.py

StageStatus = Literal["ok", "error", "skipped"]
# What a stage is to the others: a training (or inference) step; the reference step others are
# held against (the ladder's compute-bound rung); batches only, no model step; the device's
# ceilings, not a step.
StageRole = Literal["step", "reference", "loader", "ceiling"]
Equivalence = Literal["same", "mixed-precision", "differs", "unchecked", "recipe"]
Severity = Literal["info", "warning", "critical"]
SEVERITY_RANK: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}
# Bounds a file must meet (gpudiag.model.schema validates them on load). A timed step under a
# microsecond is below what CUDA events or perf_counter resolve: not a measurement.
MIN_STEP_MS = 1e-3
# ... and a step of more than a day is no step a window times (a number that large is a
# corrupt file, and would overflow the statistics).
MAX_STEP_MS = 86_400_000.0
StepMs = Annotated[float, Field(ge=MIN_STEP_MS, le=MAX_STEP_MS)]
NonNegative = Annotated[float, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
Share = Annotated[float, Field(ge=0, le=1)]
Count = Annotated[int, Field(ge=0)]


@dataclass
class TimingStats:
    """Robust summary of per-iteration times, in milliseconds."""

    n: Count
    median_ms: StepMs
    p25_ms: StepMs
    p75_ms: StepMs
    mad_ms: NonNegative
    mean_ms: StepMs
    min_ms: StepMs
    max_ms: StepMs

    @property
    def iqr_ms(self) -> float:
        return self.p75_ms - self.p25_ms

    @classmethod
    def of(cls, times_ms: list[float]) -> TimingStats:
        if not times_ms:
            raise ValueError("no iteration times to summarise")
        median = statistics.median(times_ms)
        if len(times_ms) >= 2:
            p25, _, p75 = statistics.quantiles(times_ms, n=4, method="inclusive")
        else:
            p25 = p75 = median
        mad = statistics.median(abs(t - median) for t in times_ms)
        return cls(
            n=len(times_ms),
            median_ms=median,
            p25_ms=p25,
            p75_ms=p75,
            mad_ms=mad,
            mean_ms=statistics.fmean(times_ms),
            min_ms=min(times_ms),
            max_ms=max(times_ms),
        )


@dataclass
class MemoryStats:
    """Device memory seen by the caching allocator during a stage (warm-up and timed steps)."""

    peak_allocated_mib: NonNegative
    peak_reserved_mib: NonNegative
    device_total_mib: NonNegative | None = None


@dataclass
class TelemetrySummary:
    """What the GPU reported while a stage's timed iterations ran.

    `available` is False on machines without NVML; `reason` then says why. Individual metrics a
    GPU refuses are None, with the refusal in `unavailable_metrics`.
    """

    available: bool
    reason: str | None = None
    sample_count: int = 0
    period_s: float | None = None
    window_s: float | None = None
    energy_j: float | None = None
    energy_source: str | None = None  # "counter" (NVML total-energy) or "power-integral"
    power_mean_w: float | None = None  # energy / window
    power_max_w: float | None = None  # highest instantaneous sample
    power_limit_w: float | None = None
    kernel_active_pct: float | None = None  # NVML "utilization.gpu": any kernel running
    memory_busy_pct: float | None = None  # NVML "utilization.memory": DRAM controller busy
    sm_clock_mhz_mean: float | None = None
    sm_clock_mhz_min: float | None = None
    temperature_max_c: float | None = None
    memory_used_max_mib: float | None = None
    throttle_share: dict[str, float] = field(default_factory=dict)  # reason -> share of samples
    gpm: dict[str, float] = field(default_factory=dict)  # GPM metric -> % over the window
    unavailable_metrics: dict[str, str] = field(default_factory=dict)

    @classmethod
    def unavailable(cls, reason: str) -> TelemetrySummary:
        return cls(available=False, reason=reason)


@dataclass
class SourceLine:
    """Work charged to one line of user code during the evidence window, per step."""

    location: str  # "path:line"
    function: str
    calls_per_step: NonNegative = 0.0  # torch calls made from this line
    direct_calls_per_step: NonNegative = 0.0  # ... by the line itself, not through a library
    ops_per_step: NonNegative = 0.0  # top-level operators, forward and their backward
    kernels_per_step: NonNegative = 0.0
    syncs_per_step: NonNegative = 0.0
    sync_idle_ms_per_step: NonNegative = 0.0  # device idle after this line's syncs
    memcpys_per_step: NonNegative = 0.0
    # Of those, host-to-device: a `.to(device)` that blocks syncs without reading anything
    # back (GD202/GD203's, not a read's). None: a run recorded before they were told apart.
    htod_copies_per_step: NonNegative | None = None
    host_ms_per_step: NonNegative = 0.0
    device_ms_per_step: NonNegative = 0.0
    median_kernel_us: NonNegative | None = None
    share_of_step_time: NonNegative = 0.0  # host time in this line's calls / profiled step time
    in_loop: bool = False  # the line sits inside a for/while loop or comprehension
    # The library frame (path:line) between this line of the user's code and torch, when the
    # work went through one (a Trainer, a model in site-packages); None for direct calls.
    via: str | None = None


# What device time is spent on (gpudiag/measure/evidence/kinds.py). The memory-bound kinds
# move every element through memory for a few operations each: their time is bandwidth, and
# fusing them (with each other, or into a matmul's epilogue or fused attention) removes it.
# A layout transpose (cuDNN's NCHW <-> NHWC around a convolution) is memory-bound too, but
# kept apart: no fusion removes it, a channels_last model and input do (GD306).
DeviceKind = Literal["matmul", "convolution", "attention", "softmax", "norm", "elementwise",
                     "reduction", "layout", "optimizer", "collective", "other"]
MEMORY_BOUND_KINDS: frozenset[str] = frozenset({"softmax", "norm", "elementwise", "reduction"})


@dataclass
class LineCount:
    """What one source line did per profiled step, compactly, for every line (not only the
    busiest): the gate diffs these to name the line a new op, kernel or sync comes from."""

    location: str
    function: str
    ops: NonNegative = 0.0
    kernels: NonNegative = 0.0
    syncs: NonNegative = 0.0
    copies: NonNegative = 0.0
    device_ms: NonNegative = 0.0
    sync_idle_ms: NonNegative = 0.0
    # Of its syncs, those made inside a library, by the library's line (`trainer.train()`'s
    # syncs at transformers/trainer.py's NaN check of the loss).
    sync_vias: dict[str, NonNegative] = field(default_factory=dict)
    # Device (CPU: operator) ms by kind.
    kind_ms: dict[str, NonNegative] = field(default_factory=dict)
    # What the line's operators compute and move per step, from the shapes the profiler
    # recorded (gpudiag/measure/evidence/shapes.py): matmul FLOPs, and bytes read and written
    # (an estimate: each input once, an output the size of the largest input; a matmul's exact).
    flops: NonNegative = 0.0
    bytes: NonNegative = 0.0
    # Of those bytes, the memory-bound operators' (softmax, norm, elementwise, reduction); and
    # what they would still move fused as a compiler fuses them (consecutive ones into one
    # kernel moving the largest one's bytes: gpudiag/measure/evidence/trace.py).
    memory_bytes: NonNegative = 0.0
    fused_memory_bytes: NonNegative = 0.0
    # Memory-bound kernel ms (CPU: operator ms) whose operator computed in fp32, by kind, and
    # casts into fp32 ("cast"); inside an autocast region these are fp32 islands (autocast's
    # fp32 softmax and norms and their casts, elementwise ops promoted by an fp32 input).
    fp32_ms_by_kind: dict[str, NonNegative] = field(default_factory=dict)

    @property
    def fp32_memory_bound_ms(self) -> float:
        return sum(self.fp32_ms_by_kind.values())


@dataclass
class Evidence:
    """Per-step counts from a short profiler window, run after (not among) the timed steps."""

    steps: Annotated[int, Field(ge=1)]  # a window of no step measured nothing
    step_ms: NonNegative  # profiled step time, host clock, instrumentation included
    backend: str  # "cuda" (kernels measured) or "cpu" (operator calls counted)
    kernels_per_step: NonNegative = 0.0
    launches_per_step: NonNegative = 0.0
    ops_per_step: NonNegative = 0.0
    syncs_per_step: NonNegative = 0.0
    memcpy_per_step: dict[str, NonNegative] = field(default_factory=dict)  # "HtoD-pageable": n
    memcpy_ms_per_step: dict[str, NonNegative] = field(default_factory=dict)
    # Share of HtoD copy time with a kernel running.
    htod_overlap_fraction: NonNegative | None = None
    memset_per_step: NonNegative = 0.0
    sync_ms_per_step: NonNegative = 0.0  # host time blocked in synchronising calls
    # Device idle right after syncs (until the host's next work starts): what syncs cost.
    sync_idle_ms_per_step: NonNegative = 0.0
    matmul_ms_by_dtype: dict[str, NonNegative] = field(default_factory=dict)  # "fp32": ms per step
    # Kernel time (on a CPU, top-level operators' host time) per step, by DeviceKind.
    device_ms_by_kind: dict[str, NonNegative] = field(default_factory=dict)
    device_ms_per_step: NonNegative = 0.0  # kernel time, summed over kernels
    empty_cache_per_step: NonNegative = 0.0  # cudaFree calls: the caching allocator giving back
    empty_cache_ms_per_step: NonNegative = 0.0
    device_busy_ms_per_step: NonNegative | None = None
    idle_fraction: NonNegative | None = None  # share of the step with no kernel or copy running
    short_kernels_per_step: NonNegative = 0.0
    # Collectives, all within the window. Raw time is NCCL kernel durations summed (gloo's work
    # ranges on a CPU): it includes spinning while a peer is late, so it can exceed the step.
    collective_ms_per_step: NonNegative = 0.0
    collective_wall_ms_per_step: NonNegative = 0.0  # the union of those intervals
    collective_calls_per_step: NonNegative = 0.0  # c10d collective calls (a DDP bucket each)
    # Each collective's own time in the window (NCCL kernel, gloo work range), in the order they
    # started: every rank issues the same sequence, so call by call the rank that held it least
    # (the last to arrive) shows the transfer, and the others' extra is waiting for it.
    collective_ms_by_call: list[NonNegative] = field(default_factory=list)
    # Those calls by kind: "all_reduce" (DDP), "all_gather" and "reduce_scatter" (FSDP), ...
    collective_calls_by_kind: dict[str, NonNegative] = field(default_factory=dict)
    collective_overlap_fraction: NonNegative | None = None  # share of the union beside other work
    collective_exposed_ms_per_step: NonNegative | None = None  # the union minus other device work
    compute_busy_ms_per_step: NonNegative | None = None  # union of non-collective device work
    window_step_ms: NonNegative = 0.0  # the window's span per step (host and device clocks)
    microsteps_per_step: NonNegative = 0.0  # gradient-accumulation micro-steps (gpudiag.microstep)
    microsteps_with_collectives_per_step: NonNegative = 0.0  # of which all-reduced
    top_ops_by_count: list[dict[str, Any]] = field(default_factory=list)
    top_ops_by_time: list[dict[str, Any]] = field(default_factory=list)
    source_lines: list[SourceLine] = field(default_factory=list)
    line_counts: list[LineCount] = field(default_factory=list)  # every line, see LineCount
    # Bytes copied per step between host and device, by direction ("HtoD", "DtoH").
    copy_bytes_per_step: dict[str, NonNegative] = field(default_factory=dict)
    # Kernel time of each profiled step (kernels assigned to the step that launched them).
    device_ms_by_step: list[NonNegative] = field(default_factory=list)
    window_overhead: NonNegative | None = None  # profiled step time / timed median step time
    # Why device work is not charged to source lines, when it is not (torch.compile).
    attribution_note: str | None = None
    # Inside torch.optim's step() (its "Optimizer.step#" ranges): host time, and what it issued
    # (kernel launches on a GPU, top-level operators on a CPU).
    optimizer_host_ms_per_step: NonNegative = 0.0
    optimizer_ops_per_step: NonNegative = 0.0
    # Host time per step inside FSDP2's own ranges, by phase ("FSDP::pre_backward": the
    # re-gather of parameters freed after forward, ...), on whichever thread ran them (backward
    # hooks run on autograd's device thread, which the host sampler does not see).
    fsdp_host_ms_per_step: dict[str, NonNegative] = field(default_factory=dict)

    def hottest_source_line(self) -> SourceLine | None:
        return self.source_lines[0] if self.source_lines else None

    @property
    def collective_share(self) -> float | None:
        """The share of the window's step that collectives held the step back: exposed time on
        a GPU; on a CPU their wall time (gloo cannot tell transfer from waiting for a peer).
        Both are parts of the window, so the share is in [0, 1]."""
        held = (self.collective_exposed_ms_per_step if self.backend == "cuda"
                else self.collective_wall_ms_per_step)
        if held is None or self.window_step_ms <= 0:
            return None
        return min(1.0, held / self.window_step_ms)


def bus_bandwidth_factor(world: int) -> float:
    """Bytes a ring all-reduce moves over each rank's link per byte reduced, 2(n-1)/n: the
    factor nccl-tests apply to turn algorithm bandwidth into bus bandwidth
    (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md)."""
    return 2 * (world - 1) / world


@dataclass
class Trial:
    """One fresh process's score for a stage (see gpudiag.diagnose.trials): the summary of its
    steady-state steps, which the trial does not keep; its throughput and kernel time per step
    follow from what it keeps."""

    ms_per_iter: StepMs  # the median of its steady-state steps (their mean for a bursty stage)
    iters: Count  # steady-state steps behind the score
    samples_per_step: Annotated[int, Field(ge=1)]  # the stage's, which every trial shares
    throttled: bool = False  # thermal/hardware slowdown: not valid for a gate
    energy_per_sample_j: NonNegative | None = None
    # Exact counters per step (gpudiag.diagnose.counters), and the kernel time of each profiled
    # step: what the trial's evidence window measured.
    counters: dict[str, NonNegative] = field(default_factory=dict)
    device_ms_by_step: list[NonNegative] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        """The trial's score: throughput at its time per step."""
        return self.samples_per_step / self.ms_per_iter * 1e3

    @property
    def device_ms(self) -> float | None:
        """The median kernel time of its profiled steps; None without a profiled step."""
        return statistics.median(self.device_ms_by_step) if self.device_ms_by_step else None


@dataclass
class StageResult:
    """One stage of a run: its timed iterations (`iter_ms`) and what else it recorded. Its time
    per step, throughput and timing summary are derived from those (`ms_per_iter` and the other
    properties below), so they never contradict the steps; run.json holds them too, for
    readers without this module, and they are not read back."""

    name: str
    status: StageStatus
    title: str = ""
    role: StageRole = "step"
    workload: str = ""  # what ran, e.g. "dgca (prompt: loop)"
    samples_per_step: Annotated[int, Field(ge=1)] | None = None
    tokens_per_step: Annotated[int, Field(ge=1)] | None = None
    iter_ms: list[StepMs] = field(default_factory=list)
    warmup_ms: list[NonNegative] = field(default_factory=list)
    timer: str | None = None  # how iter_ms was measured
    wall_s: float | None = None
    memory: MemoryStats | None = None
    telemetry: TelemetrySummary = field(
        default_factory=lambda: TelemetrySummary.unavailable("not measured")
    )
    phases_ms: dict[str, list[float]] = field(default_factory=dict)  # e.g. data_wait per step
    facts: StageFacts = field(default_factory=StageFacts)
    evidence: Evidence | None = None
    trials: list[Trial] = field(default_factory=list)  # filled when runs are merged
    error: str | None = None  # one line; for skipped stages the reason
    advice: str | None = None
    traceback: str | None = None
    interrupted: bool = False  # stopped by a signal while it ran (status "error")

    @property
    def timed_ms(self) -> list[float]:
        """The times the stage's summaries are of: its timed steps. The ceiling stage times no
        step; its summaries are of the operation it repeats, the bf16 matmul
        (`facts.peak.bf16_matmul_ms`), kept out of `iter_ms` so that no rule reads them as
        training steps."""
        if self.iter_ms or self.facts.peak is None:
            return self.iter_ms
        return self.facts.peak.bf16_matmul_ms

    @property
    def merged_trials(self) -> bool:
        """Runs merged into this one (gpudiag.diagnose.trials.merge_trials): its figures are
        medians over their trials, not over its own steps."""
        return self.ok and len(self.trials) >= 2

    @property
    def ms_per_iter(self) -> float | None:
        """Time per step: the median of the timed steps, or their mean for a bursty stage such
        as a prefetching DataLoader (`facts.bursty`); with merged trials, the median of theirs.
        None when nothing was timed."""
        if self.merged_trials:
            return statistics.median(t.ms_per_iter for t in self.trials)
        times = self.timed_ms
        if not times:
            return None
        return statistics.fmean(times) if self.facts.bursty else statistics.median(times)

    @property
    def samples_per_s(self) -> float | None:
        """Throughput at `ms_per_iter`; with merged trials, the median of their throughputs."""
        if self.merged_trials:
            return statistics.median(t.samples_per_s for t in self.trials)
        return self._per_s(self.samples_per_step)

    @property
    def tokens_per_s(self) -> float | None:
        return self._per_s(self.tokens_per_step)

    def _per_s(self, per_step: int | None) -> float | None:
        ms = self.ms_per_iter
        return None if not per_step or not ms else per_step / ms * 1e3

    @property
    def timing(self) -> TimingStats | None:
        """The robust summary of `timed_ms`; None when nothing was timed."""
        times = self.timed_ms
        return TimingStats.of(times) if times else None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def failed_after_timing(self) -> bool:
        """A stage that failed (a profiled script that raised) after its steps were timed and
        its profiler window recorded: what was measured is judged, the failure said beside it."""
        return self.status == "error" and bool(self.iter_ms) and self.evidence is not None

    @property
    def energy_per_sample_j(self) -> float | None:
        energy = self.telemetry.energy_j
        if energy is None or not self.samples_per_step or not self.iter_ms:
            return None
        return energy / (self.samples_per_step * len(self.iter_ms))


@dataclass
class FindingAccount:
    """The part of its stage's account a finding that prices time prices
    (gpudiag/diagnose/ledger.py): its share of that whole (the steady step, or the training
    loop), and of the run's wall time, the one whole every finding of the stage shares."""

    part: str  # a step's host kind ("sync", "data", ...), or a run part's description
    # What `share` is a share of; "run" (the run's wall time): accounts of earlier versions.
    whole: Literal["step", "loop", "run"]
    share: Share  # the finding's impact, as a share of `whole`
    share_of_wall: Share | None = None  # None: a step part, without the run's timeline
    ms_per_step: NonNegative | None = None  # a step part's time per steady step


@dataclass
class Finding:
    """One diagnosis: what was seen, where, what it costs (`impact`, 0..1) and the fix."""

    id: str
    rule: str
    severity: Severity
    stage: str | None
    title: str
    evidence: dict[str, Any] = field(default_factory=dict)
    impact: Share = 0.0
    location: str | None = None
    fix: str = ""
    account: FindingAccount | None = None  # set after the rules, for a finding that prices time

    @property
    def place(self) -> tuple[str, str | None, str | None]:
        """The same finding in another run: its rule's code, stage and location."""
        return self.id, self.stage, self.location


@dataclass
class MeasuredFix:
    """One remedy tried on the script for a run (`gpudiag profile --try-fixes`): what it bought,
    measured, and whether the script still computes the same thing."""

    remedy: str  # gpudiag.model.remedies name, or "combined" (several together)
    title: str
    findings: list[str] = field(default_factory=list)  # the finding codes it answers
    # "not-measured": planned, but a stop (Ctrl-C) came first; `note` says so.
    status: Literal["measured", "failed", "not-measured", "no-remedy"] = "measured"
    applied: str = ""  # how gpudiag applied it
    change: str = ""  # the permanent code change
    location: str | None = None  # the script's line the change goes to, when known
    before_ms: StepMs | None = None  # median step time without, and with the fix
    after_ms: StepMs | None = None
    speedup: Positive | None = None  # before / after
    speedup_low: Positive | None = None  # its interval (one process a side: optimistic)
    speedup_high: Positive | None = None
    before_j_per_step: NonNegative | None = None
    after_j_per_step: NonNegative | None = None
    # "same": losses equal within the run-to-run floor; "mixed-precision": different by no
    # more than a precision change does; "differs"; "unchecked": no losses to compare;
    # "recipe": the fix trains something else (a larger batch), whatever the losses say.
    equivalence: Equivalence = "unchecked"
    loss_gap: NonNegative | None = None  # largest relative loss difference over the first steps
    loss_floor: NonNegative | None = None  # the same between two runs without the fix
    # What the script saw of it (of them, combined): each remedy's record.
    evidence: RemedyEvidence = field(default_factory=RemedyEvidence)
    note: str = ""
    # The remedy found nothing to change in the script (no DataLoader, no save): its speedup is
    # noise between two runs, never a reason to rank or recommend it.
    changed_nothing: bool = False
    # Memory: the allocator's peak without and with the fix (CUDA; MiB), and the step a run
    # died of out-of-memory at (a fix that frees memory is judged by these, its time the cost).
    before_peak_mib: NonNegative | None = None
    after_peak_mib: NonNegative | None = None
    before_oom_step: Count | None = None
    after_oom_step: Count | None = None


@dataclass
class Rerun:
    """A re-run of a profiled script (a fix's, one without fixes, or a short script's second
    run), made in a scratch copy of the working directory its first run had, so the user's
    files stay as they were (gpudiag/measure/profile/launching/scratch.py)."""

    label: str  # its folder under fixes/, or "rerun" for a short script's second run
    source: str  # the working directory copied
    cwd: str  # the copy it ran in; what it wrote is kept there, unchanged copies are removed
    copied: Count = 0  # files copied (cloned where the filesystem can)
    # Not copied but linked to the user's (relative paths; a folder ends in "/"): version
    # control, environments, data folders, what is over the copy budget. Read-only when
    # `confined`; else a write to them reaches the user's.
    linked: list[str] = field(default_factory=list)
    linked_count: Count = 0  # all of them; `linked` lists the first
    # Paths it wrote outside the copy (seen through Python's file functions, torch.save and
    # safetensors), and whether it wrote more than are listed.
    wrote_outside: list[str] = field(default_factory=list)
    more_outside: bool = False
    changed_linked: list[str] = field(default_factory=list)  # linked files that changed meanwhile
    # What changed meanwhile of the user's files that no confinement refuses (a mode, an
    # owner, times, extended attributes; the machine's /dev/shm), one line each, with what
    # gpudiag put back; `touched_count` all of them.
    touched: list[str] = field(default_factory=list)
    touched_count: Count = 0
    # The kernel confined its writes to its own folder (Landlock): linked paths were read-only
    # to it, and `wrote_outside` lists what it tried, refused.
    confined: bool = False
    unmirrored: list[str] = field(default_factory=list)  # parent folders too large to mirror
    # The copy sat where the folder sits (its parents mirrored) and the command's absolute
    # paths into the folder were moved into it; runs recorded before either: False.
    mirrored: bool = False


@dataclass
class Env:
    """The machine a run measured. Fields that do not apply (no GPU) are None."""

    device: str
    gpu_name: str | None = None
    gpu_count: int = 0
    driver_version: str | None = None
    cuda_runtime: str | None = None  # what torch was built against
    cuda_driver: str | None = None  # what the driver supports
    compute_capability: str | None = None
    gpu_memory_mib: float | None = None
    power_limit_w: float | None = None
    torch_version: str = ""
    transformers_version: str | None = None
    python_version: str = ""
    platform: str = ""
    hostname: str = ""
    cpu_model: str | None = None
    cpu_count: int | None = None
    nvml: str = "unavailable"  # "available" or "unavailable: <reason>"
    gpm: str = "unavailable"
    telemetry_metrics: dict[str, str] = field(default_factory=dict)  # metric -> "ok" or reason
    tf32_matmul: bool | None = None
    tf32_cudnn: bool | None = None
    cudnn_benchmark: bool | None = None
    cudnn_version: int | None = None


@dataclass
class RunResult:
    """A whole run: what was measured, on what, how, and what the rules concluded."""

    tool_version: str
    env: Env
    config: AnyConfig  # RunConfig (gpudiag run) or ProfileConfig (gpudiag profile)
    stages: list[StageResult] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    # A run merged from trials (gpudiag.diagnose.trials.merge_trials): findings some trials
    # showed and others did not, near their thresholds; a comparison calls them neither new
    # nor resolved.
    unsteady_findings: list[Finding] = field(default_factory=list)
    created_utc: str = ""
    duration_s: float | None = None
    interrupted: bool = False
    notes: list[str] = field(default_factory=list)
    fixes: list[MeasuredFix] = field(default_factory=list)  # profile --try-fixes
    reruns: list[Rerun] = field(default_factory=list)  # made in scratch copies (profile)
    schema_version: int = SCHEMA_VERSION

    def stage(self, name: str) -> StageResult | None:
        return next((s for s in self.stages if s.name == name), None)

    def ok_stages(self) -> Iterator[StageResult]:
        """The stages whose measurements are judged: those that ran to their end, and those
        that failed after their timed steps and profiler window (`failed_after_timing`)."""
        return (s for s in self.stages if s.ok or s.failed_after_timing)

    @property
    def died_of_out_of_memory(self) -> bool:
        """A stage's script died of an allocation that failed (CUDA's or the CPU's)."""
        return any(s.facts.script is not None and s.facts.script.memory is not None
                   and s.facts.script.memory.oom is not None for s in self.stages)

    def stages_with_evidence(self) -> Iterator[StageResult]:
        return (s for s in self.ok_stages() if s.evidence is not None)

    def stage_in_role(self, role: StageRole) -> StageResult | None:
        """The stage that plays `role` (the reference step, the ceiling), if one ran."""
        return next((s for s in self.stages if s.role == role), None)
