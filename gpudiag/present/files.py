"""The run directory: run.json, samples.csv and report.md, written together."""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
from pathlib import Path

import pandas as pd

from gpudiag.model.atomic import named_by_user, write_text_atomic
from gpudiag.model.errors import BadInput
from gpudiag.model.results import RunResult
from gpudiag.model.runfile import RUN_MARKER, save_run
from gpudiag.present.markdown import render_markdown
from gpudiag.present.plots import write_plots
from gpudiag.present.trace import TRACE_FILE, write_trace

DEFAULT_REPORTS = Path("reports")
RUN_FILE, SAMPLES_FILE, REPORT_FILE = "run.json", "samples.csv", "report.md"


def default_run_dir(model: str, base: Path = DEFAULT_REPORTS) -> Path:
    """`reports/<UTC timestamp>-<model>`, the model name made safe for a path (prepare_run_dir
    adds -2, -3, ... when another run took the name in the same second)."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model.split(":", 1)[0]).stem or model)
    return base / f"{stamp}-{safe}"


# What gpudiag writes at the top of a run directory (run, profile, gate and their atomic
# writes' temporaries): --force replaces a directory only when it holds nothing else.
_OWN_ENTRIES = re.compile(r"(\.gpudiag-run|run\.json|report\.md|samples\.csv|trace\.json|"
                          r"[\w.-]+\.png|parts|fixes|rerun|checkpoints|base|head|"
                          r"profile-.+\.json\.gz|\.[^/]+\.tmp[^/]*)")


def _is_run_dir(path: Path) -> bool:
    return (path / RUN_MARKER).is_file() or (path / RUN_FILE).is_file()


def _not_gpudiags(path: Path) -> list[str]:
    """Why `path` is not a run directory gpudiag may replace whole: no marker (a run.json of
    the user's own is not one), or entries gpudiag never writes there (the user's files)."""
    if not (path / RUN_MARKER).is_file():
        return [f"no {RUN_MARKER} (gpudiag's mark on the directories it makes)"]
    return sorted(e.name for e in path.iterdir() if not _OWN_ENTRIES.fullmatch(e.name))


def _make_fresh(path: Path, *, unique: bool) -> Path:
    """Create `path` (which must not exist), or with `unique` the first free `path-N`."""
    for n in range(1, 1000):
        candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
        try:
            candidate.mkdir(parents=True)
        except FileExistsError:
            if unique:
                continue
            raise
        return _mark(candidate)
    raise BadInput(f"{path}: no free run directory name")


def _mark(path: Path) -> Path:
    write_text_atomic(path / RUN_MARKER, "made by gpudiag for one run; --force may replace it\n")
    return path


def _replace_run_dir(path: Path) -> None:
    """Move an old run directory aside and delete it: nothing of it mixes with the new run."""
    aside = path.with_name(f".{path.name}.replaced-{os.getpid()}")
    path.rename(aside)
    shutil.rmtree(aside, ignore_errors=True)


def prepare_run_dir(out: Path | None, default: Path, *, force: bool = False) -> Path:
    """The run's own directory, created empty: `out` when given (an existing non-empty one only
    with `force`, and only if gpudiag made it for a run), else a fresh `default`."""
    where = out or default
    try:
        if out is None:
            return _make_fresh(default, unique=True)
        out = named_by_user(out)
        if out.exists() and not out.is_dir():
            raise BadInput(f"--out {out}: exists and is not a directory")
        if out.is_dir() and any(out.iterdir()):
            if not force:
                raise BadInput(f"--out {out}: not empty; pass --force to replace it whole, or "
                               "choose another directory")
            foreign = _not_gpudiags(out)
            if foreign:
                shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more"
                                                 if len(foreign) > 3 else "")
                raise BadInput(f"--out {out}: not a directory gpudiag made for a run ({shown}); "
                               "--force replaces only those: choose another directory")
            _replace_run_dir(out)
        elif out.is_dir():  # empty: use it as it is
            return _mark(out)
        return _make_fresh(out, unique=False)
    except OSError as exc:
        raise BadInput(f"--out {where}: cannot create it ({exc.strerror or exc})") from None


def writable_output_file(path: Path, flag: str, *, force: bool) -> Path:
    """`path` checked before anything is written to it: not a directory, not a file of a run
    directory, not an existing file unless `force`, and in a directory that exists."""
    if path.is_dir():
        raise BadInput(f"{flag} {path}: is a directory")
    if path.exists() and _is_run_dir(path.parent):
        raise BadInput(f"{flag} {path}: belongs to a run directory; write elsewhere")
    if path.exists() and not force:
        raise BadInput(f"{flag} {path}: exists; pass --force to replace it")
    if not path.parent.is_dir():
        raise BadInput(f"{flag} {path}: directory {path.parent} does not exist")
    return path


def write_output_file(path: Path, text: str, flag: str) -> None:
    """Write a user-named output file atomically; an OSError is one line naming the flag."""
    try:
        write_text_atomic(named_by_user(path.parent) / path.name, text)
    except OSError as exc:
        raise BadInput(f"{flag} {path}: cannot write it ({exc.strerror or exc})") from None


def write_run_dir(path: Path, run: RunResult, samples: pd.DataFrame | None = None, *,
                  plots: bool = True) -> None:
    """run.json, samples.csv (empty without `samples`: a profiled script's telemetry is on its
    stages), trace.json, report.md and (unless `plots` is False, as for the partial writes
    during a run) the PNG plots the report links."""
    samples = pd.DataFrame() if samples is None else samples
    save_run(run, path / RUN_FILE)
    write_text_atomic(path / SAMPLES_FILE, samples.to_csv(index=False, float_format="%.6g"))
    write_trace(path / TRACE_FILE, run, samples)
    drawn = write_plots(path, run, samples) if plots else []
    write_text_atomic(path / REPORT_FILE, render_markdown(run, drawn))


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
    too with `save`, after the caller diagnosed it anew). `path` is the folder the user named
    (a link resolved); inside it a link is replaced, never written through: a run folder from
    elsewhere (a CI artifact) may hold `trace.json -> ~/.bashrc`."""
    path = named_by_user(path)
    if save:
        save_run(run, path / RUN_FILE)
    samples = read_samples(path)
    write_trace(path / TRACE_FILE, run, samples)
    plots = write_plots(path, run, samples)
    write_text_atomic(path / REPORT_FILE, render_markdown(run, plots))
