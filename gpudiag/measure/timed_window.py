"""One measuring window: warm-up, timed steps with CUDA events, phases, telemetry and memory,
and the stage result they make.

The ladder's runner and the ddp stage's ranks drive their step function through
`measure_window`; `gpudiag profile`'s recorder, where the user's script drives the steps, builds
a `Window` from its own step marks. All three turn it into a stage result with `fill_timed`, so
a stage's timings mean the same whoever measured them. The evidence window (profiler) follows
separately, never among the timed steps (see measure/evidence/profiler_window.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gpudiag.measure.interrupts import Stopped
from gpudiag.measure.telemetry import Sampler
from gpudiag.measure.timing import EarlyEnd, PhaseRecorder, synchronize, time_steps
from gpudiag.model.results import MemoryStats, StageResult, TelemetrySummary

_MIB = 2**20


@dataclass
class Window:
    """What one measuring window recorded."""

    warmup_ms: list[float]
    iter_ms: list[float]
    timer: str  # "cuda-events" or "host-clock"
    telemetry: TelemetrySummary = field(
        default_factory=lambda: TelemetrySummary.unavailable("not measured"))
    phases_ms: dict[str, list[float]] = field(default_factory=dict)
    memory: MemoryStats | None = None
    wall_s: float | None = None


def measure_window(
    step: Callable[[], object],
    *,
    device: torch.device,
    sampler: Sampler,
    phases: PhaseRecorder,
    label: str,
    warmup: int,
    iters: int | Callable[[list[float]], int],
    min_seconds: float = 0.0,
    early: EarlyEnd | None = None,
    host_only: bool = False,
    on_step: Callable[[int], None] | None = None,
    on_timed_start: Callable[[], None] = lambda: None,
) -> Window:
    """Warm up, then time at least `iters` steps (a callable decides from the warm-up times:
    the ddp ranks agree on one count) and `min_seconds`, fewer once `early` allows it, under
    `sampler`'s telemetry window.
    `on_step` hears the running count, warm-up included. Peak memory covers both."""
    # Its worker came up while the stage was built; the warm-up after it brings the device
    # back from any idle the wait left.
    sampler.wait_ready()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    phases.clear()
    warm = time_steps(step, device=device, iters=warmup, host_only=host_only,
                      label=f"{label} warm-up", on_step=on_step)
    count = iters(warm.iter_ms) if callable(iters) else iters
    synchronize(device)
    phases.clear()
    on_timed_start()
    sampler.begin(label)
    stopped: Stopped | None = None
    try:
        timed = time_steps(
            step, device=device, iters=count, min_seconds=min_seconds, early=early,
            host_only=host_only,
            label=label, on_step=None if on_step is None else lambda d: on_step(warmup + d))
    except Stopped as exc:
        stopped, timed = exc, exc.partial
    finally:
        synchronize(device)
        telemetry = sampler.end()
    phase_ms = phases.collect()
    if stopped is not None:  # phases of a step cut short would not line up with its steps
        phase_ms = {k: v[:len(timed.iter_ms)] for k, v in phase_ms.items()}
    window = Window(warmup_ms=warm.iter_ms, iter_ms=timed.iter_ms, timer=timed.timer,
                    telemetry=telemetry, phases_ms=phase_ms, memory=peak_memory(device),
                    wall_s=timed.wall_s)
    phases.clear()
    if stopped is not None:
        raise Stopped(stopped.signum, window) from stopped
    return window


def peak_memory(device: torch.device) -> MemoryStats | None:
    if device.type != "cuda":
        return None
    return MemoryStats(
        peak_allocated_mib=torch.cuda.max_memory_allocated(device) / _MIB,
        peak_reserved_mib=torch.cuda.max_memory_reserved(device) / _MIB,
        device_total_mib=torch.cuda.get_device_properties(device).total_memory / _MIB,
    )


def fill_timed(result: StageResult, window: Window, *, samples_per_step: int | None,
               tokens_per_step: int | None = None) -> StageResult:
    """Put the window's timings on `result`: per-step times (the stage's time per step,
    throughput and timing summary follow from them), what a step holds, telemetry, phases and
    memory."""
    if not window.iter_ms:
        raise ValueError("no iteration times to summarise")
    result.iter_ms, result.warmup_ms = window.iter_ms, window.warmup_ms
    result.timer, result.wall_s = window.timer, window.wall_s
    result.telemetry, result.phases_ms, result.memory = (window.telemetry, window.phases_ms,
                                                         window.memory)
    result.samples_per_step, result.tokens_per_step = samples_per_step, tokens_per_step
    return result
