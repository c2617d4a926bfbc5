"""Re-runs of a profiled script (--try-fixes, a short script's second run) run in a scratch copy
of its working directory: the user's files stay as they were, and what a re-run writes outside
the copy is listed (the field test: HF Trainer's rotation deleted the user's finished
checkpoint-60, a resuming script advanced its own checkpoint from step 0 to 141+, train.log got
5 extra "run start" lines)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import tree_hashes

from gpudiag.measure.profile import protocol
from gpudiag.measure.profile.inscript.writewatch import MAX_PATHS, WriteWatch
from gpudiag.measure.profile.launching import scratch
from gpudiag.measure.profile.launching.scratch import make_scratch, outside_writes
from gpudiag.model.runfile import RUN_MARKER


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
    before = tree_hashes(source, leave_out="reports/now/")
    run = source / "reports" / "now"
    made = make_scratch(source, run / "fixes" / "x" / "cwd", leave_out=run)
    copy = made.root
    assert sorted(tree_hashes(copy)) == [".git", ".venv", "data/big.bin", "data/small.txt",
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
    assert tree_hashes(source, leave_out="reports/now/") == before

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
    assert sorted(tree_hashes(copy)) == ["out/checkpoint-25/model.pt", "train.log"]


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


@pytest.mark.slow
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
