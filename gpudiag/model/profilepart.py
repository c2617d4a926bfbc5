"""What a profiled script's processes hand `gpudiag profile`, through files in the parts folder
(names in gpudiag/measure/profile/protocol.py): a part per process, written by the recorder
inside the script and read by the launching side, validated like run.json; and, from an
interpreter that could not load the recorder, a bootstrap error."""

from __future__ import annotations

from dataclasses import dataclass

from gpudiag.model.results import Count, Env, StageResult


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


@dataclass
class BootstrapError:
    """bootstrap-error-<pid>.json: an interpreter that could not load the recorder. Written by
    the bootstrap's sitecustomize.py with the standard library alone (gpudiag itself may be
    what failed to import), so its keys are spelled out there: these fields."""

    python: str  # the interpreter (sys.executable)
    error: str  # "ImportError: ..."
