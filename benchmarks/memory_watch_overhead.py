"""What reading each step's memory costs a step (issue 57: "the per-step counters within 1% of
the plain step"): a small, host-bound training step (the case where a fixed cost per step weighs
most) timed with and without the memory watch's step_ended() at its end, in alternating blocks
in one process (ABAB), each step on the host clock after a device sync. Prints one JSON object:
each side's median step, the ratio of the medians, the watch's own cost per call, and the
per-step samples.

    python3 benchmarks/memory_watch_overhead.py [--width 256] [--blocks 20] [--steps 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gpudiag.measure.profile.inscript.watches.memory import MemoryWatch


class _Clock:
    """The step clock the watch reads: its step count only."""

    steps = 0
    host_marks = (0.0,)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=20, help="alternating blocks a side")
    parser.add_argument("--steps", type=int, default=50, help="steps a block")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(4)]
                                ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(32, args.width, device=device)
    watch = MemoryWatch(_Clock())

    def step(read: bool) -> float:
        start = time.perf_counter()
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if read:
            watch.step_ended()
            del watch.resident[:]  # the timeline's cap would stop the reads (TIMELINE_STEPS)
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    for _ in range(50):
        step(read=True)
    samples: dict[str, list[float]] = {"plain": [], "read": []}
    for block in range(2 * args.blocks):
        side = "plain" if block % 2 == 0 else "read"
        samples[side] += [step(read=side == "read") for _ in range(args.steps)]
    calls = []
    for _ in range(20):
        start = time.perf_counter()
        for _ in range(200):
            watch.step_ended()
            del watch.resident[:]
        calls.append((time.perf_counter() - start) / 200 * 1e6)
    medians = {side: statistics.median(v) for side, v in samples.items()}
    print(json.dumps({
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "median_ms": medians, "ratio": medians["read"] / medians["plain"],
        "step_ended_us": statistics.median(calls), "samples_ms": samples}, indent=1))


if __name__ == "__main__":
    main()
