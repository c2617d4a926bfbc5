"""The host feeding the GPU: Python loops of tiny ops, starved GPUs, syncs, small kernels."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Literal

from gpudiag.diagnose.common import data_wait_share, device_ops, pct, reference_stage
from gpudiag.diagnose.gd1_host import host_only_work, host_severity
from gpudiag.diagnose.gd1_optimizer import (
    ARGUMENT,
    optimizer_price,
    optimizer_severity,
    slow_optimizer,
)
from gpudiag.diagnose.headroom import headroom
from gpudiag.diagnose.host import SHORT_KIND, HostLineTime, step_account
from gpudiag.diagnose.ledger import StepPart, Symptom, device_time
from gpudiag.diagnose.registry import Draft, Threshold, rule, severity_for
from gpudiag.model.facts import OptimizerFacts
from gpudiag.model.results import SEVERITY_RANK, RunResult, Severity, SourceLine, StageResult

LOOP_MIN_CALLS, LOOP_MIN_OPS, LOOP_WARNING, LOOP_CRITICAL = 64, 100, 0.10, 0.40
IDLE_WARNING, IDLE_CRITICAL, MAX_DATA_WAIT = 0.25, 0.50, 0.10
SYNC_MIN, SYNC_WARNING, SYNC_CRITICAL = 4, 0.05, 0.30
SYNC_NAMED = 0.01  # fewer reads than SYNC_MIN are named from this idle share on
SMALL_MIN_KERNELS, SMALL_SHORT_SHARE, SMALL_IDLE, SMALL_MAX_SM = 500, 0.5, 0.20, 40

MAX_PRICED_SHARE = 0.95  # a loop's share is capped here when it is turned into a speedup
SYMPTOM_RANK = 0.99  # GD102's impact, of its cause's, when it points to a later rule
MAX_LINES_NAMED = 3  # lines a fix names, busiest first
OPTIMIZER_LAUNCH_SHARE = 0.5  # of the step's launches, from a per-tensor optimizer: its cause

# What a loop's line does to each element, read from its source text (the host samples keep
# it): writes into a tensor one element at a time, or reduces and reads back one at a time
# (`p.grad.abs().max().item()` per parameter). Their fixes differ: one indexed write, or one
# fused reduction and one read.
_WRITES = re.compile(r"\]\s*[-+*/]?=(?!=)|\.(?:copy_|index_put_|index_copy_|scatter_|"
                     r"masked_scatter_|masked_fill_|fill_)\(")
_READS = re.compile(r"\.(?:item|tolist|cpu|numpy)\(|\.(?:max|min|sum|mean|norm|amax|amin|"
                    r"any|all|std|var)\(|\b(?:float|int|bool)\(")
LoopKind = Literal["write", "read", "unknown"]


def _loop_thresholds(prefix: str = "", *, severity: bool = True) -> tuple[Threshold, ...]:
    """What makes a line a Python loop's (and how its price grades): GD101's thresholds, and
    for GD102-GD104, prefixed `loop_`, the cause they defer to."""
    line = (
        Threshold(f"{prefix}min_direct_calls_per_step", LOOP_MIN_CALLS,
                  "a per-layer loop of a 12-48 layer model calls each line 12-48 times per "
                  "step; a loop over batch elements calls it batch-size times or more"),
        Threshold(f"{prefix}min_device_ops_per_step", LOOP_MIN_OPS,
                  "below a hundred launches a line costs at most about a millisecond of host "
                  "time"),
    )
    if not severity:
        return line
    return (*line,
            Threshold(f"{prefix}warning_share", LOOP_WARNING,
                      "a tenth of the step is worth a code change"),
            Threshold(f"{prefix}critical_share", LOOP_CRITICAL,
                      "the loop costs more than the rest of the step's host work"),
            Threshold(f"{prefix}max_priced_share", MAX_PRICED_SHARE,
                      "the loop's share of the step at most, when quoted as a speedup"))


LOOP_RULE_THRESHOLDS = _loop_thresholds()


def loop_line(stage: StageResult) -> SourceLine | None:
    """The line a per-element Python loop issues its device work from, if there is one."""
    if stage.evidence is None:
        return None
    backend = stage.evidence.backend
    candidates = [
        s for s in stage.evidence.source_lines
        if s.in_loop
        and s.direct_calls_per_step >= LOOP_MIN_CALLS
        and device_ops(s, backend) >= LOOP_MIN_OPS
    ]
    return max(candidates, key=lambda s: device_ops(s, backend), default=None)


@rule(
    "GD101", "python-loop-launches", concern="launch",
    summary="Many tiny device ops issued per step from one line inside a Python loop.",
    why=("Every eager op costs microseconds of host time to launch, and indexing with a device "
         "tensor as a Python index reads it back (a blocking sync). A loop over batch elements "
         "turns one op into thousands, and the GPU waits for the host: the seed report's "
         "DGCA-ReLM lost 2.2x this way in `_apply_prompt`."),
    fix=("Replace the loop with one indexed op over the whole batch (masked_scatter, "
         "index_put/advanced indexing with index tensors, scatter_, masked_fill); where shapes "
         "are static, torch.compile or CUDA graphs remove the remaining launch overhead."),
    prices=StepPart("torch"),
    thresholds=LOOP_RULE_THRESHOLDS,
    references=("docs/field-cases.md#case-1 (DGCA-ReLM _apply_prompt)",
                "https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs"),
)
def python_loop_launches(run: RunResult) -> Iterator[Draft]:
    """A line inside a for/while loop that calls torch itself at least 64 times per step and
    issues at least 100 device ops (kernels and copies; operator calls on a CPU)."""
    for stage in run.stages_with_evidence():
        line = loop_line(stage)
        if line is None:
            continue
        ev = stage.evidence
        assert ev is not None
        cuda = ev.backend == "cuda"
        ops = device_ops(line, ev.backend)
        share = line.share_of_step_time
        impact, twin = loop_price(run, stage, line)
        evidence: dict[str, object] = {
            "function": line.function,
            "torch_calls_per_step": round(line.direct_calls_per_step, 1),
            "device_ops_per_step": round(ops, 1),
            "operators_per_step": round(line.ops_per_step, 1),
            "host_syncs_per_step": round(line.syncs_per_step, 1),
            "share_of_step_time": round(share, 3),
            "step_device_ops": round(ev.kernels_per_step + sum(ev.memcpy_per_step.values())
                                     if cuda else ev.ops_per_step, 1),
            "speedup_if_removed": round(1 / (1 - min(share, MAX_PRICED_SHARE)), 2),
        }
        if line.median_kernel_us is not None:
            evidence["median_kernel_us"] = round(line.median_kernel_us, 2)
        price = f"{pct(share)} of the profiled step"
        unsteady = _overlapping_twin(run, stage)
        if unsteady is not None:
            price += f" ({unsteady})"
            evidence["counterfactual_unsteady"] = unsteady
        if twin is not None:
            speedup = sustained_ms(stage) / sustained_ms(twin)
            evidence.update(counterfactual_stage=twin.name,
                            counterfactual_speedup=round(speedup, 2),
                            counterfactual_device_ops_per_step=round(_device_ops(twin), 1))
            price = (f"{twin.name} runs {speedup:.1f}x faster with "
                     f"{_device_ops(twin):,.0f} device ops per step")
        what = (f"{ops:,.0f} device ops and {line.syncs_per_step:,.0f} host syncs per step"
                if cuda else f"{ops:,.0f} operator calls per step "
                             f"({line.syncs_per_step:,.0f} would block the host on a GPU)")
        yield Draft(
            severity=loop_severity(impact),
            stage=stage.name,
            title=(f"{what} come from one line inside a Python loop in {line.function}(); "
                   f"{price}"),
            location=line.location,
            impact=impact,
            evidence=evidence,
            fix=_loop_fix(stage, line) + _headroom(stage, evidence),
        )


def loop_kind(stage: StageResult, line: SourceLine) -> LoopKind:
    """What `line` does to each element, from its text (unknown without host samples)."""
    script = stage.facts.script
    text = script.host.text.get(line.location) if script and script.host else None
    if text is None:
        return "unknown"
    return "write" if _WRITES.search(text) else "read" if _READS.search(text) else "unknown"


def _loop_fix(stage: StageResult, line: SourceLine) -> str:
    write = ("write all elements with one op, e.g. x = x.masked_scatter(mask[..., None], "
             "values.expand(batch, -1, -1)) or x[rows, cols] = values with index tensors, "
             "instead of one assignment per element; never use a 0-dim device tensor as a "
             "Python index (each use is a blocking device-to-host read)")
    read = ("compute the values of all elements with one op and read them once: a reduction "
            "over a dimension, or over many tensors one fused op (torch._foreach_norm(tensors, "
            "float('inf')) for per-tensor maxima, torch.stack([...]) of per-tensor results), "
            "then one .tolist() or .cpu() instead of an .item() per element (each read is a "
            "blocking device-to-host sync)")
    kind = loop_kind(stage, line)
    how = (write if kind == "write" else read if kind == "read" else
           f"one op over all elements instead of one per element. A write: {write}. A "
           f"reduction or read: {read}")
    return (f"Vectorize the loop at {line.location} in {line.function}(): {how}. "
            f"{_capture_advice(stage, 'With static shapes, ')} also removes per-op launch "
            "cost.")


def compiled(stage: StageResult) -> bool:
    """Whether the profiled script runs torch.compile'd code (Dynamo compiled a graph)."""
    script = stage.facts.script
    return script is not None and bool(
        script.compiled_graphs or (script.compiles is not None and script.compiles.events))


def _capture_advice(stage: StageResult, lead: str = "") -> str:
    """How to take the launches out of the step: a compiled script's knob is its compile mode
    (CUDA graphs over the compiled code), anyone else's torch.compile or CUDA graphs."""
    if compiled(stage):
        return (f"{lead}compiling with mode=\"reduce-overhead\" (torch.compile(model, "
                "mode=\"reduce-overhead\"): CUDA graphs over the compiled step)")
    return f"{lead}torch.compile or capturing the step in CUDA graphs"


def loop_price(run: RunResult, stage: StageResult,
               line: SourceLine) -> tuple[float, StageResult | None]:
    """What the loop costs (share of the step at stake) and the twin that measured it. A
    measured counterfactual beats the in-window share, which profiler overhead on every other
    call dilutes."""
    twin = _counterfactual(run, stage)
    if twin is None or twin.evidence is None:
        return line.share_of_step_time, None
    return max(0.0, 1 - sustained_ms(twin) / sustained_ms(stage)), twin


def sustained_ms(stage: StageResult) -> float:
    """Lower-quartile step time: robust to host interference, which only ever adds time."""
    return stage.timing.p25_ms if stage.timing else stage.ms_per_iter or 0.0


def loop_severity(impact: float) -> Severity:
    return severity_for(impact, warning=LOOP_WARNING, critical=LOOP_CRITICAL)


def _declared_twin(run: RunResult, stage: StageResult) -> StageResult | None:
    """The stage's declared twin without the problem (full-loop: full-vectorized), if it ran."""
    name = stage.facts.counterfactual
    twin = run.stage(name) if name is not None else None
    if twin is None or not twin.ok or not twin.ms_per_iter or not stage.ms_per_iter:
        return None
    return twin


def _apart(stage: StageResult, twin: StageResult) -> bool:
    """Whether the twin measured faster beyond both stages' spread: its upper quartile below
    the stage's lower one (where they have quartiles), else its time below the stage's."""
    if stage.timing is not None and twin.timing is not None:
        return twin.timing.p75_ms < stage.timing.p25_ms
    return bool(twin.ms_per_iter and stage.ms_per_iter and twin.ms_per_iter < stage.ms_per_iter)


def _counterfactual(run: RunResult, stage: StageResult) -> StageResult | None:
    """The declared twin, where it measured apart from the stage: on an unsteady machine (a
    loaded CPU) the two stages' step times overlap, and their ratio is noise, not a price
    ("full-vectorized runs 0.5x faster")."""
    twin = _declared_twin(run, stage)
    return twin if twin is not None and _apart(stage, twin) else None


def _overlapping_twin(run: RunResult, stage: StageResult) -> str | None:
    """What to say where the declared twin ran but did not measure apart from the stage."""
    twin = _declared_twin(run, stage)
    if twin is None or _apart(stage, twin):
        return None
    if stage.timing is not None and twin.timing is not None:
        spread = (f"{twin.timing.p25_ms:.3g}-{twin.timing.p75_ms:.3g} ms a step against "
                  f"{stage.timing.p25_ms:.3g}-{stage.timing.p75_ms:.3g} ms, quartiles")
    else:
        spread = f"{twin.ms_per_iter:.3g} ms a step against {stage.ms_per_iter:.3g} ms"
    return (f"{twin.name}, its twin without the loop, did not measure apart from it here "
            f"({spread}): the timings are too unsteady to price the loop by them")


def _device_ops(stage: StageResult) -> float:
    ev = stage.evidence
    if ev is None:
        return 0.0
    if ev.backend == "cuda":
        return ev.kernels_per_step + sum(ev.memcpy_per_step.values())
    return ev.ops_per_step


STARVED_THRESHOLDS = (
    Threshold("warning_idle_fraction", IDLE_WARNING,
              "a quarter of the step with nothing running on the GPU, beyond what the run's "
              "reference stage idles, is not launch jitter"),
    Threshold("critical_idle_fraction", IDLE_CRITICAL, "the GPU waits more than it works"),
    Threshold("max_data_wait_share", MAX_DATA_WAIT,
              "above this the input-pipeline rule explains the idle time instead"),
    Threshold("max_lines_named", MAX_LINES_NAMED,
              "without a loop finding, the fix names this many lines, by host time"),
    Threshold("symptom_rank", SYMPTOM_RANK,
              "pointing to host-only work (GD105), the idle GPU ranks just below it"),
    Threshold("optimizer_launch_share", OPTIMIZER_LAUNCH_SHARE,
              "a per-tensor optimizer (GD106) issuing this share of the launches is the cause"),
    *_loop_thresholds("loop_"),
)


@rule(
    "GD102", "gpu-starved", concern="launch",
    summary="The GPU sits idle for much of each step while the host prepares work.",
    why=("Power far below the ceiling that the same run's compute-bound stage reached, and "
         "device idle time inside the step, mean the host (Python, launches, syncs) sets the "
         "pace. NVML's utilization does not show it: it counts any kernel as busy."),
    fix=("Remove host work from the step: the finding names the lines whose torch calls and "
         "syncs take the host's time (or says none does); batch small ops, avoid per-step "
         ".item()/.cpu(), use CUDA graphs or torch.compile."),
    prices=Symptom(("GD101", "GD105", "GD106")),
    thresholds=STARVED_THRESHOLDS,
    references=("docs/field-cases.md#case-1 (stage 6 vs stage 3)",
                "reports/examples/h100-dgca (the ladder on an H100)"),
)
def gpu_starved(run: RunResult) -> Iterator[Draft]:
    """GPU idle (no kernel or copy running) for a quarter of the timed step more than the run's
    reference stage (train-fp16: the same training recipe, compute-bound), from the profiled
    window's device timeline, when data loading does not explain it. A Python loop finding on
    the same stage is the cause, so this finding then never ranks above it."""
    for stage in run.stages_with_evidence():
        ev = stage.evidence
        assert ev is not None
        idle = ev.idle_fraction
        if idle is None or data_wait_share(stage) >= MAX_DATA_WAIT:
            continue
        ref = reference_stage(run, stage)
        ref_idle = (ref.evidence.idle_fraction if ref is not None and ref.evidence is not None
                    else None) or 0.0
        excess = idle - ref_idle
        if excess < IDLE_WARNING:
            continue
        evidence: dict[str, object] = {"idle_fraction": round(idle, 3),
                                       "idle_beyond_reference": round(excess, 3),
                                       "kernel_active_pct": stage.telemetry.kernel_active_pct,
                                       "sm_active_pct": stage.telemetry.gpm.get("sm_active_pct"),
                                       "power_mean_w": stage.telemetry.power_mean_w,
                                       "launches_per_step": round(ev.launches_per_step, 1),
                                       "syncs_per_step": round(ev.syncs_per_step, 1)}
        title = f"GPU idle {pct(idle)} of each step: the host, not the GPU, sets the pace"
        if ref is not None and ref.ms_per_iter and stage.ms_per_iter:
            slowdown = stage.ms_per_iter / ref.ms_per_iter
            evidence.update(reference_stage=ref.name, slowdown_vs_reference=round(slowdown, 2))
            gap = None
            if ref.telemetry.power_mean_w and stage.telemetry.power_mean_w:
                gap = ref.telemetry.power_mean_w - stage.telemetry.power_mean_w
                evidence.update(reference_power_w=ref.telemetry.power_mean_w,
                                power_gap_w=round(gap, 1))
            power = f" at {gap:.0f} W less" if gap is not None and gap > 0 else ""
            title = (f"{stage.name} is {slowdown:.1f}x slower than {ref.name}{power}, GPU idle "
                     f"{pct(idle)} of each step: the host, not the data, is the bottleneck")
        severity = severity_for(excess, warning=IDLE_WARNING, critical=IDLE_CRITICAL)
        impact = excess
        loop = loop_line(stage)
        host = host_only_work(run, stage) if loop is None else None
        optimizer = None
        if loop is not None:
            # The loop is the cause: this symptom never ranks above its finding.
            loop_impact, _ = loop_price(run, stage, loop)
            title += f"; the Python loop at {loop.location} is why (see GD101)"
            impact = min(excess, loop_impact)
            severity = min(severity, loop_severity(loop_impact), key=SEVERITY_RANK.__getitem__)
        elif host is not None and host_severity(run, stage, host[3]) != "info" \
                and not all(line.library for line in host[1]):
            # So is host-only work by line (GD105), where it explains the idle time (not a
            # framework's own loop: no line of the script to change; its fix is the batch).
            title += f"; Python/numpy work at {host[1][0].location} is why (see GD105)"
            impact = min(excess, host[3]) * SYMPTOM_RANK
            severity = min(severity, host_severity(run, stage, host[3]),
                           key=SEVERITY_RANK.__getitem__)
        elif (optimizer := _optimizer_cause(stage)) is not None:
            # And a per-tensor optimizer step (GD106), where it is most of the launches.
            title += (f"; {_named(optimizer[0])} launches most of the step's kernels one "
                      "parameter at a time (see GD106)")
            price = optimizer_price(run, stage)
            impact = min(excess, price) * SYMPTOM_RANK
            severity = min(severity, optimizer_severity(price), key=SEVERITY_RANK.__getitem__)
        cause = (f"Build {_named(optimizer[0])} with {ARGUMENT[optimizer[1]]} (GD106)."
                 if optimizer else _starved_fix(stage, loop))
        yield Draft(
            severity=severity, stage=stage.name, title=title, impact=impact, evidence=evidence,
            fix=cause + " Then batch small ops, remove per-step host syncs, and where shapes "
                f"are static try {_capture_advice(stage)}." + _headroom(stage, evidence))


def _headroom(stage: StageResult, evidence: dict[str, object]) -> str:
    """How much of the device a host- or launch-bound step uses and the batch that would fit
    (a larger batch is the other lever of such a step), into `evidence`; what the fix says of
    it (nothing where the run counted no owners on a CUDA device)."""
    room = headroom(stage)
    if room is None:
        return ""
    evidence.update(peak_bytes=room.peak, batch_scaled_bytes=room.scaled,
                    largest_batch=room.largest_batch,
                    batches_that_fit=None if room.times is None else round(room.times))
    return f" {room.says()}"


def _optimizer_cause(stage: StageResult) -> tuple[OptimizerFacts, str] | None:
    """GD106's optimizer and the implementation it names, when its per-tensor step issues at
    least half of the step's launches: the cause GD102 and GD104 then point to."""
    found = slow_optimizer(stage)
    ev = stage.evidence
    if found is None or ev is None:
        return None
    launches = ev.launches_per_step if ev.backend == "cuda" else ev.ops_per_step
    return found if ev.optimizer_ops_per_step >= OPTIMIZER_LAUNCH_SHARE * launches else None


def _named(optimizer: OptimizerFacts) -> str:
    """"AdamW at train.py:30"."""
    return optimizer.name + (f" at {optimizer.site}" if optimizer.site else "")


def _starved_fix(stage: StageResult, loop: SourceLine | None) -> str:
    """Where the host's time goes, from this stage's own evidence: the loop when there is one,
    else the lines whose torch calls or syncs take the most host time; or that no line does."""
    if loop is not None:
        return f"Vectorize the Python loop at {loop.location} (GD101)."
    step = step_account(stage)
    if step is not None:
        busiest = [line for line in step.lines if line.main_kind != "data"][:MAX_LINES_NAMED]
        if busiest:
            named = "; ".join(f"{line.location} {line.ms_per_step:.1f} ms "
                              f"({SHORT_KIND[line.main_kind]})" for line in busiest)
            return (f"The host's time per step (sampled, {step.step_ms:.1f} ms) goes most to: "
                    f"{named}.")
    ev = stage.evidence
    lines = sorted((line for line in (ev.source_lines if ev is not None else [])
                    if line.host_ms_per_step + line.sync_idle_ms_per_step > 0),
                   key=lambda line: -(line.host_ms_per_step + line.sync_idle_ms_per_step))
    if not lines:
        return ("No line's torch calls take the host's time: it goes to Python or numpy work "
                "between them (data preparation, logging, metrics in the loop).")
    named = "; ".join(
        f"{line.location} {line.host_ms_per_step:.1f} ms"
        + (f" and {line.syncs_per_step:.0f} syncs" if line.syncs_per_step >= 1 else "")
        for line in lines[:MAX_LINES_NAMED])
    return f"The host's time per step in torch calls goes to: {named}."


SYNC_THRESHOLDS = (
    Threshold("min_syncs_per_step", SYNC_MIN,
              "GradScaler's inf check and one logged loss.item() are 1-2 syncs per step; "
              "fewer are named when the script's own line makes them and the GPU idles at "
              "least min_named_idle_share of the step after them"),
    Threshold("min_named_idle_share", SYNC_NAMED,
              "fewer reads than the count, named (at the severity their idle earns) from 1% of "
              "the step on: below it, one logged loss a step is the norm and costs nothing"),
    Threshold("warning_idle_share", SYNC_WARNING,
              "the GPU idles 5% of the step after syncs, waiting for the host to refill its "
              "queue (host time blocked while the GPU works costs nothing)"),
    Threshold("critical_idle_share", SYNC_CRITICAL, "the step mostly idles after syncs"),
    *_loop_thresholds("loop_", severity=False),
)


@rule(
    "GD103", "host-syncs", concern="launch",
    summary="Host-device synchronisations every step (.item(), .cpu(), nonzero, bool(tensor)).",
    why=("A sync drains the GPU's queue: the host stops queueing work ahead and the GPU idles "
         "while the host catches up. One per step is cheap; many per step serialise host and "
         "device."),
    fix=("Keep values on the device (accumulate losses and metrics as tensors, read them every "
         "N steps); replace data-dependent Python control flow with torch.where / masked ops; "
         "avoid .nonzero() and boolean indexing in the step."),
    prices=StepPart("sync"),
    thresholds=SYNC_THRESHOLDS,
    references=("https://pytorch.org/docs/stable/generated/torch.cuda.set_sync_debug_mode.html",),
)
def host_syncs(run: RunResult) -> Iterator[Draft]:
    """At least 4 syncs per step that a Python loop finding does not already account for, or
    fewer from the script's own line that reads back (syncs beyond its host-to-device copies,
    which are GD202's) where the GPU idles at least 1% of the step after them.
    On a CPU run the count is what would block on a GPU, reported as information only."""
    for stage in run.stages_with_evidence():
        ev = stage.evidence
        assert ev is not None
        cuda = ev.backend == "cuda"
        loop = loop_line(stage)
        # On a CPU, operators that would sync on a GPU are counted; library internals (e.g. a
        # single-tensor optimizer's step counters) would not sync there, so only lines that call
        # torch themselves count.
        lines = sorted((s for s in ev.source_lines if s.syncs_per_step > 0 and s is not loop
                        and (cuda or s.direct_calls_per_step > 0)),
                       key=lambda s: s.syncs_per_step, reverse=True)
        remaining = (ev.syncs_per_step - (loop.syncs_per_step if loop else 0.0) if cuda
                     else sum(s.syncs_per_step for s in lines))
        # What syncs cost is the device idle they leave behind, as a share of the profiled step
        # (instrumentation slows the host's refill and the step alike), or the run-ahead they
        # take where that is more (a bound: _run_ahead_share).
        idle = sum(s.sync_idle_ms_per_step for s in lines)
        cost = idle / ev.step_ms if cuda and ev.step_ms else 0.0
        if not lines:
            continue
        step = step_account(stage)
        waits = step.lines_of("sync") if step is not None else []
        lead = _run_ahead_share(stage, waits) if cuda else 0.0
        bound = lead > cost
        cost = max(cost, lead)
        top = lines[0]
        if remaining < SYNC_MIN and not (cuda and _own_reads_seen(top, cost)):
            continue
        # Every line that syncs (the window's count of each), and the time the host samples
        # saw each blocked, where they did.
        every = {c.location: round(c.syncs, 1) for c in ev.line_counts
                 if c.syncs > 0 and (loop is None or c.location != loop.location)} \
            if cuda and ev.line_counts else {s.location: round(s.syncs_per_step, 1)
                                             for s in lines}
        blocked = {line.location: round(line.ms("sync"), 2) for line in waits}
        yield Draft(
            severity=severity_for(cost, warning=SYNC_WARNING, critical=SYNC_CRITICAL,
                                  cap="critical" if cuda else "info"),
            stage=stage.name,
            title=((f"{remaining:.0f} host-device syncs per step cost up to {pct(cost)} of "
                    "the step: the host waits at them, then launches with the GPU idle"
                    if bound else
                    f"{remaining:.0f} host-device syncs per step leave the GPU idle "
                    f"{pct(cost)} of the step" if cuda else
                    f"{remaining:.0f} reads per step that would block the host on a GPU "
                    "(.item(), .nonzero(), ...; none blocks on this CPU)")
                   + f"; most from {top.location} in {top.function}() "
                     f"({top.syncs_per_step:.0f}/step)"),
            location=top.location,
            impact=min(cost, 1.0),
            evidence={"syncs_per_step": round(remaining, 1),
                      "blocked_ms_per_step": round(ev.sync_ms_per_step, 2),
                      "idle_after_syncs_ms_per_step": round(idle, 2),
                      "lines": every,
                      "sampled_blocked_ms_per_step": blocked,
                      "price_is_bound": bound},
            fix=_anomaly_first(stage) + _library_sync(waits) + (
                f"At {top.location}: keep the value on the device instead of reading it back "
                "every step (log every N steps; use torch.where or masks instead of Python "
                "branches on tensors; avoid .item(), .cpu(), .nonzero())."),
        )


def _run_ahead_share(stage: StageResult, waits: list[HostLineTime]) -> float:
    """What syncs cost beyond their own idle, where the host waits at them a share of the
    step while the GPU idles a share: the run-ahead they take. A host that needs nearly the
    device's time to launch a step never gets ahead again, and the GPU starves between
    launches long after the sync's own idle (HF Trainer's NaN check: 1 ms idle after it, 15%
    saved without it on an H200). At most the smaller of the two shares: a bound. Not where
    the step holds collectives: its GPU then idles for the other ranks too (a 2-rank
    DeepSpeed job's rank 0 idled 84% of its step, its syncs held 21%)."""
    ev, step = stage.evidence, step_account(stage)
    if ev is None or step is None or ev.idle_fraction is None or ev.collective_ms_per_step:
        return 0.0
    return min(step.share(sum(line.ms("sync") for line in waits)), ev.idle_fraction)


def _own_reads_seen(top: SourceLine, cost: float) -> bool:
    """Fewer reads than the count are named where the script's own line makes them and the
    GPU measurably idles after them, at the severity their price earns: two `.item()`s of a
    small step cost 15% of it on an H200 (issue 55), or 2-3% (examples/step_reads.py);
    GradScaler's one inf check, a library's, stays below the count. A read, not a copy in:
    syncs beyond the line's host-to-device copies (known only for runs that count them
    apart)."""
    reads = top.syncs_per_step - (top.htod_copies_per_step or 0.0)
    return cost >= SYNC_NAMED and top.direct_calls_per_step > 0 \
        and top.htod_copies_per_step is not None and reads > 0


# Syncs a library makes every step by one of its settings: (its file, a fragment of the
# syncing line's source, the setting that turns it off). Matched on the source, not the line
# number, which moves between versions.
LIBRARY_SYNCS = (
    ("transformers/trainer.py", "isnan(tr_loss_step)",
     "TrainingArguments(..., logging_nan_inf_filter=False): the Trainer reads every step's "
     "loss back to check it for NaN or inf (its default), only to filter what it logs"),
)


def _library_sync(waits: list[HostLineTime]) -> str:
    """The library setting behind the busiest sync the host samples saw, where one is."""
    for line in waits:
        for path, fragment, setting in LIBRARY_SYNCS:
            if line.location.startswith(path + ":") and fragment in line.text:
                return (f"{line.location} (`{line.text.strip()}`) waits "
                        f"{line.ms('sync'):.1f} ms a step: set {setting}. ")
    return ""


def _anomaly_first(stage: StageResult) -> str:
    """Anomaly detection on through the timed steps reads every backward output back to check
    it for NaN: its syncs are the setting's (GD107), not the line's."""
    script = stage.facts.script
    anomaly = next((d for d in (script.debug if script else [])
                    if d.kind == "anomaly-detection" and d.timed_steps_on), None)
    if anomaly is None:
        return ""
    return (f"Anomaly detection ({anomaly.set_by} at {anomaly.site or 'start-up'}) checks "
            "every backward output for NaN, a device-to-host read each: turn it off first "
            "(GD107), then count again. ")


SMALL_MAX_COLLECTIVE_SHARE = 0.3
SMALL_MIN_KERNEL_ACTIVE = 80
SMALL_RECOVERABLE = 0.5


def _larger_batch(run: RunResult, stage: StageResult) -> str:
    batch = stage.samples_per_step or run.config.batch
    return f"a larger batch than {batch}" if batch else "a larger batch"


SMALL_WORK_THRESHOLDS = (
    Threshold("min_kernels_per_step", SMALL_MIN_KERNELS,
              "enough launches for their overhead to add up"),
    Threshold("min_short_kernel_share", SMALL_SHORT_SHARE, "most kernels shorter than 10 us"),
    Threshold("min_idle_fraction", SMALL_IDLE, "the GPU idles between those kernels"),
    Threshold("max_sm_active_pct", SMALL_MAX_SM,
              "GPM SM activity this low while kernels run nearly all the time: too little "
              "work per kernel to fill the SMs"),
    Threshold("max_collective_share", SMALL_MAX_COLLECTIVE_SHARE,
              "... unless collectives hold this share of the device's busy time"),
    Threshold("min_kernel_active_pct", SMALL_MIN_KERNEL_ACTIVE,
              "kernels running this much of the time: the GPU is not starved, each kernel "
              "is small"),
    Threshold("critical_idle_fraction", IDLE_CRITICAL, "short kernels with the GPU this idle"),
    Threshold("recoverable_share", SMALL_RECOVERABLE,
              "of the idle SMs' share, what larger kernels win back at most (a rough bound)"),
    Threshold("optimizer_launch_share", OPTIMIZER_LAUNCH_SHARE,
              "short kernels launched mostly by a per-tensor optimizer are GD106's"),
    *_loop_thresholds("loop_", severity=False),
)


@rule(
    "GD104", "small-work-per-launch", concern="launch",
    summary="Kernels too short or too small to keep the GPU busy (launch-bound, small batch).",
    why=("A kernel launch costs several microseconds of host time; kernels shorter than that "
         "leave the GPU waiting between launches, and kernels too small to fill the SMs leave "
         "most of the chip idle even when NVML says 'utilized'."),
    fix=("Raise the work per kernel: larger batch (or gradient accumulation over a larger "
         "micro-batch), fused ops, torch.compile, CUDA graphs for static shapes."),
    prices=device_time("the GPU idle between short kernels, or underfilled by small ones"),
    thresholds=SMALL_WORK_THRESHOLDS,
)
def small_work_per_launch(run: RunResult) -> Iterator[Draft]:
    """Either many short kernels with the GPU idle between them (not explained by a Python
    loop finding), or kernels running nearly all the time with GPM SM activity under 40%."""
    for stage in run.stages_with_evidence():
        ev = stage.evidence
        assert ev is not None
        if ev.backend != "cuda" or loop_line(stage) is not None:
            continue
        idle = ev.idle_fraction or 0.0
        optimizer = _optimizer_cause(stage)
        short = ev.short_kernels_per_step / ev.kernels_per_step if ev.kernels_per_step else 0.0
        # Short kernels launched mostly by a per-tensor optimizer are GD106's (its knob).
        if (ev.kernels_per_step >= SMALL_MIN_KERNELS and short >= SMALL_SHORT_SHARE
                and idle >= SMALL_IDLE and optimizer is None):
            evidence: dict[str, object] = {
                "kernels_per_step": round(ev.kernels_per_step, 1),
                "short_kernel_share": round(short, 3), "idle_fraction": round(idle, 3),
                "top_ops_by_count": ev.top_ops_by_count[:5]}
            yield Draft(
                severity=severity_for(idle, warning=SMALL_IDLE, critical=IDLE_CRITICAL),
                stage=stage.name,
                title=(f"{ev.kernels_per_step:,.0f} kernels per step, {pct(short)} shorter than "
                       f"10 us, GPU idle {pct(idle)}: launch-bound"),
                impact=idle, evidence=evidence,
                fix=(f"Fuse the small ops and capture the step: {_capture_advice(stage)}; "
                     f"or give each kernel more work: {_larger_batch(run, stage)}."
                     + _headroom(stage, evidence)),
            )
        sm = stage.telemetry.gpm.get("sm_active_pct")
        active = stage.telemetry.kernel_active_pct
        # NCCL kernels occupy a few SMs while they wait for data: kernel-active time with low SM
        # activity is then the all-reduce (the DDP rules' concern), not small kernels.
        collectives = ev.collective_wall_ms_per_step / (ev.device_busy_ms_per_step or math.inf)
        if (sm is not None and active is not None and active >= SMALL_MIN_KERNEL_ACTIVE
                and sm < SMALL_MAX_SM and collectives < SMALL_MAX_COLLECTIVE_SHARE):
            underfilled: dict[str, object] = {
                "kernel_active_pct": active, "sm_active_pct": sm,
                "batch_size": stage.samples_per_step or run.config.batch}
            yield Draft(
                severity="warning", stage=stage.name,
                title=(f"Kernels run {active:.0f}% of the time but keep only {sm:.0f}% of SMs "
                       "busy: too little work per kernel"),
                impact=max(0.0, 1 - sm / 100) * SMALL_RECOVERABLE, evidence=underfilled,
                fix=(f"Increase the batch ({_larger_batch(run, stage)}) or sequence "
                     "length per step, or fuse ops so each kernel does more work."
                     + _headroom(stage, underfilled)),
            )
