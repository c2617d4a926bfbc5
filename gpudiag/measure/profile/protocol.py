"""What `gpudiag profile`'s parent and the recorder inside the script agree on: environment
variables, file names and the run's ProfileConfig. No torch here: the parent starts the script
before it imports torch itself."""

from __future__ import annotations

import json
from collections.abc import Mapping

from gpudiag.model.config import ProfileConfig
from gpudiag.model.results import from_jsonable, to_jsonable

ENV_OUT = "GPUDIAG_PROFILE_OUT"  # the parts folder (absolute)
ENV_PARENT = "GPUDIAG_PROFILE_PARENT"
ENV_TRACE_DIR = "GPUDIAG_PROFILE_TRACE_DIR"  # where each window's trace is kept
# Set for a re-run only: the scratch copy of the working directory it runs in (absolute); the
# recorder then lists what the process writes outside it (writewatch.py).
ENV_SCRATCH = "GPUDIAG_PROFILE_SCRATCH"
# The run's ProfileConfig (gpudiag/model/config.py) as JSON: the schedule, telemetry, and what
# --try-fixes applies (remedies, losses to record, the seed).
ENV_CONFIG = "GPUDIAG_PROFILE_CONFIG"

PART_GLOB = "part-*.json"
BOOTSTRAP_ERROR_GLOB = "bootstrap-error-*.json"
WINDOW_DONE_GLOB = "window-*.done"
WRITES_GLOB = "writes-*.jsonl"  # a re-run's writes outside its copy: a JSON string a line
WRITES_MORE = "..."  # the line after a process's last listed one: it wrote more


def part_name(pid: int) -> str:
    return f"part-{pid}.json"


def bootstrap_error_name(pid: int) -> str:
    return f"bootstrap-error-{pid}.json"


def window_done_name(pid: int) -> str:
    return f"window-{pid}.done"


def writes_name(pid: int) -> str:
    return f"writes-{pid}.jsonl"


def config_env(config: ProfileConfig) -> dict[str, str]:
    return {ENV_CONFIG: json.dumps(to_jsonable(config))}


def config_from_env(environ: Mapping[str, str]) -> ProfileConfig:
    """The parent's config, validated like run.json; the defaults when there is none (a
    recorder installed by hand)."""
    text = environ.get(ENV_CONFIG)
    return from_jsonable(ProfileConfig, json.loads(text)) if text else ProfileConfig()
