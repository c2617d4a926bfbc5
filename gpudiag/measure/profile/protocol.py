"""What `gpudiag profile`'s two sides agree on: the launching side in gpudiag's process
(launching/) and the recorder inside each of the script's interpreters (inscript/). Environment
variables one way (where to write, the run's ProfileConfig), files the other (a part per
process, typed as gpudiag.model.profilepart.ProfilePart; bootstrap errors; the window's close;
a re-run's writes outside its copy). Neither side imports the other, and this module imports
neither and no torch (import-linter contracts in pyproject.toml): the parent never loads torch."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

from gpudiag.model.config import ProfileConfig
from gpudiag.model.profilepart import BootstrapError, ProfilePart
from gpudiag.model.results import Evidence
from gpudiag.model.runfile import RunFileError, from_jsonable, to_jsonable
from gpudiag.model.schema import SchemaError, parse_json

T = TypeVar("T")

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
WINDOW_FILES_GLOB = "window-*.*.json"  # a window's trace, and its evidence once analysed
WRITES_GLOB = "writes-*.jsonl"  # a re-run's writes outside its copy: a JSON string a line
WINDOW_VOTE_GLOB = "window-vote-*"  # the ranks' votes (window_vote_name)
WRITES_MORE = "..."  # the line after a process's last listed one: it wrote more


def part_name(pid: int) -> str:
    return f"part-{pid}.json"


def bootstrap_error_name(pid: int) -> str:
    return f"bootstrap-error-{pid}.json"


def window_trace_name(pid: int) -> str:
    return f"window-{pid}.trace.json"


def window_evidence_name(pid: int) -> str:
    return f"window-{pid}.evidence.json"


def window_done_name(pid: int) -> str:
    return f"window-{pid}.done"


def window_vote_name(step: int, rank: int) -> str:
    """A rank's vote at the end of profiled step `step`: another profiled step, or not (the
    ranks of a job between themselves: inscript/ranksagree.py)."""
    return f"window-vote-{step}-{rank}"


def writes_name(pid: int) -> str:
    return f"writes-{pid}.jsonl"


def config_env(config: ProfileConfig) -> dict[str, str]:
    return {ENV_CONFIG: json.dumps(to_jsonable(config))}


def config_from_env(environ: Mapping[str, str]) -> ProfileConfig:
    """The parent's config, validated like run.json; the defaults when there is none (a
    recorder installed by hand)."""
    text = environ.get(ENV_CONFIG)
    return from_jsonable(ProfileConfig, json.loads(text)) if text else ProfileConfig()


def part_text(part: ProfilePart) -> str:
    """A part file's text (the recorder writes it atomically)."""
    return json.dumps(to_jsonable(part))


def read_part(path: Path) -> ProfilePart:
    """A process's part, validated like run.json: RunFileError naming the field that does not
    fit, or why the file cannot be read."""
    return _read(ProfilePart, path)


def evidence_text(evidence: Evidence) -> str:
    """A window's evidence, analysed in gpudiag's process and kept for its later reads."""
    return json.dumps(to_jsonable(evidence))


def read_evidence(path: Path) -> Evidence:
    return _read(Evidence, path)


def read_bootstrap_error(path: Path) -> BootstrapError:
    """An interpreter's bootstrap error (written by sitecustomize.py, without gpudiag)."""
    return _read(BootstrapError, path)


def _read(cls: type[T], path: Path) -> T:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise RunFileError(f"cannot read ({reason})") from None
    try:
        data = parse_json(text)
    except SchemaError as exc:
        raise RunFileError(str(exc)) from None
    return from_jsonable(cls, data)
