"""Does the gate pass the same code on a real CPU, quiet or loaded? Real runs, real processes.

Each pair is two real `gpudiag run`s of the same code (the tiny dgca preset's train-fp16 stage
on the CPU), gated with `gpudiag gate --max-regression 5`:

- `quiet` pairs: both on the machine as it is. Fresh processes of the same code differ by
  6-12% on a shared 2-core CPU: the gate must never exit 1 (it may say inconclusive: one trial
  a side cannot prove a 5% change there, and says so).
- `loaded` pairs: the second run while `--busy-per-core` busy processes per core take the
  CPU. Wall time then falls by far more than any limit, while every exact counter (ops,
  kernels, syncs, copies, FLOPs) stays the same: the gate must say the machine changed and
  exit 0, never 1 (a regression).

Per pair: the slowdown, the gate's exit code and whether its output names the machine.

These were tests (tests/test_gate_decides.py, tests/test_compare.py::test_real_tiny_runs)
until issue 36: up to 18 child runs and 3 x cpu_count busy processes cost the suite minutes on
a 2-core CI machine and slowed every test beside them; their decisions are tested there on
recorded-shape runs (tests/test_compare.py::test_gate_cli_exit_codes, tests/test_gate_decides.py::
test_wall_time_drift_of_the_same_work_is_not_a_regression).

    python benchmarks/gate_real_cpu.py --quiet-pairs 3 --loaded-pairs 3 --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RUN = ["-m", "gpudiag", "run", "--device", "cpu", "--preset", "tiny", "--stages",
       "train-fp16", "--evidence-steps", "1", "--iters", "40", "--quiet"]
SETTLE_S = 1.0  # the busy processes running before the loaded run starts


def _samples_per_s(run_dir: Path) -> float:
    data = json.loads((run_dir / "run.json").read_text())
    return float(data["stages"][0]["samples_per_s"])


def one_pair(work: Path, busy_per_core: int) -> dict[str, Any]:
    """Two runs of the same code, the second under `busy_per_core` busy processes a core."""
    subprocess.run([sys.executable, *RUN, "--out", str(work / "a")], check=True)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(busy_per_core * (os.cpu_count() or 2))]
    if busy:
        time.sleep(SETTLE_S)
    try:
        subprocess.run([sys.executable, *RUN, "--out", str(work / "b")], check=True)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    gate = subprocess.run([sys.executable, "-m", "gpudiag", "gate", "--max-regression", "5",
                           str(work / "a"), str(work / "b")], capture_output=True, text=True,
                          check=False)
    return {"busy_processes": len(busy),
            "slowdown": _samples_per_s(work / "a") / _samples_per_s(work / "b"),
            "exit_code": gate.returncode,
            "names_the_machine": "the machine changed" in gate.stdout,
            "gate_output": gate.stdout.strip().splitlines()[:12]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quiet-pairs", type=int, default=3)
    parser.add_argument("--loaded-pairs", type=int, default=3)
    parser.add_argument("--busy-per-core", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    plan = [("quiet", 0)] * args.quiet_pairs + [("loaded", args.busy_per_core)] * args.loaded_pairs
    pairs: dict[str, list[dict[str, Any]]] = {"quiet": [], "loaded": []}
    for kind, busy in plan:
        with tempfile.TemporaryDirectory(prefix="gate-real-cpu-") as work:
            pair = one_pair(Path(work), busy)
        pairs[kind].append(pair)
        print(f"{kind}: {pair['slowdown']:.2f}x slower, exit {pair['exit_code']}",
              file=sys.stderr)
    every = pairs["quiet"] + pairs["loaded"]
    result = {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "busy_per_core": args.busy_per_core, "pairs": pairs,
        "loaded_passed_naming_the_machine": all(
            p["exit_code"] == 0 and p["names_the_machine"] for p in pairs["loaded"]),
        "never_a_regression": all(p["exit_code"] != 1 for p in every)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["never_a_regression"] else 1


if __name__ == "__main__":
    sys.exit(main())
