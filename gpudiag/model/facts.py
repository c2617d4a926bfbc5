"""What a stage knows about itself besides its timings: typed facts the rules read by attribute.

Each kind of stage fills the part that applies to it: a training rung its precision, the
DataLoader stages their loader settings, the checkpoint stages every save, the ddp stage its
ranks and link, a profiled script how its steps were counted. Everything here is plain data
(no gpudiag imports), written to run.json under `stages[].facts`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args

from pydantic import Field

from gpudiag.model.remedies import RemedyEvidence


@dataclass
class LoaderFacts:
    """The DataLoader settings a stage ran with."""

    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None = None
    persistent_workers: bool = False


@dataclass
class SaveRecord:
    """One checkpoint save, on the timed steps' clock."""

    step: int  # timed step at whose end the save started (0-based)
    blocking_ms: float  # training thread held by this save (copies/enqueue, or all of it)
    waited_ms: float = 0.0  # of which: waiting for the previous save to finish (async only)
    total_ms: float | None = None  # start to file written
    write_ms: float | None = None  # the file write alone
    bytes: int | None = None
    write_gbps: float | None = None
    files: int = 1  # files written by this save (one checkpoint can be several torch.save calls)
    # The frames that called it (file:line, innermost first): which training-loop line ran
    # the save, so a saving step's extra time is known to be the save's or another line's.
    stack: list[str] = field(default_factory=list)


@dataclass
class CheckpointFacts:
    """How a stage saved its training state, and every save in its timed steps."""

    mode: str  # "sync" (blocks the step) or "async"
    every: int | None = None  # steps between saves, when regular
    directory: str | None = None
    bytes_per_save: int | None = None
    saves: list[SaveRecord] = field(default_factory=list)


@dataclass
class PeakFacts:
    """The device's measured ceilings (the peak stage) beside its datasheet figures."""

    matmul_n: int
    matmul_tflops: dict[str, float]  # dtype -> measured dense matmul rate
    copy_gbps: float
    copy_bytes: int
    datasheet_tflops: dict[str, float | None] = field(default_factory=dict)
    fastest_dtype: str | None = None
    bf16_matmul_ms: list[float] = field(default_factory=list)


@dataclass
class LinkProbe:
    """An all-reduce of the gradients' size, timed: the link's bandwidth as nccl-tests report
    it (bus bandwidth = algorithm bandwidth x 2(n-1)/n)."""

    bytes: int
    ms: float
    algbw_gbps: float
    busbw_gbps: float


@dataclass
class SingleDevice:
    """The plain step on one device at the same per-device batch: the scaling baseline."""

    ms_per_iter: float
    samples_per_s: float


@dataclass
class Straggler:
    """The rank whose own compute phases (forward + optimizer) took longest."""

    rank: int
    compute_ms: float
    fastest_compute_ms: float
    ratio: float  # compute_ms / fastest_compute_ms


@dataclass
class RankFacts:
    """One rank of the ddp stage, as it measured itself."""

    rank: int
    node_rank: int = 0
    host: str = ""
    device: str = ""
    gpu_name: str | None = None
    ms_per_iter: float | None = None
    phases_ms: dict[str, float] = field(default_factory=dict)  # median per phase
    power_mean_w: float | None = None
    kernel_active_pct: float | None = None
    collective_kernel_ms_per_step: float | None = None
    exposed_comm_share: float | None = None
    collective_exposed_ms_per_step: float | None = None
    compute_busy_ms_per_step: float | None = None
    collective_overlap_fraction: float | None = None
    peak_allocated_mib: float | None = None  # CUDA: the allocator's, over the rank's steps
    peak_reserved_mib: float | None = None  # CUDA: the allocator's segments at their highest
    # The rank's process at its highest resident set over its model's build and steps (Linux;
    # what it held before them, torch's imports among them, included): a CPU's only measure
    peak_resident_mib: float | None = None


@dataclass
class DdpVariant:
    """One DDP configuration the stage timed (the default, or one knob of the sweep)."""

    name: str
    bucket_mb: float = 25.0
    accum: int = 1
    no_sync: str = "correct"  # "correct" or "backward-only" (the seed's mistake)
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    ms_per_iter: float | None = None
    samples_per_s: float | None = None
    scaling_efficiency: float | None = None


@dataclass
class DdpFacts:
    """The ddp stage: ranks, link, baseline, and where the job's time went."""

    world_size: int
    nnodes: int = 1
    backend: str = ""
    per_device_batch: int | None = None
    accum: int = 1
    no_sync: str = "correct"
    bucket_mb: float | None = None
    grad_bytes_per_round: int | None = None
    single_device: SingleDevice | None = None
    scaling_efficiency: float | None = None
    allreduce_probe: LinkProbe | None = None
    collective_kernel_ms_per_step: float | None = None  # NCCL kernels summed, waits included
    collective_overlap_fraction: float | None = None
    exposed_comm_ms_per_step: float | None = None  # the job's: the least any rank saw
    exposed_comm_share: float | None = None  # of the timed step
    allreduce_rounds_per_step: float | None = None
    transfer_ms_per_step: float | None = None  # gradient bytes at the probe's bandwidth
    straggler: Straggler | None = None
    ranks: list[RankFacts] = field(default_factory=list)
    sweep: list[DdpVariant] = field(default_factory=list)


@dataclass
class FsdpUnits:
    """The script's fully_shard(...) calls made at one line (a loop over layers is one line),
    each one FSDP2 unit: a group of parameters gathered before its forward and backward and
    their gradients reduce-scattered after. Read from FSDP2's parameter groups at the first
    optimizer step, once its lazy init has decided which units reshard after forward
    (gpudiag/measure/profile/inscript/watches/fsdp.py), never changed."""

    site: str | None  # "path:line": the script's fully_shard(...) call
    units: int
    resharding: int  # units that free their gathered parameters after forward
    param_bytes: int  # the units' parameters, unsharded
    resharding_bytes: int  # of them, the resharding units': gathered a second time in backward


@dataclass
class FsdpFacts:
    """How a profiled script sharded its model with FSDP2, by the line that did it."""

    shard_size: int  # ranks each unit's parameters are sharded over
    sites: list[FsdpUnits] = field(default_factory=list)

    @property
    def resharding(self) -> int:
        return sum(s.resharding for s in self.sites)

    @property
    def param_bytes(self) -> int:
        return sum(s.param_bytes for s in self.sites)


@dataclass
class DdpJobFacts:
    """What a profiled script's DistributedDataParallel told the recorder, and its link."""

    grad_bytes: int
    world_size: int
    backend: str = ""
    bucket_mb: float | None = None
    allreduce_probe: LinkProbe | None = None
    built_at: str | None = None  # "path:line": the script's DistributedDataParallel(...) line
    backward_at: str | None = None  # "path:line": where the script calls backward()


@dataclass
class OtherLoop:
    """A DataLoader the script iterated besides the one that feeds training (an evaluation,
    say): where its loop is, and on which steps of the timeline it ran."""

    location: str  # "path:line": the script's line that iterates it (`for batch in loader`)
    function: str
    caller: str | None  # "path:line": the script's line that called that function
    steps: list[int] = field(default_factory=list)  # timeline steps it served batches on
    batches: int = 0


@dataclass
class StepTimeline:
    """Every step of a profiled script's run on the host clock, not only the timed ones: what
    periodic work (evaluation every N steps, a save every M) costs of the whole run.

    `step_ms[i]` is step i, from one optimizer step (or gpudiag.step()) to the next; step 0
    runs from the recorder's start (imports, model and data set-up) to the first. Past
    TIMELINE_STEPS the steps are only counted, into `steps` and `total_ms`."""

    step_ms: list[float] = field(default_factory=list)
    steps: int = 0  # steps the run made
    total_ms: float = 0.0  # wall time of all of them, and of the tail
    tail_ms: float = 0.0  # after the last step, to the process's exit (a final evaluation...)
    data_wait_ms: list[float] = field(default_factory=list)  # training loader's, per step
    saves: list[SaveRecord] = field(default_factory=list)  # steps on the timeline's clock
    loops: list[OtherLoop] = field(default_factory=list)
    # [start, end): the profiler window's steps, slowed by the profiler itself.
    window_start: int | None = None
    window_end: int | None = None
    # The steps the script means to make, where it says so (its Trainer's max_steps, the
    # `range(N)` around its step), and from where: a run cut short after the window is
    # projected to them (gpudiag/measure/profile/inscript/planned.py).
    planned_steps: Annotated[int, Field(ge=1)] | None = None
    planned_from: str | None = None
    cut_short: bool = False  # gpudiag ended the script after its window (--stop-after-window)
    # The window closed on its own, its steps profiled or its budget spent, not at the
    # script's end: the schedule was met, however few steps the script made.
    window_whole: bool = False


# What the training thread was doing in a host sample
# (gpudiag/measure/profile/inscript/hostsampler.py): blocked reading a device value back, inside
# a torch call (launching work, or the op itself on a CPU), waiting for the training DataLoader,
# running Python or numpy, in a C call or operator at the user's line whose target the sample
# cannot tell (torch or not: the profiler window tells, by the line's torch calls), or in
# gpudiag's own code.
HostKind = Literal["sync", "torch", "data", "compile", "python", "call", "gpudiag"]
HOST_KINDS: tuple[HostKind, ...] = get_args(HostKind)


@dataclass
class HostLine:
    """Host time the samples charged to one line of the user's code, on the steady steps."""

    location: str  # "path:line": the innermost frame of the user's own code
    function: str
    kind: HostKind
    ms: float  # over all steady steps sampled
    via: str = ""  # "path:line" of the innermost library frame below it (not torch's)
    # No line of the user's code was below the training loop: charged to a library's own line
    # (a framework's loop, Lightning's or HF Trainer's), nothing the script could edit there
    library: bool = False


@dataclass
class HostStep:
    """A slow step's samples: which lines of the training loop its time went to."""

    step: int  # on the timeline's clock
    ms: float  # the step's wall time
    loop_ms: dict[str, float] = field(default_factory=dict)  # training-loop line -> ms


@dataclass
class HostSamples:
    """The training thread's Python stack sampled at a fixed period over the whole run (all
    steps after warm-up, less the profiler window's): where the host's time per step goes, by
    the user's line and by what the thread was doing there."""

    period_ms: float
    clock: str = ""  # who took the samples: "signal" (a timer, in the thread) or "thread"
    clock_note: str = ""  # why not a signal, or why sampling stopped early
    samples: int = 0
    steady_steps: int = 0  # steps whose samples make up `lines` (not slow, not warm-up)
    steady_wall_ms: float = 0.0  # those steps' wall time on the host clock
    sampled_ms: float = 0.0  # of which the samples covered
    kind_ms: dict[str, float] = field(default_factory=dict)  # steady steps, per HOST_KINDS
    lines: list[HostLine] = field(default_factory=list)  # steady steps, busiest first
    loop: str | None = None  # "path:line" of the training loop's function (where it steps)
    loop_ms: dict[str, float] = field(default_factory=dict)  # steady steps, by loop line
    slow_steps: list[HostStep] = field(default_factory=list)
    text: dict[str, str] = field(default_factory=dict)  # location -> its source line

    def per_step(self, ms: float) -> float:
        return ms / self.steady_steps if self.steady_steps else 0.0


@dataclass
class CompileEvent:
    """One torch.compile (Dynamo) compilation of a frame, from Dynamo's own compilation
    metrics (torch._dynamo.utils.get_compilation_metrics)."""

    function: str  # the compiled frame's function
    location: str  # "path:line" where that function is defined
    seconds: float  # the compilation's wall time
    compile_id: str = ""  # Dynamo's: "frame/compilation" (a backward pass shares its forward's)
    step: int | None = None  # the step it happened in (0: the first)
    call_site: str | None = None  # the user's line that called the compiled code, if seen
    recompile_reason: str | None = None  # the guard that failed: why this was a recompile
    failure: str | None = None  # why Dynamo gave up on the frame (e.g. the recompile limit)
    graph_break: str | None = None  # the reason Dynamo split the frame's graph, if it did
    graph_break_at: str | None = None  # "path:line" of that break, if Dynamo names it


@dataclass
class CompileFacts:
    """torch.compile over the whole profiled run."""

    events: list[CompileEvent] = field(default_factory=list)
    seconds: float = 0.0  # all compilations' wall time
    recompile_limit: int | None = None  # torch._dynamo.config.recompile_limit
    graph_breaks: dict[str, int] = field(default_factory=dict)  # Dynamo's count by reason
    events_lost: int = 0  # compilations past the ones Dynamo keeps metrics for


# How an optimizer updates its parameters (torch.optim's `foreach`/`fused` flags, resolved the
# way its step() resolves them): one small kernel set per parameter tensor, one per group of
# tensors, or one fused kernel per group; "unknown" for an optimizer outside torch.optim's.
OptimizerImpl = Literal["single-tensor", "foreach", "fused", "unknown"]


@dataclass
class OptimizerFacts:
    """One optimizer the script built and stepped, as it was built: read from the live object
    at its first step (gpudiag/measure/profile/inscript/watches/optimizers.py), never
    changed."""

    name: str  # its class, e.g. "AdamW"
    module: str  # where the class is defined, e.g. "torch.optim.adamw"
    implementation: OptimizerImpl
    chosen: str  # what decided it: "foreach=False" as the script passed it, or "default"
    parameters: int  # parameter tensors it steps
    numel: int  # their elements
    site: str | None = None  # "path:line": the script's line that built it
    step_site: str | None = None  # "path:line": the script's line that calls its step()
    fused_supported: bool = False  # its class takes fused=, for these tensors' devices/dtypes
    foreach_supported: bool = False  # its class takes foreach=, for these devices
    devices: list[str] = field(default_factory=list)
    steps: int = 0  # steps seen
    # Built by a framework from its own arguments: transformers' Trainer from
    # TrainingArguments(optim=...), and the script's line that constructs them.
    framework: str | None = None
    edit_at: str | None = None


@dataclass
class LoaderEpoch:
    """One pass over a DataLoader (`for batch in loader`: an epoch, or an evaluation): what
    starting it, its first batch and ending it held the training thread."""

    step: int  # the step it started on (the timeline's clock)
    start_ms: float  # iter(loader): worker processes started, or persistent ones reset
    first_batch_ms: float = 0.0  # the wait for its first batch
    batches: int = 0
    end_ms: float = 0.0  # the call that found it exhausted (workers shut down, if not kept)


@dataclass
class LoaderUse:
    """One DataLoader the script built and iterated, with its settings as built (read from
    the live object, never changed) and its passes."""

    site: str | None  # "path:line": the script's line that built it
    settings: LoaderFacts
    batch_size: int | None = None  # as given (None: a batch_sampler makes its batches)
    iterable: bool = False  # its dataset an IterableDataset (no larger-batch remedy)
    batch_bytes: int | None = None  # what its first batch's tensors hold (the step's inputs)
    iterated_at: str | None = None  # "path:line": where the script iterates it
    training: bool = False  # its batches fed the training steps
    passes: int = 0  # iter() calls, all of them
    epochs: list[LoaderEpoch] = field(default_factory=list)  # the first MAX_EPOCHS_KEPT
    # Built by a framework from its arguments (frameworks.py's origin keys).
    framework: str | None = None
    edit_at: str | None = None
    hook: str | None = None


# A debug setting that slows a step, as torch names it: autograd's anomaly detection, the CUDA
# launch queue turned off (CUDA_LAUNCH_BLOCKING=1), deterministic algorithms (torch's, and
# cuDNN's own flag), a profiler the script runs itself, and autograd's NVTX ranges.
DebugKind = Literal["anomaly-detection", "launch-blocking", "deterministic-algorithms",
                    "cudnn-deterministic", "profiler", "emit-nvtx"]


@dataclass
class DebugSetting:
    """A debug setting that was on while the script stepped
    (gpudiag/measure/profile/inscript/watches/debug.py): what turned it on, and where."""

    kind: DebugKind
    set_by: str  # the call or variable, e.g. "torch.autograd.set_detect_anomaly(True)"
    site: str | None = None  # "path:line": the script's line that turned it on (None: a variable)
    steps_on: int = 0  # steps it was on at the end of
    timed_steps_on: int = 0  # of them, timed steps


MemoryFormat = Literal["channels_last", "channels_first", "other"]


@dataclass
class ConvLayout:
    """The first 2-D convolution a script ran: its input's memory format (NCHW, PyTorch's
    default, is "channels_first"), where it ran, and the script's lines that built the model
    holding it and called that model: where a channels_last change goes."""

    memory_format: MemoryFormat
    device: str  # "cuda", "cpu", ...
    # What it computes in, as torch names it ("torch.bfloat16"): autocast's where autocast is
    # on for its device, else the input's.
    dtype: str
    built_at: str | None = None  # the line that built the outermost module (`model = Net()`)
    called_at: str | None = None  # the line that called it (`model(x)`): the input's


@dataclass
class OutOfMemory:
    """The allocation a script died of (CUDA's out-of-memory error, or the CPU allocator's),
    and where its memory stood then."""

    device: Literal["cuda", "cpu"]
    step: int  # steps the script had ended before it
    message: str  # the error's first sentence or two, as torch said it
    requested_mib: float | None = None  # the allocation that failed
    allocated_mib: float | None = None  # CUDA: held by tensors at the failure
    reserved_mib: float | None = None  # CUDA: the allocator's segments then
    device_total_mib: float | None = None
    device_free_mib: float | None = None  # what the driver had left (torch's message)
    # What the process may allocate where it was capped below the device
    # (torch.cuda.set_per_process_memory_fraction), None where it was not.
    cap_mib: float | None = None
    line: str | None = None  # "path:line": the script's line whose call failed


HostLimitSource = Literal["machine", "cgroup v2 memory.max", "cgroup v1 memory.limit_in_bytes"]


@dataclass
class HostLimit:
    """The host memory the script's processes may use: the smallest of the machine's memory and
    the limits of its memory cgroup and that cgroup's ancestors (a container's, a Slurm job's, a
    Kubernetes pod's), read as the script started (gpudiag/measure/hostmemory.py); and the
    kernel's count of out-of-memory kills where that limit is enforced, before and after."""

    limit_mib: float
    source: HostLimitSource
    machine_mib: float | None = None  # the machine's physical memory
    cgroup: str | None = None  # the folder of the cgroup whose limit it is
    # Where the kernel counts its out-of-memory kills for that limit: the limiting cgroup's
    # memory.events (v2) or memory.oom_control (v1), /proc/vmstat for the machine's own.
    oom_kill_file: str | None = None
    oom_kills: int | None = None  # that count as the script started
    # ... once the command had ended, read by gpudiag's process where a process was killed
    oom_kills_after: int | None = None


@dataclass
class PrivateMemory:
    """What the script's process and its children (DataLoader workers) hold of their own, not
    shared with each other (/proc/PID/smaps_rollup: Private_Clean + Private_Dirty): a forked
    worker's resident set counts every page it still shares with the script; its private
    pages are the copies it made. Read near the host's limit only (~0.5 ms a process)."""

    step: int  # the step at whose end it was read
    process_mib: float
    children: int
    children_mib: float  # their private memory's sum
    # All of them together, each shared page once (their proportional sets' sum, Pss): what
    # they hold of the machine, where no cgroup counts it
    together_mib: float | None = None


@dataclass
class MemoryTimeline:
    """The script's memory at each step's end, every step the timeline lists (cheap counters:
    gpudiag/measure/profile/inscript/watches/memory.py). On CUDA the caching allocator's bytes
    held by tensors, bytes it reserved from the driver, and the highest held so far (the
    allocator's own peak, never reset: the script may read it); on any device the process's
    resident set. Fewer entries than the timeline's steps: the run's end came mid-step."""

    device: Literal["cuda", "cpu"]
    allocated_mib: list[float] = field(default_factory=list)  # CUDA: held by tensors now
    reserved_mib: list[float] = field(default_factory=list)  # CUDA: the allocator's segments
    peak_mib: list[float] = field(default_factory=list)  # CUDA: highest allocated so far
    resident_mib: list[float] = field(default_factory=list)  # the process's resident set
    # CUDA: the allocator's cudaMalloc calls so far (in steady state none: each is a device
    # sync and a cost the allocator's cache exists to avoid)
    device_allocs: list[int] = field(default_factory=list)
    # CUDA: the allocator's live allocations (tensors' blocks) at each step's end: memory that
    # grows with them is kept tensors, without them tensors that grew (a length curriculum)
    live_blocks: list[int] = field(default_factory=list)
    # The script's child processes (DataLoader workers) at each step's end: how many, and their
    # resident sets' sum (Linux; empty elsewhere)
    children: list[int] = field(default_factory=list)
    children_resident_mib: list[float] = field(default_factory=list)
    pinned_host_mib: float | None = None  # CUDA: page-locked host memory at its highest
    device_total_mib: float | None = None
    # CUDA: what the process may allocate where the script capped it below the device
    # (torch.cuda.set_per_process_memory_fraction), None where it did not
    cap_mib: float | None = None
    host_total_mib: float | None = None  # the machine's physical memory
    # The allocator's counters at the run's end (torch.cuda.memory_stats): cudaMalloc retries
    # after freeing its cache, and out-of-memory errors it raised.
    alloc_retries: int | None = None
    ooms: int | None = None
    note: str = ""  # what this device cannot tell
    oom: OutOfMemory | None = None  # the run died of an allocation that failed
    host_limit: HostLimit | None = None  # what the script's processes may hold on the host
    # Where a cgroup's limit applies: its processes' anonymous memory at each step's end (v2
    # memory.stat anon, v1 total_rss), what its out-of-memory killer weighs; page cache apart
    host_used_mib: list[float] = field(default_factory=list)
    private: PrivateMemory | None = None  # the latest reading near the host's limit
    # Which died of SIGKILL: "process", the script's own (its part never final, its steps since
    # the last part lost; gpudiag's process sets it), or a DataLoader "worker" (torch's error
    # in the script says so): the kernel's out-of-memory killer, or a kill from elsewhere.
    killed: Literal["process", "worker"] | None = None

    # The steps whose memory was read, where the reads were spaced (the steps between repeat
    # the last read: watches/memory.py's READ_BUDGET); empty: every step was read.
    read_steps: list[int] = field(default_factory=list)

    @property
    def device_capacity_mib(self) -> float | None:
        """What the process may allocate on the device: its cap, else the device's memory."""
        return self.cap_mib or self.device_total_mib


@dataclass
class SavedSite:
    """A line of the user's code whose operations saved tensors for backward."""

    location: str  # "path:line"
    bytes: int
    tensors: int


@dataclass
class MemoryOwners:
    """Who holds the script's memory, by role, in bytes, read over one step of the profiler
    window (gpudiag/measure/profile/inscript/watches/owners.py): the parameters, their gradients
    and the optimizers' state at the step's end (after optimizer.step()), the tensors autograd
    saved for backward during the step (saved_tensors_hooks, each storage once, parameters
    left out), the training loader's batch, what earlier steps' tensors the script keeps
    (KeptTensors), and the rest of the allocator's peak: temporaries. Storages are counted
    once each, whichever role finds them first in that order; the batch a first layer saves
    for backward is among the activations and the inputs both (the hook cannot tell it from
    a tensor an operation made)."""

    device: Literal["cuda", "cpu"]
    step: int  # the step whose saved tensors were counted
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int | None = None  # saved for backward over the step (None: not hooked)
    inputs: int | None = None  # the training loader's batch (None: no DataLoader seen)
    kept: int | None = None  # held by KeptTensors at the second look (None: not looked)
    # CUDA: the allocator's highest allocated by the end of that step (never reset); a CPU's
    # allocator keeps no count: None, and so are the temporaries.
    peak: int | None = None
    temporaries: int | None = None  # peak less every owner above (0 where they exceed it)
    activation_sites: list[SavedSite] = field(default_factory=list)  # the largest, by line
    hook_ms: float = 0.0  # what counting the saved tensors cost that step (its host time)
    note: str = ""  # what this run could not tell
    # The models in the loop's namespaces looked at for repeated blocks (what activation
    # checkpointing would wrap: inscript/memoryremedies.py), and what was found: "12 `Block`
    # blocks in `GPT.h`"; None where none (or where no model was looked at)
    models_looked: int = 0
    blocks: str | None = None


KeptKind = Literal["list of tensors", "dict of tensors", "deque of tensors",
                   "tuple of tensors", "set of tensors", "tensor with its graph"]


@dataclass
class KeptTensors:
    """Something of the script's that holds more tensors at a later step boundary than at an
    earlier one (two looks, after the warm-up and after the profiler window): a container in
    the training loop's locals or the script's globals (or an attribute of an object there),
    or a tensor whose autograd graph grows (`total += loss` without .detach())."""

    name: str  # as the script names it: `history`, `self.preds`, `metrics['logits']`
    kind: KeptKind
    location: str | None  # "path:line": the line that adds to it (else the loop's)
    steps: tuple[int, int]  # the step boundaries of the two looks
    tensors: int  # held at the second look (graph: its autograd graph's nodes)
    added_per_step: float  # tensors (graph: nodes) added a step between the looks
    bytes: int  # what its tensors' storages hold at the second look
    bytes_per_step: float  # of those, added a step (0 for a graph: its saved tensors uncounted)
    graph_kept: bool  # its tensors keep autograd graphs (grad_fn, or requires_grad)
    found_by: Literal["append", "name", "loop"] = "append"  # how `location` was found
    device: str = "cpu"  # where its tensors are (the largest's device type: "cuda", "cpu")


@dataclass
class ScriptFacts:
    """How `gpudiag profile` counted a script's steps."""

    steps: int  # steps the script made while recorded
    warmup: int
    timed: int
    step_clock: str  # "optimizer.step()" or "gpudiag.step()"
    device: str | None = None
    # torch.compile, counted by Dynamo up to the end of the profiler window (None: not used):
    # graphs compiled (a recompile adds one) and graph breaks.
    compiled_graphs: int | None = None
    graph_breaks: int | None = None
    # profile --try-fixes: the first steps' losses (what each backward() started from), and
    # what each remedy applied in this process saw (gpudiag/measure/profile/inscript/remedies.py).
    losses: list[float] = field(default_factory=list)
    remedies: RemedyEvidence = field(default_factory=RemedyEvidence)
    timeline: StepTimeline | None = None
    host: HostSamples | None = None
    compiles: CompileFacts | None = None
    optimizers: list[OptimizerFacts] = field(default_factory=list)
    loaders: list[LoaderUse] = field(default_factory=list)
    fsdp: FsdpFacts | None = None  # FSDP2's units (fully_shard), where the script shards
    debug: list[DebugSetting] = field(default_factory=list)  # debug settings on while stepping
    conv_layout: ConvLayout | None = None  # the first Conv2d's input (None: no convolution)
    memory: MemoryTimeline | None = None  # each step's memory (None: a run before it was read)
    owners: MemoryOwners | None = None  # who holds it, by role, over one profiled step
    kept: list[KeptTensors] = field(default_factory=list)  # what keeps growing tensors
    # (warm-up, timed, profiled) when the recorder fitted its schedule to the steps the script
    # planned (timeline.planned_steps), fewer than the asked schedule needs: one run, no re-run.
    fitted_schedule: tuple[int, int, int] | None = None


@dataclass
class StageFacts:
    """Everything a stage records besides timings, telemetry and evidence."""

    # Steps served from a prefetching queue arrive in bursts (most instant, some long): the
    # stage's time per step is then the mean, not the median (see StageResult.ms_per_iter).
    bursty: bool = False
    precision: str | None = None  # "fp32", "fp16-autocast", "bf16-autocast"; None: unknown
    deliberate_fp32: bool = False  # fp32 on purpose (a ladder rung): precision rules inform
    inference: bool = False
    # The stage that is this one with its planted cause removed (full-loop -> full-vectorized).
    counterfactual: str | None = None
    flops_per_step: Annotated[float, Field(ge=0)] | None = None
    evidence_missing: str | None = None  # why the stage has no profiler window's evidence
    loader: LoaderFacts | None = None
    checkpoint: CheckpointFacts | None = None
    peak: PeakFacts | None = None
    ddp: DdpFacts | None = None
    ddp_job: DdpJobFacts | None = None
    script: ScriptFacts | None = None

    @property
    def step_statistic(self) -> str:
        return "mean" if self.bursty else "median"


_LOADER_KEYS = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers")
_PEAK_KEYS = ("matmul_n", "matmul_tflops", "copy_gbps", "copy_bytes", "datasheet_tflops",
              "fastest_dtype", "bf16_matmul_ms")
_SCRIPT_KEYS = {"profiled_steps": "steps", "warmup": "warmup", "timed": "timed",
                "step_clock": "step_clock", "device": "device"}


def facts_from_details(details: dict[str, Any]) -> dict[str, Any]:
    """Schema 1's untyped `details` as schema 2's `facts` (JSON form): what run.json files
    written before the facts existed (those under reports/examples/) said, key by key."""
    facts: dict[str, Any] = {
        "bursty": details.get("ms_per_iter_statistic") == "mean",
        "precision": details.get("precision"),
        "deliberate_fp32": bool(details.get("deliberate_fp32")),
        "inference": details.get("mode") == "inference",
        "counterfactual": details.get("counterfactual"),
        "flops_per_step": details.get("flops_per_step"),
        "evidence_missing": details.get("evidence_error") or details.get("evidence_note"),
        "checkpoint": details.get("checkpoint"),
        "ddp": details.get("ddp"),
        "ddp_job": details.get("ddp_job"),
    }
    if "num_workers" in details:
        facts["loader"] = {k: details.get(k) for k in _LOADER_KEYS}
    if "matmul_tflops" in details:
        facts["peak"] = {k: details.get(k) for k in _PEAK_KEYS}
    if "step_clock" in details:
        facts["script"] = {new: details.get(old) for old, new in _SCRIPT_KEYS.items()}
    return facts
