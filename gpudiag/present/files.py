"""The run directory: run.json, samples.csv and report.md, written together."""

from __future__ import annotations

import datetime as dt
import os
import re
from pathlib import Path

import pandas as pd

from gpudiag.model.errors import BadInput
from gpudiag.model.results import RunResult, save_run
from gpudiag.present.markdown import render_markdown
from gpudiag.present.plots import write_plots
from gpudiag.present.trace import TRACE_FILE, write_trace

DEFAULT_REPORTS = Path("reports")
RUN_FILE, SAMPLES_FILE, REPORT_FILE = "run.json", "samples.csv", "report.md"


def default_run_dir(model: str, base: Path = DEFAULT_REPORTS) -> Path:
    """`reports/<UTC timestamp>-<model>`, the model name made safe for a path."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model.split(":", 1)[0]).stem or model)
    return base / f"{stamp}-{safe}"


def prepare_run_dir(path: Path) -> Path:
    """Create the run directory, or refuse a path that is a file or cannot be written."""
    if path.exists() and not path.is_dir():
        raise BadInput(f"--out {path}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(f"--out {path}: cannot create it ({exc.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise BadInput(f"--out {path}: not writable")
    return path


def write_run_dir(path: Path, run: RunResult, samples: pd.DataFrame, *,
                  plots: bool = True) -> None:
    """run.json, samples.csv, trace.json, report.md and (unless `plots` is False, as for the
    partial writes during a run) the PNG plots the report links."""
    save_run(run, path / RUN_FILE)
    samples.to_csv(path / SAMPLES_FILE, index=False, float_format="%.6g")
    write_trace(path / TRACE_FILE, run, samples)
    drawn = write_plots(path, run, samples) if plots else []
    (path / REPORT_FILE).write_text(render_markdown(run, drawn))


def read_samples(path: Path) -> pd.DataFrame:
    file = path / SAMPLES_FILE
    if not file.is_file() or file.stat().st_size <= 1:
        return pd.DataFrame()
    try:
        return pd.read_csv(file)
    except (pd.errors.EmptyDataError, pd.errors.ParserError):
        return pd.DataFrame()


def rerender_run_dir(path: Path, run: RunResult, *, save: bool = False) -> None:
    """Write report.md, the trace and the plots again for `run`, saved in `path` (and run.json
    too with `save`, after the caller diagnosed it anew)."""
    if save:
        save_run(run, path / RUN_FILE)
    samples = read_samples(path)
    write_trace(path / TRACE_FILE, run, samples)
    plots = write_plots(path, run, samples)
    (path / REPORT_FILE).write_text(render_markdown(run, plots))
