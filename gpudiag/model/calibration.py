"""A machine's calibration: how much fresh processes of the same code differ there, per stage.

`gpudiag calibrate` records it (N fresh-process trials of one workload) into a file the gate
reads (default `.gpudiag/calibration.json`, meant to be committed beside baselines). One file
holds records per (device kind, GPU model, workload); recording again replaces the stages it
measured only (each profiled script is a stage of one workload identity). The gate uses a
record as its prior for the between-process spread (gpudiag/diagnose/noise.py) instead of the
built-in floor of the device kind.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import Field

from gpudiag.model.atomic import named_by_user, write_text_atomic
from gpudiag.model.errors import BadInput
from gpudiag.model.runfile import RunFileError, from_jsonable, read_json_file, to_jsonable

CALIBRATION_SCHEMA = 1
DEFAULT_CALIBRATION = Path(".gpudiag/calibration.json")
MIN_CALIBRATION_TRIALS = 3  # a spread needs two degrees of freedom to mean anything
# Spreads (SD of log throughput) past this are no machine's between-process noise but a broken
# measurement: 0.5 is one trial 65% off the next; a hand-edited 5,000% passed every
# regression, and 1e308 overflowed. Refused on load. Past NOISY_SD `calibrate` warns: the gate
# then decides only large changes (a loaded CI host recorded 59.5%).
MAX_SPREAD_SD = 0.5
NOISY_SD = 0.10
Spread = Annotated[float, Field(ge=0, le=MAX_SPREAD_SD, allow_inf_nan=False)]


@dataclass
class StageSpread:
    """One stage's between-process spread: the standard deviation of one trial's log
    throughput (wall clock, and device time where kernels were timed), over `trials`."""

    stage: str
    trials: Annotated[int, Field(ge=MIN_CALIBRATION_TRIALS)]
    wall_sd: Spread
    device_sd: Spread | None = None


@dataclass
class CalibrationRecord:
    """What one `gpudiag calibrate` measured, and on what."""

    device: str  # "cuda" or "cpu": the device kind
    gpu_name: str | None
    workload: dict[str, str | int | None]  # the config's identity (model, preset, batch, ...)
    stages: list[StageSpread]
    driver_version: str | None = None
    torch_version: str = ""
    hostname: str = ""
    created_utc: str = ""
    source: str = ""  # the run directory it was computed from

    def key(self) -> tuple[str, str | None, tuple[tuple[str, str | int | None], ...]]:
        return self.device, self.gpu_name, tuple(sorted(self.workload.items()))


@dataclass
class Calibration:
    records: list[CalibrationRecord] = field(default_factory=list)
    schema_version: int = CALIBRATION_SCHEMA

    def find(self, device: str, gpu_name: str | None, workload: dict[str, str | int | None],
             stage: str) -> tuple[CalibrationRecord, StageSpread] | None:
        """The newest record of this device, GPU and workload that measured `stage`, and its
        spread there."""
        wanted = (device, gpu_name, tuple(sorted(workload.items())))
        for record in reversed(self.records):
            spread = next((s for s in record.stages if s.stage == stage), None)
            if record.key() == wanted and spread is not None:
                return record, spread
        return None

    def with_record(self, record: CalibrationRecord) -> Calibration:
        """This calibration with `record` added: a stage it measured replaces that stage in an
        earlier record of the same key; that record's other stages stay. Profiled scripts all
        share one workload identity, their stages named by script: calibrating finetune.py
        used to drop train.py's record."""
        measured = {s.stage for s in record.stages}
        kept = []
        for earlier in self.records:
            left = [s for s in earlier.stages
                    if earlier.key() != record.key() or s.stage not in measured]
            if left:
                kept.append(dataclasses.replace(earlier, stages=left))
        return Calibration(records=[*kept, record])


def plausible(record: CalibrationRecord) -> list[str]:
    """Warnings for a record's noisy stages; BadInput where a spread is past MAX_SPREAD_SD
    (nothing is written then: the gate would refuse the file)."""
    warnings = []
    for spread in record.stages:
        worst = max(spread.wall_sd, spread.device_sd or 0.0)
        if worst > MAX_SPREAD_SD:
            raise BadInput(f"{spread.stage}: fresh processes differ by {worst:.0%} (SD of log "
                           f"throughput), past the {MAX_SPREAD_SD:.0%} a calibration may hold: "
                           "something else ran on this machine meanwhile; calibrate again on "
                           "a quiet one")
        if worst > NOISY_SD:
            warnings.append(f"warning: {spread.stage}: fresh processes differ by {worst:.1%}: "
                            "a loaded machine? The gate then decides only changes several "
                            "times that large")
    return warnings


def load_calibration(path: Path) -> Calibration:
    """The calibration file at `path`; RunFileError (one line) when it is not one."""
    data = read_json_file(path)
    if not isinstance(data, dict) or data.get("schema_version") != CALIBRATION_SCHEMA:
        raise RunFileError(f"{path}: not a gpudiag calibration file (schema_version "
                           f"{CALIBRATION_SCHEMA} expected)")
    try:
        return from_jsonable(Calibration, data)
    except RunFileError as exc:
        raise RunFileError(f"{path}: {exc}") from None


def save_calibration(calibration: Calibration, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # A linked .gpudiag/ is the user's own (shared storage): written where it points.
    write_text_atomic(named_by_user(path.parent) / path.name,
                      json.dumps(to_jsonable(calibration), indent=1) + "\n")
