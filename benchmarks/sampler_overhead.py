"""What does gpudiag's telemetry sampler cost the workload it measures?

Times stages with the telemetry sampler on and off, interleaved in one process (ABBA order, so
drift does not favour either side), and reports per stage the median of paired on/off ratios of
block medians with a bootstrap 95% interval. Host-bound stages (full-loop) are the sensitive
case: anything that takes the host's time shows there first.

    python benchmarks/sampler_overhead.py --stages train-fp16,full-loop --rounds 16 \
        --out reports/sampler_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from gpudiag.measure.env import device_identity
from gpudiag.measure.models import resolve_model
from gpudiag.measure.plan import build_config
from gpudiag.measure.stages import StageContext, get_stage
from gpudiag.measure.telemetry import open_sampler
from gpudiag.measure.timing import PhaseRecorder, synchronize, time_steps


def measure(args: argparse.Namespace) -> dict[str, object]:
    config, _ = build_config(model=args.model, preset=args.preset, device=args.device,
                             stages=args.stages.split(","), iters=args.iters)
    device = torch.device(config.device)
    uuid, index = device_identity(device) if device.type == "cuda" else (None, 0)
    ctx = StageContext(config=config, device=device, spec=resolve_model(config.model),
                       phases=PhaseRecorder(device))
    report: dict[str, object] = {"device": torch.cuda.get_device_name(device)
                                 if device.type == "cuda" else "cpu",
                                 "period_s": config.sample_period_s,
                                 "gpm_period_s": config.gpm_period_s, "stages": {}}
    for name in config.stages:
        workload = get_stage(name).build(ctx)
        time_steps(workload.step, device=device, iters=config.warmup)
        rounds: dict[str, list[float]] = {"off": [], "on": []}
        samples_seen = 0
        for r in range(args.rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for mode in order:
                sampler = open_sampler(device.type if mode == "on" else "cpu", uuid, index,
                                       period_s=config.sample_period_s,
                                       gpm_period_s=config.gpm_period_s)
                with sampler:
                    sampler.wait_ready()
                    synchronize(device)
                    sampler.begin(name)
                    times = time_steps(workload.step, device=device, iters=config.iters,
                                       host_only=workload.host_only)
                    synchronize(device)
                    summary = sampler.end()
                if mode == "on":
                    samples_seen += summary.sample_count
                rounds[mode].append(statistics.median(times.iter_ms))
            ctx.phases.clear()
        workload.close()
        off, on = statistics.median(rounds["off"]), statistics.median(rounds["on"])
        paired = [b / a for a, b in zip(rounds["off"], rounds["on"], strict=True)]
        low, high = _bootstrap_median_ci(paired)
        report["stages"][name] = {  # type: ignore[index]
            "median_ms_off": off, "median_ms_on": on,
            "median_paired_ratio": statistics.median(paired), "ci95": [low, high],
            "paired_ratios": paired, "round_medians_ms": rounds,
            "sampler_samples": samples_seen,
        }
        print(f"{name:16s} off {off:8.2f} ms  on {on:8.2f} ms  paired ratio "
              f"{statistics.median(paired):.4f} (95% CI {low:.4f}..{high:.4f}, "
              f"{args.rounds} ABBA rounds of {config.iters} steps)", flush=True)
    return report


def _bootstrap_median_ci(values: list[float], resamples: int = 10_000) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    draws = rng.choice(values, size=(resamples, len(values)), replace=True)
    low, high = np.percentile(np.median(draws, axis=1), [2.5, 97.5])
    return float(low), float(high)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dgca")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--stages", default="train-fp16,full-loop")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = measure(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
