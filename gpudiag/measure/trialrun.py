"""`gpudiag run --trials N`: the same run in N fresh processes (merged by the command layer).

Fresh processes are the unit of evidence for comparisons (see gpudiag.diagnose.trials). Each
trial is a plain `gpudiag run` writing its own directory (trial-1, trial-2, ...), evidence window
included: it runs after all of the trial's timing, and its exact counters and device time are
what a gate compares trial by trial.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from gpudiag.measure.bytecode import shared_bytecode
from gpudiag.measure.childexec import child_command
from gpudiag.measure.interrupts import child_stopped, stop_error, wait_child
from gpudiag.model.errors import NothingMeasured
from gpudiag.model.options import RunOptions, to_argv
from gpudiag.model.results import RunResult
from gpudiag.model.runfile import load_run


@dataclass
class TrialsOutput:
    runs: list[RunResult]  # one per finished (or interrupted) trial, in order
    samples: pd.DataFrame  # every trial's telemetry, with a `trial` column
    interrupted: bool


@shared_bytecode()  # its processes compile their modules once, not each
def run_trials(options: RunOptions, out_dir: Path, trials: int,
               on_trial: Callable[[int, int], None] | None = None) -> TrialsOutput:
    """Run `gpudiag run` with `options` `trials` times, each in a fresh process. The caller
    merges them (gpudiag.diagnose.trials.merge_trials)."""
    runs: list[RunResult] = []
    frames: list[pd.DataFrame] = []
    interrupted = False
    last_stop: int | None = None
    for k in range(1, trials + 1):
        if on_trial is not None:
            on_trial(k, trials)
        trial_dir = out_dir / f"trial-{k}"
        # No plots of its own: the merged run draws them (1-2 s a trial).
        command = [sys.executable, "-m", "gpudiag", "run", *to_argv(options),
                   "--out", str(trial_dir), "--quiet", "--no-plots"]
        code, stopped_by = wait_child(subprocess.Popen(child_command(command)))
        last_stop = stopped_by
        if (trial_dir / "run.json").is_file():
            runs.append(load_run(trial_dir))
            samples = trial_dir / "samples.csv"
            if samples.is_file() and samples.stat().st_size > 1:
                frames.append(pd.read_csv(samples).assign(trial=k))
        if child_stopped(code, stopped_by):
            interrupted = True
            break
    if not runs:
        if interrupted:  # stopped before any trial wrote its run: the CLI's 130 or 143
            raise stop_error(last_stop)
        raise NothingMeasured(f"none of the {trials} trials wrote a run.json (each trial's "
                              f"error is above; their directories are in {out_dir})")
    return TrialsOutput(runs=runs, samples=pd.concat(frames) if frames else pd.DataFrame(),
                        interrupted=interrupted)
