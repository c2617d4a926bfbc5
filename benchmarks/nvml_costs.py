"""How much does each NVML read gpudiag makes cost on this GPU? (docs/performance.md)

    python benchmarks/nvml_costs.py --out reports/nvml_costs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gpudiag.measure.env import device_identity
from gpudiag.measure.telemetry import TelemetryUnavailable
from gpudiag.measure.telemetry.nvml import _FAST_READERS, open_gpu


def _cost_us(call: Callable[[], object], repeats: int) -> dict[str, float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    times.sort()
    return {"median_us": statistics.median(times), "p99_us": times[int(0.99 * (len(times) - 1))],
            "max_us": times[-1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    try:
        gpu = open_gpu(*device_identity(torch.device("cuda", 0)))
    except TelemetryUnavailable as exc:
        print(f"no NVML: {exc}")
        return 2
    costs: dict[str, object] = {"gpu": gpu.name, "status": gpu.metric_status}
    for metric, reader in _FAST_READERS.items():
        if gpu.metric_status[metric] == "ok":
            costs[metric] = {**_cost_us(lambda r=reader: r(gpu.handle), args.repeats),
                             "value": reader(gpu.handle)}
    costs["read_all_fast"] = _cost_us(gpu.read, args.repeats)
    costs["energy_counter"] = _cost_us(gpu.energy_mj, 20)
    if gpu.gpm_ok:
        first = gpu.gpm_snapshot()
        costs["gpm_sample"] = _cost_us(lambda: gpu.gpm_release(gpu.gpm_snapshot()), 20)
        time.sleep(0.2)
        second = gpu.gpm_snapshot()
        costs["gpm_metrics"] = _cost_us(lambda: gpu.gpm_metrics(first, second), 20)
        costs["gpm_values_idle"] = gpu.gpm_metrics(first, second)
        gpu.gpm_release(first)
        gpu.gpm_release(second)
    gpu.close()
    for name, value in costs.items():
        print(f"{name:20s} {value}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(costs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
