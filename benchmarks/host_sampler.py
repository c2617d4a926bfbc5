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

--toggle measures the same two costs with less noise, for as long as --seconds allows and
written as it goes (a call cut short keeps its pairs): one recorder runs the steps, and in
alternate blocks of ~50 ms, in a random order within each pair, either its step bookkeeping is
on or off (the timeline; no sampler), or the sampler's timer is armed or disarmed (the
timeline on in both; armed at a random phase, so an armed block gets the rate's samples). No
recorder is built and no collection run between the two blocks of a pair: they differ only in
what is measured. A new recorder starts every 20,000 steps (the sampler's span in a run). The
figure is the 10%-trimmed mean of the pairs' log ratios, with a bootstrap 95% interval; a
second reading of the sampler's cost comes from the steps themselves: a step a sample landed
in against its two neighbours without one. --pool reads several --toggle files (calls on the
same machine) and gives the figures over all their pairs.

    python benchmarks/host_sampler.py --toggle --seconds 500 --out toggle.json
    python benchmarks/host_sampler.py --pool toggle-1.json toggle-2.json
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
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

from gpudiag.measure.profile.inscript.hostsampler import Clock, HostSampler
from gpudiag.measure.profile.inscript.recorder import Recorder
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

# --- --toggle: the two costs in alternate blocks of one recorder's steps --------------------

TOGGLE_SEGMENT_STEPS = 20_000  # a new recorder (and sampler) every this many steps
TRIM = 0.1  # of the pairs' log ratios, cut at each end: an outside interruption moves one pair


def _arm(sampler: HostSampler, rng: random.Random) -> None:
    """Arm the sampler's timer with its first expiry at a random phase of the period (an
    armed block gets the rate's samples on average, whatever its length), and make the
    sampler count its periods from there."""
    assert sampler.timer is not None
    phase = rng.uniform(0.05, 1.0) * sampler.period_s
    sampler.timer_start, sampler.ticks = sampler.timer.start(phase), 0


def _disarm(sampler: HostSampler) -> None:
    assert sampler.timer is not None
    sampler.timer.pause()


def _trimmed_interval(values: list[float], seed: int = 0) -> tuple[float, float, float]:
    """The TRIM-trimmed mean of `values` and its bootstrap 95% interval."""
    data = np.asarray(values, dtype=float)
    cut = int(TRIM * len(data))

    def trimmed(rows: np.ndarray) -> np.ndarray:
        ordered = np.sort(rows, axis=-1)
        return ordered[..., cut:ordered.shape[-1] - cut].mean(axis=-1)

    rng = np.random.default_rng(seed)
    means = np.concatenate([trimmed(data[rng.integers(0, len(data), (100, len(data)))])
                            for _ in range(BOOTSTRAP // 100)])
    low, high = np.quantile(means, [0.025, 0.975])
    return float(trimmed(data)), float(low), float(high)


class _Toggle:
    """toggle_pairs' measurement: pairs of blocks of `steps` steps, one with a cost on and
    one with it off, in a random order within the pair."""

    def __init__(self, step: Callable[[], None], steps: int, device: torch.device, hz: float,
                 scratch: Path) -> None:
        self.step, self.steps, self.device, self.hz, self.scratch = step, steps, device, hz, \
            scratch
        self.rng = random.Random(2)
        self.pairs: dict[str, list[tuple[float, float]]] = {"timeline": [], "sampler": []}
        # Each step a sample landed in alone (its neighbours in the block without one): the
        # ms of the step before, of it, and of the step after.
        self.sampled_steps: list[tuple[float, float, float]] = []
        self.samples_on = self.steps_on = 0

    def data(self) -> dict[str, Any]:
        return {"pairs": self.pairs, "sampled_steps": self.sampled_steps,
                "samples_per_step_on": self.samples_on / max(1, self.steps_on)}

    def segment(self, cost: str, until: float) -> None:
        """Pairs for `cost` ("timeline" or "sampler") on a new recorder, until the
        perf_counter time `until` or TOGGLE_SEGMENT_STEPS steps."""
        config = ProfileConfig(warmup=0, timed=0, evidence_steps=0, telemetry="off",
                               host_sample_hz=self.hz if cost == "sampler" else 0.0)
        recorder = Recorder(self.scratch, config)
        self._run(recorder, 3, True)  # the sampler starts at the second boundary
        sampler = recorder.host_sampler
        if sampler is not None:
            assert sampler.result.clock == "signal", "--toggle needs the timer signal"
            _disarm(sampler)
        gc.collect()
        for _ in range(TOGGLE_SEGMENT_STEPS // (2 * self.steps)):
            if time.perf_counter() >= until:
                break
            block: dict[bool, float] = {}
            for on in self.rng.sample((True, False), 2):
                block[on] = self._block(recorder, on, sampler)
            self.pairs[cost].append((block[True], block[False]))
        if sampler is not None:
            sampler.stop()
        recorder.finished = True

    def _block(self, recorder: Recorder, on: bool, sampler: HostSampler | None) -> float:
        """One block's mean ms per step: the recorder's bookkeeping `on` (no sampler), or
        with a sampler, its timer armed if `on`."""
        if sampler is not None and on:
            _arm(sampler, self.rng)
        first = len(recorder.host_marks)
        before = sampler.result.samples if sampler is not None else 0
        _sync(self.device)
        begin = time.perf_counter()
        counts = self._run(recorder, self.steps, on or sampler is not None)
        _sync(self.device)
        ms = (time.perf_counter() - begin) * 1e3 / self.steps
        if sampler is not None and on:
            _disarm(sampler)  # (before reading: no sample lands in the reading)
            marks = recorder.host_marks[first - 1:]
            walls = [(b - a) * 1e3 for a, b in itertools.pairwise(marks)]
            landed = [b - a for a, b in itertools.pairwise([before, *counts])]
            self.samples_on += counts[-1] - before
            self.steps_on += len(landed)
            self.sampled_steps += [
                (walls[k - 1], walls[k], walls[k + 1]) for k in range(1, len(landed) - 1)
                if landed[k] == 1 and landed[k - 1] == landed[k + 1] == 0]
        return ms

    def _run(self, recorder: Recorder, count: int, bookkeeping: bool) -> list[int]:
        """`count` steps; with `bookkeeping`, the recorder's boundary after each, and the
        sampler's count of samples read after it."""
        counts = []
        sampler, step = recorder.host_sampler, self.step
        for _ in range(count):
            step()
            if bookkeeping:
                recorder.boundary()
                counts.append(sampler.result.samples if sampler is not None else 0)
        return counts


def toggle_pairs(step: Callable[[], None], steps: int, device: torch.device, hz: float,
                 seconds: float, scratch: Path, save: Callable[[dict[str, Any]], None],
                 ) -> dict[str, Any]:
    """_Toggle's pairs for `seconds`: the timeline's cost (the recorder's bookkeeping at each
    step, no sampler) and the sampler's (its timer armed; the bookkeeping on in both), in
    alternate segments of at most a sixth of the time, each saved as it ends."""
    toggle = _Toggle(step, steps, device, hz, scratch)
    started = time.perf_counter()
    segment = 0
    while (now := time.perf_counter()) - started < seconds:
        toggle.segment(("sampler", "timeline")[segment % 2],
                       min(started + seconds, now + seconds / 6))
        segment += 1
        save(toggle.data())
    return toggle.data()


def toggle_figures(name: str, hz: float, data: dict[str, Any]) -> dict[str, Any]:
    """The costs as ratios with their intervals, from toggle_pairs' data (one call's, or
    several pooled)."""
    figures: dict[str, Any] = {"step": name, "hz": hz}
    for cost, pairs in data["pairs"].items():
        if len(pairs) < 10:
            continue
        logs = [np.log(on / off) for on, off in pairs]
        mean, low, high = _trimmed_interval(logs)
        base = statistics.fmean(off for _, off in pairs)
        figures[f"{cost}_on_over_off"] = {"ratio": float(np.exp(mean)),
                                          "ci95": [float(np.exp(low)), float(np.exp(high))],
                                          "pairs": len(pairs), "off_ms_per_step": base}
        print(f"{name}: {cost} on / off = {np.exp(mean):.4f} (95% CI {np.exp(low):.4f}-"
              f"{np.exp(high):.4f}; {len(pairs)} pairs of blocks, off {base:.3f} ms/step)",
              flush=True)
    steps = data["sampled_steps"]
    if len(steps) >= 10 and data["pairs"]["sampler"]:
        extra = [(mid - (before + after) / 2) * 1e3 for before, mid, after in steps]
        per_sample, low, high = _trimmed_interval(extra)
        rate = data["samples_per_step_on"]
        base = statistics.fmean(off for _, off in data["pairs"]["sampler"]) * 1e3
        figures["per_sample_us"] = {"trimmed_mean": per_sample, "ci95": [low, high],
                                    "steps": len(steps), "samples_per_step": rate,
                                    "share_of_step": per_sample * rate / base,
                                    "share_ci95": [low * rate / base, high * rate / base]}
        print(f"{name}: a sample's step against its neighbours: {per_sample:.1f} us (95% CI "
              f"{low:.1f}-{high:.1f}; {len(steps)} steps) x {rate:.3f} samples a step = "
              f"{per_sample * rate / base:.2%} of a {base / 1e3:.3f} ms step "
              f"({low * rate / base:.2%}-{high * rate / base:.2%})", flush=True)
    return figures


def toggle(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> None:
    """--toggle: each 2 ms step for its share of --seconds (the 100 ms step: a short check,
    its cost is well inside the noise of pairs of single steps)."""
    Make = Callable[[torch.device, float], Callable[[], None]]
    blocks: list[tuple[str, Make, float, int, float]] = [
        ("2 ms, Python and numpy (host-bound)", python_and_numpy, 2.0, 25, 0.45),
        ("2 ms, small kernels (launch-bound)", small_kernels, 2.0, 25, 0.45),
        ("100 ms, large matmuls (device-bound)", large_matmuls, 100.0, 1, 0.1)]
    chosen = [b for b in blocks if args.only in b[0]]
    share_total = sum(b[4] for b in chosen)
    with tempfile.TemporaryDirectory() as tmp:
        for name, make, target_ms, steps, share in chosen:
            step = make(device, target_ms)
            gc.collect()
            gc.freeze()
            entry: dict[str, Any] = {"step": name, "steps_per_block": steps, "hz": args.hz}
            report["results"].append(entry)

            def save(data: dict[str, Any], entry: dict[str, Any] = entry) -> None:
                entry["data"] = data
                if args.out:
                    write_json(args.out, report)

            seconds = 8.0 if args.quick else args.seconds * share / share_total
            data = toggle_pairs(step, steps, device, args.hz, seconds, Path(tmp), save)
            entry["data"] = data
            entry["figures"] = toggle_figures(name, args.hz, data)
            if args.out:
                write_json(args.out, report)


def pool(files: list[Path]) -> dict[str, Any]:
    """--pool: several --toggle calls' pairs, step by step, as one measurement."""
    pooled: dict[str, dict[str, Any]] = {}
    for file in files:
        for entry in json.loads(file.read_text())["results"]:
            data = entry.get("data")
            if data is None:
                continue
            into = pooled.setdefault(entry["step"], {
                "hz": entry["hz"], "pairs": {"timeline": [], "sampler": []},
                "sampled_steps": [], "rates": []})
            for cost in ("timeline", "sampler"):
                into["pairs"][cost] += data["pairs"][cost]
            into["sampled_steps"] += data["sampled_steps"]
            into["rates"].append((data["samples_per_step_on"], len(data["sampled_steps"])))
    results = []
    for name, into in pooled.items():
        weight = sum(n for _, n in into["rates"]) or 1
        into["samples_per_step_on"] = sum(r * n for r, n in into["rates"]) / weight
        results.append(toggle_figures(name, into["hz"], into))
    return {"pooled": [str(f) for f in files], "results": results}


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Written whole and renamed into place: a call killed while writing keeps the last."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report))
    partial.replace(path)



def _pinned(cores: int) -> tuple[torch.device, dict[str, Any]]:
    """Pin the process to its last `cores` cores (0: not); the device, and the report's
    heading."""
    if cores and hasattr(os, "sched_setaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, allowed[-cores:])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda"
                              else "cpu", "torch": torch.__version__,
                              "python": sys.version.split()[0],
                              "cores": sorted(os.sched_getaffinity(0))
                              if hasattr(os, "sched_getaffinity") else None, "results": []}
    return device, report


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
    parser.add_argument("--toggle", action="store_true",
                        help="pairs of blocks of one recorder's steps, each cost on and off")
    parser.add_argument("--pool", type=Path, nargs="+", default=None,
                        help="--toggle files to read as one measurement")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.pool:
        pooled = pool(args.pool)
        if args.out:
            write_json(args.out, pooled)
        return 0
    device, report = _pinned(args.cores)
    if args.toggle:
        toggle(args, device, report)
        return 0
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
