"""Runs in a scratch copy with a guarantee, not a report (issue 38's red team): the kernel
confines their writes (Linux Landlock), so nothing linked into the copy (data past the budget,
.git, a virtualenv, the parents' folders) and no path outside it can be written; the copy sits
where the working directory sits, so `../data` reads the user's data; an absolute path to the
script runs the copy; files the user's run wrote are copied first; a stop while copying leaves
nothing. Where the kernel cannot confine, nothing re-runs without the user's consent."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import in_folder, invoke, script_run, script_stage, tree_hashes

from gpudiag.measure import childexec as confine
from gpudiag.measure import confine as confinement
from gpudiag.measure.confine import confined_writable
from gpudiag.measure.interrupts import stop_on_signals
from gpudiag.measure.profile.launching import scratch, session, userfiles
from gpudiag.measure.profile.launching.scratch import make_scratch
from gpudiag.model.errors import BadInput, ExitCode
from gpudiag.model.results import MeasuredFix, Rerun
from gpudiag.present.fixes import fixes_table, rerun_warning, reruns_markdown

landlock = pytest.mark.skipif(confine.landlock_abi() < 1, reason="the kernel has no Landlock")


def _user_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A project beside its data, as the red team built it: a dataset folder past the
    walk's per-folder limit, checkpoints to rotate, a log, a file past the copy budget, a
    repository; the run folder inside the project."""
    top = tmp_path / "work"
    source = top / "proj"
    for name, text in {"train.py": "", "train.log": "run start\n", "exp/out/ckpt-1001.pt": "c",
                       "big.bin": "B" * 500, ".git/index": "index", ".git/HEAD": "ref"}.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text(text)
    images = source / "data" / "images"
    images.mkdir(parents=True)
    for n in range(12):  # past DATASET_ENTRIES as the test sets it
        (images / f"{n}.jpg").write_text("jpg")
    (top / "data").mkdir()
    (top / "data" / "shared.txt").write_text("read beside the folder")
    return source, source / "reports" / "now"


ATTACKS = """
    import json, os, pathlib, sys, tempfile
    out = pathlib.Path(sys.argv[1])
    tried = {}
    def attempt(name, action):
        try:
            action()
            tried[name] = "done"
        except OSError as exc:
            tried[name] = type(exc).__name__
    attempt("append linked big file", lambda: open("big.bin", "a").write("x"))
    attempt("delete in linked dataset", lambda: os.remove("data/images/0.jpg"))
    attempt("rotate a dataset file", lambda: os.rename("data/images/1.jpg", "moved.jpg"))
    attempt("git index", lambda: open(".git/index", "w").write("rewritten"))
    attempt("write beside the folder", lambda: open("../data/shared.txt", "w").write("x"))
    attempt("absolute path outside", lambda: open(out / "elsewhere.txt", "w").write("x"))
    attempt("the log by absolute path", lambda: open(sys.argv[2], "a").write("moved\\n"))
    attempt("rotate a copied checkpoint", lambda: os.remove("exp/out/ckpt-1001.pt"))
    attempt("append the copied log", lambda: open("train.log", "a").write("again\\n"))
    attempt("a temporary file", lambda: tempfile.NamedTemporaryFile().close())
    attempt("read beside", lambda: open("../data/shared.txt").read())
    print(json.dumps(tried))
"""


@landlock
@pytest.mark.slow
def test_a_confined_run_writes_only_its_copy_and_its_own_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scratch, "MAX_COPY_BYTES", 100)  # big.bin is linked, not copied
    monkeypatch.setattr(scratch, "DATASET_ENTRIES", 10)  # data/images is a dataset: linked
    source, out = _user_folder(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "tmp").mkdir()
    before, beside = tree_hashes(source), tree_hashes(tmp_path / "work" / "data")
    made = make_scratch(source, out / "cwd", leave_out=out, confined=True)
    assert (made.root / "data" / "images").is_symlink() and (made.root / "big.bin").is_symlink()
    assert (made.root / ".git").is_symlink() and not (made.root / "train.log").is_symlink()
    script = tmp_path / "attacks.py"
    script.write_text(textwrap.dedent(ATTACKS))
    env = dict(os.environ)
    command = confine.child_command(
        made.command([sys.executable, str(script), str(elsewhere), str(source / "train.log")]),
        confined_writable([out, tmp_path / "tmp"], source, env, []))
    done = subprocess.run(command, cwd=made.root, env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    tried = json.loads(done.stdout)
    refused = {name for name, how in tried.items() if how == "PermissionError"}
    assert refused == {"append linked big file", "delete in linked dataset",
                       "rotate a dataset file", "git index", "write beside the folder",
                       "absolute path outside"}
    assert {name for name, how in tried.items() if how == "done"} == {
        "rotate a copied checkpoint", "append the copied log", "a temporary file",
        "read beside", "the log by absolute path"}  # moved into the copy: the copy's log
    assert tree_hashes(source, leave_out="reports/") == before  # the run folder: gpudiag's
    assert tree_hashes(tmp_path / "work" / "data") == beside
    assert not any(elsewhere.iterdir())
    assert (made.root / "train.log").read_text() == "run start\nmoved\nagain\n"


def test_the_copy_sits_where_the_folder_sits_and_takes_its_absolute_paths(
        tmp_path: Path) -> None:
    source, out = _user_folder(tmp_path)
    made = make_scratch(source, out / "cwd", leave_out=out)
    assert made.root == out / "cwd" / "work" / "proj"
    assert (made.root / ".." / "data" / "shared.txt").read_text() == "read beside the folder"
    assert (made.top / tmp_path.name).is_symlink() is False  # the source's own parent: made
    moved = made.command([sys.executable, str(source / "train.py"), f"--log={source}/train.log",
                          "--data", str(tmp_path / "work" / "data"), str(source / ".git"),
                          "relative.txt", "-x"])
    assert moved == [sys.executable, str(made.root / "train.py"),
                     f"--log={made.root}/train.log", "--data", str(tmp_path / "work" / "data"),
                     str(source / ".git"),  # only linked in the copy: the user's path stays
                     "relative.txt", "-x"]
    rerun = made.finish("x", out / "parts")
    assert not (out / "cwd" / "work").exists()  # nothing written: the mirror is gone too
    assert rerun.cwd == str(made.root)


def test_what_the_users_run_wrote_is_copied_before_the_budget_runs_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scratch, "MAX_COPY_FILES", 2)
    source = tmp_path / "proj"
    source.mkdir()
    for n in range(5):
        (source / f"a{n}.txt").write_text("s")
    (source / "train.log").write_text("a long log, larger than the small files" * 10)
    old = time.time() - 3600
    for path in source.iterdir():
        os.utime(path, (old, old))
    since = time.time() - 60
    os.utime(source / "train.log")  # written by the user's run, just now
    made = make_scratch(source, tmp_path / "run" / "cwd", leave_out=tmp_path / "run",
                        written_since=since)
    assert not (made.root / "train.log").is_symlink()
    assert sum(not (made.root / f"a{n}.txt").is_symlink() for n in range(5)) == 1


def test_a_stop_while_the_copy_is_made_leaves_no_half_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "proj"
    source.mkdir()
    for n in range(20):
        (source / f"{n}.txt").write_text("x")
    copied = []
    real_copy = scratch._copy

    def copy_then_stop(original: Path, copy: Path, *, may_copy: bool) -> str | None:
        copied.append(copy)
        if len(copied) == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # a CI job's timeout, mid-copy
        return real_copy(original, copy, may_copy=may_copy)

    monkeypatch.setattr(scratch, "_copy", copy_then_stop)
    top = tmp_path / "run" / "cwd"
    with pytest.raises(KeyboardInterrupt), stop_on_signals():
        make_scratch(source, top, leave_out=tmp_path / "run")
    assert not top.exists() and len(copied) == 5
    assert sorted(p.name for p in source.iterdir()) == sorted(f"{n}.txt" for n in range(20))


def test_names_that_are_not_utf8_are_written_escaped(tmp_path: Path) -> None:
    source = tmp_path / "proj"
    source.mkdir()
    odd = os.fsdecode(b"caf\xe9.bin")
    (source / odd).write_text("x")
    made = make_scratch(source, tmp_path / "run" / "cwd", leave_out=tmp_path / "run")
    (made.root / odd).unlink()
    made.links[made.root / odd] = str(source / odd)  # as if linked past the budget
    made.linked[source / odd] = None
    rerun = made.finish("x", tmp_path / "run" / "parts")
    assert rerun.linked == ["caf\\xe9.bin/"]
    "\n".join(reruns_markdown(script_run(reruns=[rerun]))).encode("utf-8")  # no UnicodeEncodeError


def test_a_fix_that_was_not_measured_is_never_to_be_made_permanent() -> None:
    from rich.console import Console

    run = script_run()
    run.fixes = [MeasuredFix(remedy="loader", title="DataLoader workers", status="failed",
                             change="DataLoader(num_workers=8)", note="its runs failed"),
                 MeasuredFix(remedy="none", title="Sync", status="no-remedy",
                             change="drop .item()", note="no safe automatic remedy")]
    console = Console(width=100, record=True)
    console.print(fixes_table(run))
    text = console.export_text()
    assert "make it permanent" not in text and "not recommended: its runs failed" in text
    assert "num_workers=8" not in text


def test_without_landlock_nothing_runs_in_a_copy_unless_the_user_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(confine.ENV_OFF, "1")
    confine.landlock_abi.cache_clear()
    try:
        script = tmp_path / "train.py"
        script.write_text("print('never runs')\n")
        with in_folder(tmp_path):
            done = invoke(["profile", "--try-fixes", "--out", tmp_path / "run", "--",
                           sys.executable, str(script)])
        assert done.exit_code == ExitCode.BAD_INPUT, done.output
        assert "--unconfined-reruns" in done.stderr and "Traceback" not in done.output
        assert not (tmp_path / "run").exists() and "never runs" not in done.output
    finally:
        confine.landlock_abi.cache_clear()


def test_the_rerun_record_says_how_it_was_kept() -> None:
    rerun = Rerun(label="loader", source="/u/proj", cwd="/u/proj/r/cwd/u/proj",
                  wrote_outside=["/data/out.pt"], confined=True)
    run = script_run(reruns=[rerun])
    text = "\n".join(reruns_markdown(run))
    assert "refused outside its copy" in text and "(read-only)" in text


@pytest.mark.slow
def test_a_child_dies_with_the_gpudiag_that_started_it(tmp_path: Path) -> None:
    """SIGKILL (the out-of-memory killer) to a gpudiag that started a trial, torchrun or a
    profiled command: the child gets SIGTERM (Linux's parent-death signal) instead of running
    on orphaned."""
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import subprocess, sys, time
            from gpudiag.measure.childexec import child_command
            child = subprocess.Popen(child_command([sys.executable, "-c",
                                                    "import time; time.sleep(60)"]))
            print(child.pid, flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    time.sleep(0.3)  # the child has exec'd its command
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child), "the child outlived the gpudiag that started it"


def _alive(pid: int) -> bool:
    """Running: not gone, and not a zombie waiting for init to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
def test_run_trials_start_through_the_child_launcher(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpudiag.measure import trialrun
    from gpudiag.model.options import RunOptions

    started: list[list[str]] = []
    real_popen = subprocess.Popen

    def record(command: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        started.append(command)
        return real_popen([sys.executable, "-c", "pass"], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", record)
    with pytest.raises(Exception, match="none of the 1 trials"):
        trialrun.run_trials(RunOptions(), tmp_path, 1)
    (command,) = started
    assert command[3] == confine.__file__ and command[4:6] == ["--parent", str(os.getpid())]
    assert command[command.index("--") + 1:][1:4] == ["-m", "gpudiag", "run"]


WRITES_ITS_OUTPUT_ELSEWHERE = """
    import sys
    import gpudiag

    for step in range(12):
        if step == 1:  # an absolute output path from the script's config
            with open(sys.argv[1], "w") as out:
                out.write("x")
        gpudiag.step()
"""


@pytest.mark.slow
@landlock
def test_a_run_in_a_copy_refused_a_write_outside_says_so_and_how_to_allow_it(
        tmp_path: Path) -> None:
    script = tmp_path / "proj" / "train.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(WRITES_ITS_OUTPUT_ELSEWHERE))
    target = tmp_path / "outputs" / "metrics.json"
    target.parent.mkdir()
    with in_folder(script.parent):
        done = invoke(["profile", "--no-plots", "--stop-after-window", "--warmup", "1",
                       "--timed", "2", "--steps", "1", "--host-sample-hz", "0", "--telemetry",
                       "off", "--out", tmp_path / "run", "--", sys.executable, "train.py",
                       target])
    assert done.exit_code == 1, done.output  # the script's own failure
    said = done.stderr.replace("\n", " ")
    assert f"could not write {target}: refused by confinement" in said
    assert f"--rerun-writable {target.parent} lets" in said and not target.exists()
    report = (tmp_path / "run" / "report.md").read_text()
    assert "refused outside its copy" in report and str(target) in report


SHORT_WITH_A_LOG = """
    import sys
    import gpudiag

    with open(sys.argv[1], "a") as log:  # its log outside its folder, as /tmp/app.log
        log.write("start\\n")
    for step in range(4):  # too few steps for the schedule: it is run once more
        gpudiag.step()
"""


@pytest.mark.slow
@landlock
def test_a_short_scripts_rerun_refused_its_log_leaves_the_users_run_standing(
        tmp_path: Path) -> None:
    """Issue 56's most common case: a short script that logs outside its folder succeeds; its
    re-run, confined to a copy, is refused the log and crashes. The user's run stands (exit
    0, not 1), and the terminal and report.md say the re-run could not write it and how to
    let it."""
    script = tmp_path / "proj" / "train.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(SHORT_WITH_A_LOG))
    log = tmp_path / "logs" / "app.log"
    log.parent.mkdir()
    with in_folder(script.parent):
        done = invoke(["profile", "--no-plots", "--host-sample-hz", "0", "--telemetry", "off",
                       "--out", tmp_path / "run", "--", sys.executable, "train.py", log])
    assert done.exit_code == 0, done.output
    said = done.stderr.replace("\n", " ")
    assert f"the re-run could not write {log}: refused by confinement" in said
    assert f"--rerun-writable {log.parent} lets" in said
    assert "the first run's results stand" in said and "Traceback" not in done.output
    assert log.read_text() == "start\n"  # the user's run's line alone
    report = (tmp_path / "run" / "report.md").read_text()
    assert "The re-run could not write" in report and "refused outside its copy" in report


@pytest.mark.slow
def test_without_landlock_a_short_script_is_not_run_again_unasked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(confine.ENV_OFF, "1")
    confine.landlock_abi.cache_clear()
    script = tmp_path / "train.py"
    script.write_text("import gpudiag\nn = 0\nwhile n < 4:\n    gpudiag.step()\n    n += 1\n")
    try:
        with in_folder(tmp_path):
            done = invoke(["profile", "--no-plots", "--host-sample-hz", "0", "--telemetry",
                           "off", "--out", tmp_path / "run", "--", sys.executable, "train.py"])
    finally:
        confine.landlock_abi.cache_clear()
    assert done.exit_code == 0, done.output
    said = done.stderr.replace("\n", " ")
    assert "it would run once more in a scratch copy" in said and "--unconfined-reruns" in said
    assert not (tmp_path / "run" / "rerun").exists()
    # Not re-run, it says it could not see, never that all is well.
    report = (tmp_path / "run" / "report.md").read_text()
    assert "no rule saw a material cost" not in report
    assert "No evidence for train.py: the stage failed (no timed steps: the script made 4" \
        in report and "could not see everything" in report


def test_a_busy_cpu_under_autogroup_scheduling_is_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpudiag.measure.profile.launching import session

    flag = tmp_path / "sched_autogroup_enabled"
    monkeypatch.setattr(session, "AUTOGROUP", flag)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for enabled, load, said in (("1", 3.0, True), ("1", 0.2, False), ("0", 3.0, False)):
        flag.write_text(enabled + "\n")
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        note = session.scheduling_note()
        assert (note is not None and "autogroup" in note and "load 3.0 on 2 CPUs" in note) \
            if said else note is None
    flag.unlink()  # not Linux, or no such knob
    assert session.scheduling_note() is None


def test_a_log_beside_many_data_files_is_copied_not_the_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The red team's 20,100 small files in data/ (shards of 1,500, each under the dataset
    limit) beside train.log and ckpt.pt: copied smallest first, the log and checkpoint were
    past the file budget, linked, and the re-run wrote through them. Files of folders that
    hold few go first."""
    monkeypatch.setattr(scratch, "MAX_COPY_FILES", 10)
    source = tmp_path / "proj"
    for shard in range(3):
        for n in range(6):
            (source / "data" / f"part{shard}").mkdir(parents=True, exist_ok=True)
            (source / "data" / f"part{shard}" / f"{n}.jpg").touch()  # empty: smallest
    (source / "train.log").write_text("run start\n")
    (source / "ckpt.pt").write_text("the user's")
    made = make_scratch(source, tmp_path / "run" / "cwd", leave_out=tmp_path / "run")
    assert not (made.root / "train.log").is_symlink() and not (made.root / "ckpt.pt").is_symlink()
    # The data: copied while the budget lasts (ten files, two of them the log and checkpoint),
    # linked past it.
    linked = [p for p in (made.root / "data").rglob("*.jpg") if p.is_symlink()]
    assert len(linked) == 18 - 8


@pytest.mark.parametrize(("abi", "said"), [
    (0, "this kernel cannot keep it from writing elsewhere (--unconfined-reruns)"),
    (2, "but not a truncate by path, which this kernel's Landlock, ABI 2, cannot refuse"),
    (7, "the kernel refuses its writes to your files elsewhere")])
def test_the_announcement_says_how_far_this_kernel_keeps_a_run(
        monkeypatch: pytest.MonkeyPatch, abi: int, said: str) -> None:
    """Each kernel's branch, forced: no Landlock (the user consented), one too old to refuse a
    truncate by path (Linux 5.13-6.1), and one that refuses every write."""
    monkeypatch.setattr(confinement, "landlock_abi", lambda: abi)
    monkeypatch.setattr(confinement, "shm_of_its_own", lambda: True)
    policy = confinement.ConfinementPolicy(unconfined=True)
    text = confinement.how_kept(policy, "the copy")
    assert said in text
    assert ("truncate" in text) == (abi == 2)


@landlock
@pytest.mark.slow
def test_a_cache_a_fresh_machine_lacks_is_made_and_writable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh runner has no ~/.cache yet: a confined run's first download (torch hub, Hugging
    Face) would be refused making it. The caches are made, empty, before the run."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "TRITON_CACHE_DIR")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton" / "cache")
    (tmp_path / "own").mkdir()
    writable = confined_writable([tmp_path / "own"], tmp_path / "work", env, [])
    assert str(home / ".cache") in writable and (tmp_path / "triton" / "cache").is_dir()
    assert not any((home / ".cache").iterdir())
    script = "import os, sys; os.makedirs(sys.argv[1]); open(sys.argv[1] + '/w', 'w').write('x')"
    done = subprocess.run(confine.child_command(
        [sys.executable, "-c", script, str(home / ".cache" / "huggingface" / "hub")], writable),
        env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def test_a_gate_trial_is_not_promised_a_list_of_its_writes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a profile's scratch copies are watched; a gate's or calibrate's trials are not, so
    neither their announcement nor their refusal says writes are listed afterwards."""
    monkeypatch.setattr(confinement, "landlock_abi", lambda: 0)
    monkeypatch.setattr(confinement, "shm_of_its_own", lambda: False)
    consented = confinement.ConfinementPolicy(unconfined=True)
    assert "listed" not in confinement.how_kept(consented, "its checkout", watched=False)
    refusal = confinement.confinement_refusal(confinement.ConfinementPolicy(), "gate",
                                              watched=False)
    assert refusal is not None and "--unconfined-reruns" in refusal and "listed" not in refusal
    monkeypatch.setattr(confinement, "landlock_abi", lambda: 2)
    assert "listed" not in confinement.how_kept(consented, "its checkout", watched=False)


@pytest.mark.parametrize(("given", "refused"), [
    ("proj/data", "it is inside the working directory"),
    ("proj/data/../data", "it is inside the working directory"),
    ("link-to-data", "it is inside the working directory"),
    (".", "it holds the working directory"),
    ("outputs", None)])
def test_a_folder_a_run_in_a_copy_may_write_is_outside_the_working_directory(
        tmp_path: Path, given: str, refused: str | None) -> None:
    """--rerun-writable (profile, gate, calibrate: all check it here) names a folder outside
    the working directory: one inside it, by any spelling, is refused (issue 56: `data` let a
    re-run delete data/keep.txt), as one holding it is; a folder beside it is allowed."""
    (tmp_path / "proj" / "data").mkdir(parents=True)
    (tmp_path / "outputs").mkdir()
    (tmp_path / "link-to-data").symlink_to(tmp_path / "proj" / "data")
    with in_folder(tmp_path / "proj"):
        path = str(tmp_path / given)
        if refused is None:
            policy = confinement.confinement_policy([path], unconfined=True, isolated=None)
            assert policy.writable == (str(tmp_path / "outputs"),)
        else:
            with pytest.raises(BadInput, match=refused):
                confinement.confinement_policy([path], unconfined=True, isolated=None)
    # Even handed one, the confined run's list leaves it out.
    source = (tmp_path / "proj").resolve()
    assert str(source / "data") not in confined_writable(
        [tmp_path / "run"], source, {}, [str(source / "data")])


@pytest.mark.parametrize(("written", "said"), [
    ("work/proj/big.bin", "big.bin (500 bytes) is past the scratch copy's budget (100 bytes "
     "copied, 20,000 files), so the copy links it read-only: move it out of this folder"),
    ("work/proj/data/images/0.jpg", "data/images/ is linked whole into the scratch copy"),
    ("work/proj/out/metrics.json", "that path is your folder's own, not the copy's"),
    ("logs/app.log", "if {tmp}/logs holds nothing of yours, --rerun-writable {tmp}/logs lets"),
    ("work/app.log", "{tmp}/work holds the working directory, which no run in a copy may "
     "write")])
def test_a_refused_write_comes_with_the_advice_that_applies_to_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str, said: str) -> None:
    """Issue 56: a 2 GiB log in the script's own folder, past the copy's budget, was refused
    with advice (--rerun-writable) that cannot apply to the working directory. Each refused
    path gets what can: the file named with the budget it is past, the folder linked whole,
    a path of the working directory's own, and the flag only for a folder it may name."""
    monkeypatch.setattr(scratch, "MAX_COPY_BYTES", 100)  # big.bin is linked, not copied
    monkeypatch.setattr(scratch, "DATASET_ENTRIES", 10)  # data/images is a dataset: linked
    source, out = _user_folder(tmp_path)
    made = make_scratch(source, out / "cwd", leave_out=out, confined=True)
    rerun = Rerun(label="loader", source=str(source), cwd=str(made.root), confined=True,
                  wrote_outside=[str(tmp_path / written)])
    refused = session.refused_writes(rerun, made.why_linked)
    assert refused is not None and refused.what.startswith(
        f"could not write {tmp_path / written}: refused by confinement")
    assert said.format(tmp=tmp_path) in refused.advice
    assert ("--rerun-writable" in refused.advice) == written.startswith(("logs", "work/app"))
    assert session.refused_writes(Rerun(label="x", source=str(source), cwd="c"),
                                  made.why_linked) is None  # nothing refused, nothing said


def test_a_failed_rerun_of_a_short_script_leaves_the_first_run_standing() -> None:
    """Issue 56: a short script's re-run refused its /tmp/app.log failed, and the run it
    replaced the user's good one with was marked failed, exit 1. The re-run's failure is its
    own: the first run, its exit code and its stages stand, with the re-run's record and why."""
    first = session.ProfileOutput(script_run(script_stage([1.0] * 4)), exit_code=0)
    rerun = Rerun(label="rerun", source="/u/proj", cwd="/u/run/rerun/cwd/u/proj",
                  wrote_outside=["/tmp/app.log"], confined=True)
    refused = session.Refused("could not write /tmp/app.log: refused by confinement",
                              "--rerun-writable /tmp lets the runs write it")
    second = session.ProfileOutput(script_run(reruns=[rerun]), exit_code=1, refused=refused)
    kept = session._kept_run(first, second)
    assert kept is first and kept.exit_code == 0 and kept.run.stages
    assert kept.run.reruns == [rerun]
    line = (f"the re-run {refused.what}; the first run's results stand; "
            "--rerun-writable /tmp lets")
    assert any(m.startswith(line) for m in kept.messages)
    assert any(n.startswith(line[0].upper() + line[1:]) for n in kept.run.notes)
    # One that failed otherwise says how; one that worked, or was stopped, replaces the first.
    crashed = session.ProfileOutput(script_run(reruns=[rerun]), exit_code=3)
    assert "the re-run exited with code 3" in session._kept_run(first, crashed).messages[-1]
    good = session.ProfileOutput(script_run(), exit_code=0)
    assert session._kept_run(first, good) is good


@pytest.mark.parametrize("abi", [1, 3, 5, 6, 7, 9])
def test_the_ruleset_takes_what_each_abi_has(abi: int) -> None:
    """Issue 56, beyond the files, each kernel's branch forced: signals and abstract unix
    sockets are scoped from ABI 6 (the ruleset's `scoped` field, which an older kernel's
    shorter attribute lacks), a pathname socket's connection is a right from ABI 9; a rule on
    one file (a device) grants only a file's rights."""
    assert confine.scopes(abi) == (confine.SCOPE_ABSTRACT_UNIX_SOCKET | confine.SCOPE_SIGNAL
                                   if abi >= 6 else 0)
    assert confine.ruleset_size(abi) == (24 if abi >= 6 else 16 if abi >= 4 else 8)
    assert bool(confine.write_access(abi) & confine.RESOLVE_UNIX) == (abi >= 9)
    assert confine.file_access(abi) & ~(confine.WRITE_FILE | confine.TRUNCATE) == 0
    assert bool(confine.file_access(abi) & confine.TRUNCATE) == (abi >= 3)


@pytest.mark.parametrize(("abi", "own_shm", "kept", "loose"), [
    (5, False, [], ["/dev/shm's files (compared afterwards)", "signalling your other "
                    "processes and connecting to their abstract unix sockets (Landlock ABI 6; "
                    "this kernel's is 5)",
                    "connecting to a unix socket by its path (Landlock ABI 9)"]),
    (7, True, ["/dev/shm its own", "it cannot signal your other processes or reach their "
               "abstract sockets"], ["connecting to a unix socket by its path"]),
    (9, True, ["nor connect to a unix socket outside its own folders"], [])])
def test_the_run_says_what_this_kernel_leaves_open(
        abi: int, own_shm: bool, kept: list[str], loose: list[str]) -> None:
    """The line said before anything runs: what is confined and what is not, by the kernel's
    ABI and whether a run gets a /dev/shm of its own; a file's metadata never is."""
    said = confinement.beyond_files(abi, own_shm, watched=True)
    before, _, after = said.partition("not confined: ")
    assert "/proc is read-only to it" in before
    assert all(k in before for k in kept) and all(k in after for k in loose)
    assert "a file's mode, owner, times and extended attributes (compared afterwards and put " \
           "back)" in after
    assert ("signal" in after) == (abi < 6) and ("by its path" in after) == (abi < 9)
    assert ("/dev/shm" in after) == (not own_shm)
    assert "compared" not in confinement.beyond_files(abi, own_shm, watched=False)


def test_a_confined_run_gets_devices_but_not_shm_proc_or_disks(tmp_path: Path) -> None:
    """/dev's devices stay writable (a GPU, /dev/null); /dev/shm (ordinary files, a user's
    among them), /proc (/proc/sys as root) and block devices (a disk written raw) are not in
    the list (childexec adds the run's own /dev/shm and /proc/PID)."""
    (tmp_path / "own").mkdir()
    writable = confined_writable([tmp_path / "own"], tmp_path / "work", {}, [])
    assert "/dev/null" in writable and str(tmp_path / "own") in writable
    assert not {"/dev", "/dev/shm", "/proc"} & set(writable)
    assert not any(Path(w).is_block_device() for w in writable)


BEYOND_FILES = """
    import json, os, socket, sys
    victim, abstract, pathname, shm = sys.argv[1:5]
    tried = {}
    def attempt(name, action):
        try:
            action()
            tried[name] = "done"
        except OSError as exc:
            tried[name] = type(exc).__name__
    attempt("signal outside", lambda: os.kill(int(victim), 0))
    attempt("abstract socket", lambda: socket.socket(socket.AF_UNIX).connect("\\0" + abstract))
    attempt("pathname socket", lambda: socket.socket(socket.AF_UNIX).connect(pathname))
    attempt("proc sys", lambda: open("/proc/sys/kernel/hostname", "w").close())
    attempt("own comm", lambda: open("/proc/self/comm", "w").write("rerun"))
    attempt("user's shm file", lambda: open(shm, "r+").write("over"))
    attempt("new shm file", lambda: open("/dev/shm/gpudiag-own", "w").write("x"))
    attempt("dev null", lambda: open("/dev/null", "w").write("x"))
    print(json.dumps(tried))
"""


@landlock
@pytest.mark.slow
def test_a_confined_run_reaches_nothing_of_the_users_beyond_its_files(tmp_path: Path) -> None:
    """Issue 56: a re-run signalled another process of the user's, reached one through an
    abstract socket, appended to a file in /dev/shm and (as root) could write /proc/sys. On a
    kernel with Landlock ABI 6 the first two are refused; /dev/shm is the run's own where it
    can have one; /proc is read-only but its own entry. A pathname socket is reached below
    ABI 9 (said so before the run)."""
    abi = confine.landlock_abi()
    victim = subprocess.Popen(["sleep", "30"])
    name = f"gpudiag-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX) as abstract, socket.socket(socket.AF_UNIX) as named:
        abstract.bind("\0" + name)
        abstract.listen()
        named.bind(str(tmp_path / "s"))
        named.listen()
        users = Path("/dev/shm") / f"{name}-users"
        users.write_text("the user's")
        script = tmp_path / "beyond.py"
        script.write_text(textwrap.dedent(BEYOND_FILES))
        (tmp_path / "own").mkdir()
        try:
            done = subprocess.run(confine.child_command(
                [sys.executable, str(script), str(victim.pid), name, str(tmp_path / "s"),
                 str(users)], confined_writable([tmp_path / "own"], tmp_path, {}, [])),
                capture_output=True, text=True, timeout=30, check=False)
            assert done.returncode == 0, done.stderr
            tried = json.loads(done.stdout)
            kept = users.read_text() == "the user's"
        finally:
            users.unlink()
            victim.kill()
    scoped = "PermissionError" if abi >= confine.SCOPE_ABI else "done"
    own_shm = confinement.shm_of_its_own()
    assert tried == {"signal outside": scoped, "abstract socket": scoped,
                     "pathname socket": "done" if abi < confine.RESOLVE_UNIX_ABI else tried[
                         "pathname socket"],
                     "proc sys": "PermissionError", "own comm": "done",
                     "user's shm file": "FileNotFoundError" if own_shm else "done",
                     "new shm file": "done", "dev null": "done"}
    assert kept == own_shm  # else the machine's /dev/shm: compared after a re-run (scratch.py)
    assert not Path("/dev/shm/gpudiag-own").exists() or not own_shm


@landlock
@pytest.mark.slow
@pytest.mark.parametrize("abi", [5, 6])
def test_an_older_abi_is_asked_for_what_it_has(abi: int) -> None:
    """Both branches on this kernel, the ABI forced: a ruleset of ABI 5's size (no `scoped`)
    is accepted and leaves a signal outside possible; ABI 6's refuses it."""
    if confine.landlock_abi() < abi:
        pytest.skip(f"the kernel's Landlock is older than ABI {abi}")
    victim = subprocess.Popen(["sleep", "30"])
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(confine.__file__).parent)!r})
        import childexec
        childexec.landlock_abi = lambda: {abi}
        childexec.restrict_writes([])
        try:
            os.kill({victim.pid}, 0)
            print("reached")
        except PermissionError:
            print("refused")
    """)
    try:
        done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True,
                              text=True, timeout=30, check=False)
    finally:
        victim.kill()
    assert done.stdout.strip() == ("refused" if abi >= confine.SCOPE_ABI else "reached"), \
        done.stderr


def test_what_no_confinement_refuses_is_compared_and_put_back(tmp_path: Path) -> None:
    """Issue 56: Landlock has no right for a file's attributes, so a re-run changed the mode
    (chmod 000), times and a user.* attribute of the user's files and deleted one in
    /dev/shm, and the record compared none of them. Each change is now said, file by file,
    and the mode, times and attributes put back."""
    names = ["model.py", "ckpt.pt", "notes.txt", "gone.txt"]
    for name in names:
        (tmp_path / name).write_text(name)
    states = userfiles.record(tmp_path / name for name in names)
    os.chmod(tmp_path / "model.py", 0)  # noqa: PTH101  (as the re-run did, by path)
    os.utime(tmp_path / "notes.txt", ns=(1, 1))
    (tmp_path / "ckpt.pt").write_text("overwritten, longer")
    (tmp_path / "gone.txt").unlink()
    xattrs = True
    try:
        os.setxattr(tmp_path / "notes.txt", "user.gpudiag", b"x")
    except OSError:  # a filesystem without user attributes
        xattrs = False
    lines = userfiles.touched(states)
    said = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in lines}
    assert said[str(tmp_path / "model.py")] == "the mode from 0644 to 0000 (the mode put back)"
    assert said[str(tmp_path / "gone.txt")] == "deleted"
    assert said[str(tmp_path / "ckpt.pt")].startswith("the size from 7 to 19 bytes, the "
                                                     "modification time")
    assert "put back" not in said[str(tmp_path / "ckpt.pt")]  # contents: said, never hidden
    notes = said[str(tmp_path / "notes.txt")]
    assert notes.startswith("the modification time") and "the times put back" in notes
    assert ("the extended attributes (user.gpudiag)" in notes) == xattrs
    assert (tmp_path / "model.py").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "notes.txt").stat().st_mtime_ns == states[tmp_path / "notes.txt"].mtime_ns
    if xattrs:
        assert os.listxattr(tmp_path / "notes.txt") == []
    assert userfiles.touched(userfiles.record(tmp_path / n for n in names[:3])) == []


def test_a_linked_files_contents_are_said_once(tmp_path: Path) -> None:
    """A linked file a re-run wrote is listed as changed (linked, not copied); its record
    adds only what else changed."""
    (tmp_path / "big.bin").write_text("B")
    states = userfiles.record([tmp_path / "big.bin"])
    (tmp_path / "big.bin").write_text("BB")
    assert userfiles.touched(states, contents_said=[tmp_path / "big.bin"]) == []
    rerun = Rerun(label="loader", source=str(tmp_path), cwd=str(tmp_path / "c"),
                  touched=["/p/a: the mode from 0644 to 0000 (the mode put back)"],
                  touched_count=3)
    warned = rerun_warning(rerun)
    assert warned == ("loader: CHANGED your files while it ran: /p/a: the mode from 0644 to "
                      "0000 (the mode put back); and 2 more")


CHMODS = """
    import os, sys
    os.chmod(sys.argv[1], 0)  # through the link in the copy: the user's file
    os.chmod(sys.argv[2], 0o600)  # by absolute path
    os.utime(sys.argv[2], (0, 0))
    try:
        os.unlink(sys.argv[3])  # the machine's /dev/shm, where the run has none of its own
    except OSError:
        pass
"""


@landlock
@pytest.mark.slow
def test_a_confined_rerun_that_chmods_the_users_files_is_told_and_undone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The end to end case: a confined re-run chmods a linked file and one by absolute path,
    touches its times and deletes a file in /dev/shm; its record says each, and what was put
    back."""
    monkeypatch.setattr(scratch, "MAX_COPY_BYTES", 100)  # big.bin is linked, not copied
    source, out = _user_folder(tmp_path)
    shm = Path("/dev/shm") / f"gpudiag-test-{os.getpid()}"
    shm.write_text("the user's")
    try:
        made = make_scratch(source, out / "cwd", leave_out=out, confined=True)
        script = tmp_path / "chmods.py"
        script.write_text(textwrap.dedent(CHMODS))
        env = dict(os.environ)
        done = subprocess.run(confine.child_command(
            [sys.executable, str(script), "big.bin", str(source / "train.py"), str(shm)],
            confined_writable([out], source, env, [])), cwd=made.root, env=env,
            capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 0, done.stderr
        rerun = made.finish("rerun", out / "parts")
        assert shm.exists() == confinement.shm_of_its_own()
    finally:
        shm.unlink(missing_ok=True)
    said = "; ".join(rerun.touched)
    assert f"{source / 'big.bin'}: the mode from 0644 to 0000 (the mode put back)" in said
    assert f"{source / 'train.py'}: the modification time, the mode from 0644 to 0600" in said
    assert (f"{shm}: deleted" in said) != confinement.shm_of_its_own()
    assert (source / "big.bin").stat().st_mode & 0o777 == 0o644
    assert (source / "train.py").stat().st_mode & 0o777 == 0o644
    assert (source / "train.py").stat().st_mtime > 1
    assert "**CHANGED while it ran:**" in "\n".join(reruns_markdown(
        script_run(reruns=[rerun])))


@landlock
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv")
                    or not Path("/usr/bin/python3").exists(),
                    reason="needs root to start a process as another user (setpriv), and a "
                    "Python that user may run")
def test_a_user_without_root_gets_a_shm_of_its_own_where_user_namespaces_allow(
        tmp_path: Path) -> None:
    """Not root: the run's /dev/shm is made in a user namespace of its own, its user and group
    the same inside; a semaphore (DataLoader workers' queues) still works there."""
    nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    python = "/usr/bin/python3"  # the system's: the user may not reach this environment's
    probe = subprocess.run([*nobody, python, "-I", "-S", confine.__file__, "--shm-probe"],
                           capture_output=True, timeout=30, check=False)
    if probe.returncode != 0:
        pytest.skip("this kernel allows no unprivileged user namespaces")
    mine = Path("/dev/shm") / f"gpudiag-test-{os.getpid()}"
    mine.write_text("root's")
    try:
        command = confine.child_command([python, "-c", "import os, multiprocessing; "
                                         "multiprocessing.Lock(); print(os.getuid(), "
                                         "os.listdir('/dev/shm'))"], [str(tmp_path)])
        done = subprocess.run([*nobody, python, *command[1:]], capture_output=True, text=True,
                              timeout=30, check=False)
    finally:
        mine.unlink()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["65534", "[]"]


def test_the_machines_shm_is_compared_where_a_run_has_none_of_its_own(tmp_path: Path) -> None:
    """The other branch (no mount namespace for the run: a container without the right, a
    kernel without user namespaces): the re-run writes the machine's /dev/shm, whose files
    are recorded with the copy and compared after it: a file appended to or deleted there is
    said, where report.md said "nothing seen"."""
    appended = Path("/dev/shm") / f"gpudiag-test-{os.getpid()}-a"
    deleted = Path("/dev/shm") / f"gpudiag-test-{os.getpid()}-d"
    for path in (appended, deleted):
        path.write_text("the user's")
    source, out = _user_folder(tmp_path)
    try:
        made = make_scratch(source, out / "cwd", leave_out=out, confined=True)
        with appended.open("a") as shared:  # as the re-run did
            shared.write(" and more")
        deleted.unlink()
        rerun = made.finish("rerun", out / "parts")
    finally:
        appended.unlink()
        deleted.unlink(missing_ok=True)
    assert f"{deleted}: deleted" in rerun.touched
    assert any(line.startswith(f"{appended}: the size from 10 to 19 bytes")
               for line in rerun.touched)
    assert "nothing seen" not in "\n".join(reruns_markdown(script_run(reruns=[rerun])))
