"""What the whole-run step timeline and the host sampler cost a training step.

One process runs the same training step in blocks, interleaved: plain; with the profile
recorder's step bookkeeping (its step boundary every step: host mark, CUDA event, NVTX range:
the timeline) and no host sampler; and with the host sampler at its default rate (or
--hz). Each block is timed on the host clock between two device syncs; each variant's block
is divided by the plain block of its round, and the ratio of the variants' mean step times
comes with a bootstrap 95% interval over rounds. The process is pinned to a few cores and its
garbage collector run before each block, so that core migrations and collections do not
swamp a 1% effect. Three steps: ~2 ms of many small kernels (the host holds the GIL most of
the step: the sampler's worst case), ~2 ms of mid-size matmuls, ~100 ms of large matmuls.

    python benchmarks/host_sampler.py --out host_sampler.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpudiag.measure.profile.recorder import Recorder
from gpudiag.model.config import HOST_SAMPLE_HZ, ProfileConfig

BOOTSTRAP = 2000


def small_kernels(device: torch.device, target_ms: float) -> Callable[[], None]:
    """A launch-bound step: a deep narrow MLP, forward, backward, SGD."""
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64, device=device)

    def once() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _repeat_to(once, device, target_ms)


def large_matmuls(device: torch.device, target_ms: float, width: int = 8192
                  ) -> Callable[[], None]:
    """A device-bound step: matmuls, forward and backward."""
    width = width if device.type == "cuda" else 512
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(2048 if device.type == "cuda" else 64, width, device=device)

    def once() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _repeat_to(once, device, target_ms)


def _repeat_to(once: Callable[[], None], device: torch.device,
               target_ms: float) -> Callable[[], None]:
    """`once` repeated to take about `target_ms` per step."""
    for _ in range(3):
        once()
    _sync(device)
    start = time.perf_counter()
    for _ in range(5):
        once()
    _sync(device)
    each = (time.perf_counter() - start) * 1e3 / 5
    times = max(1, round(target_ms / each))

    def step() -> None:
        for _ in range(times):
            once()

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_block(step: Callable[[], None], steps: int, device: torch.device, hz: float | None,
              scratch: Path) -> float:
    """Mean ms per step over one block; `hz` None: plain, else recorded with that rate."""
    recorder = None
    if hz is not None:
        config = ProfileConfig(warmup=0, timed=10**9, evidence_steps=0, telemetry="off",
                               host_sample_hz=hz)
        recorder = Recorder(scratch, config)
        for _ in range(3):  # the sampler starts at the second boundary: before timing
            step()
            recorder.boundary()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
        if recorder is not None:
            recorder.boundary()
    _sync(device)
    elapsed = (time.perf_counter() - start) * 1e3 / steps
    if recorder is not None and recorder.host_sampler is not None:
        recorder.host_sampler.stop()
    return elapsed


def ratio_interval(variant: list[float], plain: list[float]) -> tuple[float, float, float]:
    """mean(variant) / mean(plain), and its bootstrap 95% interval over rounds."""
    rng = random.Random(0)
    rounds = range(len(plain))
    ratios = []
    for _ in range(BOOTSTRAP):
        picked = rng.choices(rounds, k=len(plain))
        ratios.append(sum(variant[i] for i in picked) / sum(plain[i] for i in picked))
    ratios.sort()
    return (statistics.fmean(variant) / statistics.fmean(plain),
            ratios[int(0.025 * BOOTSTRAP)], ratios[int(0.975 * BOOTSTRAP) - 1])


def measure(name: str, step: Callable[[], None], steps: int, rounds: int,
            device: torch.device, hz: float, scratch: Path) -> dict[str, object]:
    variants: dict[str, float | None] = {"plain": None, "timeline": 0.0, "sampler": hz}
    samples: dict[str, list[float]] = {v: [] for v in variants}
    order = list(variants)
    for k in range(rounds):
        # Rotate which variant goes first, so drift favours none.
        for v in order[k % 3:] + order[:k % 3]:
            gc.collect()
            samples[v].append(run_block(step, steps, device, variants[v], scratch))
    result: dict[str, object] = {"step": name, "steps_per_block": steps, "rounds": rounds,
                                 "hz": hz, "ms_per_step": samples}
    for v in ("timeline", "sampler"):
        ratio, low, high = ratio_interval(samples[v], samples["plain"])
        result[f"{v}_ratio"] = {"mean_ratio": ratio, "ci95": [low, high]}
        print(f"{name}: {v} / plain = {ratio:.4f} (95% CI {low:.4f}-{high:.4f}; plain "
              f"{statistics.fmean(samples['plain']):.3f} ms/step)", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--hz", type=float, default=HOST_SAMPLE_HZ)
    parser.add_argument("--cores", type=int, default=4, help="pin to this many cores (0: not)")
    parser.add_argument("--quick", action="store_true", help="a few rounds (a smoke test)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.cores and hasattr(os, "sched_setaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, allowed[-args.cores:])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rounds = 3 if args.quick else args.rounds
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda"
                              else "cpu", "torch": torch.__version__,
                              "python": sys.version.split()[0], "rounds": rounds,
                              "cores": sorted(os.sched_getaffinity(0))
                              if hasattr(os, "sched_getaffinity") else None, "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        cases = [("2 ms, small kernels (host-bound)", small_kernels(device, 2.0), 50),
                 ("2 ms, matmuls (device-bound)", large_matmuls(device, 2.0, width=2048), 50),
                 ("100 ms, large matmuls (device-bound)", large_matmuls(device, 100.0), 4)]
        for name, step, steps in cases:
            report["results"].append(measure(name, step, steps, rounds, device, args.hz,
                                             Path(tmp)))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
