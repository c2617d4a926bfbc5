"""The stage table as formatted cells, shared by the terminal and markdown renderers."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from gpudiag.diagnose.ceilings import utilisation
from gpudiag.diagnose.ranks import memory_rank
from gpudiag.model.config import REFERENCE_STAGE, ProfileConfig, RunConfig
from gpudiag.model.results import RunResult, StageResult

# The stage the ladder compares against: the seed's "GPU saturated, fp16" rung.
DASH = "-"


def fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return DASH if value is None else f"{value:{spec}}{suffix}"


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    short: str  # terminal header; empty: markdown only (the terminal table is narrower)
    cell: Callable[[StageResult, RunResult], str]
    help: str = ""


def _vs_reference(stage: StageResult, run: RunResult) -> str:
    ref = run.stage_in_role("reference")
    if (stage.role != "step" or ref is None or not ref.ok
            or not stage.ms_per_iter or not ref.ms_per_iter):
        return DASH
    return f"{stage.ms_per_iter / ref.ms_per_iter:.2f}x"


def _iqr(stage: StageResult, run: RunResult) -> str:
    return fmt(stage.timing.iqr_ms if stage.timing else None, ".2f")


def _power(stage: StageResult, run: RunResult) -> str:
    t = stage.telemetry
    if t.power_mean_w is None:
        return DASH
    limit = f" ({t.power_mean_w / t.power_limit_w:.0%})" if t.power_limit_w else ""
    return f"{t.power_mean_w:.0f}{limit}"


def _gpm(metric: str) -> Callable[[StageResult, RunResult], str]:
    return lambda s, r: fmt(s.telemetry.gpm.get(metric), ".0f")


def _memory(stage: StageResult, run: RunResult) -> str:
    """The stage's peak; a ddp stage's is its most reserved rank's, and says which (a profiled
    rank's stage is named for its rank)."""
    cell = fmt(stage.memory.peak_allocated_mib / 1024 if stage.memory else None, ".1f")
    rank = memory_rank(stage) if stage.memory and stage.facts.ddp is not None else None
    return cell if rank is None else f"{cell} (rank {rank})"


def _tflops(stage: StageResult, run: RunResult) -> str:
    use = utilisation(run, stage)
    return fmt(use["tflops"] if use else None, ",.1f")


def _mfu(stage: StageResult, run: RunResult) -> str:
    use = utilisation(run, stage)
    return fmt(use["mfu"] * 100 if use and use["mfu"] is not None else None, ".0f")


def _status(stage: StageResult, run: RunResult) -> str:
    if stage.ok:
        return "ok"
    return f"{stage.status}: {stage.error}" if stage.error else stage.status


COLUMNS: tuple[Column, ...] = (
    Column("stage", "stage", "stage", lambda s, r: s.name),
    Column("ms", "ms/iter", "ms/iter", lambda s, r: fmt(s.ms_per_iter, ".1f"),
           help="median of the timed steps (the mean for stages whose steps come in bursts: "
                "the dataloader's prefetch queue, checkpoint saves)"),
    Column("iqr", "IQR ms", "IQR", _iqr, help="interquartile range of the timed steps"),
    Column("sps", "samples/s", "samples/s", lambda s, r: fmt(s.samples_per_s, ",.1f")),
    Column("tps", "tokens/s", "", lambda s, r: fmt(s.tokens_per_s, ",.0f")),
    Column("vs", f"time vs {REFERENCE_STAGE}", "vs fp16", _vs_reference,
           help=f"median step time over {REFERENCE_STAGE}'s"),
    Column("power", "power W (of limit)", "W (limit)", _power,
           help="mean power: energy-counter joules over the stage's timed window"),
    Column("pmax", "max W", "max W", lambda s, r: fmt(s.telemetry.power_max_w, ".0f"),
           help="highest instantaneous power sample"),
    Column("jps", "J/sample", "J/sample", lambda s, r: fmt(s.energy_per_sample_j, ".3f")),
    Column("active", "kernel-active %", "kern%",
           lambda s, r: fmt(s.telemetry.kernel_active_pct, ".0f"),
           help="NVML utilization.gpu: share of time any kernel ran, not how busy the chip was"),
    Column("sm", "SM active %", "SM%", _gpm("sm_active_pct"), help="GPM: share of SMs busy"),
    Column("tensor", "tensor %", "TC%", _gpm("tensor_active_pct"),
           help="GPM: tensor-pipe activity, the matrix units' share"),
    Column("dram", "DRAM BW %", "", _gpm("dram_bw_pct"), help="GPM: DRAM bandwidth used of peak"),
    Column("tflops", "TFLOP/s", "TFLOP/s", _tflops,
           help="FLOPs of one step (FlopCounterMode) over the median step time"),
    Column("mfu", "MFU %", "MFU%", _mfu,
           help="TFLOP/s over the ceiling in the stage's matmul dtype: the peak stage's "
                "measured rate when it ran, else the datasheet's"),
    Column("mem", "peak mem GiB", "GiB", _memory, help="peak allocated by the caching allocator"),
    Column("status", "status", "", _status),
)


# The terminal table sheds columns in this order when the console is too narrow.
TERMINAL_DROP_ORDER = ("jps", "pmax", "iqr", "mem", "active", "tensor", "sm", "vs", "power")


def table_cells(run: RunResult, *, terminal: bool) -> tuple[list[Column], list[list[str]]]:
    """Columns and cells; the terminal drops columns with nothing measured (no GPU: no power)."""
    columns = [c for c in COLUMNS if c.short or not terminal]
    cells = [[c.cell(s, run) for c in columns] for s in run.stages]
    if terminal:
        keep = [i for i, c in enumerate(columns)
                if c.key == "stage" or any(row[i] != DASH for row in cells)]
        columns = [columns[i] for i in keep]
        cells = [[row[i] for i in keep] for row in cells]
    return columns, cells


def phase_medians(stage: StageResult) -> dict[str, float]:
    """Median milliseconds per phase of a step (forward, backward, ...), when measured."""
    return {phase: statistics.median(ms) for phase, ms in stage.phases_ms.items() if ms}


def window_steps(config: ProfileConfig | RunConfig) -> str:
    """The profiler window's steps as configured: '3', or 'up to 3' where a budget may have
    ended it sooner (each stage's evidence says how many it profiled)."""
    if config.evidence_budget_s is None:
        return str(config.evidence_steps)
    return f"up to {config.evidence_steps}"


def run_subject(run: RunResult) -> tuple[str, str]:
    """(what ran, how it was set up) for report headings: a ladder's model and preset, or a
    profiled command."""
    c = run.config
    if isinstance(c, ProfileConfig):
        return (" ".join(c.command), f"profiled: warm-up {c.warmup}, timed {c.timed}, "
                f"evidence {window_steps(c)} steps")
    return (c.model, f"preset {c.preset}, batch {c.batch_size}, seq {c.seq_len}, "
            f"{c.amp_dtype}")
