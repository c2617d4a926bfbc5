"""Plots for the run directory (PNG, linked from report.md by relative paths).

Four pictures: throughput per stage with mean power on a second axis; the whole run's power and
SM/tensor activity over time with each stage's window shaded and named; each stage's
step-time distribution, where spikes (checkpoint saves, stalls) show; and a profiled script's
memory at each step's end, where growth shows. White cards with dark
text and mid-tone colours, so they read in dark and light viewers alike.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from gpudiag.model.atomic import atomic_file
from gpudiag.model.results import RunResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PLOTS = {"throughput": "throughput.png", "timeline": "timeline.png",
         "steps": "step-times.png", "memory": "memory.png"}
BLUE, ORANGE, GREEN, GREY = "#1f77b4", "#d9730d", "#2a9d4b", "#888888"
DPI = 110
PROCESS_STYLES = ("-", "--", ":", "-.")  # memory.png: each process (a job's rank) its own line
LEGEND_ROOM = 1.4  # memory.png's height over its highest line
NEAR_DEVICE = 0.5  # memory above this share of the device's size: its size drawn as a line


def _figure(width: float = 9.0, height: float = 4.0) -> tuple[Figure, Axes]:
    # A Figure of its own on the Agg canvas, not pyplot: pyplot's import and its global
    # figure registry cost more than the drawing (matplotlib's "Embedding in a web
    # application server" recipe), and nothing here is shown on a screen.
    from matplotlib.figure import Figure  # noqa: PLC0415 (optional: a GPU machine may lack it)

    fig = Figure(figsize=(width, height), facecolor="white")
    ax = fig.subplots()
    ax.set_facecolor("white")
    return fig, ax


def _save(fig: Figure, path: Path) -> None:
    """Drawn into a new file beside `path` and renamed over it: a full disk leaves no truncated
    PNG, and a link planted at the name is replaced, not written through (model/atomic.py)."""
    fig.tight_layout()
    with atomic_file(path) as fh:
        fig.savefig(fh, dpi=DPI, facecolor="white", format="png")


def throughput_plot(run: RunResult, path: Path) -> bool:
    stages = [s for s in run.ok_stages() if s.samples_per_s and s.role != "loader"]
    if not stages:
        return False
    fig, ax = _figure()
    names = [s.name for s in stages]
    ax.bar(names, [s.samples_per_s or 0.0 for s in stages], color=BLUE)
    ax.set_ylabel("throughput (samples/s)", color=BLUE)
    ax.set_title(f"Throughput and power per stage - {run.env.gpu_name or run.env.device}")
    ax.tick_params(axis="x", rotation=30)
    powers = [s.telemetry.power_mean_w for s in stages]
    if any(p is not None for p in powers):
        power_ax = ax.twinx()
        power_ax.plot(names, [p if p is not None else float("nan") for p in powers], "o-",
                      color=ORANGE)
        power_ax.set_ylabel("mean power (W)", color=ORANGE)
        limit = next((s.telemetry.power_limit_w for s in stages if s.telemetry.power_limit_w),
                     None)
        if limit:
            power_ax.axhline(limit, color=ORANGE, linestyle=":", linewidth=1)
            power_ax.set_ylim(0, limit * 1.1)
    _save(fig, path)
    return True


def timeline_plot(run: RunResult, samples: pd.DataFrame, path: Path) -> bool:
    if samples.empty or "t_s" not in samples or "power_instant_w" not in samples:
        return False
    fig, ax = _figure(10.0, 4.2)
    ax.plot(samples["t_s"], samples["power_instant_w"], color=ORANGE, linewidth=1)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("power (W)", color=ORANGE)
    activity = ax.twinx()
    for column, colour, label in (("sm_active_pct", BLUE, "SM active %"),
                                  ("tensor_active_pct", GREEN, "tensor %")):
        if column in samples and samples[column].notna().any():
            points = samples[["t_s", column]].dropna()  # GPM ticks are sparser than power's
            activity.plot(points["t_s"], points[column], color=colour, linewidth=1,
                          label=label)
    activity.set_ylim(0, 105)
    activity.set_ylabel("activity (%)")
    if activity.get_legend_handles_labels()[0]:
        activity.legend(loc="upper right", fontsize=8)
    if "stage" in samples:
        top = ax.get_ylim()[1]
        for k, (name, rows) in enumerate(samples.dropna(subset=["stage"]).groupby(
                "stage", sort=False)):
            start, end = float(rows["t_s"].min()), float(rows["t_s"].max())
            ax.axvspan(start, end, color=GREY, alpha=0.12 if k % 2 else 0.22, linewidth=0)
            ax.text((start + end) / 2, top * 0.97, str(name), ha="center", va="top",
                    fontsize=7, rotation=90)
    ax.set_title("Power and activity over the run (shaded: each stage's timed window; "
                 "after them, the profiler windows)")
    _save(fig, path)
    return True


def steps_plot(run: RunResult, path: Path) -> bool:
    stages = [s for s in run.ok_stages() if len(s.iter_ms) >= 3]
    if not stages:
        return False
    fig, ax = _figure(9.0, 0.5 + 0.45 * len(stages) + 1.5)
    ax.boxplot([s.iter_ms for s in stages], orientation="horizontal", whis=(0, 100),
               tick_labels=[s.name for s in stages],
               medianprops={"color": ORANGE}, boxprops={"color": BLUE})
    for row, stage in enumerate(stages, start=1):  # every step as a dot: spikes show as dots
        offsets = [0.25 * (((i * 37) % 11) / 10 - 0.5) for i in range(len(stage.iter_ms))]
        ax.scatter(stage.iter_ms, [row + o for o in offsets], s=6, color=GREY, alpha=0.6,
                   zorder=3)
    ax.set_xscale("log")
    # Plain numbers (0.5, 10, 200): the default's 10^n labels go through mathtext, a third of
    # the plot's drawing time, and read worse for milliseconds.
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415 (optional, as above)

    def minor_label(x: float, _pos: int | None) -> str:
        low, high = ax.get_xlim()
        decades = high / low if low > 0 else float("inf")
        leading = round(x / 10 ** math.floor(math.log10(x)))
        return f"{x:g}" if decades < 10 or (decades < 100 and leading in (2, 5)) else ""

    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(minor_label))
    ax.set_xlabel("step time (ms, log scale; dots: every timed step)")
    ax.set_title("Step-time distribution per stage")
    _save(fig, path)
    return True


def memory_plot(run: RunResult, path: Path) -> bool:
    """Each profiled stage's memory at every step's end: on CUDA what tensors hold, what the
    allocator reserved and the highest held so far, against the device's size; the process's
    resident set on every device (a CPU's only measure)."""
    kept = [(s.name, s.facts.script.memory) for s in run.stages
            if s.facts.script is not None and s.facts.script.memory is not None
            and len(s.facts.script.memory.resident_mib) >= 2]
    if not kept:
        return False
    fig, ax = _figure(9.0, 4.0)
    # A colour per series, a line style per process: the ranks of a job apart, each labelled.
    for (name, memory), style in zip(kept, itertools.cycle(PROCESS_STYLES), strict=False):
        label = f"{name}: " if len(kept) > 1 else ""
        gib = [[m / 1024 for m in series] for series in (
            memory.allocated_mib, memory.reserved_mib, memory.peak_mib, memory.resident_mib)]
        for series, colour, what in zip(gib, (BLUE, GREEN, ORANGE, GREY), (
                "allocated (tensors)", "reserved (allocator)", "peak so far",
                "process resident"), strict=True):
            if series:
                ax.plot(range(len(series)), series, color=colour, linewidth=1,
                        linestyle=style, label=label + what)
    totals = [m.device_total_mib for _, m in kept if m.device_total_mib]
    highest = max(max(s, default=0.0) for _, m in kept for s in (
        m.allocated_mib, m.reserved_mib, m.peak_mib, m.resident_mib))
    size = f"the device holds {max(totals) / 1024:,.0f} GiB" if totals else ""
    if totals and highest >= NEAR_DEVICE * max(totals):  # near it: drawn (dotted)
        ax.axhline(max(totals) / 1024, color=BLUE, linestyle=":", linewidth=1)
        size += ", dotted"
    ax.set_xlabel("step")
    ax.set_ylabel("GiB at the step's end")
    # Room above the lines for the legend (a line per series and process: a job's ranks
    # double it), which flat memory near the top would run under.
    ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], highest / 1024 * LEGEND_ROOM))
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("Memory at each step's end" + (f" ({size})" if size else ""))
    _save(fig, path)
    return True


def write_plots(path: Path, run: RunResult, samples: pd.DataFrame) -> list[str]:
    """Write what can be drawn; the file names written. Without matplotlib, nothing."""
    try:
        import matplotlib  # noqa: F401, PLC0415 (optional at run time)
    except ImportError:
        return []
    written = []
    for key, ok in (("throughput", throughput_plot(run, path / PLOTS["throughput"])),
                    ("timeline", timeline_plot(run, samples, path / PLOTS["timeline"])),
                    ("steps", steps_plot(run, path / PLOTS["steps"])),
                    ("memory", memory_plot(run, path / PLOTS["memory"]))):
        if ok:
            written.append(PLOTS[key])
    return written
