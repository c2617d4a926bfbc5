"""The device itself: memory pressure, allocator churn, clock throttling."""

from __future__ import annotations

import statistics
from collections.abc import Iterator

from gpudiag.results import RunResult
from gpudiag.rules.common import pct
from gpudiag.rules.registry import Draft, Threshold, rule, severity_for

THERMAL_REASONS = ("sw_thermal", "hw_thermal", "hw_slowdown", "power_brake")
RESERVED_WARNING, FRAGMENTATION = 0.90, 0.20
MIN_FREES = 0.5
THERMAL_WARNING, THERMAL_CRITICAL, POWER_CAP_INFO = 0.10, 0.50, 0.50
# Clock loss while thermally throttled, for ranking only: NVML gives no boost clock to compare.
THROTTLED_SLOWDOWN = 0.2


@rule(
    "GD401", "memory-near-capacity", concern="memory",
    summary="Peak reserved device memory close to the GPU's capacity.",
    why=("Near capacity the caching allocator starts freeing and retrying, fragmentation turns "
         "into out-of-memory errors, and a slightly longer sequence fails."),
    fix=("Free large temporaries early (in-place ops where autograd allows, del), fuse the "
         "vocabulary-sized tensors, gradient checkpointing, or a smaller micro-batch with "
         "gradient accumulation; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against "
         "fragmentation."),
    thresholds=(Threshold("warning_reserved_share", RESERVED_WARNING,
                          "90% of device memory reserved"),
                Threshold("fragmentation_share", FRAGMENTATION,
                          "reserved exceeds allocated by 20% of the device")),
)
def memory_near_capacity(run: RunResult) -> Iterator[Draft]:
    """Peak reserved at least 90% of the device (warning); reserved exceeding allocated by 20%
    of the device (information: fragmentation)."""
    for stage in run.ok_stages():
        mem = stage.memory
        if mem is None or not mem.device_total_mib:
            continue
        reserved = mem.peak_reserved_mib / mem.device_total_mib
        slack = (mem.peak_reserved_mib - mem.peak_allocated_mib) / mem.device_total_mib
        evidence = {"peak_allocated_mib": round(mem.peak_allocated_mib),
                    "peak_reserved_mib": round(mem.peak_reserved_mib),
                    "device_total_mib": round(mem.device_total_mib)}
        if reserved >= RESERVED_WARNING:
            yield Draft(severity="warning", stage=stage.name,
                        title=f"Peak reserved memory is {pct(reserved)} of the GPU",
                        impact=0.0, evidence=evidence,
                        fix=("Shrink the largest temporaries or the micro-batch (gradient "
                             "accumulation keeps the effective batch)."))
        elif slack >= FRAGMENTATION:
            yield Draft(severity="info", stage=stage.name,
                        title=f"Allocator holds {pct(slack)} of the GPU more than it uses",
                        impact=0.0, evidence=evidence,
                        fix="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces "
                            "fragmentation from varying tensor sizes.")


@rule(
    "GD402", "empty-cache-in-loop", concern="memory",
    summary="torch.cuda.empty_cache() (memory handed back to the driver) every step.",
    why=("empty_cache frees the caching allocator's blocks with cudaFree, which synchronises "
         "the device; the next step allocates them again with cudaMalloc."),
    fix="Remove torch.cuda.empty_cache() from the training loop (keep it, at most, between "
        "phases such as training and evaluation).",
    thresholds=(Threshold("min_frees_per_step", MIN_FREES,
                          "blocks freed in at least every other step"),),
    references=("SEEDS.md sections 3 and 5",),
)
def empty_cache_in_loop(run: RunResult) -> Iterator[Draft]:
    """cudaFree calls in the profiled steps: at least one every other step."""
    for stage in run.stages_with_evidence():
        ev = stage.evidence
        assert ev is not None
        if ev.empty_cache_per_step < MIN_FREES:
            continue
        yield Draft(
            severity="warning", stage=stage.name,
            title=f"{ev.empty_cache_per_step:.1f} cudaFree calls per step: allocator churn",
            impact=(min(1.0, ev.empty_cache_ms_per_step / stage.ms_per_iter)
                    if stage.ms_per_iter else 0.0),
            evidence={"frees_per_step": round(ev.empty_cache_per_step, 2),
                      "free_ms_per_step": round(ev.empty_cache_ms_per_step, 2)},
            fix="Delete the torch.cuda.empty_cache() call from the step.",
        )


@rule(
    "GD501", "clock-throttling", concern="clocks",
    summary="The GPU lowered its clocks during a stage (heat, or its power limit).",
    why=("Thermal or hardware slowdown makes timings depend on the room, not the code; a power "
         "cap means the stage is compute-bound and draws all the power it may."),
    fix=("Thermal: check cooling and airflow, and do not compare timings across throttled runs. "
         "Power cap: the GPU is saturated; only less work (lower precision, smaller model) "
         "makes it faster."),
    thresholds=(Threshold("thermal_share", THERMAL_WARNING, "thermal reasons in 10% of samples"),
                Threshold("power_cap_share", POWER_CAP_INFO, "power cap in half of the samples")),
)
def clock_throttling(run: RunResult) -> Iterator[Draft]:
    """Thermal/hardware slowdown in 10%+ of a stage's samples (warning); power cap in half of
    them (information: the stage is compute-bound)."""
    for stage in run.ok_stages():
        shares = stage.telemetry.throttle_share
        thermal = max((shares.get(r, 0.0) for r in THERMAL_REASONS), default=0.0)
        evidence = {"throttle_share": shares, "sm_clock_mhz_min": stage.telemetry.sm_clock_mhz_min,
                    "sm_clock_mhz_mean": stage.telemetry.sm_clock_mhz_mean,
                    "temperature_max_c": stage.telemetry.temperature_max_c}
        if thermal >= THERMAL_WARNING:
            yield Draft(severity=severity_for(thermal, warning=THERMAL_WARNING,
                                              critical=THERMAL_CRITICAL),
                        stage=stage.name,
                        title=f"Thermal/hardware clock slowdown in {pct(thermal)} of samples",
                        impact=thermal * THROTTLED_SLOWDOWN, evidence=evidence,
                        fix=("Fix cooling before trusting these timings; compare only "
                             "unthrottled runs."))
        elif shares.get("power_cap", 0.0) >= POWER_CAP_INFO:
            yield Draft(severity="info", stage=stage.name,
                        title=(f"At the power limit in {pct(shares['power_cap'])} of samples: "
                               "compute-bound"),
                        impact=0.0, evidence=evidence,
                        fix="Saturated: speed now comes from doing less work (precision, fusion).")


SHIFT_LIMIT = 1.25
MIN_STEPS_FOR_SHIFT = 20


@rule(
    "GD601", "unstable-timing", concern="measurement",
    summary="Step times shifted within a stage: its figures are not one steady measurement.",
    why=("A level shift in step times with steady clocks means something outside the workload "
         "(another process, CPU steal on a shared host, a background job) took the host or GPU "
         "for a while. Medians and ratios from such a stage describe the interference too."),
    fix=("Rerun on a quiet machine, or with --trials N so that comparisons rest on several "
         "fresh processes; look for other jobs on the host (nvidia-smi, top)."),
    thresholds=(Threshold("max_block_shift", SHIFT_LIMIT,
                          "the slowest block of 5 steps' median over the fastest's"),
                Threshold("min_steps", MIN_STEPS_FOR_SHIFT, "enough steps to form blocks")),
)
def unstable_timing(run: RunResult) -> Iterator[Draft]:
    """Blocks of 5 consecutive timed steps whose medians differ by more than 25%, in a stage of
    at least 20 steps whose clocks did not throttle (throttling has its own rule) and whose
    steps are not bursty by nature (a prefetching DataLoader). Information: it is about the
    measurement, not time the code loses; compare and gate read it through their intervals."""
    for stage in run.ok_stages():
        times = stage.iter_ms
        if (len(times) < MIN_STEPS_FOR_SHIFT or stage.telemetry.throttle_share.get("hw_thermal")
                or stage.details.get("ms_per_iter_statistic") == "mean"):
            continue
        blocks = [statistics.median(times[i:i + 5]) for i in range(0, len(times) - 4, 5)]
        fast, slow = min(blocks), max(blocks)
        if fast <= 0 or slow / fast <= SHIFT_LIMIT:
            continue
        yield Draft(
            severity="info", stage=stage.name,
            title=(f"Step times shifted from {fast:.1f} to {slow:.1f} ms within the stage: "
                   "outside interference; its figures are not one steady measurement"),
            impact=0.0,
            evidence={"fastest_block_ms": round(fast, 2), "slowest_block_ms": round(slow, 2),
                      "shift": round(slow / fast, 2), "steps": len(times),
                      "sm_clock_mhz_min": stage.telemetry.sm_clock_mhz_min},
            fix="Rerun on a quiet machine, or with --trials N before comparing this stage.",
        )
