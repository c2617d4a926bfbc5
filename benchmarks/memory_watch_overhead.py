"""What reading each step's memory costs a step (issue 57: "the per-step counters within 1% of
the plain step"): a small, host-bound training step (the case where a fixed cost per step weighs
most) timed with and without the memory watch's step_ended() at its end (and with each of its
preads alone), step by step in turn in one process (drift and warm caches fall on every side
alike), each step on the host clock after a device sync. Prints one JSON object: each side's
median and mean step and their ratios to the plain step's, each read's own cost per call (the
allocator's counters, the resident set, the children), and the per-step samples.

    python3 benchmarks/memory_watch_overhead.py [--width 256] [--blocks 20] [--steps 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from gpudiag.measure.profile.inscript.watches.memory import MemoryWatch, resident_mib


class _Clock:
    """The step clock the watch reads: its step count, and each step's end on the host clock
    (the watch spaces its costly reads by the steps' length)."""

    def __init__(self) -> None:
        self.steps = 0
        self.host_marks = [time.perf_counter()]


def _each_call(read: Callable[[], object]) -> float:
    """Median microseconds of one `read()`, over 20 x 200 calls."""
    runs = []
    for _ in range(20):
        start = time.perf_counter()
        for _ in range(200):
            read()
        runs.append((time.perf_counter() - start) / 200 * 1e6)
    return statistics.median(runs)


def _parts(watch: MemoryWatch, *, cuda: bool) -> dict[str, float]:
    """What each of step_ended's reads costs apart (step_ended itself spaces the allocator's:
    the A/B above is what a step pays)."""
    parts = {"resident": _each_call(lambda: resident_mib(watch.statm))}
    if watch.child_reader is not None:
        parts["children"] = _each_call(watch.child_reader.resident)
    if cuda:
        parts["allocator"] = _each_call(torch.cuda.memory_stats_as_nested_dict)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=20, help="(with --steps) steps a side: "
                        "blocks x steps")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(4)]
                                ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(32, args.width, device=device)
    clock = _Clock()
    watch = MemoryWatch(clock)  # type: ignore[arg-type]  # a clock of its parts

    # What each step ends with: nothing, one of step_ended's reads alone, or step_ended.
    ends: dict[str, Callable[[], object]] = {
        "plain": lambda: None, "read": watch.step_ended,
        "resident only": lambda: resident_mib(watch.statm)}
    if watch.child_reader is not None:
        ends["children only"] = watch.child_reader.resident

    def step(end: Callable[[], object]) -> float:
        start = time.perf_counter()
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.host_marks.append(time.perf_counter())
        end()  # step_ended's calls: within the timeline's TIMELINE_STEPS (blocks x steps)
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    for _ in range(50):
        step(watch.step_ended)
    samples: dict[str, list[float]] = {side: [] for side in ends}
    for i in range(len(ends) * args.blocks * args.steps):  # round robin, step by step
        side = list(ends)[i % len(ends)]
        samples[side].append(step(ends[side]))

    parts = _parts(watch, cuda=device == "cuda")
    medians = {side: statistics.median(v) for side, v in samples.items()}
    # The mean too: where the reads are spaced (MemoryWatch's stride), few steps pay them.
    means = {side: statistics.fmean(v) for side, v in samples.items()}
    print(json.dumps({
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "median_ms": medians, "ratio": {side: m / medians["plain"] for side, m in medians.items()},
        "mean_ms": means, "ratio_of_means": {side: m / means["plain"] for side, m in means.items()},
        "read_every": watch.read_every,
        "parts_us": parts, "samples_ms": samples}, indent=1))


if __name__ == "__main__":
    main()
