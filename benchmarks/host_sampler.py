"""What the whole-run step timeline and the host sampler cost a training step.

One process runs the same training step in blocks, interleaved: plain; with the profile
recorder's step bookkeeping (its step boundary every step: host mark, CUDA event, NVTX range:
the timeline) and no host sampler; and with the host sampler at its default rate (or
--hz). Each block is timed on the host clock between two device syncs; each variant's block
is divided by the plain block next to it, and the ratio's median comes with a bootstrap 95%
interval over those pairs. Two steps: a ~2 ms step of many small kernels (the host holds the
GIL most of the step, the sampler's worst case) and a ~100 ms step of large matmuls.

    python benchmarks/host_sampler.py --out host_sampler.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

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


def large_matmuls(device: torch.device, target_ms: float) -> Callable[[], None]:
    """A device-bound step: big matmuls, forward and backward."""
    width = 8192 if device.type == "cuda" else 512
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


def interval(ratios: list[float]) -> tuple[float, float]:
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(BOOTSTRAP))
    return medians[int(0.025 * BOOTSTRAP)], medians[int(0.975 * BOOTSTRAP) - 1]


def measure(name: str, step: Callable[[], None], steps: int, blocks: int,
            device: torch.device, hz: float, scratch: Path) -> dict[str, object]:
    variants: dict[str, float | None] = {"plain": None, "timeline": 0.0, "sampler": hz}
    samples: dict[str, list[float]] = {v: [] for v in variants}
    order = list(variants)
    for k in range(blocks):
        # Rotate which variant goes first, so drift favours none.
        for v in order[k % 3:] + order[:k % 3]:
            samples[v].append(run_block(step, steps, device, variants[v], scratch))
    result: dict[str, object] = {"step": name, "steps_per_block": steps, "blocks": blocks,
                                 "hz": hz, "ms_per_step": samples}
    for v in ("timeline", "sampler"):
        ratios = [a / b for a, b in zip(samples[v], samples["plain"], strict=True)]
        low, high = interval(ratios)
        result[f"{v}_ratio"] = {"median": statistics.median(ratios), "ci95": [low, high]}
        print(f"{name}: {v} / plain = {statistics.median(ratios):.4f} "
              f"(95% CI {low:.4f}-{high:.4f}; plain {statistics.median(samples['plain']):.2f}"
              f" ms/step)", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--hz", type=float, default=HOST_SAMPLE_HZ)
    parser.add_argument("--quick", action="store_true", help="a few blocks (a smoke test)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    blocks = 3 if args.quick else args.blocks
    report: dict[str, object] = {"device": torch.cuda.get_device_name() if device.type == "cuda"
                                 else "cpu", "torch": torch.__version__,
                                 "python": sys.version.split()[0], "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        cases = [("2 ms, small kernels", small_kernels(device, 2.0), 200),
                 ("100 ms, large matmuls", large_matmuls(device, 100.0), 8)]
        for name, step, steps in cases:
            report["results"].append(  # type: ignore[attr-defined]
                measure(name, step, max(2, steps // (20 if args.quick else 1)), blocks, device,
                        args.hz, Path(tmp)))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
