"""run.json on disk: its versions and their upgrades, JSON in and out, reading and writing.

The types a run is made of live in results.py; this module is their file format, so that
results.py (the types) and validity.py (what a run's values must agree on) never import each
other: reading a run goes through here, which checks both.
"""

from __future__ import annotations

import dataclasses
import json
import math
import stat
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from gpudiag.model.atomic import write_text_atomic
from gpudiag.model.errors import GpudiagError
from gpudiag.model.facts import StageFacts, facts_from_details
from gpudiag.model.remedies import field_of
from gpudiag.model.results import (
    SCHEMA_VERSION,
    Evidence,
    RunResult,
    StageResult,
    StageRole,
    TimingStats,
    Trial,
)
from gpudiag.model.schema import SchemaError, parse_json, validate_as
from gpudiag.model.validity import check_run

# run.json's versions (results.SCHEMA_VERSION is the one written):
# 2: stages[].facts (typed, gpudiag.model.facts) replaced stages[].details (an untyped dict).
# 3: stages[].role says what a stage is to the others; config.mode tells the two configs apart.
# 4: a stage's ms_per_iter, samples_per_s, tokens_per_s and timing (and a trial's samples_per_s
#    and device_ms) are derived from its steps, written but not read; a trial keeps its
#    samples_per_step; findings[].account (typed) replaced findings[].evidence.account;
#    the remedies' records (fixes[].evidence, facts.script.remedies) are typed, keyed by field
#    (no_empty_cache), not by remedy name (no-empty-cache).
READABLE_SCHEMAS = (1, 2, 3, 4)
assert READABLE_SCHEMAS[-1] == SCHEMA_VERSION

# Written into every directory gpudiag makes for a run (run, profile, gate): what --force may
# replace (gpudiag/present/files.py), and what a re-run's scratch copy leaves out. A directory
# without it (or a run.json) holds someone else's files.
RUN_MARKER = ".gpudiag-run"


class RunFileError(GpudiagError):
    """A run.json that cannot be read: missing, not JSON, or from an incompatible schema (bad
    input: exit 2, its one-line message naming the file and the field)."""


# Before schema 3 the roles were the built-in stages' names.
_ROLES_BY_NAME: dict[str, StageRole] = {"train-fp16": "reference", "dataloader": "loader",
                                        "peak": "ceiling"}


def run_from_dict(data: dict[str, Any]) -> RunResult:
    """A run from parsed run.json, validated against the schema (gpudiag.model.schema);
    RunFileError names the field that does not fit."""
    version = data.get("schema_version")
    if version not in READABLE_SCHEMAS or isinstance(version, bool):
        raise RunFileError(
            f"run.json schema_version {version!r} is not one of {READABLE_SCHEMAS} "
            "(written by a different gpudiag)"
        )
    if version == 1:
        data = _upgrade_from_1(data)
    if version in (1, 2):
        data = _upgrade_from_2(data)
    if version in (1, 2, 3):
        data = _upgrade_from_3(data)
    try:
        run = validate_as(RunResult, data)
    except SchemaError as exc:
        raise RunFileError(str(exc)) from None
    repeated = [name for name, n in Counter(s.name for s in run.stages).items() if n > 1]
    if repeated:
        raise RunFileError(f"stages: {repeated[0]!r} appears more than once")
    try:
        check_run(run)
    except SchemaError as exc:
        raise RunFileError(str(exc)) from None
    return run


def _upgrade_from_1(data: dict[str, Any]) -> dict[str, Any]:
    stages = [dict(s, facts=facts_from_details(s.get("details") or {}))
              if isinstance(s, dict) else s for s in data.get("stages") or []]
    return {**data, "stages": stages, "schema_version": 2}


def _upgrade_from_2(data: dict[str, Any]) -> dict[str, Any]:
    stages = [dict(s, role=_ROLES_BY_NAME.get(str(s.get("name")), "step"))
              if isinstance(s, dict) else s for s in data.get("stages") or []]
    return {**data, "stages": stages, "schema_version": 3}


def _upgrade_from_3(data: dict[str, Any]) -> dict[str, Any]:
    upgrades: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
        "stages": _stage_from_3, "findings": _finding_from_3,
        "fixes": lambda fix: dict(fix, evidence=_remedies_from_3(fix["evidence"]))
        if "evidence" in fix else fix}
    upgraded = {**data, "schema_version": 4}
    for key, upgrade in upgrades.items():
        items = data.get(key)
        if isinstance(items, list):  # anything else is left for the schema to refuse
            upgraded[key] = [upgrade(x) if isinstance(x, dict) else x for x in items]
    return upgraded


def _stage_from_3(stage: dict[str, Any]) -> dict[str, Any]:
    """A trial's samples per step, which schema 3 kept on its stage only (a trial's stored
    samples_per_s was that over its ms_per_iter: refused on load when it was not); the
    remedies a profiled script's process applied, by field."""
    trials, per_step = stage.get("trials"), stage.get("samples_per_step")
    if isinstance(trials, list) and per_step is not None:
        stage = dict(stage, trials=[{"samples_per_step": per_step, **t}
                                    if isinstance(t, dict) else t for t in trials])
    facts = stage.get("facts")
    script = facts.get("script") if isinstance(facts, dict) else None
    if isinstance(facts, dict) and isinstance(script, dict) and "remedies" in script:
        script = dict(script, remedies=_remedies_from_3(script["remedies"]))
        stage = dict(stage, facts=dict(facts, script=script))
    return stage


def _remedies_from_3(records: Any) -> Any:
    """Remedies' records keyed by name ("no-empty-cache") as keyed by RemedyEvidence's field."""
    if not isinstance(records, dict):
        return records
    return {field_of(str(name)): record for name, record in records.items()}


def _finding_from_3(finding: dict[str, Any]) -> dict[str, Any]:
    """Schema 3 kept a finding's account in its evidence, as {part, share_of_step or
    share_of_run, share_of_wall, ms_per_step}; anything else there is refused as the account."""
    evidence = finding.get("evidence")
    if not isinstance(evidence, dict) or "account" not in evidence:
        return finding
    rest = {k: v for k, v in evidence.items() if k != "account"}
    old = evidence["account"]
    if not isinstance(old, dict):
        return {**finding, "evidence": rest, "account": old}
    whole = "run" if "share_of_run" in old else "step"
    account = {"part": old.get("part"), "whole": whole, "share": old.get(f"share_of_{whole}"),
               "share_of_wall": old.get("share_of_wall"), "ms_per_step": old.get("ms_per_step")}
    return {**finding, "evidence": rest, "account": account}


# Derived values written into run.json for readers that do not use this module; a reader of
# run.json that does (run_from_dict) derives them again and ignores these keys.
_DERIVED = {StageResult: ("ms_per_iter", "samples_per_s", "tokens_per_s", "timing",
                          "energy_per_sample_j"),
            Trial: ("samples_per_s", "device_ms"), TimingStats: ("iqr_ms",),
            Evidence: ("collective_share",), StageFacts: ("step_statistic",)}


def to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
        for name in _DERIVED.get(type(value), ()):
            out[name] = to_jsonable(getattr(value, name))
        return out
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; a missing number reads as null
    return value


T = TypeVar("T")


def from_jsonable(cls: type[T], data: Any) -> T:
    """Dataclass `cls` from parsed JSON, validated like run.json (gpudiag.model.schema);
    RunFileError names the field that does not fit. Unknown keys are ignored."""
    try:
        return validate_as(cls, data)
    except SchemaError as exc:
        raise RunFileError(str(exc)) from None


def run_json_text(run: RunResult) -> str:
    """run.json's text for `run`, exactly as save_run writes it."""
    return json.dumps(to_jsonable(run), indent=1, allow_nan=False) + "\n"


def save_run(run: RunResult, path: Path) -> None:
    """Write run.json atomically, so an interrupted write never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, run_json_text(run))


# run.json of a 15-hour run is a few MB (its timeline is capped); a file past this is not one
# of gpudiag's, and reading it whole would take the machine's memory (/dev/zero grew to 5.5 GB
# in 20 s before reads were bounded).
MAX_JSON_BYTES = 256 * 2**20


def read_json_file(file: Path) -> Any:
    """A gpudiag file's parsed JSON; RunFileError (one line, naming the file) when it cannot be
    read or parsed, is not a regular file (a FIFO would block forever, a device never end) or
    is larger than any gpudiag writes."""
    try:
        status = file.stat()
        if not stat.S_ISREG(status.st_mode):
            raise RunFileError(f"{file}: not a regular file")
        with file.open("rb") as handle:
            data = handle.read(MAX_JSON_BYTES + 1)
        if len(data) > MAX_JSON_BYTES:
            raise RunFileError(f"{file}: larger than {MAX_JSON_BYTES // 2**20} MiB: not a "
                               "gpudiag file")
        text = data.decode()
    except FileNotFoundError:
        raise RunFileError(f"{file}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise RunFileError(f"{file}: cannot read ({reason})") from None
    try:
        return parse_json(text)
    except SchemaError as exc:
        raise RunFileError(f"{file}: {exc}") from None


def load_run(path: Path) -> RunResult:
    """Read a run from a run directory or a run.json file; RunFileError (one line, naming the
    file and the field) for anything that is not a valid run."""
    path = Path(path)
    file = path / "run.json" if path.is_dir() else path
    data = read_json_file(file)
    if not isinstance(data, dict):
        raise RunFileError(f"{file}: not a gpudiag run (top level is not an object)")
    try:
        return run_from_dict(data)
    except RunFileError as exc:
        raise RunFileError(f"{file}: {exc}") from None
