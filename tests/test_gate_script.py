"""README's CI recipe for the user's own script, end to end on the CPU: `gpudiag gate
--base-ref REF -- python train.py` in a real git repository, each trial a `gpudiag profile` of
the script in a temporary worktree; the profiled runs it leaves gated against each other
(`gate A B`) and calibrated from (`calibrate --from`). The step sleeps: on a loaded 2-core
machine its time holds to a few percent, as a GPU step's does on its runner, and the
calibration the recipe asks for is written as a runner's committed file would be."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import GIT, git, in_folder, invoke, line_of

from gpudiag.measure import childexec

ROOT = Path(__file__).resolve().parents[1]
# Its own update and gpudiag.step() (README: a loop without an optimizer): torch.optim's first
# optimizer imports torch._dynamo, 2.6 s of every process on a 2-core machine.
SCRIPT = '''\
import time

import torch

import gpudiag

torch.manual_seed(0)
weight = torch.randn(32, 32, requires_grad=True)
x = torch.randn(16, 32)
for step in range(40):
    loss = (x @ weight).square().mean()
    loss.backward()
    with torch.no_grad():
        weight -= 0.01 * weight.grad
        weight.grad = None
    gpudiag.step()
    time.sleep(0.020)
'''
SLEEP = "    time.sleep(0.020)\n"
# This runner's spread between processes of the script, as `gpudiag calibrate -- python
# train.py` records it (a sleeping step: 0.1-0.5% on an idle 2-core VM; 1% for a loaded one).
CALIBRATION = {"schema_version": 1, "records": [{
    "device": "cpu", "gpu_name": None, "workload": {"mode": "profile"},
    "stages": [{"stage": "train.py", "trials": 8, "wall_sd": 0.01}]}]}


landlock = pytest.mark.skipif(childexec.landlock_abi() < 1, reason="the kernel has no Landlock")


def readme_script_gate() -> list[str]:
    """README's gate of a user's script (`gpudiag gate --base-ref ... -- python ...`), its
    continuations joined, up to the `--`."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^(gpudiag gate --base-ref (?:.*\\\n)*.* -- python .*)$", text, re.M)
    assert match, "README.md shows no `gpudiag gate --base-ref ... -- python` command"
    argv = shlex.split(match.group(1).replace("\\\n", " "))
    return argv[1:argv.index("--")]


def _repo(tmp: Path, head: str | None) -> Path:
    """tmp/repo: train.py committed as the base, `head` (a whole script) committed on top, and
    the runner's calibration committed where the gate reads it."""
    repo = tmp / "repo"
    repo.mkdir()
    (repo / "train.py").write_text(SCRIPT)
    (repo / ".gpudiag").mkdir()
    (repo / ".gpudiag" / "calibration.json").write_text(json.dumps(CALIBRATION))
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        git(repo, *args)
    if head is not None:
        (repo / "train.py").write_text(head)
        git(repo, "commit", "-qam", "head")
    return repo


def _gate(repo: Path, out: Path, *extra: str, env: dict[str, str] | None = None,
          ) -> subprocess.CompletedProcess[str]:
    argv = readme_script_gate()
    argv[argv.index("origin/main")] = "HEAD~1" if git(repo, "rev-list", "--count",
                                                     "HEAD").strip() != "1" else "HEAD"
    with in_folder(repo):
        done = invoke([*argv, "--out", str(out), *extra, "--", sys.executable, "train.py"],
                      env=env)
    assert done.exception is None or isinstance(done.exception, SystemExit), done.exception
    return subprocess.CompletedProcess(argv, done.exit_code, done.stdout, done.stderr)


def _worktrees(repo: Path) -> int:
    return len(git(repo, "worktree", "list").strip().splitlines())


@pytest.mark.slow
@pytest.mark.heavy
def test_a_slower_step_and_a_new_sync_fail_the_recipe_with_their_lines(
        tmp_path: Path) -> None:
    """The head sleeps 40% longer and reads the loss with .item() every step: exit 1 at the
    first trial a side, the wall time's regression at the sleep's line, the sync's at the
    .item() line, in the step summary and gate.md; the user's checkout and files untouched,
    the worktrees gone, no plots drawn for trials."""
    head = SCRIPT.replace(SLEEP, "    loss.item()\n    time.sleep(0.028)\n")
    repo = _repo(tmp_path, head)
    before = {p.name for p in repo.iterdir()}
    summary = tmp_path / "summary.md"
    done = _gate(repo, tmp_path / "job", env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert done.returncode == 1, done.stdout + done.stderr
    text = summary.read_text()
    assert text.startswith("## gpudiag gate: REGRESSION"), text
    assert (tmp_path / "job" / "gate.md").read_text() == text.rstrip("\n") + "\n"
    assert not list((tmp_path / "job").rglob("*.png"))
    sleep = f"train.py:{line_of(repo / 'train.py', 'time.sleep(0.028)')}"
    item = f"train.py:{line_of(repo / 'train.py', 'loss.item()')}"
    wall = next(line for line in done.stdout.splitlines() if "[wall]" in line)
    assert "regression" in wall and "step rate (samples per step unknown)" in wall, wall
    assert sleep in wall, wall
    syncs = next(line for line in done.stdout.splitlines() if "[syncs]" in line)
    assert "regression" in syncs and f"from {item}" in syncs, syncs
    assert "trial-2" not in {p.name for p in (tmp_path / "job" / "base").iterdir()}
    assert {p.name for p in repo.iterdir()} == before  # the script ran elsewhere
    assert not git(repo, "status", "--porcelain").strip()
    assert _worktrees(repo) == 1


@pytest.mark.slow
@pytest.mark.heavy
def test_unchanged_code_passes_the_recipe_and_its_runs_gate_and_calibrate(
        tmp_path: Path) -> None:
    """No change (an uncommitted edit to a comment, and an untracked file the head carries):
    exit 0, PASS, wall time decided. Its trials are profiled runs of the same code: two of them
    given to `gate A B` pass (an A/A pair), `calibrate --from` their folder records the spread
    between them, and a profile of a head that crashes before its first step, gated against
    one, exits 5 with the head's error."""
    repo = _repo(tmp_path, None)
    (repo / "train.py").write_text("# edited\n" + SCRIPT)
    (repo / "notes.txt").write_text("mine")
    # README's limits, wall time's widened for a loaded 2-core machine (sleeping steps overshoot
    # by what the scheduler gives them): the 40% slower head above fails at README's 10%.
    done = _gate(repo, tmp_path / "job", "--max-regression", "20")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("PASS"), done.stdout
    assert re.search(r"train.py wall time: decided \(pass\) with \d trial", done.stdout)
    assert (repo / "notes.txt").read_text() == "mine" and _worktrees(repo) == 1
    runs = sorted(p for p in (tmp_path / "job").glob("*/trial-*") if p.is_dir())
    assert len(runs) >= 2
    # One run a side: the calibrated 1% allows a 20% limit to be decided (README says so).
    with in_folder(repo):
        pair = invoke(["gate", str(runs[0]), str(runs[-1]), "--max-regression", "20"])
    assert pair.exit_code == 0 and pair.stdout.startswith("PASS"), pair.stdout
    trials = tmp_path / "trials"
    for run in runs:
        shutil.copytree(run, trials / f"{run.parent.name}-{run.name}")
    if len(runs) >= 3:
        with in_folder(tmp_path):
            calibrated = invoke(["calibrate", "--from", str(trials), "--file",
                                 str(tmp_path / "calibration.json")])
        assert calibrated.exit_code == 0, calibrated.output
        assert re.search(r"train.py: wall time \d+\.\d+% between processes", calibrated.stdout)
    (repo / "train.py").write_text("raise RuntimeError('broken on purpose')\n" + SCRIPT)
    with in_folder(repo):
        invoke(["profile", "--out", str(tmp_path / "crashed"), "--no-plots", "--",
                sys.executable, "train.py"])
        crashed = invoke(["gate", str(runs[0]), str(tmp_path / "crashed")])
    assert crashed.exit_code == 5, crashed.output
    assert crashed.stdout.startswith("FAILED: the head's run broke where the base's ran")
    assert re.search(r"failed\s+train.py \[wall\]: the head's stage failed where the base's "
                     r"ran: .*RuntimeError: broken on purpose", crashed.stdout), crashed.stdout


@pytest.mark.slow
def test_the_command_form_is_checked_before_anything_runs(tmp_path: Path) -> None:
    """Run options belong to gpudiag's workload, --share and --samples-per-step to a command,
    a --share path must exist under the working directory; each a one-line exit 2."""
    repo = _repo(tmp_path, None)
    cases = [
        (["gate", "--base-ref", "HEAD", "--stages", "train", "--", sys.executable, "train.py"],
         "measure gpudiag's workload"),
        (["gate", "--base-ref", "HEAD", "--share", "data"], "go with --base-ref REF -- COMMAND"),
        (["gate", "--base-ref", "HEAD", "--share", "data", "--", sys.executable, "train.py"],
         "--share data: no such file or directory"),
        (["calibrate", "--share", "data"], "--share goes with a COMMAND"),
        (["calibrate", "--stages", "train", "--", sys.executable, "train.py"],
         "a command is profiled with its defaults"),
        (["gate", "--base-ref", "HEAD", "--rerun-writable", "/tmp"],
         "--rerun-writable and --unconfined-reruns go with a COMMAND"),
        (["gate", "--base-ref", "HEAD", "--rerun-writable", "nowhere", "--", sys.executable,
          "train.py"], "--rerun-writable nowhere: not a folder"),
        (["gate", "--base-ref", "HEAD", "--rerun-writable", ".gpudiag", "--", sys.executable,
          "train.py"], "--rerun-writable .gpudiag: it is inside the working directory"),
        (["calibrate", "--rerun-writable", ".gpudiag", "--", sys.executable, "train.py"],
         "--rerun-writable .gpudiag: it is inside the working directory"),
    ]
    for argv, message in cases:
        with in_folder(repo):
            done = invoke(argv)
        assert done.exit_code == 2 and message in done.stderr, (argv, done.output)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert subprocess.run([*GIT, "worktree", "list"], cwd=repo, capture_output=True,
                          text=True, check=True).stdout.count("\n") == 1
    assert not (repo / "reports").exists()


# A script that writes where a gate's trial must not: the user's file outside the repository
# (an absolute path), and the repository's index (`git status` in its worktree may write only
# the worktree's own).
INTRUDER = '''\
import subprocess
import sys

try:
    with open(sys.argv[1], "a") as log:
        log.write("a trial wrote here\\n")
    print("outside: written")
except PermissionError:
    print("outside: refused")
subprocess.run(["git", "status", "--porcelain"], check=True, capture_output=True)
'''


@pytest.mark.slow
@pytest.mark.heavy
@landlock
def test_a_gated_command_is_confined_to_its_worktree(tmp_path: Path) -> None:
    """`gate --base-ref -- COMMAND`: each trial runs confined to its worktree, so the script's
    append to an absolute path of the user's is refused on both sides (it used to land twice),
    git in the worktree still works, and the gate says so before it runs."""
    repo = _repo(tmp_path, None)
    (repo / "train.py").write_text(INTRUDER + SCRIPT.replace("range(40)", "range(12)"))
    git(repo, "commit", "-qam", "intruder")
    outside = tmp_path / "mine" / "log.txt"
    outside.parent.mkdir()
    outside.write_text("mine\n")
    with in_folder(repo):
        done = invoke(["gate", "--base-ref", "HEAD", "--max-trials", "1", "--out",
                       str(tmp_path / "job"), "--", sys.executable, "train.py", str(outside)])
    assert done.exit_code == 0, done.output
    assert "the kernel refuses its writes to your files elsewhere" in done.stderr
    assert outside.read_text() == "mine\n"
    logs = sorted((tmp_path / "job").rglob("trial-1.log"))
    assert len(logs) == 2 and all("outside: refused" in p.read_text() for p in logs), logs
    assert not git(repo, "status", "--porcelain").strip() and _worktrees(repo) == 1


@pytest.mark.slow
@landlock
def test_a_command_that_cannot_run_confined_is_nothing_measured_and_says_why(
        tmp_path: Path) -> None:
    """A script that makes its output folder at an absolute path outside the repository (as
    nanoGPT's `--out_dir=/abs` does): refused on both sides, so the gate measured nothing:
    exit 4, the error quoted with the option that allows the folder, nothing made there."""
    repo = _repo(tmp_path, None)
    (repo / "train.py").write_text("import os, sys\nos.makedirs(sys.argv[1])\n" + SCRIPT)
    git(repo, "commit", "-qam", "an output folder outside")
    outside = tmp_path / "mine" / "out"
    with in_folder(repo):
        done = invoke(["gate", "--base-ref", "HEAD", "--max-trials", "1", "--out",
                       str(tmp_path / "job"), "--", sys.executable, "train.py", str(outside)])
    assert done.exit_code == 4, done.output
    assert done.stdout.startswith("NOTHING MEASURED"), done.stdout
    assert "PermissionError" in done.stdout and "--rerun-writable FOLDER" in done.stdout
    assert not outside.parent.exists() and _worktrees(repo) == 1


@pytest.mark.slow
def test_without_landlock_a_gated_command_runs_only_with_consent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel cannot confine the trials, `gate --base-ref -- COMMAND` and
    `calibrate -- COMMAND` refuse before any worktree or folder exists (the branch forced)."""
    repo = _repo(tmp_path, None)
    monkeypatch.setenv(childexec.ENV_OFF, "1")
    childexec.landlock_abi.cache_clear()
    try:
        for argv in (["gate", "--base-ref", "HEAD"], ["calibrate", "--trials", "3"]):
            with in_folder(repo):
                done = invoke([*argv, "--out", str(tmp_path / "job"), "--", sys.executable,
                               "train.py"])
            assert done.exit_code == 2, done.output
            assert "--unconfined-reruns" in done.stderr and "Traceback" not in done.output
            assert len(done.stderr.strip().splitlines()) == 1, done.stderr
            assert not (tmp_path / "job").exists() and _worktrees(repo) == 1
    finally:
        childexec.landlock_abi.cache_clear()
