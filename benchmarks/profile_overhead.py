"""What `gpudiag profile` costs a script outside its profiler window.

The same training script runs plainly and under `gpudiag profile`, alternately, in fresh
processes. The script times its own steps with CUDA events (host clock on a CPU) over the steps
gpudiag times (after warm-up, before the profiler window) and prints the median; the ratio of
medians, pair by pair, is the overhead of the step hooks, DataLoader and save wrappers, NVTX
ranges and telemetry sampling.

    python benchmarks/profile_overhead.py --pairs 5 --out overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WARMUP, TIMED = 10, 60

SCRIPT = f"""
import statistics, time, torch
from torch import nn
cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
torch.manual_seed(0)
width = 2048 if cuda else 256
model = nn.Sequential(*[nn.Linear(width, width) for _ in range(8)]).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
data = torch.utils.data.DataLoader(torch.randn(4096, width), batch_size=256 if cuda else 32)
marks, stamps = [], []
batches = iter(data)
for step in range({WARMUP + TIMED + 10}):
    try:
        x = next(batches).to(device)
    except StopIteration:
        batches = iter(data)
        x = next(batches).to(device)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        e = torch.cuda.Event(enable_timing=True); e.record(); marks.append(e)
    stamps.append(time.perf_counter())
if cuda:
    torch.cuda.synchronize()
    ms = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
else:
    ms = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
print("MEDIAN_MS", statistics.median(ms[{WARMUP}:{WARMUP + TIMED}]))
"""


def median_ms(command: list[str]) -> float:
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return float(next(line.split()[1] for line in output.splitlines()
                      if line.startswith("MEDIAN_MS")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--telemetry", default="full", help="gpudiag profile --telemetry")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(SCRIPT)
        plain = [sys.executable, str(script)]
        profiled = [sys.executable, "-m", "gpudiag", "profile", "--out", str(Path(tmp) / "run"),
                    "--warmup", str(WARMUP), "--timed", str(TIMED), "--telemetry",
                    args.telemetry, "--", *plain]
        rows = []
        for k in range(args.pairs):
            # Alternate which goes first, so drift does not favour one side.
            order = [("plain", plain), ("profiled", profiled)]
            if k % 2:
                order.reverse()
            row = {name: median_ms(command) for name, command in order}
            row["ratio"] = row["profiled"] / row["plain"]
            rows.append(row)
            print(row, flush=True)
    ratios = [r["ratio"] for r in rows]
    report = {"pairs": rows, "median_ratio": statistics.median(ratios),
              "min_ratio": min(ratios), "max_ratio": max(ratios), "warmup": WARMUP,
              "telemetry": args.telemetry,
              "timed": TIMED}
    print(f"overhead: median ratio {report['median_ratio']:.4f} "
          f"(range {report['min_ratio']:.4f}-{report['max_ratio']:.4f})")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
