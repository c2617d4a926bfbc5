"""`gpudiag gate --base-ref` of gpudiag's workload (`--model`): README's recipe is the one the
benchmarks measured, a head that cannot run is the head's failure, bad input is one line, and
the user's own worktrees stay registered. (The recipe for a user's script, end to end:
tests/test_gate_script.py; the decisions: tests/test_gate.py.)"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
from conftest import GIT, git, gpudiag_repo, in_folder, invoke

ROOT = Path(__file__).resolve().parents[1]


def _benchmark(name: str = "gate_regressions") -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_gate_command() -> list[str]:
    """The `gpudiag gate --base-ref` command of README.md's CI section, continuations joined."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^(gpudiag gate --base-ref \S+ --model (?:.*\\\n)*.*)$", text, re.M)
    assert match, "README.md shows no `gpudiag gate --base-ref` command"
    return shlex.split(match.group(1).replace("\\\n", " "))


def test_the_readme_recipe_is_the_benchmarked_one() -> None:
    """README's gate command is the one benchmarks/gate_decides.py measured on an H100 (and
    gate_regressions.py replays): the same limits, the default first trial, the same cap."""
    argv = readme_gate_command()
    limits = [argv[i + 1] for i, a in enumerate(argv) if a == "--max-regression"]
    for bench in (_benchmark("gate_decides"), _benchmark()):
        assert limits == bench.RECIPE_LIMITS
        assert argv[argv.index("--max-trials") + 1] == str(bench.RECIPE_MAX_TRIALS)
    assert "--trials" not in argv
    assert "gpudiag calibrate" in (ROOT / "README.md").read_text()


def _gpudiag(cwd: Path, *args: str, env: dict[str, str] | None = None,
             ) -> subprocess.CompletedProcess[str]:
    """`gpudiag ARGS` from `cwd` with `env`, in this process (its trials run in their own)."""
    with in_folder(cwd):
        done = invoke(args, env=env)
    assert done.exception is None or isinstance(done.exception, SystemExit), done.exception
    return subprocess.CompletedProcess(args, done.exit_code, done.stdout, done.stderr)


@pytest.mark.heavy
def test_a_head_that_cannot_import_its_model_is_the_heads_failure(tmp_path: Path) -> None:
    """The head commit leaves a SyntaxError in the model file the gate runs: the base's trial
    ran, the head's wrote nothing. Exit 5 (the head broke), not 2 (bad input), in one line
    that says it was the head; the worktree is gone."""
    repo = gpudiag_repo(tmp_path, {"model.py": ROOT / "tests" / "tiny_mlp.py"})
    (repo / "model.py").write_text("def factory(options:\n")  # the head's typo
    git(repo, "commit", "-qam", "broken")
    done = _gpudiag(repo, "gate", "--base-ref", "HEAD~1", "--device", "cpu", "--preset", "tiny",
                    "--model", "model.py:factory", "--stages", "train", "--iters", "4",
                    "--evidence-steps", "0", "--out", str(tmp_path / "job"))
    assert done.returncode == 5, done.stdout + done.stderr
    assert "the head (this checkout) broke where the base ran" in done.stderr
    assert "Traceback" not in done.stderr.split("gpudiag: error:")[-1]
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=repo, capture_output=True,
                               text=True, check=True).stdout
    assert len(worktrees.strip().splitlines()) == 1


@pytest.mark.slow
def test_base_ref_errors_are_one_line(tmp_path: Path) -> None:
    outside = _gpudiag(tmp_path, "gate", "--base-ref", "main", "--device", "cpu")
    assert outside.returncode == 2 and "not inside a git repository" in outside.stderr
    subprocess.run([*GIT, "init", "-q"], cwd=tmp_path, check=True)
    missing = _gpudiag(tmp_path, "gate", "--base-ref", "nope", "--device", "cpu")
    assert missing.returncode == 2 and "no such commit" in missing.stderr
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    both = _gpudiag(tmp_path, "gate", "a", "b", "--base-ref", "main")
    assert both.returncode == 2 and "not both" in both.stderr
    stray = _gpudiag(tmp_path, "gate", "a", "b", "--stages", "train-fp16")
    assert stray.returncode == 2 and "only apply with --base-ref" in stray.stderr
    for err in (outside, missing, both, stray):
        assert "Traceback" not in err.stderr and len(err.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "reports").exists()  # nothing written for a gate that never ran


def test_an_unwritable_step_summary_is_a_warning(tmp_path: Path) -> None:
    from gpudiag.model.runfile import load_run, save_run

    run = load_run(ROOT / "tests" / "data" / "h100-dgca-run.json")
    save_run(run, tmp_path / "a" / "run.json")
    for stage in run.stages:  # another run of the same steps: the gate refuses one run twice
        stage.iter_ms.reverse()
    save_run(run, tmp_path / "b" / "run.json")
    env = {"GITHUB_STEP_SUMMARY": str(tmp_path / "no-such-dir" / "summary.md")}
    done = _gpudiag(tmp_path, "gate", "a", "b", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "warning: GITHUB_STEP_SUMMARY" in done.stderr


def test_a_run_whose_steps_its_own_evidence_contradicts_is_refused(tmp_path: Path) -> None:
    """The head's steps saved from the wrong window (a warm-up's 2 us where its stage's
    kernels take ~75 ms a step): refused in one line, exit 2, never a pass."""
    from gpudiag.model.runfile import load_run, save_run

    run = load_run(ROOT / "tests" / "data" / "h100-dgca-run.json")
    save_run(run, tmp_path / "base" / "run.json")
    for stage in run.stages:
        stage.iter_ms = [0.002 + 1e-6 * k for k in range(len(stage.iter_ms))]
    save_run(run, tmp_path / "head" / "run.json")
    done = _gpudiag(tmp_path, "gate", "base", "head")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "head/run.json: stages[0].iter_ms: a mean step of 0.002" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "PASS" not in done.stdout


def _committed(repo: Path, files: dict[str, str]) -> Path:
    """A git repository at `repo` holding `files` (name -> text) in one commit."""
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "a"]):
        git(repo, *args)
    return repo


@pytest.mark.slow
def test_the_base_checkout_leaves_the_users_worktrees_registered(tmp_path: Path) -> None:
    """gate --base-ref's worktree is removed alone: a worktree of the user's whose directory
    is missing at that moment (an unmounted drive, a moved folder) stays registered."""
    from gpudiag.measure.gatejob import base_checkout

    repo = _committed(tmp_path / "repo", {"a.txt": "a\n"})
    mine = tmp_path / "drive" / "feature"
    git(repo, "worktree", "add", "-q", "-b", "feature", str(mine))
    (tmp_path / "drive").rename(tmp_path / "unmounted")  # its directory is gone for now

    def listed() -> str:
        return subprocess.run(["git", "worktree", "list", "--porcelain"], cwd=repo,
                              capture_output=True, text=True, check=True).stdout

    with base_checkout("HEAD", repo) as base:
        assert (base / "a.txt").read_text() == "a\n"
    assert str(mine) in listed() and "gpudiag-gate" not in listed()
    (tmp_path / "unmounted").rename(tmp_path / "drive")
    assert subprocess.run(["git", "status", "--short"], cwd=mine, check=False,
                          capture_output=True).returncode == 0


@pytest.mark.slow
def test_a_killed_gates_worktree_is_removed_by_the_next_gate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gate SIGKILLed inside its base checkout leaves the worktree registered and its folder;
    the next gate removes both, and nothing of a live gate's or of the user's."""
    from gpudiag.measure.gatejob import base_checkout

    repo = _committed(tmp_path / "repo", {"a.txt": "a\n"})
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    mine = tmp_path / "feature"
    git(repo, "worktree", "add", "-q", "-b", "feature", str(mine))
    code = ("import sys, time; from pathlib import Path; "
            "from gpudiag.measure.gatejob import base_checkout\n"
            "with base_checkout('HEAD', Path(sys.argv[1])):\n"
            "    print('in', flush=True); time.sleep(60)\n")
    killed, live = (subprocess.Popen([sys.executable, "-c", code, str(repo)],
                                     stdout=subprocess.PIPE, text=True) for _ in range(2))
    try:
        for gate in (killed, live):
            assert gate.stdout is not None and gate.stdout.readline() == "in\n"
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert len(_worktrees(repo)) == 4 and len(list(temp.iterdir())) == 2
        with base_checkout("HEAD", repo):
            assert len(_worktrees(repo)) == 4  # the killed one's gone, this one's in
        assert [t for t in _worktrees(repo) if f"-{killed.pid}-" in str(t)] == []
        assert mine in _worktrees(repo)
        assert [p.name.split("-")[2] for p in temp.iterdir()] == [str(live.pid)]
    finally:
        live.kill()
        live.wait()


@pytest.mark.slow
def test_a_folder_the_base_lacks_is_named_before_any_worktree(tmp_path: Path) -> None:
    """The gate run from sub/, which the head added: one line naming the folder, no
    worktree, not a trial failing in a deleted temporary path."""
    from gpudiag.measure.gatejob import base_checkout
    from gpudiag.model.errors import BadInput

    repo = _committed(tmp_path / "repo", {"a.txt": "a\n"})
    (repo / "sub").mkdir()
    (repo / "sub" / "train.py").write_text("print(1)\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "sub")
    with (pytest.raises(BadInput, match=r"'HEAD~1' has no sub/, the folder this gate runs"),
          base_checkout("HEAD~1", repo / "sub")):
        pass
    assert len(git(repo, "worktree", "list").strip().splitlines()) == 1
    with base_checkout("HEAD", repo / "sub") as base:
        assert (base / "train.py").is_file()


@pytest.mark.slow
def test_the_head_checkout_is_this_checkout_as_it_is(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A script's head runs in a worktree holding this checkout's uncommitted change and its
    untracked file, made from a freshly copied clone (stale stat data in its index, as on a CI
    runner) by a git with no identity configured; the user's checkout is left as it was."""
    from gpudiag.measure.gatejob import head_checkout

    made = _committed(tmp_path / "made", {"train.py": "steps = 10\n", ".gitignore": "data/\n"})
    repo = tmp_path / "copied"
    shutil.copytree(made, repo)
    later = (repo / ".gitignore").stat().st_mtime + 5
    os.utime(repo / ".gitignore", (later, later))  # as a copy made later: its index is stale
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "no-config"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    with head_checkout(repo) as head:  # nothing changed: HEAD
        assert (head / "train.py").read_text() == "steps = 10\n"
    (repo / "train.py").write_text("steps = 20\n")
    (repo / "notes.py").write_text("new = 1\n")
    (repo / "data").mkdir()
    (repo / "data" / "big.bin").write_bytes(b"0" * 10)
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True,
                            text=True, check=True).stdout
    with head_checkout(repo) as head:
        assert (head / "train.py").read_text() == "steps = 20\n"
        assert (head / "notes.py").read_text() == "new = 1\n"
        assert not (head / "data").exists()  # ignored: --share's to link
    assert subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True,
                          text=True, check=True).stdout == status
    assert not subprocess.run(["git", "stash", "list"], cwd=repo, capture_output=True,
                              text=True, check=True).stdout


@pytest.mark.slow
def test_a_head_with_an_untracked_environment_is_refused_before_any_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An untracked, unignored folder past the copy's budget (a venv, a dataset) is refused in
    one line naming it, before any worktree exists; within the budget it is copied."""
    from gpudiag.measure import gatejob
    from gpudiag.model.errors import BadInput

    repo = _committed(tmp_path / "repo", {"train.py": "steps = 10\n"})
    (repo / "venv" / "lib").mkdir(parents=True)
    for k in range(5):
        (repo / "venv" / "lib" / f"m{k}.py").write_text("x = 1\n")
    monkeypatch.setattr(gatejob, "MAX_UNTRACKED_FILES", 4)
    refused = pytest.raises(BadInput, match=r"5 untracked files .* most under venv\) would be")
    with refused, gatejob.head_checkout(repo):
        pass
    assert "gpudiag-gate" not in subprocess.run(["git", "worktree", "list"], cwd=repo,
                                                capture_output=True, text=True,
                                                check=True).stdout
    monkeypatch.setattr(gatejob, "MAX_UNTRACKED_FILES", 5)
    with gatejob.head_checkout(repo) as head:
        assert (head / "venv" / "lib" / "m4.py").read_text() == "x = 1\n"


@pytest.mark.slow
def test_submodules_are_checked_out_offline_from_the_users_copies(tmp_path: Path) -> None:
    """A submodule (its remote gone: offline) is in both sides' worktrees: the base's at the
    commit it records, the head's as the user's copy is (moved, with a change); one the user
    has not checked out stays empty; a commit the user's copy lacks is named in one line
    before any trial. The user's checkout is left as it was."""
    from gpudiag.measure.gatejob import base_checkout, head_checkout
    from gpudiag.model.errors import BadInput

    lib = _committed(tmp_path / "lib", {"v.txt": "1\n"})
    repo = _committed(tmp_path / "repo", {"train.py": "steps = 1\n"})
    for name in ("lib", "docs"):
        git(repo, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), name)
    git(repo, "commit", "-qm", "submodules")
    git(repo, "submodule", "deinit", "-q", "docs")  # the user never checked it out
    (repo / "lib" / "v.txt").write_text("2\n")
    git(repo / "lib", "commit", "-qam", "2")
    (repo / "lib" / "v.txt").write_text("3\n")  # and changed it since
    shutil.rmtree(lib)  # no remote to fetch from
    status = git(repo, "status", "--porcelain")
    with base_checkout("HEAD", repo) as base:
        assert (base / "lib" / "v.txt").read_text() == "1\n"
        assert (base / "docs").is_dir() and not list((base / "docs").iterdir())
    with head_checkout(repo) as head:
        assert (head / "lib" / "v.txt").read_text() == "3\n"
    assert git(repo, "status", "--porcelain") == status and _worktrees(repo) == [repo]
    git(repo, "commit", "-qam", "lib at 2")
    git(repo / "lib", "reset", "-q", "--hard", "HEAD~1")
    git(repo / "lib", "reflog", "expire", "--expire=now", "--all")
    git(repo / "lib", "gc", "-q", "--prune=now")  # commit 2 gone from the user's copy
    with pytest.raises(BadInput, match=r"submodule lib: your checkout's copy lacks commit"), \
            base_checkout("HEAD", repo):
        pass
    assert _worktrees(repo) == [repo]


@pytest.mark.slow
def test_a_commands_absolute_path_into_the_repository_is_the_sides_own(tmp_path: Path) -> None:
    """`python /repo/sub/train.py` from /repo/sub: each side's trial runs its checkout's file,
    not the head's; a path outside the repository stays as given."""
    from gpudiag.measure.gatejob import TrialCommand, base_checkout

    repo = _committed(tmp_path / "repo", {"sub/train.py": "steps = 1\n"})
    outside = str(tmp_path / "data.bin")
    trial = TrialCommand(command=("python", str(repo / "sub" / "train.py"), outside), top=repo)
    with in_folder(repo / "sub"), base_checkout("HEAD", repo / "sub") as base:
        *_, script, data = trial.argv(base, tmp_path / "out")
        assert script == str(base / "train.py") and Path(script).is_file()
        assert data == outside


@pytest.mark.slow
def test_an_ignored_environment_in_the_repository_runs_the_command_on_both_sides(
        tmp_path: Path) -> None:
    """`.venv/bin/python train.py` with .venv/ ignored by git (uv's and poetry's layout): no
    worktree has it, so each side runs the user's interpreter, unresolved (a venv's python is
    a link out of it), and is told so; a program in git, or found on PATH, stays the side's."""
    from gpudiag.measure.confine import ConfinementPolicy
    from gpudiag.measure.gatejob import base_checkout, command_note, command_trial

    repo = _committed(tmp_path / "repo", {"train.py": "print('trained')\n",
                                         "run.sh": "exit 0\n", ".gitignore": ".venv/\n"})
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    trial = command_trial([".venv/bin/python", "train.py"], None, repo)
    assert trial.program == str(python)
    with in_folder(repo), base_checkout("HEAD", repo) as base:
        argv = trial.argv(base, tmp_path / "out")
        assert argv[-2:] == [str(python), "train.py"] and not (base / ".venv").exists()
        ran = subprocess.run(argv[-2:], cwd=base, capture_output=True, text=True, check=True)
        assert ran.stdout == "trained\n"
    absolute = command_trial([str(python), "train.py"], None, repo)
    assert absolute.program == str(python)
    for tracked in (["./run.sh"], ["python", "train.py"], ["missing/python", "train.py"]):
        assert command_trial(tracked, None, repo).program is None
    note = command_note([], ConfinementPolicy(), program=trial.program)
    kept = "read-only" if ConfinementPolicy().confined else "as it is"
    assert f"its program is your {python} (ignored by git), {kept}" in note


def _worktrees(repo: Path) -> list[Path]:
    listed = subprocess.run(["git", "worktree", "list", "--porcelain"], cwd=repo,
                            capture_output=True, text=True, check=True).stdout
    return [Path(line.split(" ", 1)[1]) for line in listed.splitlines()
            if line.startswith("worktree ")]


@pytest.mark.slow
def test_a_gate_job_checks_out_both_sides_before_its_run_folder(tmp_path: Path) -> None:
    """A bad ref makes no run folder; a user's command gets both sides checked out, --share
    linked into each, before the folder is made and the trials start; none is left after."""
    from gpudiag.measure.gatejob import Interleaved, TrialCommand, gate_job
    from gpudiag.model.errors import BadInput

    repo = _committed(tmp_path / "repo", {"train.py": "steps = 1\n", ".gitignore": "data/\n"})
    (repo / "data").mkdir()
    (repo / "data" / "x").write_text("1")
    trial = TrialCommand(command=("python", "train.py"), top=repo)
    made: list[Path] = []
    shared: list[bool] = []

    def out_dir() -> Path:
        made.append(tmp_path / "out")
        return made[-1]

    def started(out: Path) -> None:
        shared.extend((tree / "data" / "x").is_file() and (tree / "data").is_symlink()
                      for tree in _worktrees(repo) if tree != repo)

    def no_trials(done: Interleaved) -> int:
        return 0

    with pytest.raises(BadInput, match="no such commit"):
        gate_job(trial, "nope", repo, share=[], first=1, out_dir=out_dir, next_count=no_trials)
    assert not made
    done = gate_job(trial, "HEAD", repo, share=["data"], first=0, out_dir=out_dir,
                    next_count=no_trials, on_start=started)
    assert done == Interleaved(tmp_path / "out")
    assert shared == [True, True]  # base and head, each with data/ linked in
    assert _worktrees(repo) == [repo]


def test_only_a_users_command_has_a_trials_policy_and_a_note_before_it_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """gpudiag's workload writes only its run folders: no policy. A user's command is said to
    run in a temporary checkout before it does, with what --share links into it."""
    from gpudiag.measure import confine
    from gpudiag.measure.confine import ConfinementPolicy

    # What this kernel leaves open is asked of a process of its own: not in the fast tier.
    monkeypatch.setattr(confine, "shm_of_its_own", lambda: True)
    from gpudiag.measure.gatejob import command_note, trials_policy
    from gpudiag.model.options import ConfineOptions

    assert trials_policy(ConfineOptions(), [], "gate --base-ref") is None
    policy = trials_policy(ConfineOptions(unconfined_reruns=True), ["python", "t.py"],
                           "gate --base-ref")
    assert policy is not None and policy.unconfined
    note = command_note(["data"], ConfinementPolicy(unconfined=True),
                        who="calibrate: the trials run")
    assert note.startswith("calibrate: the trials run in a temporary checkout (this checkout "
                           "with its uncommitted changes"), note
    assert "data linked into it" in note
    assert "--share" not in command_note([], ConfinementPolicy(unconfined=True))
