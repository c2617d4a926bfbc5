"""GD6xx, the measurement itself: timings too unstable to compare."""

from __future__ import annotations

import statistics
from collections.abc import Iterator

from gpudiag.diagnose.ledger import NoPart
from gpudiag.diagnose.registry import Draft, Threshold, rule
from gpudiag.model.results import RunResult, StageResult

SHIFT_LIMIT = 1.25
MIN_STEPS_FOR_SHIFT = 20


@rule(
    "GD601", "unstable-timing", concern="measurement",
    summary="Step times shifted within a stage: its figures are not one steady measurement.",
    why=("A level shift in step times with steady clocks means something outside the workload "
         "(another process, CPU steal on a shared host, a background job) took the host or GPU "
         "for a while, or, in a compiled script, that torch.compile compiled during the timed "
         "steps. Medians and ratios from such a stage describe that too."),
    fix=("Rerun on a quiet machine, or with --trials N so that comparisons rest on several "
         "fresh processes; look for other jobs on the host (nvidia-smi, top)."),
    prices=NoPart("its findings are about the measurement and price no time"),
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
                or stage.facts.bursty):
            continue
        blocks = [statistics.median(times[i:i + 5]) for i in range(0, len(times) - 4, 5)]
        fast, slow = min(blocks), max(blocks)
        if fast <= 0 or slow / fast <= SHIFT_LIMIT:
            continue
        compiled = _compiled_timed_steps(stage)
        cause = (f"torch.compile compiled on timed step(s) {', '.join(map(str, compiled))}"
                 if compiled else "outside interference")
        yield Draft(
            severity="info", stage=stage.name,
            title=(f"Step times shifted from {_ms(fast)} to {_ms(slow)} ms ({slow / fast:.2f}x) "
                   f"within the stage: {cause}; its figures are not one steady measurement"),
            impact=0.0,
            evidence={"fastest_block_ms": round(fast, 2), "slowest_block_ms": round(slow, 2),
                      "shift": round(slow / fast, 2), "steps": len(times),
                      "sm_clock_mhz_min": stage.telemetry.sm_clock_mhz_min,
                      "compiled_on_steps": compiled},
            fix=(f"Time the steps after the compilations: --warmup {compiled[-1] + 1} or more, "
                 "or remove the recompilations (compile-recompiles' fix)." if compiled else
                 "Rerun on a quiet machine, or with --trials N before comparing this stage."),
        )


def _ms(value: float) -> str:
    """Three significant digits below 100 ms: a 0.1 ms step's shift is not "0.1 to 0.1 ms"."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _compiled_timed_steps(stage: StageResult) -> list[int]:
    """The timed steps of a profiled script on which torch.compile compiled."""
    script = stage.facts.script
    if script is None or script.compiles is None:
        return []
    first, last = script.warmup, script.warmup + len(stage.iter_ms)
    return sorted({e.step for e in script.compiles.events
                   if e.step is not None and first <= e.step < last})
