"""What the whole-run step timeline and the host sampler cost a training step.

One process runs the same training step in short blocks side by side, in a new random order
every round: plain; with the profile recorder's step bookkeeping (its step boundary every
step past the timed window: host mark, NVTX range: the timeline) and no host sampler; with the host
sampler at its default rate (or --hz); and with it at 10 times that rate (what one sample
costs, well above the noise). Each block is timed on the host clock between two device syncs;
the median over rounds of the ratio of a variant's block to its base's comes with a
bootstrap 95% interval. The process is pinned to a few cores and its garbage collector run
before each block, so that core migrations and collections do not swamp a 1% effect.

A host-bound step's speed drifts by several percent over seconds on a shared host, far more
than a 1% effect; blocks of ~50 ms a few tenths of a second apart share that drift, so
hundreds of rounds of them read the sampler's cost at its own rate, directly. Four steps:
~2 ms of per-sample numpy and Python (the training thread holds the GIL nearly all the step),
~2 ms of many small kernels (launch-bound), ~4 ms of mid-size matmuls, ~100 ms of large
matmuls (device-bound). First, the stall each sample causes a pure-Python loop, for samples
taken by the timer signal (the default) and by a sampling thread (the fallback).

    python benchmarks/host_sampler.py --out host_sampler.json

--handler times one sample from inside the training thread: the timer signal's handler, and
within it the filing of the steps ended since the previous sample and the stack's
classification, on ~2 ms steps of a small model (a module's forward, backward, SGD, Python
work, a read-back) sampled at --hz, for --seconds.

    python benchmarks/host_sampler.py --handler --seconds 20
"""

from __future__ import annotations

import argparse
import functools
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
# The amplified sampler's rate, in multiples of the default: what one sample costs, read well
# above the noise (the default rate's cost is measured directly).
AMPLIFY = 10.0
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
    each = _time_step(once, device, 5)
    times = max(1, round(target_ms / each))

    def step() -> None:
        for _ in range(times):
            once()

    return step


def _time_step(step: Callable[[], None], device: torch.device, times: int = 3) -> float:
    """Mean ms of `step`, warm."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(times):
        step()
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_block(step: Callable[[], None], steps: int, device: torch.device, hz: float | None,
              scratch: Path) -> tuple[float, float]:
    """Mean ms per step over one block, and host samples taken per step; `hz` None: plain,
    else recorded with that rate (0: the recorder's step bookkeeping alone)."""
    recorder = None
    if hz is not None:
        # Past the timed window, as most of a run's steps are: no CUDA event per step (the 30
        # timed steps carry one each, ~12 us of host time on an H100 host).
        config = ProfileConfig(warmup=0, timed=0, evidence_steps=0, telemetry="off",
                               host_sample_hz=hz)
        recorder = Recorder(scratch, config)
        for _ in range(3):  # the sampler starts at the second boundary: before timing
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
        taken = recorder.host_sampler.stop().samples
    return elapsed, taken / steps


def ratio_interval(variant: list[float], base: list[float]) -> tuple[float, float, float]:
    """The median over rounds of variant / base (the two blocks of one round ran side by
    side), and its bootstrap 95% interval: a block hit by an outside interruption (the host's
    other tenants, a core migration) moves one round, not the figure."""
    ratios = [v / b for v, b in zip(variant, base, strict=True)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(BOOTSTRAP))
    return (statistics.median(ratios), medians[int(0.025 * BOOTSTRAP)],
            medians[int(0.975 * BOOTSTRAP) - 1])


def measure(name: str, step: Callable[[], None], steps: int, rounds: int,
            device: torch.device, hz: float, scratch: Path) -> dict[str, object]:
    """Plain, the timeline alone, the timeline with the sampler at `hz`, and at AMPLIFY x
    `hz`, in short blocks side by side, in a new random order every round: a host-bound
    step's speed drifts by several percent over seconds on a shared host, far more than the
    effect, and blocks a fraction of a second apart share the drift, so each round's ratio
    cancels it. The sampler's cost is the sampler's blocks over the timeline's."""
    variants: dict[str, float | None] = {"plain": None, "timeline": 0.0, "sampler": hz,
                                         f"sampler_x{AMPLIFY:g}": AMPLIFY * hz}
    samples: dict[str, list[float]] = {v: [] for v in variants}
    taken: dict[str, list[float]] = {v: [] for v in variants}
    rng = random.Random(1)
    for _ in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for v in order:
            gc.collect()
            ms, rate = run_block(step, steps, device, variants[v], scratch)
            samples[v].append(ms)
            taken[v].append(rate)
    per_step = {v: statistics.fmean(taken[v]) for v in variants}
    result: dict[str, object] = {"step": name, "steps_per_block": steps, "rounds": rounds,
                                 "hz": hz, "ms_per_step": samples,
                                 "samples_per_step": per_step}
    for v, base in (("timeline", "plain"), ("sampler", "timeline"),
                    (f"sampler_x{AMPLIFY:g}", "timeline")):
        ratio, low, high = ratio_interval(samples[v], samples[base])
        result[f"{v}_over_{base}"] = {"median_ratio": ratio, "ci95": [low, high]}
        print(f"{name}: {v} / {base} = {ratio:.4f} (95% CI {low:.4f}-{high:.4f}; "
              f"{base} {statistics.fmean(samples[base]):.3f} ms/step, "
              f"{per_step[v]:.2f} samples/step)", flush=True)
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
    result: dict[str, object] = {"method": "stalls of a GIL-bound loop", "clock": clock,
              "seconds_per_window": seconds, "windows": windows, "hz": hz,
              "stalled_on_s": on_stalled, "stalled_off_s": off_stalled, "samples": taken,
              "stall_per_sample_us": per_sample_us,
              "overhead_at_hz": per_sample_us * 1e-6 * hz}
    print(f"GIL-bound loop, samples by {clock}: {per_sample_us:.1f} us stalled per sample: "
          f"{per_sample_us * 1e-6 * hz:.2%} of its time at {hz:g} Hz "
          f"(stalled {on_stalled:.3f} s with, {off_stalled:.3f} s without)", flush=True)
    return result


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


def _small_training_loop(device: torch.device, step_ms: float
                         ) -> tuple[Callable[[int], float], list[float]]:
    """`train(steps)`, a loop of ~`step_ms` steps: a small model's forward (modules of the
    script's own and torch's), backward, SGD, Python work and a read-back; and the step marks
    it appends to."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(64), _Block(64), nn.LayerNorm(64), nn.Linear(64, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64, device=device)
    y = torch.randint(0, 10, (32,), device=device)
    marks = [time.perf_counter()]
    work = [100]

    def train(steps: int) -> float:
        total = 0.0
        for _ in range(steps):
            out = model(x)
            loss = nn.functional.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += sum(i * i for i in range(work[0]))
            total += loss.item()
            marks.append(time.perf_counter())
        return total

    def timed(steps: int) -> float:
        started = time.perf_counter()
        train(steps)
        return (time.perf_counter() - started) * 1e3 / steps

    train(10)
    base_ms = timed(20)
    work[0] = 20_000
    per_work = (timed(20) - base_ms) / 19_900
    work[0] = max(100, round(100 + (step_ms - base_ms) / max(per_work, 1e-9)))
    del marks[1:]
    marks[0] = time.perf_counter()
    return train, marks


def handler_cost(seconds: float, hz: float, device: torch.device,
                 step_ms: float = 2.0) -> dict[str, object]:
    """Microseconds per sample, timed inside the training thread: the timer signal's handler
    (the sampler's, with no signal delivery), and the classification of the stack within it
    (remembered stacks: hits, and the first sight of a stack), on a loop of ~`step_ms` steps
    (_small_training_loop): at 50 Hz ~10 steps end between two samples, each filed at the
    next one."""
    torch.set_num_threads(1)  # (a shared host's other work stalls an OpenMP team of several)
    train, marks = _small_training_loop(device, step_ms)
    sampler = HostSampler(marks, thread_id=threading.get_ident(), loop_code=train.__code__,
                          cuda=device.type == "cuda", warmup=0, skip=(), max_steps=10**9,
                          period_s=1 / hz, clock="signal")
    handler_us: list[float] = []
    hit_us: list[float] = []
    miss_us: list[float] = []
    filing_us: list[float] = []
    on_signal, classifier, close_steps = sampler._on_signal, sampler.classifier, \
        sampler._close_steps

    def timed_handler(signum: int, frame: Any) -> None:
        start = time.perf_counter_ns()
        on_signal(signum, frame)
        handler_us.append((time.perf_counter_ns() - start) / 1e3)

    def timed_classifier(frame: Any) -> Any:
        known = len(classifier.known)
        start = time.perf_counter_ns()
        sample = classifier(frame)
        took = (time.perf_counter_ns() - start) / 1e3
        (hit_us if len(classifier.known) == known else miss_us).append(took)
        return sample

    def timed_filing(step: int) -> None:
        start = time.perf_counter_ns()
        close_steps(step)
        filing_us.append((time.perf_counter_ns() - start) / 1e3)

    sampler._on_signal = timed_handler  # (read when the timer starts)
    sampler._close_steps = timed_filing
    sampler.classifier = timed_classifier
    gc.collect()
    sampler.start()
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        train(10)
    result = sampler.stop()
    step_ms = (marks[-1] - marks[0]) * 1e3 / (len(marks) - 1)
    classify_us = hit_us + miss_us
    hit = statistics.median(hit_us) if hit_us else float("nan")
    first = statistics.median(miss_us) if miss_us else float("nan")
    report: dict[str, object] = {
        "method": "the handler timed from inside", "hz": hz, "seconds": seconds,
        "step_ms": step_ms, "samples": result.samples, "stacks": len(classifier.known),
        "handler_us": {"median": statistics.median(handler_us),
                       "mean": statistics.fmean(handler_us)},
        "filing_steps_us": {"median": statistics.median(filing_us),
                            "mean": statistics.fmean(filing_us)},
        "classify_us": {"median": statistics.median(classify_us),
                        "mean": statistics.fmean(classify_us), "seen_before_median": hit,
                        "first_seen_median": first}}
    print(f"handler: {step_ms:.2f} ms steps, {result.samples} samples at {hz:g} Hz, "
          f"{len(classifier.known)} distinct stacks. Per sample: the handler "
          f"{statistics.median(handler_us):.1f} us median ({statistics.fmean(handler_us):.1f} "
          f"mean), of which filing the steps ended since the previous sample "
          f"{statistics.median(filing_us):.1f} us median ({statistics.fmean(filing_us):.1f} mean)"
          f" and the stack's classification {statistics.median(classify_us):.1f} "
          f"us median ({statistics.fmean(classify_us):.1f} mean; a stack seen before {hit:.1f}, "
          f"first seen {first:.1f})", flush=True)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0,
                        help="time spent on each step's blocks")
    parser.add_argument("--hz", type=float, default=HOST_SAMPLE_HZ)
    parser.add_argument("--cores", type=int, default=4, help="pin to this many cores (0: not)")
    parser.add_argument("--quick", action="store_true", help="a few rounds (a smoke test)")
    parser.add_argument("--only", default="", help="the steps whose name holds this text")
    parser.add_argument("--no-stalls", action="store_true")
    parser.add_argument("--handler", action="store_true",
                        help="only the handler's time per sample, timed from inside")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.cores and hasattr(os, "sched_setaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, allowed[-args.cores:])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda"
                              else "cpu", "torch": torch.__version__,
                              "python": sys.version.split()[0],
                              "cores": sorted(os.sched_getaffinity(0))
                              if hasattr(os, "sched_getaffinity") else None, "results": []}
    if args.handler:
        report["results"].append(handler_cost(5.0 if args.quick else args.seconds, args.hz,
                                              device))
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
        return 0
    clocks: tuple[Clock, ...] = () if args.no_stalls else ("signal", "thread")
    for clock in clocks:
        report["results"].append(stalls(0.5 if args.quick else 2.0, args.hz, clock))
    # (name, step, target ms, steps per block): a block of about 50 ms or two steps.
    Make = Callable[[torch.device, float], Callable[[], None]]
    blocks: list[tuple[str, Make, float, int]] = [
              ("2 ms, Python and numpy (host-bound)", python_and_numpy, 2.0, 25),
              ("2 ms, small kernels (launch-bound)", small_kernels, 2.0, 25),
              ("4 ms, matmuls (device-bound)", functools.partial(large_matmuls, width=2048),
               4.0, 12),
              ("100 ms, large matmuls (device-bound)", large_matmuls, 100.0, 2)]
    with tempfile.TemporaryDirectory() as tmp:
        for name, make, target_ms, steps in blocks:
            if args.only not in name:
                continue
            step = make(device, target_ms)
            gc.collect()
            gc.freeze()  # what is alive now is never collected: a collection per block is short
            block_ms = steps * _time_step(step, device)
            rounds = 3 if args.quick else max(10, int(args.seconds * 1e3 / (4 * block_ms)))
            report["results"].append(measure(name, step, steps, rounds, device, args.hz,
                                             Path(tmp)))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
