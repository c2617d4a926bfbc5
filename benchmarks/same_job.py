"""Whether `gpudiag profile` trains the job the script trains without it (issue 56: Lightning
DDP trained with batch size 1 under gpudiag, its DataLoader rebuilt from a hook's bare
signature).

    python benchmarks/same_job.py [--only lightning-ddp ...] [--out reports/examples/same-job]

Lightning, the Hugging Face Trainer and Accelerate, each in one process and as a 2-rank DDP
job on CPU (gloo): the tiny deterministic scripts under benchmarks/same_job/ print each step's
rank, global step, batch size and loss (the float's repr). Each job runs plain, then under
`gpudiag profile --no-rerun` with a schedule whose profiler window falls inside its 30 steps;
a row passes when every rank made the same steps, of the same batch sizes, with bit-identical
losses. Writes same_job.json and same_job.md to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

from gpudiag.model.runfile import load_run

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "same_job"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2"]
# A profiler window inside the jobs' 30 steps (warm-up 3, 6 timed, 2 profiled), no re-run.
PROFILE = [sys.executable, "-m", "gpudiag", "profile", "--no-rerun", "--warmup", "3", "--timed",
           "6", "--evidence-steps", "2", "--telemetry", "off", "--no-plots"]
FRAMEWORKS = {"lightning": "lightning", "hf-trainer": "transformers",
              "accelerate": "accelerate"}
MARK = re.compile(r"SAMEJOB (\{\"rank\": [^{}]*\})")  # a step's line, as the scripts print it
TIMEOUT_S = 900


def _command(job: str, hf_out: Path) -> list[str]:
    """The job's command line, as a user would type it."""
    framework, mode = job.rsplit("-", 1)
    if framework == "lightning":  # Lightning starts its DDP ranks itself
        return [sys.executable, str(SCRIPTS / "lightning_job.py"), "2" if mode == "ddp" else "1"]
    script = str(SCRIPTS / ("hf_job.py" if framework == "hf-trainer" else "accelerate_job.py"))
    extra = [str(hf_out)] if framework == "hf-trainer" else []
    return [*(TORCHRUN if mode == "ddp" else [sys.executable]), script, *extra]


JOBS = [f"{framework}-{mode}" for framework in FRAMEWORKS for mode in ("single", "ddp")]


@dataclass
class Steps:
    """What one run printed: each rank's (step, batch size, loss repr), in order; its exit."""

    returncode: int
    by_rank: dict[int, list[tuple[int, int, str]]]
    seconds: float
    gpudiag: dict[str, object] = field(default_factory=dict)  # what the profile recorded


def _run(command: list[str], cwd: Path) -> Steps:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = datetime.datetime.now()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    seconds = (datetime.datetime.now() - start).total_seconds()
    by_rank: dict[int, list[tuple[int, int, str]]] = {}
    for found in MARK.finditer(done.stdout):  # anywhere: two ranks share one pipe
        step = json.loads(found.group(1))
        by_rank.setdefault(step["rank"], []).append((step["step"], step["batch"], step["loss"]))
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
    return Steps(done.returncode, dict(sorted(by_rank.items())), round(seconds, 1))


def _recorded(run_dir: Path) -> dict[str, object]:
    """What gpudiag recorded of the profiled run: steps, batch size, whether it profiled."""
    stages = load_run(run_dir).stages
    return {"stages": len(stages),
            "steps": [s.facts.script.steps if s.facts and s.facts.script else None
                      for s in stages],
            "samples_per_step": [s.samples_per_step for s in stages],
            "profiler_window": [s.evidence is not None for s in stages]}


@dataclass
class Row:
    job: str
    command: list[str]
    plain: Steps
    profiled: Steps
    steps_per_rank: dict[int, tuple[int, int]]  # rank: (plain, profiled)
    batch_sizes: list[int]  # every batch size seen, plain or profiled
    same_steps: bool
    same_batches: bool
    same_losses: bool  # bit for bit (the floats' repr)
    max_loss_difference: float
    passed: bool


def _compare(job: str, command: list[str], plain: Steps, profiled: Steps) -> Row:
    ranks = sorted(set(plain.by_rank) | set(profiled.by_rank))
    a = {r: plain.by_rank.get(r, []) for r in ranks}
    b = {r: profiled.by_rank.get(r, []) for r in ranks}
    same_steps = all([s for s, _, _ in a[r]] == [s for s, _, _ in b[r]] for r in ranks)
    same_batches = all([n for _, n, _ in a[r]] == [n for _, n, _ in b[r]] for r in ranks)
    same_losses = all([x for _, _, x in a[r]] == [x for _, _, x in b[r]] for r in ranks)
    gaps = [abs(float(x) - float(y)) for r in ranks
            for (_, _, x), (_, _, y) in zip(a[r], b[r], strict=False)]
    expected_ranks = 2 if job.endswith("-ddp") else 1
    passed = (plain.returncode == profiled.returncode == 0 and len(ranks) == expected_ranks
              and all(a[r] for r in ranks) and same_steps and same_batches and same_losses)
    return Row(job, command, plain, profiled, {r: (len(a[r]), len(b[r])) for r in ranks},
               sorted({n for r in ranks for _, n, _ in a[r] + b[r]}), same_steps,
               same_batches, same_losses, max(gaps, default=0.0), passed)


def _job(job: str, tmp: Path) -> Row:
    plain_dir, profiled_dir = tmp / job / "plain", tmp / job / "profiled"
    plain_dir.mkdir(parents=True)
    profiled_dir.mkdir(parents=True)
    command = _command(job, Path("hf-out"))
    print(f"{job}: {' '.join(command)}", file=sys.stderr, flush=True)
    plain = _run(command, plain_dir)
    run_dir = profiled_dir / "run"
    profiled = _run([*PROFILE, "--out", str(run_dir), "--", *command], profiled_dir)
    if (run_dir / "run.json").is_file():
        profiled.gpudiag = _recorded(run_dir)
    shown = ["python" if part == sys.executable else part.replace(f"{ROOT}/", "")
             for part in command]  # as typed in the repository's root
    row = _compare(job, shown, plain, profiled)
    print(f"{job}: {'pass' if row.passed else 'FAIL'} {row.steps_per_rank} batches "
          f"{row.batch_sizes} losses {'identical' if row.same_losses else 'differ'}",
          file=sys.stderr, flush=True)
    return row


def _markdown(rows: list[Row], versions: dict[str, str]) -> str:
    lines = ["# The same job with and without `gpudiag profile`", "",
             "`python benchmarks/same_job.py` (issue 56): each job plain, then under `"
             + " ".join(["gpudiag", *PROFILE[3:]]) + " -- <the same command>`; CPU, gloo, "
             "one intra-op thread. Steps per rank are plain/profiled; losses are compared as "
             "the floats' repr (bit for bit).", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), "",
             "| job | ranks | steps per rank (plain/profiled) | batch sizes | losses | "
             "max loss difference | gpudiag saw (steps, batch, window) | result |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        steps = ", ".join(f"{r}: {p}/{q}" for r, (p, q) in row.steps_per_rank.items())
        seen = row.profiled.gpudiag
        saw = (f"{seen.get('steps')}, {seen.get('samples_per_step')}, "
               f"{seen.get('profiler_window')}" if seen else "no run recorded")
        lines.append(f"| {row.job} | {len(row.steps_per_rank)} | {steps} | "
                     f"{row.batch_sizes} | {'identical' if row.same_losses else 'differ'} | "
                     f"{row.max_loss_difference:g} | {saw} | "
                     f"{'pass' if row.passed else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def _versions() -> dict[str, str]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True, check=False).stdout.strip()
    return {"gpudiag": commit, "python": platform.python_version(), "torch": version("torch"),
            **{package: version(package) for package in FRAMEWORKS.values()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=JOBS, default=[])
    parser.add_argument("--out", type=Path, default=ROOT / "reports/examples/same-job")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="same-job-") as tmp:
        rows = [_job(job, Path(tmp)) for job in args.only or JOBS]
    versions = _versions()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "same_job.json").write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions, "machine": platform.platform(), "profile": PROFILE[2:],
        "rows": [asdict(row) for row in rows]}, indent=1) + "\n")
    (args.out / "same_job.md").write_text(_markdown(rows, versions))
    print(_markdown(rows, versions))
    return 0 if all(row.passed for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
