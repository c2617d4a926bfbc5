"""What the whole-run step timeline and the host sampler cost a training step.

One process runs the same training step in blocks, interleaved: plain; with the profile
recorder's step bookkeeping (its step boundary every step: host mark, CUDA event, NVTX range:
the timeline) and no host sampler; with the host sampler at its default rate (or --hz); and
with it at 10 and 50 times that rate. Each block is timed on the host clock between two device
syncs; the ratio of a variant's mean step time to the plain one's comes with a bootstrap 95%
interval over rounds. The process is pinned to a few cores and its garbage collector run
before each block, so that core migrations and collections do not swamp a 1% effect.

A host-bound step's own time varies by 10-25% from block to block on an H100 host, more than a
1% effect: the amplified rates carry the measurement there (the cost at the default rate is
the amplified cost over the amplification, read to a fiftieth of the noise). Four steps:
~2 ms of per-sample numpy and Python (the training thread holds the GIL nearly all the step),
~2 ms of many small kernels (launch-bound), ~4 ms of mid-size matmuls, ~100 ms of large
matmuls (device-bound). First, the stall each sample causes a pure-Python loop, for samples
taken by the timer signal (the default) and by a sampling thread (the fallback).

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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gpudiag.measure.profile.hostsampler import Clock, HostSampler
from gpudiag.measure.profile.recorder import Recorder
from gpudiag.model.config import HOST_SAMPLE_HZ, ProfileConfig

BOOTSTRAP = 2000
# The amplified sampler's rates, in multiples of the default: at 50x (5 kHz) the samples
# cost a 2 ms step tens of percent, well above the host's block-to-block noise, and the cost
# per sample, so at the default rate, is read to a fiftieth of that noise.
AMPLIFY = (10.0, 50.0)
STALL_GAP_S = 5e-6  # a gap this long between two iterations of a tight loop is a stall


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


def python_and_numpy(device: torch.device, target_ms: float) -> Callable[[], None]:
    """A host-bound step: per-sample numpy and Python on the training thread (it holds the
    GIL nearly all the step), then a small device step on the batch."""
    rng = np.random.default_rng(0)
    images = rng.random((16, 16, 16, 3), dtype=np.float32)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16 * 16 * 3, 64), nn.ReLU(),
                          nn.Linear(64, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def once() -> None:
        batch = np.stack([np.rot90(image, k=k % 4) - image.mean() for k, image in
                          enumerate(images)])
        x = torch.from_numpy(batch).to(device)
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
              scratch: Path) -> tuple[float, float]:
    """Mean ms per step over one block, and host samples taken per step; `hz` None: plain,
    else recorded with that rate."""
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
    taken = 0
    if recorder is not None and recorder.host_sampler is not None:
        sampler = recorder.host_sampler
        taken = sampler.stop().samples
    return elapsed, taken / (steps + 1)  # (sampling starts at the second boundary)


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
    """Plain, timeline, sampler at `hz`, and sampler at each AMPLIFY x `hz`: an amplified
    rate makes the per-sample cost stand well above the step's own noise, which hides it at
    `hz`; the cost at `hz` is then the amplified one over the amplification."""
    variants: dict[str, float | None] = {"plain": None, "timeline": 0.0, "sampler": hz}
    variants.update({f"sampler_x{k:g}": k * hz for k in AMPLIFY})
    samples: dict[str, list[float]] = {v: [] for v in variants}
    taken: dict[str, list[float]] = {v: [] for v in variants}
    order = list(variants)
    for k in range(rounds):
        # Rotate which variant goes first, so drift favours none.
        for v in order[k % len(order):] + order[:k % len(order)]:
            gc.collect()
            ms, per_step = run_block(step, steps, device, variants[v], scratch)
            samples[v].append(ms)
            taken[v].append(per_step)
    per_step = {v: statistics.fmean(taken[v]) for v in variants}
    result: dict[str, object] = {"step": name, "steps_per_block": steps, "rounds": rounds,
                                 "hz": hz, "ms_per_step": samples,
                                 "samples_per_step": per_step}
    for v in order[1:]:
        ratio, low, high = ratio_interval(samples[v], samples["plain"])
        result[f"{v}_ratio"] = {"mean_ratio": ratio, "ci95": [low, high]}
        print(f"{name}: {v} / plain = {ratio:.4f} (95% CI {low:.4f}-{high:.4f}; plain "
              f"{statistics.fmean(samples['plain']):.3f} ms/step)", flush=True)
    # What each sample costs the step, from an amplified rate over the timeline alone, and
    # what that makes the default rate cost: scaled by the samples each actually took per
    # step (at a high rate the timer's periods merge while a sample is being taken).
    for k in AMPLIFY:
        ratio, low, high = ratio_interval(samples[f"sampler_x{k:g}"], samples["timeline"])
        scale = per_step["sampler"] / max(per_step[f"sampler_x{k:g}"], 1e-9)
        implied = [1 + (r - 1) * scale for r in (ratio, low, high)]
        result[f"implied_by_x{k:g}"] = {"mean_ratio": implied[0], "ci95": implied[1:]}
        print(f"{name}: implied by x{k:g}: sampler at {hz:g} Hz / timeline = {implied[0]:.4f}"
              f" (95% CI {implied[1]:.4f}-{implied[2]:.4f})", flush=True)
    return result


def stalls(seconds: float, hz: float, clock: Clock, windows: int = 8) -> dict[str, object]:
    """The training thread's stall per sample, directly: a pure-Python loop (it holds the GIL
    all the time, a sampling thread's worst case) notes every gap between its iterations over
    STALL_GAP_S; the sampler (taking samples by `clock`) is on in alternate windows of
    `seconds`. The extra stalled time per sample taken, times the rate, is what the sampler
    costs a GIL-bound step."""
    marks = [time.perf_counter()]
    on_stalled, off_stalled, taken = 0.0, 0.0, 0
    for k in range(2 * windows):
        sampler = None
        if k % 2 == 0:
            sampler = HostSampler(marks, thread_id=threading.get_ident(), loop_code=None,
                                  cuda=False, warmup=0, skip=(), max_steps=10**9,
                                  period_s=1 / hz, clock=clock)
            sampler.start()
        gc.collect()
        stalled = 0.0
        previous = start = time.perf_counter()
        while previous - start < seconds:
            now = time.perf_counter()
            if now - previous > STALL_GAP_S:
                stalled += now - previous
            previous = now
            sum(range(20))
        if sampler is not None:
            # A sampling thread takes the GIL at every wake-up, keeping a sample or not.
            taken += sampler.stop().samples if clock == "signal" else round(seconds * hz)
            on_stalled += stalled
        else:
            off_stalled += stalled
    per_sample_us = (on_stalled - off_stalled) / max(1, taken) * 1e6
    result = {"method": "stalls of a GIL-bound loop", "clock": clock,
              "seconds_per_window": seconds, "windows": windows, "hz": hz,
              "stalled_on_s": on_stalled, "stalled_off_s": off_stalled, "samples": taken,
              "stall_per_sample_us": per_sample_us,
              "overhead_at_hz": per_sample_us * 1e-6 * hz}
    print(f"GIL-bound loop, samples by {clock}: {per_sample_us:.1f} us stalled per sample: "
          f"{per_sample_us * 1e-6 * hz:.2%} of its time at {hz:g} Hz "
          f"(stalled {on_stalled:.3f} s with, {off_stalled:.3f} s without)", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
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
    for clock in ("signal", "thread"):
        report["results"].append(stalls(0.5 if args.quick else 2.0, args.hz, clock))
    with tempfile.TemporaryDirectory() as tmp:
        blocks = [("2 ms, Python and numpy (host-bound)", python_and_numpy(device, 2.0), 200),
                  ("2 ms, small kernels (launch-bound)", small_kernels(device, 2.0), 200),
                  ("4 ms, matmuls (device-bound)", large_matmuls(device, 4.0, width=2048), 50),
                  ("100 ms, large matmuls (device-bound)", large_matmuls(device, 100.0), 4)]
        for name, step, steps in blocks:
            report["results"].append(measure(name, step, steps, rounds, device, args.hz,
                                             Path(tmp)))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
