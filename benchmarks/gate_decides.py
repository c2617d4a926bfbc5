"""Does `gpudiag gate` decide, end to end, with README's recipe? Real jobs on real builds.

A throwaway git repository holds a short training workload, `net.py`: a stack of residual
Linear layers (BASE_DEPTH of them) trained with mixed precision, device-bound on a GPU. Each
job commits a head on top of the base and runs README's recipe as a CI job would, as real
processes: `gpudiag calibrate` once for the machine (the recipe's one-time step, committed to
the repository), then `gpudiag gate --base-ref HEAD~1 ...` per job. Heads:

- `aa`: the same code (A/A): must exit 0 with device time decided (pass);
- `plus2`, `plus1`: 2% or 1% more layers (BASE_DEPTH + 2, + 1): 2% or 1% more device work per
  step with the same operators a layer (FLOPs grow too: the recipe does not limit them here).

Jobs of the variants alternate (aa, plus2, plus1, aa, ...), so drift over the hour weighs on
all alike. Per job: exit code, trials a side, each instrument's verdict and at how many trials
a side device time was decided, wall time; then the counts the issue asks for.

    python benchmarks/gate_decides.py --jobs aa=10 plus2=5 plus1=5 --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

BASE_DEPTH = 100
EXTRA_LAYERS = {"aa": 0, "plus1": 1, "plus2": 2}
WORKLOAD = ["--model", "net.py:factory", "--stages", "train-fp16", "--batch-size", "4096",
            "--iters", "40", "--warmup", "10", "--min-seconds", "1"]
WIDTH = 1024
# README's recipe ("CI: gpudiag gate"); tests/test_gate_job.py checks they agree.
RECIPE_LIMITS = ["10", "device=0.5", "syncs=0", "flops=2"]
RECIPE_MAX_TRIALS = 4
RECIPE_EVIDENCE_STEPS = 5
CALIBRATION_TRIALS = 8

NET = '''"""A short training workload for the gate benchmark: DEPTH residual Linear layers."""
import torch
from torch import nn

from gpudiag import ModelBundle

DEPTH = {depth}
WIDTH = {width}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return nn.functional.mse_loss(x.float(), y)


def factory(options):
    def batch(start: int, count: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(start)
        return {{"x": torch.randn(count, WIDTH, generator=g),
                 "y": torch.randn(count, WIDTH, generator=g)}}

    return ModelBundle(model=Net(), make_example=lambda i: {{k: v[0] for k, v in
                                                             batch(i, 1).items()}},
                       make_batch=batch, description=f"{{DEPTH}} residual layers")
'''
GIT = ["git", "-c", "user.name=gpudiag", "-c", "user.email=gpudiag@localhost"]


def recipe() -> list[str]:
    return [*WORKLOAD, "--evidence-steps", str(RECIPE_EVIDENCE_STEPS), "--max-trials",
            str(RECIPE_MAX_TRIALS), *[a for x in RECIPE_LIMITS for a in ("--max-regression", x)]]


def _write_net(repo: Path, depth: int) -> None:
    (repo / "net.py").write_text(NET.format(depth=depth, width=WIDTH))


def make_repo(work: Path) -> Path:
    """The repository with the base commit and the machine's calibration in it."""
    repo = work / "repo"
    repo.mkdir(parents=True)
    _write_net(repo, BASE_DEPTH)
    subprocess.run([*GIT, "init", "-q"], cwd=repo, check=True)
    done = subprocess.run([sys.executable, "-m", "gpudiag", "calibrate", *WORKLOAD,
                           "--evidence-steps", str(RECIPE_EVIDENCE_STEPS), "--trials",
                           str(CALIBRATION_TRIALS), "--out", str(work / "calibration-trials")],
                          cwd=repo, check=False, capture_output=True, text=True)
    print(done.stdout + done.stderr[-2000:], flush=True)
    if done.returncode != 0:
        raise SystemExit(f"calibrate failed (exit {done.returncode})")
    subprocess.run([*GIT, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-qm", "base"], cwd=repo, check=True)
    return repo


def _device_gate(stdout: str, stderr: str) -> tuple[str | None, int | None]:
    """The device-time verdict, and the first round (trials a side) it was decided at: the
    gate reports every round's verdicts on stderr ("gate: 2 a side: ... device time pass")."""
    verdict = re.search(r"^\s+(\w+)\s+\S+ \[device\]", stdout, re.M)
    for line in stderr.splitlines():
        round_ = re.match(r"gate: (\d+) a side: .*device time (pass|regression)", line)
        if round_:
            return (verdict.group(1) if verdict else None), int(round_.group(1))
    return (verdict.group(1) if verdict else None), None


def job(repo: Path, work: Path, variant: str, k: int) -> dict[str, Any]:
    """One CI job: head = variant on top of the base, README's recipe, real processes."""
    _write_net(repo, BASE_DEPTH + EXTRA_LAYERS[variant])
    subprocess.run([*GIT, "commit", "-qam", f"{variant} {k}", "--allow-empty"], cwd=repo,
                   check=True)
    out = work / f"gate-{variant}-{k}"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gpudiag", "gate", "--base-ref", "HEAD~1",
                           *recipe(), "--out", str(out)], cwd=repo, check=False,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    summary = done.stdout
    subprocess.run([*GIT, "reset", "-q", "--hard", "HEAD~1"], cwd=repo, check=True)
    device, decided_at = _device_gate(summary, done.stderr)
    per_side = len(list((out / "head").glob("trial-*"))) if (out / "head").is_dir() else 0
    print(f"{variant} {k}: exit {done.returncode}, device {device} at {decided_at}, "
          f"{per_side} a side, {wall:.0f} s", flush=True)
    return {"variant": variant, "job": k, "exit": done.returncode, "trials_a_side": per_side,
            "device": device, "device_decided_at": decided_at, "wall_s": round(wall, 1),
            "summary": summary, "stderr_tail": done.stderr[-1500:]}


def tally(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant in EXTRA_LAYERS:
        mine = [j for j in jobs if j["variant"] == variant]
        if not mine:
            continue
        out[variant] = {
            "jobs": len(mine),
            "exit_codes": dict(Counter(str(j["exit"]) for j in mine)),
            "device_verdicts": dict(Counter(str(j["device"]) for j in mine)),
            "device_decided_at": dict(Counter(str(j["device_decided_at"]) for j in mine)),
            "trials_a_side": dict(Counter(str(j["trials_a_side"]) for j in mine)),
            "wall_s_median": sorted(j["wall_s"] for j in mine)[len(mine) // 2],
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", nargs="+", default=["aa=10", "plus2=5", "plus1=5"],
                        help="VARIANT=N ...")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no job after this many seconds (results so far are kept)")
    parser.add_argument("--smoke", action="store_true",
                        help="a CPU-sized workload (narrow layers, small batch), 3 calibration "
                             "trials: checks the benchmark runs, measures nothing")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.smoke:
        global WIDTH, CALIBRATION_TRIALS
        WIDTH, CALIBRATION_TRIALS = 32, 3
        WORKLOAD[WORKLOAD.index("--batch-size") + 1] = "16"
        WORKLOAD[WORKLOAD.index("--iters") + 1] = "20"
    wanted = {v: int(n) for v, n in (item.split("=") for item in args.jobs)}
    order = [(v, k) for k in range(1, max(wanted.values()) + 1) for v in wanted
             if k <= wanted[v]]
    started = time.perf_counter()
    result: dict[str, Any] = {"recipe": recipe(), "calibration_trials": CALIBRATION_TRIALS,
                              "base_depth": BASE_DEPTH, "jobs": []}
    with tempfile.TemporaryDirectory(prefix="gpudiag-gate-decides-") as tmp:
        work = Path(tmp)
        repo = make_repo(work)
        result["calibration"] = json.loads((repo / ".gpudiag" / "calibration.json").read_text())
        for variant, k in order:
            if time.perf_counter() - started > args.budget_s:
                result["stopped"] = f"budget of {args.budget_s:.0f} s spent"
                break
            result["jobs"].append(job(repo, work, variant, k))
            result["tally"] = tally(result["jobs"])
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
        if os.environ.get("KEEP_GATE_TRIALS"):
            shutil.copytree(work, os.environ["KEEP_GATE_TRIALS"], dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("*.json.gz", "trace.json"))
    print(json.dumps(result.get("tally", {}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
