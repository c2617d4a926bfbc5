"""A/A self-calibration of `gpudiag gate`: false alarms and the smallest slowdown caught.

Runs K trials of identical code (fresh processes), then gates many random A/B splits of that
pool against each other: every `regression` is a false alarm. Then the B side of each split is
slowed by s (every step time x (1+s)) to find the smallest s caught in at least 90% of splits.
Also reports the single-trial case (one run per side, block intervals).

    python benchmarks/gate_calibration.py --trials 12 --group 3 --splits 20 \
        --out reports/examples/benchmarks/cpu-gate-calibration.json
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from gpudiag.diagnose.compare import compare_runs
from gpudiag.diagnose.gate import GATE_ALPHA, GateLimits, decide
from gpudiag.diagnose.trials import merge_trials
from gpudiag.model.results import RunResult
from gpudiag.model.runfile import load_run

SLOWDOWNS = (0.02, 0.03, 0.05, 0.08, 0.10, 0.15, 0.20, 0.25)
DETECTION_RATE = 0.9


def slowed(run: RunResult, s: float) -> RunResult:
    """The same run with every step (1 + s) times longer (its figures follow its steps)."""
    out = copy.deepcopy(run)
    for stage in out.stages:
        stage.iter_ms = [t * (1 + s) for t in stage.iter_ms]
    return out


def outcomes(pairs: list[tuple[list[RunResult], list[RunResult]]], limit: float,
             slowdown: float = 0.0) -> Counter[str]:
    counts: Counter[str] = Counter()
    for a, b in pairs:
        before = merge_trials(a) if len(a) > 1 else a[0]
        after_runs = [slowed(r, slowdown) for r in b]
        after = merge_trials(after_runs) if len(after_runs) > 1 else after_runs[0]
        comparison = compare_runs(before, after, alpha=GATE_ALPHA)
        counts[decide(comparison, GateLimits({(None, "wall"): limit})).outcome] += 1
    return counts


def summarise(name: str, pairs: list[tuple[list[RunResult], list[RunResult]]],
              limit: float) -> dict[str, object]:
    aa = outcomes(pairs, limit)
    detection = {s: outcomes(pairs, limit, s)["regression"] / len(pairs) for s in SLOWDOWNS}
    caught = next((s for s in SLOWDOWNS if detection[s] >= DETECTION_RATE), None)
    print(f"{name}: A/A over {len(pairs)} pairs: {dict(aa)}; false alarms "
          f"{aa['regression']}/{len(pairs)}; smallest slowdown caught in >=90%: "
          f"{'none up to 25%' if caught is None else f'{caught:.0%}'}", flush=True)
    return {"pairs": len(pairs), "aa_outcomes": dict(aa),
            "false_alarm_rate": aa["regression"] / len(pairs),
            "detection_rate_by_slowdown": detection, "smallest_caught": caught}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dgca")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--stages", default="train-fp16,full-vectorized")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--trials", type=int, default=12, help="pool of identical trials")
    parser.add_argument("--group", type=int, default=3, help="trials per side")
    parser.add_argument("--splits", type=int, default=20)
    parser.add_argument("--limit", type=float, default=5.0, help="gate limit, percent")
    parser.add_argument("--pool", type=Path, default=None, help="reuse a folder of trials")
    parser.add_argument("--pool-out", type=Path, default=None,
                        help="run the trials into this folder (kept), not a temporary one")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    pool_dir = args.pool
    if pool_dir is None:
        pool_dir = args.pool_out or Path(tempfile.mkdtemp(prefix="gpudiag-aa-"))
        command = [sys.executable, "-m", "gpudiag", "run", "--model", args.model, "--stages",
                   args.stages, "--iters", str(args.iters), "--trials", str(args.trials),
                   "--evidence-steps", "0", "--out", str(pool_dir), "--quiet"]
        command += ["--preset", args.preset] if args.preset else []
        command += ["--device", args.device] if args.device else []
        subprocess.run(command, check=True)
    trials = [load_run(p) for p in sorted(pool_dir.glob("trial-*"))]
    rng = random.Random(0)
    limit = args.limit / 100
    grouped = []
    for _ in range(args.splits):
        chosen = rng.sample(trials, 2 * args.group)
        grouped.append((chosen[:args.group], chosen[args.group:]))
    single = [tuple([r] for r in rng.sample(trials, 2)) for _ in range(args.splits)]
    report = {
        "trials": len(trials), "stages": args.stages, "limit_pct": args.limit,
        "gpu": trials[0].env.gpu_name or trials[0].env.device,
        f"{args.group}_trials_per_side": summarise(f"{args.group} trials per side", grouped,
                                                   limit),
        "1_trial_per_side": summarise("1 trial per side (blocks)", single, limit),  # type: ignore[arg-type]
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
