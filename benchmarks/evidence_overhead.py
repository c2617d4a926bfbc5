"""What does the evidence window cost? Per stage: the timed step, the profiled step (profiler +
source annotator), and the wall time the whole window adds (warm-up step, capture, trace export,
analysis). The window runs after the timed steps, so timings never include it.

    python benchmarks/evidence_overhead.py --stages train-fp16,full-loop,full-vectorized
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from gpudiag.measure.evidence.profiler_window import collect_evidence
from gpudiag.measure.models import resolve_model
from gpudiag.measure.plan import build_config
from gpudiag.measure.stages import StageContext, get_stage
from gpudiag.measure.timing import PhaseRecorder, time_steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dgca")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--stages", default="train-fp16,full-loop,full-vectorized")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    config, _ = build_config(model=args.model, preset=args.preset, device=args.device,
                             stages=args.stages.split(","))
    device = torch.device(config.device)
    ctx = StageContext(config=config, device=device, spec=resolve_model(config.model),
                       phases=PhaseRecorder(device))
    report: dict[str, object] = {"device": str(device), "profiled_steps": args.steps}
    for name in config.stages:
        workload = get_stage(name).build(ctx)
        time_steps(workload.step, device=device, iters=config.warmup)
        timed = statistics.median(time_steps(workload.step, device=device,
                                             iters=config.iters).iter_ms)
        start = time.perf_counter()
        evidence = collect_evidence(workload.step, device=device, steps=args.steps,
                                    timed_step_ms=timed)
        wall = time.perf_counter() - start
        workload.close()
        ctx.phases.clear()
        report[name] = {"timed_step_ms": timed, "profiled_step_ms": evidence.step_ms,
                        "step_slowdown": evidence.step_ms / timed, "window_wall_s": wall,
                        "window_wall_in_timed_steps": wall * 1e3 / timed}
        print(f"{name:16s} timed {timed:8.2f} ms  profiled {evidence.step_ms:8.2f} ms "
              f"({evidence.step_ms / timed:.2f}x)  window wall {wall:5.2f} s", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
