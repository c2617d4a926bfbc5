"""Activation checkpointing measured by a plain timer, independent of gpudiag (issue 57): the
field's "-30-50% memory for +20-30% time" on examples/deep_activations.py, checkpointed and not,
in alternating blocks of steps in one process (ABAB: a drifting clock shows in both), each
step timed with CUDA events, each block's peak from the allocator's own max_memory_allocated
(reset before the block). Prints one JSON object: per-step samples, medians, the ratio of the
medians, and each side's peak allocated and reserved (the figures gpudiag's --try-fixes row for
the same script must agree with).

    python3 benchmarks/checkpointing_ab.py [--blocks 6] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from example_module import load_example


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6, help="alternating blocks a side")
    parser.add_argument("--steps", type=int, default=8, help="timed steps a block")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("checkpointing_ab: needs a CUDA device (the allocator's peak is the figure)")
    example = load_example("deep_activations")
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("high")
    model = example.Model().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(example.TOKENS, example.WIDTH, device="cuda")
    target = torch.randn(example.TOKENS, 1, device="cuda")

    def step() -> None:
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    samples: dict[str, list[float]] = {"plain": [], "checkpointed": []}
    peaks: dict[str, list[float]] = {"plain": [], "checkpointed": []}
    reserved: dict[str, list[float]] = {"plain": [], "checkpointed": []}
    for block in range(2 * args.blocks):
        side = "plain" if block % 2 == 0 else "checkpointed"
        example.CHECKPOINT = side == "checkpointed"
        step()  # the side's first step after a switch: not timed
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(args.steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            samples[side].append(start.elapsed_time(end))
        peaks[side].append(torch.cuda.max_memory_allocated() / 2**20)
        reserved[side].append(torch.cuda.max_memory_reserved() / 2**20)
    medians = {side: statistics.median(v) for side, v in samples.items()}
    print(json.dumps({
        "device": torch.cuda.get_device_name(),
        "shape": {"tokens": example.TOKENS, "width": example.WIDTH, "blocks": example.BLOCKS},
        "median_ms": medians,
        "time_ratio": medians["checkpointed"] / medians["plain"],
        "peak_allocated_mib": {side: max(v) for side, v in peaks.items()},
        "peak_reserved_mib": {side: max(v) for side, v in reserved.items()},
        "memory_ratio": max(peaks["checkpointed"]) / max(peaks["plain"]),
        "samples_ms": samples,
    }, indent=1))


if __name__ == "__main__":
    main()
