"""Re-runs of a profiled script (--try-fixes, a short script's second run) run in a scratch copy
of its working directory: the user's files stay as they were, and what a re-run writes outside
the copy is listed (the field test: HF Trainer's rotation deleted the user's finished
checkpoint-60, a resuming script advanced its own checkpoint from step 0 to 141+, train.log got
5 extra "run start" lines)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import in_folder, invoke

from gpudiag.measure.profile import protocol
from gpudiag.measure.profile.inscript.writewatch import MAX_PATHS, WriteWatch
from gpudiag.measure.profile.launching import scratch
from gpudiag.measure.profile.launching.scratch import make_scratch, outside_writes
from gpudiag.model.remedies import BASELINE_RUNS, REMEDIES
from gpudiag.model.results import RUN_MARKER, load_run


def _hashes(folder: Path, leave_out: str = "//") -> dict[str, str]:
    """Every file and link under `folder` (but `leave_out`): a link by its target, a file by
    its bytes."""
    found = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if rel.startswith(leave_out):
            continue
        if path.is_symlink():
            found[rel] = f"-> {path.readlink()}"
        elif path.is_file():
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def _project(root: Path, elsewhere: Path) -> Path:
    """A user's folder as found in the field: the script, its log and checkpoints, data, a
    repository, a virtualenv, an earlier gpudiag run, links in and out."""
    files = {"train.py": "print('hi')\n", "train.log": "run start\n",
             "out/checkpoint-60/model.pt": "finished", "data/small.txt": "small",
             "data/big.bin": "B" * 500, ".git/HEAD": "ref", ".venv/pyvenv.cfg": "home = /usr",
             "reports/old/run.json": "{}", f"reports/old/{RUN_MARKER}": "",
             f"reports/now/{RUN_MARKER}": ""}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "inside").symlink_to("data/small.txt")
    elsewhere.mkdir()
    (root / "up").symlink_to(os.path.relpath(elsewhere, root))
    return root


def test_the_copy_is_the_users_folder_and_changes_none_of_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scratch, "MAX_COPY_BYTES", 100)  # big.bin is over the budget
    source = _project(tmp_path / "proj", tmp_path / "elsewhere")
    before = _hashes(source, leave_out="reports/now/")
    run = source / "reports" / "now"
    made = make_scratch(source, run / "fixes" / "x" / "cwd", leave_out=run)
    copy = made.root
    assert sorted(_hashes(copy)) == [".git", ".venv", "data/big.bin", "data/small.txt",
                                     "inside", "out/checkpoint-60/model.pt", "train.log",
                                     "train.py", "up"]  # no run folder of gpudiag's
    for name in ("train.py", "train.log", "out/checkpoint-60/model.pt", "data/small.txt"):
        assert not (copy / name).is_symlink()  # a real copy: a write to it is the copy's
        assert (copy / name).read_bytes() == (source / name).read_bytes()
    assert (copy / "inside").readlink() == Path("data/small.txt")  # into the copy
    assert (copy / "up").readlink() == tmp_path / "elsewhere"  # still where it pointed
    assert (copy / "data/big.bin").readlink() == source / "data/big.bin"

    # What the field's scripts did, in the copy: a log appended, a checkpoint rotated away,
    # one resumed from and overwritten. The user's folder is as it was.
    with (copy / "train.log").open("a") as log:
        log.write("run start\n")
    (copy / "out/checkpoint-60/model.pt").unlink()
    (copy / "out/checkpoint-25").mkdir()
    (copy / "out/checkpoint-25/model.pt").write_text("truncated")
    assert _hashes(source, leave_out="reports/now/") == before

    # A write through a link (native code, a file over the copy budget) is found afterwards.
    with (source / "data/big.bin").open("a") as big:
        big.write("changed")
    parts = run / "parts"
    parts.mkdir(parents=True)
    (parts / protocol.writes_name(1)).write_text(json.dumps("/abs/elsewhere.pt") + "\n")
    rerun = made.finish("x", parts)
    assert rerun.changed_linked == [str(source / "data/big.bin")]
    assert rerun.wrote_outside == ["/abs/elsewhere.pt"] and not rerun.more_outside
    assert sorted(rerun.linked) == [".git/", ".venv/", "data/big.bin"]
    assert rerun.copied == 4 and rerun.source == str(source)
    # The copy keeps only what the run wrote.
    assert sorted(_hashes(copy)) == ["out/checkpoint-25/model.pt", "train.log"]


WATCHED_SCRIPT = """
    import os, shutil, sys, tempfile
    from pathlib import Path
    from gpudiag.measure.profile.inscript.writewatch import install, written
    install()
    out = Path(sys.argv[1])
    with open("log.txt", "a") as log:
        log.write("in the copy")
    (out / "abs.txt").write_text("outside")
    (out / "read.txt").read_text()
    os.makedirs(out / "existing", exist_ok=True)
    os.makedirs(out / "made")
    with tempfile.TemporaryDirectory() as temporary:
        Path(temporary, "t").write_text("a temporary of its own")
    with tempfile.NamedTemporaryFile("w") as named:
        named.write("x")
    Path("through/ckpt.pt").write_text("through a link to a folder outside")
    os.remove("to-file")  # the link itself, in the copy
    os.replace(out / "old.txt", out / "new.txt")
    shutil.rmtree(out / "tree")
    written("saved.pt")  # torch.save to a path in the copy (native code, noted by name)
    written(str(out / "saved.pt"))
    if os.fork() == 0:  # a forked worker that never runs Python's shutdown
        (out / "child.txt").write_text("x")
        os._exit(0)
    os.wait()
"""


def test_the_write_watch_lists_what_lands_outside_the_copy(tmp_path: Path) -> None:
    copy, parts, out = tmp_path / "run" / "cwd", tmp_path / "run" / "parts", tmp_path / "user"
    for folder in (copy, parts, out / "existing", out / "tree" / "a"):
        folder.mkdir(parents=True)
    for name in ("read.txt", "old.txt", "tree/a/f1", "tree/a/f2"):
        (out / name).write_text("user's")
    (copy / "through").symlink_to(out)
    (copy / "to-file").symlink_to(out / "read.txt")
    script = tmp_path / "watched.py"
    script.write_text(textwrap.dedent(WATCHED_SCRIPT))
    env = {**os.environ, protocol.ENV_SCRATCH: str(copy), protocol.ENV_OUT: str(parts),
           protocol.ENV_TRACE_DIR: str(tmp_path / "run")}
    done = subprocess.run([sys.executable, str(script), str(out)], cwd=copy, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    listed, more = outside_writes(parts)
    assert listed == sorted(str(out / name) for name in (
        "abs.txt", "made", "ckpt.pt", "old.txt", "new.txt", "tree", "saved.pt",
        "child.txt")) and not more
    assert (out / "read.txt").read_text() == "user's"  # removing the link left the file


def test_the_watch_lists_a_bounded_number_of_paths(tmp_path: Path) -> None:
    watch = WriteWatch(str(tmp_path), [str(tmp_path)])
    for n in range(MAX_PATHS + 10):
        watch.audit("open", (f"/elsewhere/{n}", "w", 0))
        watch.audit("open", (f"/elsewhere/{n}", "r", 0))  # a read is no write
    listed, more = outside_writes(tmp_path)
    assert len(listed) == scratch.MAX_LISTED and more
    assert len((tmp_path / protocol.writes_name(os.getpid())).read_text().splitlines()) == (
        MAX_PATHS + 1)


# The field's script: appends to its log, resumes from its own checkpoint, saves and rotates
# checkpoints (keeping the last one), and writes one file to an absolute path it is given.
RESUMING_SCRIPT = """
    import os, sys, torch
    with open(sys.argv[1], "a") as outside:
        outside.write("x")
    with open("train.log", "a") as log:
        log.write("run start\\n")
    start = torch.load("ckpt.pt")["step"] if os.path.exists("ckpt.pt") else 0
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(start, start + 8):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step % 2 == 1:
            torch.save({"step": step + 1}, "ckpt.pt")
            torch.save({"step": step + 1}, f"checkpoint-{step + 1}.pt")
            for old in os.listdir("."):
                if old.startswith("checkpoint-") and old != f"checkpoint-{step + 1}.pt":
                    os.remove(old)
"""


@pytest.mark.slow
@pytest.mark.heavy
def test_try_fixes_reruns_leave_the_users_folder_as_one_run_left_it(tmp_path: Path) -> None:
    """8 steps against a schedule of 9: the diagnosis runs twice, then three --try-fixes
    runs. The user's folder sees one run: one more log line, the checkpoint one run further."""
    user = tmp_path / "proj"
    (user / "data").mkdir(parents=True)
    (user / "train.py").write_text(textwrap.dedent(RESUMING_SCRIPT))
    (user / "data" / "in.txt").write_text("input")
    (user / "train.log").write_text("run start\n")
    torch.save({"step": 8}, user / "ckpt.pt")
    (user / "checkpoint-8.pt").write_bytes((user / "ckpt.pt").read_bytes())
    before = _hashes(user)
    outside = tmp_path / "outside.txt"
    with in_folder(user):
        done = invoke(["profile", "--no-plots", "--try-fixes", "--fix", "no-empty-cache",
                       "--warmup", "2",
                       "--timed", "6", "--evidence-steps", "1", "--out", tmp_path / "run", "--",
                       sys.executable, "train.py", outside])
    assert done.exit_code == 0, done.output
    said = done.stderr.replace("\n", " ")
    most = 1 + 1 + len(BASELINE_RUNS) + len(REMEDIES) + 1  # diagnosis, its re-run, fixes
    assert said.index(f"the script runs at most {most} times") < said.index("it is run once more")
    assert said.index("runs at most 3 more times") < said.index("running without-fixes-1")

    after = _hashes(user)
    assert {k: v for k, v in after.items() if k not in ("train.log", "ckpt.pt")} == {
        **{k: v for k, v in before.items() if k not in ("train.log", "ckpt.pt",
                                                       "checkpoint-8.pt")},
        "checkpoint-16.pt": after["checkpoint-16.pt"]}  # the diagnosis run's rotation only
    assert (user / "train.log").read_text() == "run start\n" * 2
    assert outside.read_text() == "x" * 5  # each run wrote there: listed below

    def step(folder: Path) -> int:
        return int(torch.load(folder / "ckpt.pt")["step"])

    assert step(user) == 16  # one run further, not five
    run = load_run(tmp_path / "run")
    assert [r.label for r in run.reruns] == ["rerun", "without-fixes-1", "no-empty-cache",
                                             "without-fixes-2"]
    for rerun in run.reruns:  # each started from the folder as the diagnosis left it
        assert rerun.wrote_outside == [str(outside)] and rerun.source == str(user)
        assert (Path(rerun.cwd) / "train.log").read_text() == "run start\n" * 3
        assert step(Path(rerun.cwd)) > 16
    report = (tmp_path / "run" / "report.md").read_text()
    assert "## Where the re-runs ran" in report
    assert f"| without-fixes-1 | `{tmp_path / 'run'}/fixes/without-fixes-1/cwd` |" in report
    assert report.count(f"| {outside} |") == 4
    assert f"without-fixes-2: wrote outside its scratch copy: {outside}" in said
