"""What `gpudiag calibrate` costs, and whether a cheaper one records the same spread (issue 39).

README's gate recipe workload (benchmarks/gate_decides.py: `net.py`, 100 residual Linear layers,
fp16, batch 4096, ~25 ms a step, 5 profiled steps) calibrated with each gpudiag source tree
(`--tree DIR`, e.g. a worktree of an earlier commit, and `.`), the trees alternated ABBA, as
real `gpudiag calibrate` processes. Per calibration: its wall time, each trial's run clock
(the rest of a trial is its interpreter and imports), the spreads it recorded with their 95%
intervals (chi-squared, trials - 1 degrees of freedom), and each trial's step and device time.
`--imports` also times `import torch` in fresh processes as the environment has it and with
the bytecode kept in a folder of their own (measure/bytecode.py), the cause of most of it
where the environment says not to write bytecode.

    git worktree add /tmp/base HEAD~3
    python benchmarks/calibrate_cost.py --tree /tmp/base --tree . --repeats 2 --out cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scipy import stats

sys.path.insert(0, str(Path(__file__).parent))
import gate_decides  # its workload

STAGE = "train-fp16"


def _interval(sd: float | None, trials: int) -> list[float] | None:
    """The 95% interval of a standard deviation from `trials` samples (chi-squared)."""
    if sd is None:  # no device time (a CPU)
        return None
    df = trials - 1
    return [sd * (df / stats.chi2.ppf(q, df)) ** 0.5 for q in (0.975, 0.025)]


def calibrate(tree: Path, repo: Path, work: Path, trials: int, label: str) -> dict[str, Any]:
    path = os.pathsep.join(p for p in (str(tree.resolve()), os.environ.get("PYTHONPATH")) if p)
    out, file = work / f"cal-{label}", work / f"cal-{label}.json"
    command = [sys.executable, "-m", "gpudiag", "calibrate", *gate_decides.WORKLOAD,
               "--evidence-steps", str(gate_decides.RECIPE_EVIDENCE_STEPS), "--trials",
               str(trials), "--out", str(out), "--file", str(file)]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=repo, env={**os.environ, "PYTHONPATH": path},
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    row: dict[str, Any] = {"tree": str(tree), "label": label, "wall_s": round(wall, 1),
                           "rc": done.returncode, "stdout": done.stdout[-800:]}
    if done.returncode != 0:
        row["stderr_tail"] = done.stderr[-1500:]
        return row
    record = json.loads(file.read_text())["records"][-1]
    spread = next(s for s in record["stages"] if s["stage"] == STAGE)
    row["spread"] = {"trials": spread["trials"],
                     "wall_sd": spread["wall_sd"], "wall_sd_95": _interval(spread["wall_sd"],
                                                                          spread["trials"]),
                     "device_sd": spread["device_sd"],
                     "device_sd_95": _interval(spread["device_sd"], spread["trials"])}
    row["trials"] = []
    for k in range(1, trials + 1):
        run = json.loads((out / f"trial-{k}" / "run.json").read_text())
        stage = next(s for s in run["stages"] if s["name"] == STAGE)
        row["trials"].append({"run_clock_s": round(run["duration_s"], 2),
                              "ms_per_iter": stage.get("ms_per_iter"),
                              "timed_steps": len(stage.get("iter_ms") or []),
                              "device_ms": (stage.get("evidence") or {}).get(
                                  "device_ms_per_step")})
    clocks = [t["run_clock_s"] for t in row["trials"]]
    row["per_trial_s"] = round(wall / trials, 2)
    row["run_clock_mean_s"] = round(sum(clocks) / len(clocks), 2)
    return row


def import_times(repeats: int) -> dict[str, list[float]]:
    """`import torch` in fresh processes: as this environment has it, then with a bytecode
    folder of their own (the first writes it, the others read)."""
    times: dict[str, list[float]] = {"as_is": [], "own_bytecode_folder": []}
    child = [sys.executable, "-c", "import time; t = time.perf_counter(); import torch; "
             "print(time.perf_counter() - t)"]
    with tempfile.TemporaryDirectory() as folder:
        envs = {"as_is": dict(os.environ),
                "own_bytecode_folder": {**{k: v for k, v in os.environ.items()
                                           if k != "PYTHONDONTWRITEBYTECODE"},
                                        "PYTHONPYCACHEPREFIX": folder}}
        for name, env in envs.items():
            for _ in range(repeats):
                done = subprocess.run(child, env=env, capture_output=True, text=True,
                                      check=True)
                times[name].append(round(float(done.stdout.split()[-1]), 2))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, action="append", required=True,
                        help="a gpudiag source tree (repeat to compare)")
    parser.add_argument("--trials", type=int, default=gate_decides.CALIBRATION_TRIALS)
    parser.add_argument("--repeats", type=int, default=1,
                        help="calibrations per tree, the trees' order reversed each time")
    parser.add_argument("--imports", type=int, default=0,
                        help="also time `import torch` in this many fresh processes a way")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    env_note = {name: os.environ.get(name) for name in ("PYTHONDONTWRITEBYTECODE",
                                                         "PYTHONPYCACHEPREFIX")}
    result: dict[str, Any] = {"environment": env_note, "workload": gate_decides.WORKLOAD,
                              "calibrations": []}
    if args.imports:
        result["import_torch_s"] = import_times(args.imports)
        print(json.dumps(result["import_torch_s"]), flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        repo = work / "repo"
        repo.mkdir()
        gate_decides._write_net(repo, gate_decides.BASE_DEPTH)
        for repeat in range(args.repeats):
            for i, tree in enumerate(args.tree if repeat % 2 == 0 else args.tree[::-1]):
                label = f"{repeat + 1}-{i + 1}-{tree.resolve().name}"
                row = calibrate(tree, repo, work, args.trials, label)
                result["calibrations"].append(row)
                spread = row.get("spread", {})
                print(f"{label:24s} wall {row['wall_s']:6.1f} s rc {row['rc']} per trial "
                      f"{row.get('per_trial_s')} s (run clock {row.get('run_clock_mean_s')} s) "
                      f"wall sd {spread.get('wall_sd', float('nan')):.4f} device sd "
                      f"{spread.get('device_sd') or float('nan'):.5f}", flush=True)
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
