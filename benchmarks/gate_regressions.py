"""Does the CI gate pass unchanged code and fail real regressions? Measured on real builds.

Builds of the dgca workload, each a copy of this checkout with one edit to
gpudiag/measure/models/dgca.py (a real code change, not a scaled copy of a run):

- `base`: unchanged;
- `extra-sync`: a NaN check on the loss, `if not torch.isfinite(loss)`: one more host sync;
- `extra-layer`: a residual feed-forward adapter (H -> 4H -> H) on the encoder output: ~5% more
  device work per step;
- `candidates-N`: N more confusion-set candidates per position: more device time per step with
  the same operators (FLOPs and peak memory grow a little).

`--measure` runs fresh-process trials of every build round-robin (so drift over the job weighs
on all builds alike) into a pool; `--analyse` replays the README's gate recipe on that pool with
the gate's own functions (gpudiag.diagnose.gate), adding trials from the pool exactly as
`gpudiag gate --base-ref` adds them, and writes the pass and detection rates. `--job` times
the real command end to end in a throwaway git repository (base commit, head commit).

    python benchmarks/gate_regressions.py --measure --pool /tmp/pool --trials base=14 ...
    python benchmarks/gate_regressions.py --analyse --pool /tmp/pool --out result.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from gpudiag.diagnose.compare import compare_runs
from gpudiag.diagnose.gate import GATE_ALPHA, GateDecision, decide, parse_limits
from gpudiag.diagnose.trials import merge_trials
from gpudiag.measure.gatejob import run_one
from gpudiag.model.options import RunOptions
from gpudiag.model.results import RunResult
from gpudiag.model.runfile import load_run

ROOT = Path(__file__).resolve().parents[1]
MODEL_FILE = Path("gpudiag/measure/models/dgca.py")
# The README's recipe (README.md, "CI: gpudiag gate"); tests/test_gate_job.py checks they agree.
RECIPE_LIMITS = ["10", "device=0.5", "syncs=0", "flops=2"]
RECIPE_TRIALS, RECIPE_MAX_TRIALS = 1, 4  # the gate's first trial is its default
LOSS = "        loss = correction + detection + RANKING_WEIGHT * ranking + auxiliary_mlm\n"
EDITS: dict[str, list[tuple[str, str]]] = {
    "base": [],
    "extra-sync": [(LOSS, LOSS + "        if not torch.isfinite(loss):  # a NaN check: one host "
                    "sync per step\n            raise FloatingPointError('loss is not "
                    "finite')\n")],
    "extra-layer": [
        ("        self.candidate_proj = nn.Linear(hidden, hidden)\n",
         "        self.candidate_proj = nn.Linear(hidden, hidden)\n        self.adapter = "
         "nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),\n"
         "                                     nn.Linear(4 * hidden, hidden))\n"),
        ("attention_mask=attention_mask).last_hidden_state\n",
         "attention_mask=attention_mask).last_hidden_state\n        hs = hs + self.adapter(hs)\n"),
    ],
}
CANDIDATES_LINE = "    p, seq, k = options.prompt_length, options.seq_len, options.candidates\n"


def edits(variant: str) -> list[tuple[str, str]]:
    if variant.startswith("candidates-"):
        extra = int(variant.split("-")[1])
        return [(CANDIDATES_LINE, CANDIDATES_LINE.replace("options.candidates",
                                                          f"options.candidates + {extra}"))]
    return EDITS[variant]


def build(variant: str, into: Path) -> Path:
    """A copy of this checkout's package with the variant's edits applied."""
    target = into / variant
    shutil.copytree(ROOT / "gpudiag", target / "gpudiag",
                    ignore=shutil.ignore_patterns("__pycache__"))
    model = target / MODEL_FILE
    text = model.read_text()
    for old, new in edits(variant):
        if old not in text:
            raise SystemExit(f"{variant}: the edit no longer applies to {MODEL_FILE}")
        text = text.replace(old, new, 1)
    model.write_text(text)
    return target


def measure(pool: Path, trials: dict[str, int], options: RunOptions) -> None:
    with tempfile.TemporaryDirectory(prefix="gpudiag-builds-") as tmp:
        builds = {v: build(v, Path(tmp)) for v in trials}
        for k in range(1, max(trials.values()) + 1):
            for variant, checkout in builds.items():
                if k <= trials[variant] and not (pool / variant / f"trial-{k}").exists():
                    start = time.perf_counter()
                    run_one(options, checkout, pool / variant / f"trial-{k}")
                    print(f"{variant} trial {k}: {time.perf_counter() - start:.1f} s",
                          flush=True)


def _judge(base: list[RunResult], head: list[RunResult]) -> GateDecision:
    comparison = compare_runs(merge_trials(base), merge_trials(head), alpha=GATE_ALPHA)
    return decide(comparison, parse_limits(RECIPE_LIMITS), interleaved=True)


def gate_like_the_job(base: list[RunResult], head: list[RunResult], first: int,
                      most: int) -> tuple[GateDecision, int]:
    """The decision `gpudiag gate --base-ref` reaches drawing its trials from these lists in
    order, and the trials a side it used."""
    k = first
    while True:  # one round at a time, as run_interleaved asks after every round
        decision = _judge(base[:k], head[:k])
        if decision.trials_wanted(k, most) <= k:
            return decision, k
        k += 1


def _draws(pool: list[RunResult], n: int, rng: random.Random) -> list[RunResult]:
    return rng.sample(pool, min(n, len(pool)))


def _replay(base: list[RunResult], head: list[RunResult] | None, comparisons: int,
            first: int, most: int, seed: int) -> dict[str, Any]:
    """`comparisons` gates, each on random disjoint draws (A/A when head is None)."""
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    exits: Counter[int] = Counter()
    used, named = [], 0
    caught_by: Counter[str] = Counter()  # comparisons each instrument found a regression in
    for _ in range(comparisons):
        if head is None:
            shuffled = _draws(base, len(base), rng)
            a, b = shuffled[:len(base) // 2], shuffled[len(base) // 2:]
        else:
            a, b = _draws(base, most, rng), _draws(head, most, rng)
        decision, k = gate_like_the_job(a, b, first, min(most, len(a), len(b)))
        outcomes[decision.outcome] += 1
        exits[decision.exit_code("pass")] += 1
        used.append(k)
        failing = [g for g in decision.stages if g.outcome == "regression"]
        named += any("dgca.py" in g.reason for g in failing)
        caught_by.update({g.metric for g in failing})
    return {"comparisons": comparisons, "outcomes": dict(outcomes),
            "exit_codes": {str(k): v for k, v in exits.items()},
            "trials_per_side": dict(Counter(used)), "cause_named_in": named,
            "regression_by_metric": dict(caught_by)}


def _spread(runs: list[RunResult], stage: str) -> dict[str, Any]:
    """Between-process spread of wall and device time, and every counter's distinct values."""
    stages = [s for r in runs if (s := r.stage(stage)) is not None and s.ok]
    trials = [merge_trials([r]).stage(stage).trials[0] for r in runs]  # type: ignore[union-attr]
    wall = [t.ms_per_iter for t in trials]
    device = [t.device_ms for t in trials if t.device_ms]
    counters = {name: sorted({t.counters[name] for t in trials if name in t.counters})
                for name in trials[0].counters}

    def cv(xs: list[float]) -> float | None:
        return statistics.stdev(xs) / statistics.mean(xs) if len(xs) > 1 else None

    return {"trials": len(stages), "wall_ms": wall, "device_ms": device,
            "wall_cv": cv(wall), "device_cv": cv(device),
            "distinct_counter_values": counters}


def _ratio(spread: dict[str, Any], variant: str, key: str) -> float | None:
    """Median over the variant's trials over the base's (None without measurements)."""
    if not spread[variant][key] or not spread["base"][key]:
        return None
    return statistics.median(spread[variant][key]) / statistics.median(spread["base"][key])


def analyse(pool: Path, stage: str, comparisons: int, seed: int) -> dict[str, Any]:
    runs = {p.name: [load_run(t) for t in sorted(p.iterdir()) if (t / "run.json").is_file()]
            for p in sorted(pool.iterdir()) if p.is_dir()}
    base = runs.pop("base")
    result: dict[str, Any] = {
        "recipe": {"max_regression": RECIPE_LIMITS, "trials": RECIPE_TRIALS,
                   "max_trials": RECIPE_MAX_TRIALS},
        "gpu": base[0].env.gpu_name, "driver": base[0].env.driver_version,
        "torch": base[0].env.torch_version, "stage": stage,
        "spread": {"base": _spread(base, stage)},
        "aa_recipe": _replay(base, None, comparisons, RECIPE_TRIALS, RECIPE_MAX_TRIALS, seed),
        "aa_one_trial": _replay(base, None, comparisons, 1, 1, seed),
    }
    for variant, head in runs.items():
        result["spread"][variant] = _spread(head, stage)
        wall, device = (_ratio(result["spread"], variant, key) for key in ("wall_ms", "device_ms"))
        result[variant] = {
            "wall_ratio": wall, "device_ratio": device,
            "one_trial": _replay(base, head, comparisons, 1, 1, seed),
            "recipe": _replay(base, head, comparisons, RECIPE_TRIALS, RECIPE_MAX_TRIALS, seed),
        }
        print(f"{variant}: device x{device}, wall x{wall}; one trial "
              f"{result[variant]['one_trial']['outcomes']}; recipe "
              f"{result[variant]['recipe']['outcomes']}", flush=True)
    print(f"A/A recipe: {result['aa_recipe']['outcomes']}; one trial "
          f"{result['aa_one_trial']['outcomes']}", flush=True)
    return result


def job(work: Path, variant: str, argv: list[str]) -> dict[str, Any]:
    """`gpudiag gate --base-ref HEAD~1 ...` end to end in a throwaway repository whose head
    commit is `variant`: its exit code, wall time and summary."""
    repo = work / f"repo-{variant}"
    shutil.copytree(ROOT / "gpudiag", repo / "gpudiag",
                    ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-c", "user.name=gpudiag", "-c", "user.email=gpudiag@localhost"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=repo, check=True)
    head = build(variant, work / "edit") / MODEL_FILE
    shutil.copy(head, repo / MODEL_FILE)
    subprocess.run([*git, "commit", "-qam", variant, "--allow-empty"], cwd=repo, check=True)
    summary = work / f"summary-{variant}.md"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gpudiag", "gate", "--base-ref", "HEAD~1",
                           *argv, "--out", str(work / f"gate-{variant}")], cwd=repo,
                          env={**_env(), "GITHUB_STEP_SUMMARY": str(summary)}, check=False)
    return {"variant": variant, "exit": done.returncode,
            "wall_s": time.perf_counter() - start,
            "summary": summary.read_text() if summary.is_file() else None}


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=Path, required=True)
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--analyse", action="store_true")
    parser.add_argument("--job", nargs="*", default=None, metavar="VARIANT",
                        help="time `gpudiag gate --base-ref` with these head variants")
    parser.add_argument("--trials", nargs="+", default=["base=2"], help="VARIANT=N ...")
    parser.add_argument("--stage", default="full-vectorized")
    parser.add_argument("--evidence-steps", type=int, default=5)
    parser.add_argument("--comparisons", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    options = RunOptions(model="dgca", stages=(args.stage,), evidence_steps=args.evidence_steps)
    if args.measure:
        trials = {v: int(n) for v, n in (item.split("=") for item in args.trials)}
        measure(args.pool, trials, options)
    result: dict[str, Any] = {}
    if args.analyse:
        result = analyse(args.pool, args.stage, args.comparisons, args.seed)
    if args.job is not None:
        recipe = ["--model", "dgca", "--stages", args.stage, "--evidence-steps",
                  str(args.evidence_steps), "--trials", str(RECIPE_TRIALS), "--max-trials",
                  str(RECIPE_MAX_TRIALS), *[a for x in RECIPE_LIMITS for a in
                                             ("--max-regression", x)]]
        with tempfile.TemporaryDirectory(prefix="gpudiag-job-") as tmp:
            result["jobs"] = [job(Path(tmp), v, recipe) for v in args.job]
        for j in result["jobs"]:
            print(f"job {j['variant']}: exit {j['exit']} in {j['wall_s']:.0f} s", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
