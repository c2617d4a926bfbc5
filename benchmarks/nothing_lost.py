"""Issue 38's red-team classes at field scale, re-run: folders a unit test cannot hold (50,001
files, 20,100 files, a 2.2 GiB log, made sparse or empty), and issue 56's (--rerun-writable
inside the working directory, a short script's re-run refused its log, links planted in the
run folder, a file of the user's in /dev/shm, a chmod through a link, a signal to another
process; a gate of a venv or a submodule in the repository, after a killed gate, of a run its
evidence contradicts), each profiled (or gated) as a user would, with the user's folder
hashed before and after, gpudiag's exit code, its output searched for a traceback, and the
processes it left. Writes a JSON record and a markdown table:

    python benchmarks/nothing_lost.py --out reports/examples/nothing-lost

Every case's expectation is the issue's: no file of the user's changes, nothing is left
running, no traceback, and what the re-run could not do is said. Issue 56's stops and bad
input (`stops_and_bad_input`: a SIGTERM or SIGHUP while gpudiag imports, a double Ctrl-C in a
gate's trial, a library's SystemExit(3) or GeneratorExit, `--iters 99999999999999999999`, a
removed working directory) run the gpudiag command itself: one line, README's exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpudiag.model.runfile import load_run

# Names in the run folder that a confined run links to the user's checkpoint: what gpudiag
# writes there after it (and the plots' old predictable temporary name).
PLANTED = ("run.json", "samples.csv", "trace.json", "report.md", ".step-times.png.tmp")
# A script that does to its folder what the red team's did: rotates checkpoints, appends to
# its log, overwrites a checkpoint, writes beside __file__, runs git, reads ../data, writes a
# file whose name is not UTF-8 outside its folder. It runs STEPS steps; gpudiag stops it early.
SCRIPT = """
    import os, subprocess, sys
    from pathlib import Path
    import gpudiag

    PLANTED = {planted!r}
    here = Path(__file__).resolve().parent
    action = sys.argv[1]
    if action == "slow-exit":  # its own cleanup at exit outlasts the 3 s a SIGTERM waits
        import atexit, time
        atexit.register(lambda: (Path(sys.argv[2]).touch(), time.sleep(3.5)))
    for step in range(40):
        if action in ("short", "short-log") and step == 4:  # fewer than it plans: run again
            break
        if action == "short-log" and step == 0:  # its log outside its folder (/tmp/app.log)
            with open(sys.argv[2], "a") as log:
                log.write("start\\n")
        if step == 2:
            if action == "rotate":
                os.makedirs("exp/out", exist_ok=True)
                Path(f"exp/out/ckpt-{step}.pt").write_text("new")
                for old in Path("exp/out").glob("ckpt-*.pt"):
                    if old.name != f"ckpt-{step}.pt":
                        old.unlink()
            elif action == "log-and-ckpt":
                with open("train.log", "a") as log:
                    log.write("run start\\n")
                Path("ckpt.pt").write_text("overwritten")
            elif action == "beside-file":
                (here / "results.json").write_text("{}")
            elif action == "git":
                subprocess.run(["git", "status", "--short"], check=False, capture_output=True)
                subprocess.run(["git", "add", "-A"], check=False, capture_output=True)
            elif action == "read-up":
                assert Path("../data/x.txt").read_text() == "beside"
            elif action == "delete-kept":  # a file of the user's, by its absolute path
                try:
                    os.remove(sys.argv[2])
                except PermissionError:
                    pass  # refused: the run goes on
            elif action == "plant":  # a confined run may write its run folder: links there
                run = Path(os.environ["GPUDIAG_PROFILE_OUT"]).parent
                for name in PLANTED:
                    (run / name).unlink(missing_ok=True)
                    (run / name).symlink_to(sys.argv[2].removeprefix("to:"))
            elif action == "shm":  # a file of the user's in /dev/shm: appended, deleted
                try:
                    with open(sys.argv[2], "a") as shared:
                        shared.write("appended")
                    os.remove(sys.argv[2])
                except OSError:
                    pass  # not there: the run's /dev/shm is its own
            elif action == "chmod":  # through a link into the copy, and by absolute path
                os.chmod("weights.bin", 0)
                absolute = sys.argv[2].removeprefix("at:")  # as a config names it, unmoved
                os.chmod(absolute, 0)
                os.utime(absolute, (0, 0))
            elif action == "kill":  # another process of the user's
                try:
                    os.kill(int(sys.argv[2]), 15)
                except PermissionError:
                    pass  # refused: the run goes on
            elif action == "odd-name":
                try:
                    open(os.fsdecode(sys.argv[2].encode() + b"/caf\\xe9.txt"), "w").write("x")
                except PermissionError:
                    pass  # refused: the run goes on
        gpudiag.step()
"""


@dataclass
class Case:
    name: str
    what: str  # the red team's case
    exit_code: int = -1
    unchanged: bool = False
    traceback: bool = False
    left_running: list[str] = field(default_factory=list)
    said: list[str] = field(default_factory=list)  # lines of gpudiag's output that matter
    seconds: float = 0.0
    passed: bool = False


def _hashes(folder: Path, leave_out: Path) -> dict[str, str]:
    found = {}
    for path in sorted(folder.rglob("*")):
        if path == leave_out or leave_out in path.parents:
            continue
        rel = str(path.relative_to(folder))
        if path.is_symlink():
            found[rel] = f"-> {path.readlink()}"
        elif path.is_file():
            stat = path.stat()
            # Sparse and empty files by size and time; the small ones by their bytes.
            found[rel] = (hashlib.sha256(path.read_bytes()).hexdigest() if stat.st_size < 2**20
                          else f"{stat.st_size}/{stat.st_mtime_ns}")
    return found


def _many(folder: Path, count: int, per_folder: int | None = None) -> None:
    for n in range(count):
        sub = folder if per_folder is None else folder / f"part{n // per_folder}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{n}.jpg").touch()


def _own_processes(marker: str) -> list[str]:
    left = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline:
                left.append(cmdline[:120])
    return left


def _profile(project: Path, args: list[str], *, stop_when: Callable[[], bool] | None = None,
             ) -> tuple[int, str]:
    command = [sys.executable, "-m", "gpudiag", "profile", "--no-plots", "--warmup", "1",
               "--timed", "3", "--steps", "1", "--host-sample-hz", "0", "--telemetry", "off",
               "--out", str(project / "run"), *args]
    process = subprocess.Popen(command, cwd=project, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    if stop_when is not None:
        while process.poll() is None and not stop_when():
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=600)
    return process.returncode, output


def run_case(case: Case, root: Path, build: Callable[[Path], None], args: list[str],
             expect: Callable[[Case, str, Path], bool],
             stop_when: Callable[[Path], Callable[[], bool]] | None = None) -> Case:
    project = root / case.name / "proj"
    project.mkdir(parents=True)
    (project / "train.py").write_text(textwrap.dedent(SCRIPT).replace("{planted!r}",
                                                                      repr(PLANTED)))
    (project.parent / "data").mkdir()
    (project.parent / "data" / "x.txt").write_text("beside")
    build(project)
    args = [str(project / "train.py") if a == "SCRIPT" else a.replace("{project}", str(project))
            for a in args]
    before = _hashes(project.parent, project / "run")
    started = time.perf_counter()
    code, output = _profile(project, args,
                            stop_when=stop_when(project) if stop_when is not None else None)
    case.seconds = round(time.perf_counter() - started, 1)
    time.sleep(0.5)
    case.exit_code = code
    case.unchanged = _hashes(project.parent, project / "run") == before
    case.traceback = "Traceback" in output and "PermissionError" not in output
    case.left_running = _own_processes(str(project))
    case.said = [line for line in output.splitlines() if any(
        w in line for w in ("refused", "scratch", "stopped", "Landlock", "rerun-writable"))][:6]
    case.passed = (case.unchanged and not case.traceback and not case.left_running
                   and expect(case, output, project))
    return case


def _issue56_cases(root: Path) -> list[Case]:
    """Issue 56's classes: a --rerun-writable folder inside the working directory, a short
    script's re-run refused its log, links planted in the run folder."""
    cases: list[Case] = []

    def kept_data(p: Path) -> None:
        (p / "data").mkdir()
        (p / "data" / "keep.txt").write_text("the user's")

    inside = root / "rerun-writable-inside" / "proj"
    cases.append(run_case(
        Case("rerun-writable-inside", "--rerun-writable data (inside the working "
             "directory), the script deleting data/keep.txt by its absolute path"),
        root, kept_data, ["--rerun-writable", "data", "--stop-after-window", "--",
                          sys.executable, "train.py", "delete-kept",
                          str(inside / "data" / "keep.txt")],
        lambda c, o, p: c.exit_code == 2 and len(o.strip().splitlines()) == 1
        and "it is inside the working directory" in o))
    logs = root / "logs"
    logs.mkdir()
    cases.append(run_case(
        Case("rerun-refused-log", "a short script logging to a file outside its folder: "
             "its re-run is refused the log"),
        root, lambda p: None, ["--", sys.executable, "train.py", "short-log",
                               str(logs / "app.log")],
        lambda c, o, p: c.exit_code == 0 and (logs / "app.log").read_text() == "start\n"
        and "the re-run could not write" in o and "first run's results stand" in o))

    def links_replaced(c: Case, o: str, p: Path) -> bool:
        """gpudiag wrote its files over the links, not through them; then the run folder,
        as a CI artifact with trace.json -> the checkpoint, is rendered by `report`."""
        replaced = all((p / "run" / name).is_file() and not (p / "run" / name).is_symlink()
                       for name in PLANTED if not name.startswith("."))
        (p / "run" / "trace.json").unlink()
        (p / "run" / "trace.json").symlink_to(p / "ckpt.pt")
        report = subprocess.run([sys.executable, "-m", "gpudiag", "report", str(p / "run")],
                                cwd=p, capture_output=True, text=True, check=False)
        return (c.exit_code == 0 and replaced and report.returncode == 0
                and (p / "ckpt.pt").read_text() == "the user's"
                and not (p / "run" / "trace.json").is_symlink())

    cases.append(run_case(
        Case("links-in-run-folder", "a confined run links run.json, samples.csv, "
             "trace.json, report.md to ckpt.pt; then `report` of that folder"),
        root, lambda p: (p / "ckpt.pt").write_text("the user's"),
        ["--stop-after-window", "--", sys.executable, "train.py", "plant",
         "to:{project}/ckpt.pt"], links_replaced))  # "to:": not moved into the copy
    return cases


GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "init.defaultBranch=main"]


def _git(folder: Path, *args: str) -> None:
    subprocess.run([*GIT, *args], cwd=folder, check=True, capture_output=True)


def _committed(folder: Path) -> Path:
    """`folder` as a git repository holding the red team's script, committed."""
    folder.mkdir(parents=True)
    (folder / "train.py").write_text(textwrap.dedent(SCRIPT).replace("{planted!r}",
                                                                     repr(PLANTED)))
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        _git(folder, *args)
    return folder


def gate_case(case: Case, project: Path, args: list[str], expect: Callable[[Case, str], bool],
              env: dict[str, str] | None = None) -> Case:
    """`gpudiag gate ARGS` from `project` (a repository), its files (.git aside: the gate's
    worktrees are registered there while it runs) hashed before and after."""
    before = _hashes(project, project / ".git")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gpudiag", "gate", *args], cwd=project,
                          capture_output=True, text=True, check=False, env=env)
    case.seconds = round(time.perf_counter() - started, 1)
    output = done.stdout + done.stderr
    case.exit_code = done.returncode
    case.unchanged = _hashes(project, project / ".git") == before
    case.traceback = "Traceback" in output
    case.left_running = _own_processes(str(project))
    case.said = [line for line in output.splitlines() if "gate:" in line or "error" in line][:6]
    case.passed = (case.unchanged and not case.traceback and not case.left_running
                   and expect(case, output))
    return case


def _measured(project: Path) -> bool:
    """Both sides of a gate's one trial wrote a run with timed steps."""
    runs = [json.loads((project.parent / "out" / side / "trial-1" / "run.json").read_text())
            for side in ("base", "head")
            if (project.parent / "out" / side / "trial-1" / "run.json").is_file()]
    return len(runs) == 2 and all(run["stages"] and run["stages"][0]["iter_ms"] for run in runs)


def _venv_of_this_python(folder: Path) -> None:
    """A virtual environment at `folder` with this one's packages, as uv makes one: its
    python a link to the base interpreter, found a venv by the pyvenv.cfg beside it."""
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").symlink_to(Path(sys.executable).resolve())
    (folder / "lib").symlink_to(Path(sys.prefix) / "lib", target_is_directory=True)
    (folder / "pyvenv.cfg").write_text(f"home = {Path(sys.executable).resolve().parent}\n"
                                       "include-system-site-packages = false\n")


def _issue56_gate_cases(root: Path) -> list[Case]:
    """Issue 56's gate classes: a venv inside the repository, a submodule, a killed gate's
    worktrees and bytecode folder, a run whose steps its own evidence contradicts."""
    cases: list[Case] = []
    one = ["--trials", "1", "--max-trials", "1", "--on-inconclusive", "pass"]
    venv = _committed(root / "gate-venv-in-repo" / "proj")
    (venv / ".gitignore").write_text(".venv/\n")
    _git(venv, "add", "-A")
    _git(venv, "commit", "-qm", "ignore the venv")
    _venv_of_this_python(venv / ".venv")
    cases.append(gate_case(
        Case("gate-venv-in-repo", "gate --base-ref of .venv/bin/python train.py, the venv "
             "in the repository and ignored by git"),
        venv, ["--base-ref", "HEAD", *one, "--out", str(venv.parent / "out"), "--",
               ".venv/bin/python", "train.py", "steps"],
        lambda c, o: c.exit_code == 0 and _measured(venv) and "(ignored by git)" in o))

    lib = _committed(root / "gate-submodule" / "lib")
    (lib / "helper.py").write_text("STEPS = 40\n")
    _git(lib, "add", "-A")
    _git(lib, "commit", "-qm", "helper")
    sub = _committed(root / "gate-submodule" / "proj")
    _git(sub, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "lib")
    (sub / "train.py").write_text("import lib.helper\n" + (sub / "train.py").read_text())
    _git(sub, "commit", "-qam", "uses its submodule")
    (lib / ".git").rename(lib / "gone.git")  # offline: its remote unreachable
    cases.append(gate_case(
        Case("gate-submodule", "gate --base-ref of a script importing a git submodule, its "
             "remote unreachable"),
        sub, ["--base-ref", "HEAD", *one, "--out", str(sub.parent / "out"), "--",
              sys.executable, "train.py", "steps"],
        lambda c, o: c.exit_code == 0 and _measured(sub)))
    cases.append(_killed_gate_case(root, one))
    cases.append(_contradicting_run_case(root))
    return cases


def _killed_gate_case(root: Path, one: list[str]) -> Case:
    """A gate SIGKILLed during its first trial; the next gate removes its worktrees and its
    folders (and a killed job's bytecode folder), and is measured."""
    project = _committed(root / "gate-killed" / "proj")
    temp = root / "gate-killed" / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    dead = 2**22 + 1  # above Linux's largest pid_max: no process has it
    (temp / f"gpudiag-bytecode-{dead}-left").mkdir()
    killed = subprocess.Popen([sys.executable, "-m", "gpudiag", "gate", "--base-ref", "HEAD",
                               *one, "--out", str(project.parent / "killed"), "--",
                               sys.executable, "train.py", "steps"],
                              cwd=project, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (project.parent / "killed" / "base").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    left = subprocess.run(["git", "worktree", "list"], cwd=project, capture_output=True,
                          text=True, check=True).stdout.count("\n")

    def cleaned(c: Case, o: str) -> bool:
        listed = subprocess.run(["git", "worktree", "list"], cwd=project, capture_output=True,
                                text=True, check=True).stdout
        c.said.append(f"worktrees after the kill: {left}, after the next gate: "
                      f"{listed.count(chr(10))}; left in TMPDIR: "
                      f"{sorted(p.name for p in temp.iterdir())}")
        return (left == 3 and c.exit_code == 0 and listed.count("\n") == 1
                and not any(temp.iterdir()) and _measured(project))

    return gate_case(
        Case("gate-killed", "a gate SIGKILLed in its first trial (two worktrees and its "
             "folders left, and a killed job's bytecode folder), then the next gate"),
        project, ["--base-ref", "HEAD", *one, "--out", str(project.parent / "out"), "--",
                  sys.executable, "train.py", "steps"], cleaned, env=env)


def _contradicting_run_case(root: Path) -> Case:
    """A head run whose timed steps are its warm-up's microseconds, against a stage whose
    kernels take ~75 ms a step: refused (exit 2, one line), never a pass."""
    source = Path(__file__).resolve().parents[1] / "tests" / "data" / "h100-dgca-run.json"
    project = root / "gate-contradicting-run" / "proj"
    for side in ("base", "head"):
        data = json.loads(source.read_text())
        if side == "head":
            for stage in data["stages"]:
                stage["iter_ms"] = [0.002 + 1e-6 * k for k in range(len(stage["iter_ms"]))]
        (project / side).mkdir(parents=True)
        (project / side / "run.json").write_text(json.dumps(data))
    return gate_case(
        Case("gate-contradicting-run", "gate of a head run.json whose steps are 2 us where "
             "its own evidence measured ~75 ms of kernels a step"),
        project, ["base", "head"],
        lambda c, o: c.exit_code == 2 and len(o.strip().splitlines()) == 1
        and "stages[0].iter_ms: a mean step of 0.002" in o and "PASS" not in o)


def _beyond_files(cases: list[Case], root: Path) -> None:
    """Issue 56's cases beyond a file's contents: the user's file in /dev/shm, a chmod
    through a link and by absolute path, a signal to another process of the user's."""
    shared = Path("/dev/shm") / f"nothing-lost-{root.name}"
    shared.write_text("the user's")
    try:
        cases.append(run_case(
            Case("dev-shm", "the re-run appends to and deletes a file of the user's in "
                 "/dev/shm"), root, lambda p: None,
            ["--stop-after-window", "--", sys.executable, "train.py", "shm", str(shared)],
            # Out of its reach (a /dev/shm of its own), or the change is said.
            lambda c, o, p: c.exit_code == 0 and (
                (shared.exists() and shared.read_text() == "the user's")
                or f"{shared}: deleted" in (p / "run" / "report.md").read_text())))
    finally:
        shared.unlink(missing_ok=True)

    def linked_weights(p: Path) -> None:
        with (p / "weights.bin").open("wb") as weights:
            weights.truncate(int(2.2 * 2**30))  # past the copy budget: linked, not copied
        (p / "config.yaml").write_text("lr: 1")

    chmodded = root / "chmod-through-link" / "proj"

    def modes_back(c: Case, o: str, p: Path) -> bool:
        report = " ".join((p / "run" / "report.md").read_text().split())
        return (c.exit_code == 0 and all((p / n).stat().st_mode & 0o777 == 0o644
                                         for n in ("weights.bin", "config.yaml"))
                and "weights.bin: the mode from 0644 to 0000 (the mode put back)" in report
                and "config.yaml: the modification time, the mode from 0644 to 0000" in report)

    cases.append(run_case(
        Case("chmod-through-link", "the re-run chmods 000 a file linked into its copy and one "
             "by absolute path, and sets the latter's times"), root, linked_weights,
        ["--stop-after-window", "--", sys.executable, "train.py", "chmod",
         f"at:{chmodded / 'config.yaml'}"], modes_back))
    victim = subprocess.Popen(["sleep", "600"])
    try:
        cases.append(run_case(
            Case("signal-outside", "the re-run sends SIGTERM to another process of the "
                 "user's"), root, lambda p: None,
            ["--stop-after-window", "--", sys.executable, "train.py", "kill", str(victim.pid)],
            # Refused from Landlock ABI 6; before it, said before anything runs.
            lambda c, o, p: c.exit_code == 0 and (victim.poll() is None or "signalling your "
                                                  "other processes" in " ".join(o.split()))))
    finally:
        victim.kill()


# The gpudiag command itself, as a user starts it; each case's PREFIX (Python run before
# gpudiag's entry) makes its moment certain: a signal while gpudiag.cli is imported, a
# library's SystemExit or GeneratorExit inside a command.
ENTRY = "import sys\n{prefix}sys.argv[0] = 'gpudiag'\nfrom gpudiag.launch import main\nmain()\n"
SELF_SIGNAL_WHILE_IMPORTING = (
    "import os, signal\n"
    "class Stop:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'gpudiag.cli':\n"
    "            os.kill(os.getpid(), signal.{})\n"
    "sys.meta_path.insert(0, Stop())\n")
RAISE_IN_RULES = ("import gpudiag.present\n"
                  "def rules_markdown(*_):\n"
                  "    raise {}\n"
                  "gpudiag.present.rules_markdown = rules_markdown\n")


def command_case(case: Case, cwd: Path, args: list[str], expect: Callable[[Case, str], bool],
                 *, prefix: str = "", stop: Callable[[subprocess.Popen[str]], None] | None = None,
                 ) -> Case:
    """`gpudiag ARGS` from `cwd` (its files hashed before and after), PREFIX run first;
    `stop` signals it as a user would. What it printed is searched for a traceback; the
    lines that matter are kept."""
    before = _hashes(cwd, cwd / "run") if cwd.is_dir() else {}
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", ENTRY.format(prefix=prefix), *args],
                               cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    if stop is not None:
        stop(process)
    try:
        output, _ = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # it ran on: the case fails, nothing is left running
        process.kill()
        output, _ = process.communicate()
    case.seconds = round(time.perf_counter() - started, 1)
    case.exit_code = process.returncode
    case.unchanged = (_hashes(cwd, cwd / "run") if cwd.is_dir() else {}) == before
    case.traceback = "Traceback" in output or "Exception ignored" in output
    case.left_running = _own_processes(str(cwd)) if cwd.is_dir() else []
    case.said = [line for line in output.splitlines() if line.startswith("gpudiag")][:6]
    case.passed = (case.unchanged and not case.traceback and not case.left_running
                   and expect(case, output))
    return case


def _double_ctrl_c(job: Path) -> Callable[[subprocess.Popen[str]], None]:
    """A terminal's Ctrl-C (the whole group) once a gate's first trial has run a while, and
    a second one later than the 2 s in which a repeat is the same stop."""
    def stop(process: subprocess.Popen[str]) -> None:
        deadline = time.monotonic() + 120
        while not (job / "base").is_dir() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(6)
        for _ in range(2):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGINT)
            time.sleep(2.5)
    return stop


def _one_line(case: Case, output: str, code: int, words: str) -> bool:
    lines = [line for line in output.splitlines() if line.startswith("gpudiag")]
    return case.exit_code == code and len(lines) == 1 and words in lines[0]


def stops_and_bad_input(root: Path) -> list[Case]:
    """Issue 56's stops and bad input: one line, the documented code, never a traceback."""
    cases = []
    here = root / "commands"  # the folder they start in, hashed before and after
    here.mkdir()
    (here / "train.py").write_text("print('the users')\n")
    for name, signum, code in (("SIGTERM", "SIGTERM", 143), ("SIGHUP", "SIGHUP", 129)):
        cases.append(command_case(
            Case(f"{name.lower()}-while-importing", f"{name} while gpudiag is still importing"),
            here, ["rules"], lambda c, o, code=code, name=name: _one_line(
                c, o, code, f"stopped by {name}"),
            prefix=SELF_SIGNAL_WHILE_IMPORTING.format(signum)))
    for name, raised, said in (("systemexit-3", "SystemExit(3)", "SystemExit: 3"),
                               ("generatorexit", "GeneratorExit()", "GeneratorExit")):
        cases.append(command_case(
            Case(f"{name}-from-a-library", f"a library raises {raised} inside a command"),
            here, ["rules", "--markdown"], lambda c, o, said=said: _one_line(
                c, o, 70, f"internal error: {said} (a bug in gpudiag"),
            prefix=RAISE_IN_RULES.format(raised)))
    for flag, value, limit in (("--iters", "99999999999999999999", "10,000,000"),
                               ("--min-seconds", "1e300", "604,800")):
        cases.append(command_case(
            Case(f"run-{flag[2:]}-huge", f"run {flag} {value}"), root,
            ["run", "--device", "cpu", "--preset", "tiny", flag, value, "--out",
             str(here / f"huge{flag}")],
            lambda c, o, flag=flag, limit=limit: _one_line(
                c, o, 2, f"{flag} must be at most {limit}")))
    gone = root / "removed-cwd"  # entered, then removed under it (as by another shell)
    gone.mkdir()
    cases.append(command_case(
        Case("removed-working-directory", "gpudiag profile from a folder removed under it"),
        here, ["profile", "--", sys.executable, "train.py"],
        lambda c, o: _one_line(c, o, 2, "the working directory no longer exists"),
        prefix=f"import os\nos.chdir({str(gone)!r})\nos.rmdir({str(gone)!r})\n"))
    repo = root / "gate-repo"
    shutil.copytree(Path(__file__).resolve().parents[1] / "gpudiag", repo / "gpudiag",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for git in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"],
                ["commit", "-q", "--allow-empty", "-m", "head"]):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *git], cwd=repo,
                       check=True, capture_output=True)
    job = root / "gate-job"

    def one_worktree() -> bool:
        listed = subprocess.run(["git", "worktree", "list"], cwd=repo, capture_output=True,
                                text=True, check=True).stdout
        return len(listed.strip().splitlines()) == 1

    cases.append(command_case(
        Case("ctrl-c-twice-in-gate", "a double Ctrl-C (2.5 s apart) during a gate's trial"),
        repo, ["gate", "--base-ref", "HEAD~1", "--device", "cpu", "--preset", "tiny",
               "--stages", "train", "--iters", "100000", "--out", str(job)],
        lambda c, o: _one_line(c, o, 130, "stopped by SIGINT") and one_worktree(),
        stop=_double_ctrl_c(job)))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    cases: list[Case] = []
    with tempfile.TemporaryDirectory(prefix="nothing-lost-") as temporary:
        root = Path(temporary)
        elsewhere = root / "elsewhere"
        elsewhere.mkdir()
        ok = (lambda c, o, p: c.exit_code == 0)  # noqa: E731

        def dataset_and_checkpoints(p: Path) -> None:
            _many(p / "data", 50_001)
            (p / "exp" / "out").mkdir(parents=True)
            (p / "exp" / "out" / "ckpt-1001.pt").write_text("the user's")

        cases.append(run_case(
            Case("dataset-50001", "50,001 images in data/, checkpoint rotation in exp/out"),
            root, dataset_and_checkpoints, ["--stop-after-window", "--", sys.executable,
                                            "train.py", "rotate"], ok))

        def small_files(p: Path) -> None:
            _many(p / "data", 20_100, per_folder=1_500)
            (p / "train.log").write_text("run start\n")
            (p / "ckpt.pt").write_text("the user's")

        cases.append(run_case(
            Case("small-files-20100", "20,100 small files beside train.log and ckpt.pt"),
            root, small_files, ["--stop-after-window", "--", sys.executable, "train.py",
                                "log-and-ckpt"], ok))

        def big_log(p: Path) -> None:
            with (p / "train.log").open("wb") as log:
                log.truncate(int(2.2 * 2**30))  # sparse: 2.2 GiB long, no blocks
            (p / "ckpt.pt").write_text("the user's")

        cases.append(run_case(
            Case("log-2.2GiB", "one 2.2 GiB train.log the script appends to"),
            root, big_log, ["--stop-after-window", "--", sys.executable, "train.py",
                            "log-and-ckpt"],
            # Refused, with advice that can apply to the working directory (issue 56): the
            # file named with the budget it is past, never --rerun-writable.
            lambda c, o, p: c.exit_code != 0 and "train.log (2.2 GiB) is past the scratch "
            "copy's budget" in " ".join(o.split()) and "--rerun-writable" not in o))
        cases.append(run_case(
            Case("absolute-script", "python /abs/path/train.py writing beside __file__"),
            root, lambda p: (p / "results.json").write_text("the user's"),
            ["--stop-after-window", "--", sys.executable, "SCRIPT", "beside-file"], ok))

        def repository(p: Path) -> None:
            subprocess.run(["git", "init", "-q"], cwd=p, check=True)
            (p / "new.txt").write_text("untracked")

        cases.append(run_case(
            Case("git", "the script runs git status and git add -A"),
            root, repository, ["--stop-after-window", "--", sys.executable, "train.py", "git"],
            ok))
        cases.append(run_case(
            Case("read-beside", "the script reads ../data"), root, lambda p: None,
            ["--stop-after-window", "--", sys.executable, "train.py", "read-up"], ok))
        cases.append(run_case(
            Case("odd-name", "a write outside, to a name that is not UTF-8"), root,
            lambda p: None, ["--stop-after-window", "--", sys.executable, "train.py",
                             "odd-name", str(elsewhere)],
            lambda c, o, p: c.exit_code == 0 and not any(elsewhere.iterdir())
            and "caf\\xe9" in (p / "run" / "report.md").read_text()))

        cases += _issue56_cases(root)
        _beyond_files(cases, root)
        cases += _issue56_gate_cases(root)

        def copy_started(p: Path) -> Callable[[], bool]:
            return (p / "run" / "rerun" / "cwd").exists

        cases.append(run_case(
            Case("sigterm-in-copy", "SIGTERM while a short script's re-run copies 18,000 "
                 "files"), root, lambda p: _many(p / "data", 18_000, per_folder=1_500),
            ["--", sys.executable, "train.py", "short"],
            lambda c, o, p: c.exit_code == 143 and (p / "run" / "run.json").is_file()
            and not (p / "run" / "rerun" / "cwd").exists(),
            stop_when=copy_started))
        cases.append(run_case(
            Case("sigterm-at-exit", "SIGTERM while the script's own cleanup runs at its exit"),
            root, lambda p: None, ["--no-rerun", "--", sys.executable, "train.py", "slow-exit",
                                   str(root / "at-exit")],  # outside the hashed folders
            lambda c, o, p: c.exit_code == 143 and "Exception ignored" not in o
            and len(load_run(p / "run").stages[0].iter_ms) == 3,
            stop_when=lambda p: (root / "at-exit").exists))
        cases += stops_and_bad_input(root)
    for case in cases:
        print(f"{'PASS' if case.passed else 'FAIL'} {case.name}: exit {case.exit_code}, "
              f"unchanged {case.unchanged}, {case.seconds} s")
    (out / "nothing-lost.json").write_text(json.dumps([asdict(c) for c in cases], indent=1))
    rows = [f"| {c.name} | {c.what} | {c.exit_code} | {'yes' if c.unchanged else '**NO**'} | "
            f"{'none' if not c.left_running else len(c.left_running)} | "
            f"{'**yes**' if c.traceback else 'no'} | {c.seconds} | "
            f"{'pass' if c.passed else '**FAIL**'} |" for c in cases]
    (out / "README.md").write_text("\n".join([
        "# Issue 38's red-team classes, re-run (`benchmarks/nothing_lost.py`)", "",
        "| case | what | exit | user's folder unchanged | left running | traceback | s | |",
        "| --- | --- | ---: | --- | --- | --- | ---: | --- |", *rows, ""]))


if __name__ == "__main__":
    main()
