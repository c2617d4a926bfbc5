"""A larger batch measured by a plain timer, independent of gpudiag (issue 57): the same model
and data as examples/small_batch.py, its steps at batch 8 and at batch 64 in alternating blocks
in one process (ABAB), each step timed on the host clock from fetching the DataLoader's batch
to the optimizer's step and a device sync (the loop's own pace: a host-bound step is the case);
samples per second from each side's median step, and each side's peak from
the allocator's max_memory_allocated. The figures gpudiag's --try-fixes row (larger-batch)
must agree with.

    python3 benchmarks/batch_ab.py [--small 8] [--large 64] [--blocks 6] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from example_module import load_example
from torch.utils.data import DataLoader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=8)
    parser.add_argument("--large", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=6, help="alternating blocks a side")
    parser.add_argument("--steps", type=int, default=30, help="timed steps a block")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("batch_ab: needs a CUDA device")
    torch.manual_seed(0)
    model, data = load_example("small_batch").build("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = {size: iter(DataLoader(data, batch_size=size, shuffle=True, drop_last=True))
               for size in (args.small, args.large)}

    def step(size: int) -> float:
        start = time.perf_counter()
        tokens, labels = next(batches[size])
        loss = torch.nn.functional.cross_entropy(model(tokens.cuda()), labels.cuda())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    samples: dict[int, list[float]] = {args.small: [], args.large: []}
    peaks: dict[int, float] = {}
    for block in range(2 * args.blocks):
        size = args.small if block % 2 == 0 else args.large
        step(size)  # the first step after a switch: not timed
        torch.cuda.reset_peak_memory_stats()
        samples[size] += [step(size) for _ in range(args.steps)]
        peaks[size] = max(peaks.get(size, 0.0), torch.cuda.max_memory_allocated() / 2**20)
    medians = {size: statistics.median(v) for size, v in samples.items()}
    rates = {size: 1e3 * size / ms for size, ms in medians.items()}
    print(json.dumps({
        "device": torch.cuda.get_device_name(), "median_ms": medians,
        "samples_per_s": rates, "samples_per_s_ratio": rates[args.large] / rates[args.small],
        "peak_allocated_mib": peaks, "samples_ms": samples}, indent=1))


if __name__ == "__main__":
    main()
