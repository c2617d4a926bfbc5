"""gpudiag's figures for a recorded field run beside the script's own plain timer.

Each run folder holds run.json (a `gpudiag profile` of the script) and the script's ground
truth: truth.json from examples/host_bound.py or examples/periodic_eval.py (perf_counter
around the augmentation, the logging line, every evaluation and save), or nanoGPT's own log
(`iter N: ... time T ms`, log_interval 1). Prints one markdown row per figure.

    python benchmarks/field_figures.py reports/examples/h100-host/* reports/examples/h100-periodic/*
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from gpudiag.diagnose.host import step_account
from gpudiag.diagnose.timeline import RunAccount, stage_account
from gpudiag.measure.profile.inscript.hostsampler import SLOW_STEP, SLOW_STEP_MIN_EXTRA_MS
from gpudiag.model.results import RunResult
from gpudiag.model.runfile import load_run

WARMUP = 10  # the script's first steps are left out of its own medians
ITER = re.compile(r"^iter (\d+): .* time ([\d.]+)ms")


def _account(run: RunResult) -> RunAccount:
    whole = stage_account(run.stages[0])
    assert whole is not None, "a profiled script with its timeline"
    return whole


def host_rows(name: str, run: RunResult, truth: dict[str, list[float]]) -> list[list[str]]:
    step = step_account(run.stages[0])
    assert step is not None
    times = truth["step_ms"][WARMUP:]
    usual = statistics.median(times)
    # gpudiag's steady steps leave out the slow ones
    # (gpudiag/measure/profile/inscript/hostsampler.py): the plain mean does the same.
    steady = [t for t in times if t <= max(SLOW_STEP * usual, usual + SLOW_STEP_MIN_EXTRA_MS)]
    rows = [[name, "steady step", f"{statistics.fmean(steady):.2f} ms",
             f"{step.step_ms:.2f} ms"]]
    for key, label in (("augment_ms", "batch preparation (host)"),
                       ("log_ms", "logging line + empty_cache")):
        plain = statistics.fmean(truth[key][WARMUP:])
        if plain < 0.05:
            continue
        if key == "augment_ms":
            lines = [x for x in step.lines if x.function == "augment"
                     or x.text.startswith("batch = ")]
        else:
            lines = [x for x in step.lines if "history.append" in x.text
                     or "empty_cache" in x.text]
        ms = sum(x.ms_per_step for x in lines)
        where = ", ".join(f"{x.location} {x.ms_per_step:.2f}" for x in lines[:3])
        rows.append([name, label, f"{plain:.2f} ms/step", f"{ms:.2f} ms/step ({where})"])
    return rows


def periodic_rows(name: str, run: RunResult, truth: dict[str, list[float]]) -> list[list[str]]:
    whole = _account(run)
    rows = []
    for work in whole.works:
        # The script's evaluations or saves: the timed work that ran as often.
        key = "save_ms" if work.kind == "save" else "eval_ms"
        ours = (f"{work.per_occurrence_ms:.1f} ms each, {whole.share(work.extra_ms):.2%}"
                f" at {work.line or (work.loop.caller if work.loop else '-')}")
        what = f"{work.kind} every {work.period} ({work.occurrences} x)"
        if work.kind not in ("loop", "other", "save") or len(truth.get(key, [])) != \
                work.occurrences:
            rows.append([name, what, "- (no timer around it)", ours])
            continue
        plain = statistics.fmean(truth[key])
        share_plain = sum(truth[key]) / whole.wall_ms
        rows.append([name, what, f"{plain:.1f} ms each, {share_plain:.2%} of the run", ours])
    return rows


def nanogpt_rows(name: str, run: RunResult, log: str) -> list[list[str]]:
    whole = _account(run)
    times = {int(m[1]): float(m[2]) for m in map(ITER.match, log.splitlines()) if m}
    evals = [t for i, t in times.items() if i and i % 20 == 0]
    usual = statistics.median(t for i, t in times.items() if i > WARMUP and i % 20)
    plain = statistics.fmean(t - usual for t in evals)
    periodic = [w for w in whole.works if w.period == 20]
    ours = sum(w.per_occurrence_ms for w in periodic)
    share = sum(whole.share(w.extra_ms) for w in periodic)
    named = ", ".join(f"{w.kind} {w.per_occurrence_ms:.0f} ms at {w.line or '-'}"
                      for w in periodic)
    return [[name, f"evaluation + save every 20 ({len(evals)} x)",
             f"{plain:.0f} ms each, {len(evals) * plain / whole.wall_ms:.2%} of the run",
             f"{ours:.0f} ms each ({named}), {share:.2%}"]]


def rows_for(folder: Path) -> list[list[str]]:
    run = load_run(folder)
    name = folder.name
    if (folder / "nanogpt-log.txt").is_file():
        return nanogpt_rows(name, run, (folder / "nanogpt-log.txt").read_text())
    truth = json.loads((folder / "truth.json").read_text())
    return host_rows(name, run, truth) if "augment_ms" in truth else \
        periodic_rows(name, run, truth)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", type=Path, nargs="+")
    args = parser.parse_args()
    print("| run | figure | plain timer | gpudiag |")
    print("|---|---|---:|---:|")
    for folder in args.folders:
        if (folder / "run.json").is_file():
            for row in rows_for(folder):
                print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
