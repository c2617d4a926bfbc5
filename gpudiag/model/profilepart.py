"""What a profiled script's processes hand `gpudiag profile`, through files in the parts folder
(names in gpudiag/measure/profile/protocol.py): a part per process, written by the recorder
inside the script and read by the launching side, validated like run.json; and, from an
interpreter that could not load the recorder, a bootstrap error."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpudiag.model.results import Count, Env, StageResult


@dataclass
class WindowTrace:
    """A closed profiler window left to gpudiag's own process to read: parsing and analysing a
    trace in the script cost it ~40% of its window (reports/examples/benchmarks/
    h100-window-phases-after.json), while gpudiag's process waits on it anyway. The trace as
    torch exported it, in the parts folder, and what the analysis needs besides."""

    trace: str  # its file name in the parts folder
    steps: int  # steps profiled (closed)
    step_ms: float  # their mean host time
    backend: str  # "cuda" or "cpu"
    timed_step_ms: float | None  # the timed steps' pace (lower quartile)
    # Compiled kernels' source lines (--compile-lines: inscript/watches/compiled.py).
    kernel_lines: dict[str, list[str]] = field(default_factory=dict)
    # Where the script found its files (its working directory, then its sys.path): a line's
    # path is looked up there, as the script would, to tell whether it sits in a loop.
    roots: list[str] = field(default_factory=list)
    attribution_note: str | None = None  # how device work is charged to lines, where not fully
    save_as: str | None = None  # where its gzipped copy is kept (--no-traces: nowhere)


@dataclass
class ProfilePart:
    """part-<pid>.json: one process's record so far. Rewritten atomically as the script runs
    (the end of warm-up, the window's close, every minute after) and at its exit; a part
    without `final` from a process that ended means it died without Python's shutdown."""

    pid: int
    argv: list[str]  # the process's sys.argv
    steps: Count  # steps it made (those past the recorder's limit not counted)
    rank: int | None = None  # its rank in a multi-process job
    cuda: bool = False  # timed on CUDA events
    error: str | None = None  # what failed in the recording (the window, telemetry)
    final: bool = True  # written at a normal exit
    crash: str | None = None  # an uncaught exception's traceback tail
    stage: StageResult | None = None  # its stage (None before its first step)
    env: Env | None = None  # the machine and settings, as the process saw them
    window: WindowTrace | None = None  # its closed window, to analyse (the stage's evidence)


@dataclass
class BootstrapError:
    """bootstrap-error-<pid>.json: an interpreter that could not load the recorder. Written by
    the bootstrap's sitecustomize.py with the standard library alone (gpudiag itself may be
    what failed to import), so its keys are spelled out there: these fields."""

    python: str  # the interpreter (sys.executable)
    error: str  # "ImportError: ..."
