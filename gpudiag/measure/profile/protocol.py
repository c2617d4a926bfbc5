"""What `gpudiag profile`'s parent and the recorder inside the script agree on: environment
variables, file names and the step schedule. No torch here: the parent starts the script before
it imports torch itself."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

ENV_OUT = "GPUDIAG_PROFILE_OUT"  # the parts folder (absolute)
ENV_WARMUP = "GPUDIAG_PROFILE_WARMUP"
ENV_TIMED = "GPUDIAG_PROFILE_TIMED"
ENV_STEPS = "GPUDIAG_PROFILE_STEPS"
ENV_PARENT = "GPUDIAG_PROFILE_PARENT"
ENV_TELEMETRY = "GPUDIAG_PROFILE_TELEMETRY"  # full, basic (no GPM) or off
ENV_STOP = "GPUDIAG_PROFILE_STOP"  # "1": end the script once its profiler window closed
ENV_TRACE_DIR = "GPUDIAG_PROFILE_TRACE_DIR"  # where each window's trace is kept
# --try-fixes: remedies to apply (comma-separated names of gpudiag.model.remedies), losses to
# record (the first N backward() calls), and the seed every run of one --try-fixes shares.
ENV_REMEDIES = "GPUDIAG_PROFILE_REMEDIES"
ENV_LOSSES = "GPUDIAG_PROFILE_LOSSES"
ENV_SEED = "GPUDIAG_PROFILE_SEED"

PART_GLOB = "part-*.json"
BOOTSTRAP_ERROR_GLOB = "bootstrap-error-*.json"
WINDOW_DONE_GLOB = "window-*.done"


def part_name(pid: int) -> str:
    return f"part-{pid}.json"


def bootstrap_error_name(pid: int) -> str:
    return f"bootstrap-error-{pid}.json"


def window_done_name(pid: int) -> str:
    return f"window-{pid}.done"


MIN_FITTED_STEPS = 4  # a script this short still gets warm-up 1, timed 2, profiled 1


@dataclass(frozen=True)
class Schedule:
    """Steps [0, warmup) warm up, [warmup, warmup + timed) are timed, the next `profiled` are
    the profiler window."""

    warmup: int = 5
    timed: int = 30
    profiled: int = 3

    @property
    def steps_needed(self) -> int:
        return self.warmup + self.timed + self.profiled

    def env(self) -> dict[str, str]:
        return {ENV_WARMUP: str(self.warmup), ENV_TIMED: str(self.timed),
                ENV_STEPS: str(self.profiled)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Schedule:
        default = cls()
        return cls(int(environ.get(ENV_WARMUP, default.warmup)),
                   int(environ.get(ENV_TIMED, default.timed)),
                   int(environ.get(ENV_STEPS, default.profiled)))

    def fitted(self, made: int) -> Schedule | None:
        """This schedule shrunk to fit a script that made `made` steps, or None when it is too
        short to time and profile at all. Warm-up keeps a fifth of the steps (at least one, for
        first-step costs), the window up to this schedule's size and a sixth, the rest is timed;
        one step is left spare for scripts whose step count varies a little."""
        if made < MIN_FITTED_STEPS:
            return None
        spare = 1 if made >= 2 * MIN_FITTED_STEPS else 0
        profiled = max(1, min(self.profiled, made // 6))
        warmup = max(1, min(self.warmup, math.floor(made / 5)))
        timed = made - spare - warmup - profiled
        return Schedule(warmup, timed, profiled) if timed >= 2 else None
