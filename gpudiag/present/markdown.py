"""report.md: the stage table like the seed's, the environment, and how it was measured."""

from __future__ import annotations

from gpudiag.diagnose.ceilings import utilisation
from gpudiag.diagnose.roofline import roofline
from gpudiag.model.config import (
    GPM_PERIOD_S,
    PRECISE_AFTER_STEPS,
    SAMPLE_PERIOD_S,
    ProfileConfig,
)
from gpudiag.model.facts import DdpFacts
from gpudiag.model.results import RunResult, StageResult
from gpudiag.present.findings import diagnosis_markdown
from gpudiag.present.fixes import fixes_markdown, reruns_markdown
from gpudiag.present.owners import owners_markdown
from gpudiag.present.rankmemory import rank_memory_markdown
from gpudiag.present.rows import COLUMNS, fmt, phase_medians, run_subject, table_cells, window_steps
from gpudiag.present.tables import markdown_table
from gpudiag.present.terminal import env_rows
from gpudiag.present.waterfall import markdown_sections

PHASE_ORDER = ("data_wait", "h2d_copy", "forward", "backward", "optimizer")


PLOT_CAPTIONS = {"throughput.png": "Throughput and mean power per stage",
                 "timeline.png": "Power and SM/tensor activity over the run",
                 "step-times.png": "Step-time distribution per stage",
                 "memory.png": "Memory at each step's end"}


def render_markdown(run: RunResult, plots: list[str] | tuple[str, ...] = ()) -> str:
    c = run.config
    env = run.env
    gpu = env.gpu_name or env.device
    subject, setting = run_subject(run)
    out = [f"# gpudiag: `{subject}` on {gpu}", ""]
    if isinstance(c, ProfileConfig):
        head = f"{run.created_utc} · gpudiag {run.tool_version} · {setting}"
    else:
        head = (f"{run.created_utc} · gpudiag {run.tool_version} · preset `{c.preset}` "
                f"(batch {c.batch_size}, seq {c.seq_len}) · mixed precision {c.amp_dtype}")
    out.append(head + (f" · power limit {env.power_limit_w:.0f} W" if env.power_limit_w
                       else ""))
    out.append("")
    if run.interrupted:
        out += ["> **Interrupted (a signal stopped it):** the stages below are what was "
                "measured before.", ""]
    out += [f"> {note}" for note in run.notes]
    if run.notes:
        out.append("")

    out += diagnosis_markdown(run)
    out += fixes_markdown(run)
    out += ["## Stages", ""]
    columns, rows = table_cells(run, terminal=False)
    out += markdown_table([col.header for col in columns], rows)
    out.append("")
    out += [f"- **{col.header}**: {col.help}" for col in COLUMNS if col.help]
    out.append("")
    out += _ceilings(run)
    out += markdown_sections(run)
    if plots:
        out += ["### Plots", ""]
        out += [f"![{PLOT_CAPTIONS.get(p, p)}]({p})" for p in plots]
        out.append("")
    out += _what_ran(run)
    out += _phases(run)
    out += _evidence(run)
    out += owners_markdown(run)
    out += rank_memory_markdown(run)
    out += _rooflines(run)
    out += _distributed(run)
    out += _problems(run)
    out += reruns_markdown(run)
    windows = (", and each stage's profiler window (kernels, copies, the source-line ranges) in "
               "profile-<stage>.json.gz beside it" if any(run.stages_with_evidence()) else "")
    out += ["The timeline (stages, steps, power and SM/tensor activity, findings) is in "
            f"[trace.json](trace.json){windows}: open {'them' if windows else 'it'} in "
            "https://ui.perfetto.dev or chrome://tracing.", ""]
    out += ["## Environment", ""]
    out += markdown_table(["", ""], [[k, v] for k, v in env_rows(env)], right=2)
    out.append("")
    out += _method(run)
    return "\n".join(out).rstrip() + "\n"


def _ceilings(run: RunResult) -> list[str]:
    """The peak stage's measurements and each stage's share of its ceiling, in words."""
    lines = []
    peak = run.stage_in_role("ceiling")
    facts = peak.facts.peak if peak is not None and peak.ok else None
    if facts is not None:
        sheet = facts.datasheet_tflops
        measured = ", ".join(
            f"{k} {v:,.1f}" + (f" (datasheet {sheet[k]:,.0f})" if sheet.get(k) else "")
            for k, v in facts.matmul_tflops.items())
        lines.append(f"- Measured ceilings ({facts.matmul_n}^2 matmuls, TFLOP/s): "
                     f"{measured}; device copy {facts.copy_gbps:,.0f} GB/s.")
    for stage in run.ok_stages():
        use = utilisation(run, stage)
        if use and use["mfu"] is not None:
            lines.append(f"- {stage.name} runs at {use['mfu']:.0%} of {use['ceiling']} "
                         f"{use['dtype']} peak ({use['tflops']:,.1f} of "
                         f"{use['ceiling_tflops']:,.0f} TFLOP/s).")
    return ["### Against this GPU's ceilings", "", *lines, ""] if lines else []


def _what_ran(run: RunResult) -> list[str]:
    rows = [[s.name, s.title, s.workload or "-"] for s in run.stages]
    return ["### What each stage runs", "",
            *markdown_table(["stage", "what", "workload"], rows, right=3), ""]


def _phases(run: RunResult) -> list[str]:
    rows = []
    for stage in run.ok_stages():
        medians = phase_medians(stage)
        if medians:
            rows.append([stage.name, fmt(stage.ms_per_iter, ".1f")]
                        + [fmt(medians.get(p), ".2f") for p in PHASE_ORDER])
    if not rows:
        return []
    header = ["stage", "step", *[p.replace("_", " ") for p in PHASE_ORDER]]
    return ["### Where a step's time goes (median ms)", "",
            "Device phases are CUDA-event gaps on the GPU timeline; data wait is host time "
            "blocked on the DataLoader.", "", *markdown_table(header, rows), ""]


def _evidence(run: RunResult) -> list[str]:
    rows = []
    for stage in run.stages_with_evidence():
        ev = stage.evidence
        assert ev is not None
        hot = ev.hottest_source_line()
        copies = sum(ev.memcpy_per_step.values())
        rows.append([
            stage.name, fmt(ev.kernels_per_step, ",.0f") if ev.backend == "cuda" else "-",
            fmt(ev.launches_per_step, ",.0f") if ev.backend == "cuda" else "-",
            fmt(ev.ops_per_step, ",.0f"), fmt(ev.syncs_per_step, ",.0f"), fmt(copies, ",.0f"),
            fmt(ev.idle_fraction * 100 if ev.idle_fraction is not None else None, ".0f"),
            (f"`{hot.location}`" + (f" via `{hot.via}`" if hot.via else "")
             + f" ({hot.ops_per_step:,.0f} ops)") if hot else "-",
            fmt(ev.window_overhead, ".2f", "x") + _steps_cut(run, ev.steps),
        ])
    if not rows:
        return []
    header = ["stage", "kernels", "launches", "operators", "host syncs", "copies", "GPU idle %",
              "busiest source line", "window cost"]
    return ["### Evidence per step (profiler window, after the timed steps)", "",
            *markdown_table(header, rows), "",
            "Operators are top-level ATen calls, forward and backward; GPU idle is the share of "
            "the timed step with no kernel or copy running; window cost is the profiled step "
            "time over the timed one (instrumentation overhead, excluded from the timings).", ""]


def _steps_cut(run: RunResult, profiled: int) -> str:
    """', over 1 step' where the window's budget profiled fewer steps than configured."""
    c = run.config
    if c.evidence_budget_s is None or profiled >= c.evidence_steps:
        return ""
    return f", over {profiled} step" + ("s" if profiled > 1 else "")


def _rate(value: float | None) -> str:
    """Three significant figures for small rates (a CPU's TFLOP/s), whole numbers for large."""
    if value is None:
        return fmt(None)
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _rooflines(run: RunResult) -> list[str]:
    """Each profiled stage's busiest lines against the roofline (gpudiag/diagnose/roofline.py)."""
    out = []
    for stage in run.stages_with_evidence():
        found = roofline(run, stage)
        if found is None or not found.lines:
            continue
        rows = [[f"`{line.location}`", fmt(line.device_ms, ".2f"), _rate(line.tflops),
                 _rate(line.gbps), _rate(line.flops_per_byte),
                 line.bound or "-", fmt(line.of_roof * 100 if line.of_roof is not None
                                         else None, ".0f", "%")]
                for line in found.lines]
        matmuls = (f"{found.dtype} matmuls {fmt(found.peak_tflops, ',.0f')} TFLOP/s"
                   if found.dtype else "matmuls' dtype not recorded (a compiled model's)")
        peaks = (f"{matmuls}, memory {fmt(found.peak_gbps, ',.0f')} GB/s ({found.source})"
                 if found.peak_gbps else "no peaks known for this device: achieved rates only")
        out += [f"### Lines against the roofline: {stage.name}", "",
                *markdown_table(["line", "device ms/step", "TFLOP/s", "GB/s (at least)",
                                 "FLOP/byte", "bound", "of its roof"], rows), "",
                f"Peaks: {peaks}. FLOPs are the line's matmuls', from the shapes the profiler "
                "recorded; bytes are a floor (each input read once, one output written), so "
                "GB/s and a memory-bound line's share of its roof are at least these.", ""]
    return out


def _pct(value: float | None) -> str:
    return fmt(None if value is None else value * 100, ".0f")


def _ddp_stage_lines(stage: StageResult, info: DdpFacts) -> list[str]:
    single_sps = info.single_device.samples_per_s if info.single_device else None
    busbw = info.allreduce_probe.busbw_gbps if info.allreduce_probe else None
    lines = [f"- `{stage.name}`: {info.world_size} ranks ({info.backend}), "
             f"{fmt(stage.samples_per_s, ',.0f')} samples/s against "
             f"{info.world_size} x {fmt(single_sps, ',.0f')} on one "
             f"device: scaling efficiency {_pct(info.scaling_efficiency)}%. Gradients "
             f"{fmt((info.grad_bytes_per_round or 0) / 1e6, ',.0f')} MB per round; "
             f"all-reduce probe {fmt(busbw, ',.1f')} GB/s bus bandwidth.", ""]
    rows = [[str(r.rank), r.gpu_name or r.device or "-", fmt(r.ms_per_iter, ".1f"),
             _pct(r.exposed_comm_share), _pct(r.collective_overlap_fraction),
             fmt(r.collective_kernel_ms_per_step, ".1f"), fmt(r.compute_busy_ms_per_step, ".1f"),
             fmt(r.power_mean_w, ".0f")] for r in info.ranks]
    lines += markdown_table(["rank", "device", "ms/iter", "exposed comm % of step", "overlap %",
                     "collective kernel ms/step", "own device work ms/step", "power W"], rows)
    if info.sweep:
        lines += ["", *markdown_table(
            ["DDP variant", "ms/iter", "samples/s", "scaling efficiency %"],
            [[r.name, fmt(r.ms_per_iter, ".1f"), fmt(r.samples_per_s, ",.0f"),
              _pct(r.scaling_efficiency)] for r in info.sweep])]
    return [*lines, ""]


def _profiled_rank_lines(stages: list[StageResult]) -> list[str]:
    rows = []
    for stage in stages:
        ev = stage.evidence
        assert ev is not None
        job = stage.facts.ddp_job
        probe = (job.allreduce_probe.busbw_gbps
                 if job is not None and job.allreduce_probe is not None else None)
        rows.append([stage.name, fmt(stage.ms_per_iter, ".1f"), _pct(ev.collective_share),
                     _pct(ev.collective_overlap_fraction), fmt(ev.collective_ms_per_step, ".1f"),
                     fmt(ev.compute_busy_ms_per_step, ".1f"),
                     fmt(job.grad_bytes / 1e6 if job is not None and job.grad_bytes else None,
                         ",.0f"),
                     fmt(probe, ",.1f")])
    return [*markdown_table(["process", "ms/iter", "exposed comm % of step", "overlap %",
                     "collective kernel ms/step", "own device work ms/step", "gradient MB",
                     "probe GB/s"], rows), ""]


def _distributed(run: RunResult) -> list[str]:
    """Communication per rank, each figure named for what it is (see the note below)."""
    out: list[str] = []
    for stage in run.ok_stages():
        if stage.facts.ddp is not None:
            out += _ddp_stage_lines(stage, stage.facts.ddp)
    profiled = [s for s in run.stages_with_evidence() if s.facts.ddp is None
                and s.evidence and s.evidence.collective_calls_per_step]
    if profiled:
        out += _profiled_rank_lines(profiled)
    if not out:
        return []
    return ["### Communication per rank", "", *out,
            "Exposed comm is the share of the profiled window's step in which a collective ran "
            "with no other device work beside it (on a CPU: gloo's work time, waits for peers "
            "included); it is measured inside one window, so it never exceeds 100%. Overlap is "
            "the share of the collectives' time with other device work beside them. Collective "
            "kernel time sums NCCL kernel durations, which include spinning while a peer is "
            "late: it can exceed the step and is not a share of it.", ""]


def _problems(run: RunResult) -> list[str]:
    bad = [s for s in run.stages if not s.ok]
    if not bad:
        return []
    lines = ["### Stages that did not run", ""]
    for stage in bad:
        advice = f" Advice: {stage.advice}." if stage.advice else ""
        lines.append(f"- `{stage.name}` **{stage.status}**: {stage.error}.{advice}")
    return [*lines, ""]


def _window(config: ProfileConfig) -> str:
    """'a 3-step profiler window', or the same with its budget, where it had one."""
    if config.evidence_budget_s is None:
        return f"a {config.evidence_steps}-step profiler window"
    return (f"a profiler window of {window_steps(config)} steps (no further step once they "
            f"took {config.evidence_budget_s:g} s on the host: the evidence table says how "
            "many each stage profiled)")


def _method(run: RunResult) -> list[str]:
    c = run.config
    timers = sorted({s.timer for s in run.ok_stages() if s.timer})
    lines = ["## How it was measured", ""]
    # A profiled script's recorder samples at the defaults (gpudiag/measure/profile/).
    sample_period_s, gpm_period_s = SAMPLE_PERIOD_S, GPM_PERIOD_S
    if isinstance(c, ProfileConfig):
        lines.append(f"- The script's own steps, counted at optimizer.step() (or gpudiag.step()):"
                     f" {c.warmup} warm-up steps, {c.timed} timed steps, then "
                     f"{_window(c)}. Every timed step's time "
                     "is kept in run.json (`iter_ms`); the table shows medians and "
                     "interquartile ranges.")
    else:
        sample_period_s, gpm_period_s = c.sample_period_s, c.gpm_period_s
        lines.append(
            f"- Each stage builds its workload, runs {c.warmup} warm-up steps, then at "
            f"least {c.iters} timed steps"
            + (f" (or, from {PRECISE_AFTER_STEPS} on, as many as pin their median down within "
               f"±{c.timed_precision:.1%} at 95%)" if c.timed_precision is not None else "")
            + (f" and at least {c.min_seconds:g} s" if c.min_seconds else "")
            + ". Every timed step's time is kept in run.json (`iter_ms`); the table shows "
              "medians and interquartile ranges.")
    if "cuda-events" in timers:
        lines.append("- Step times are gaps between CUDA events recorded after every step on "
                     "the compute stream, with no synchronisation between steps (the host queues "
                     "ahead as in real training); one synchronisation reads them at the end.")
    if "host-clock" in timers:
        lines.append("- Host-only stages (and every stage on the CPU) use the host's monotonic "
                     "clock.")
    if run.env.nvml == "available":
        lines.append(
            f"- Telemetry: NVML sampled every {sample_period_s * 1e3:.0f} ms in a "
            "background thread: instantaneous power (field 186), the driver's 1-second average "
            "power, utilization.gpu (reported as *kernel-active time*: the share of time any "
            "kernel ran, not how much of the chip worked), SM clock, temperature, throttle "
            "reasons and memory in use. Stage energy is the total-energy counter read at the "
            "window's edges after a device synchronisation; mean power is that energy over the "
            "window.")
        if run.env.gpm == "available":
            lines.append(f"- GPM (SM activity, occupancy, tensor-pipe activity, DRAM bandwidth) "
                         f"over each stage's whole window, and every "
                         f"{gpm_period_s * 1e3:.0f} ms for the timeline.")
        else:
            lines.append(f"- GPM: {run.env.gpm}.")
    else:
        lines.append(f"- Telemetry: {run.env.nvml}.")
    lines.append("- Files: `run.json` (everything above, every step time), `samples.csv` (the "
                 "telemetry timeline with stage labels).")
    return lines
