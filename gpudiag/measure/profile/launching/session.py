"""The parent side of `gpudiag profile`: run the user's command with the recorder injected, then
turn what each process recorded into an ordinary run (one stage per script, or per rank).

Injection: a bootstrap folder holding a sitecustomize.py leads PYTHONPATH, so every Python
process the command starts (the script, torchrun's ranks) installs the recorder before the
user's code runs; nothing in the script changes. Output passes through; the command's exit code
is kept. The command runs in its own process group: SIGINT, SIGTERM and SIGHUP sent to gpudiag
are passed to all of it, and on Linux to every other process of its job too, whatever its group
or session (jobprocesses.py); a gpudiag killed outright takes the command with it (the
recorder's parent-death signal, lifecycle.py). Whatever the processes recorded is read even
when the command failed or was stopped. A re-run (a short script's second run, each of
--try-fixes' runs) runs in a scratch copy of the working directory (scratch.py): the first run
is the user's own, in the user's directory; the others leave its files as they were. This
module never imports torch: the recorder in each process reports its machine and settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from gpudiag._version import __version__
from gpudiag.measure.childexec import child_command
from gpudiag.measure.confine import (
    DEFAULT_POLICY,
    ConfinementPolicy,
    confined,
    confinement_refusal,
)
from gpudiag.measure.hostmemory import oom_kills
from gpudiag.measure.interrupts import REPEAT_WINDOW_S, signal_name, signal_of
from gpudiag.measure.profile import protocol
from gpudiag.measure.profile.launching.jobprocesses import (
    JobProcesses,
    Process,
    describe,
    job_processes,
    python_helper,
)
from gpudiag.measure.profile.launching.scratch import (
    SCRATCH_DIR,
    Scratch,
    ScratchError,
    make_scratch,
)
from gpudiag.measure.profile.launching.windows import window_evidence
from gpudiag.model.atomic import own_folder
from gpudiag.model.config import ProfileConfig
from gpudiag.model.errors import BadInput
from gpudiag.model.profilepart import WindowTrace
from gpudiag.model.remedies import DIAGNOSIS_RUN
from gpudiag.model.results import Env, Rerun, RunResult, StageResult
from gpudiag.model.runfile import RunFileError

# The folder whose sitecustomize.py installs the recorder in every Python process the command
# starts: the script's side's (a path only; this side never imports that code).
BOOTSTRAP = Path(__file__).resolve().parents[1] / "inscript" / "bootstrap"
PACKAGE_ROOT = Path(__file__).resolve().parents[4]  # holds gpudiag/: the child imports it
PARTS_DIR = "parts"
RERUN_DIR = "rerun"  # a short script's second run: its scratch copy, and its label
STOP_GRACE_S = 30.0  # after a forwarded signal, before the command's processes are killed
KILL_WAIT_S = 2.0  # for SIGKILLed processes to be gone (one in uninterruptible sleep may stay)
POLL_S = 0.5
NO_STEPS_HELP = (
    "no training steps detected: gpudiag counts optimizer.step() calls. For a loop without "
    "an optimizer, call gpudiag.step() once per step, or wrap the loop body in "
    "`with gpudiag.watch():`")


@dataclass
class ProfileOutput:
    run: RunResult
    exit_code: int  # the command's (130/143 when gpudiag was interrupted)
    messages: list[str] = field(default_factory=list)
    refused: Refused | None = None  # a confined re-run that failed, refused a write


@dataclass(frozen=True)
class Refused:
    """A write a confined re-run was refused, as the line that says why it failed: `what`
    ("could not write PATH: refused by confinement ..."), and the `advice` that applies."""

    what: str
    advice: str


def child_env(parts: Path, out: Path, config: ProfileConfig) -> dict[str, str]:
    env = dict(os.environ)
    package_root = str(PACKAGE_ROOT)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(BOOTSTRAP), package_root, env.get("PYTHONPATH", "")) if p)
    env.update(protocol.config_env(config))
    # Absolute: a script that changes directory (Hydra's job.chdir) must still find them.
    env.update({protocol.ENV_OUT: str(parts.resolve()), protocol.ENV_PARENT: str(os.getpid()),
                protocol.ENV_TRACE_DIR: str(out.resolve())})
    if config.compile_lines:
        # Inductor records which source lines each fused kernel came from
        # (torch._inductor.config.trace.provenance_tracking_level); the user's own setting wins.
        env.setdefault("INDUCTOR_PROVENANCE", "1")
        # ... and, on a CPU, its C++ kernels show in the profiler under their own names.
        env.setdefault("TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE", "1")
    return env


class _Forwarder:
    """SIGINT/SIGTERM/SIGHUP to gpudiag, passed on to the command (SIGHUP as SIGTERM: the
    script's own terminal may be gone). SIGINT goes to its whole process
    group, as a terminal's Ctrl-C would, and to every other process of its job. SIGTERM goes
    to the command's own process (and to each process of the job that left its group or lost
    its parent): torch's DataLoader workers take a SIGTERM from anyone but their parent as a
    crash, and the script would then die raising "DataLoader worker killed by signal"; the
    script's exit stops its workers (torchrun passes it on to its ranks). A second signal (not
    the same one arriving twice), or STOP_GRACE_S without an exit, kills every process of the
    job."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.first_at: float | None = None
        self.job: JobProcesses | None = None

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.first_at is not None and now - self.first_at < REPEAT_WINDOW_S:
            return
        self.received.append(signum)
        if self.job is None:
            return
        if self.first_at is not None:
            self.job.kill()
        elif signum == signal.SIGINT:
            self.job.interrupt()
        else:
            self.job.terminate()
        self.first_at = self.first_at or now

    def overdue(self) -> bool:
        return self.first_at is not None and time.monotonic() - self.first_at > STOP_GRACE_S


def check_command(command: Sequence[str]) -> None:
    """Refuse a command that cannot start, before a run directory is made for it: not found,
    a directory, not executable, or a file with neither an interpreter line nor a binary
    format the kernel runs (POSIX execve: ENOEXEC)."""
    if not command:
        raise BadInput("no command to profile: gpudiag profile -- python train.py ...")
    found = shutil.which(command[0])
    path = Path(found) if found else Path(command[0])
    if not found:
        if path.is_dir():
            raise BadInput(f"cannot run {command[0]!r}: it is a directory")
        if path.is_file() and "/" in command[0]:
            raise BadInput(f"cannot run {command[0]!r}: not executable (chmod +x, or run it "
                           "with its interpreter: python script.py)")
        raise BadInput(f"command not found: {command[0]}")
    try:
        with path.open("rb") as fh:
            head = fh.read(4)
    except OSError as exc:
        raise BadInput(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None
    if not head.startswith((b"#!", b"\x7fELF")):
        raise BadInput(f"cannot run {command[0]!r}: no interpreter line (#!) and not a "
                       "program; run it with its interpreter (python script.py, sh script)")
    blocked = _isolating_flag(command)
    if blocked is not None:
        arg, flag = blocked
        raise BadInput(f"{command[0]} {arg}: {ISOLATING_FLAGS[flag]}, so gpudiag's recorder "
                       f"cannot load in it; run the script without -{flag}")
    if os.environ.get(protocol.ENV_PARENT):
        raise BadInput("this process is already profiled by a gpudiag profile above it: profile "
                       "the training command once, from the outside")


# Interpreter options under which the bootstrap's sitecustomize never runs.
ISOLATING_FLAGS = {"I": "isolated mode ignores PYTHONPATH and the site hooks",
                   "E": "it ignores PYTHON* variables, PYTHONPATH among them",
                   "S": "it skips the site module, which imports sitecustomize"}
_PYTHON = re.compile(r"^python[0-9.]*$")
_TAKES_VALUE = ("-X", "-W", "--check-hash-based-pycs")


def _isolating_flag(command: Sequence[str]) -> tuple[str, str] | None:
    """(the argument, the letter): `-I` (or `-E`, `-S`, alone or among other letters) on a
    Python interpreter's command line, before its script, `-m` or `-c`."""
    if not _PYTHON.match(Path(command[0]).name):
        return None
    args = iter(command[1:])
    for arg in args:
        if arg in ("-m", "-c", "-") or not arg.startswith("-"):
            return None
        if arg in _TAKES_VALUE:
            next(args, None)
        elif not arg.startswith("--") and arg[1] not in "XW":
            flag = next((letter for letter in arg[1:] if letter in ISOLATING_FLAGS), None)
            if flag is not None:
                return arg, flag
    return None


def _start(command: Sequence[str], env: dict[str, str],
           cwd: Path | None = None) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(list(command), env=env, start_new_session=True, cwd=cwd)
    except FileNotFoundError:
        raise BadInput(f"command not found: {command[0]}") from None
    except OSError as exc:  # a directory, no execute permission, no interpreter line
        raise BadInput(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None


# SIGHUP too: a closed terminal or a dropped ssh session stops the run (and the script), as
# SIGTERM does; it would otherwise end gpudiag and leave the script training on, orphaned.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_STOPPED_RETURNCODES = tuple(code for s in FORWARDED for code in (-s, 128 + s))


@dataclass
class Ended:
    """How the command ended: Popen's return code (negative: killed by that signal), the
    signal gpudiag received and passed on, if it was stopped, and the processes the command
    left running when it ended on its own, which gpudiag stopped (a line that says so)."""

    returncode: int
    stopped_by: int | None = None
    left_running: str | None = None

    @property
    def code(self) -> int:
        """The exit code as a shell reports it: 128 + the signal that stopped or killed it."""
        if self.stopped_by is not None:
            return 128 + self.stopped_by
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    @property
    def interrupted(self) -> bool:
        """Stopped: gpudiag passed a signal on, or someone sent SIGINT/SIGTERM/SIGHUP to the
        script itself (it died of it, or exited 130/143/129 as a shell would)."""
        return self.stopped_by is not None or self.returncode in _STOPPED_RETURNCODES

    @property
    def failed(self) -> bool:
        """Ended badly on its own."""
        return not self.interrupted and self.returncode != 0

    def describe(self) -> str:
        if self.returncode < 0:
            return f"was killed by {signal_name(-self.returncode)}"
        return f"exited with code {self.returncode}"


def run_command(command: Sequence[str], env: dict[str, str],
                on_tick: Callable[[], None] | None = None, cwd: Path | None = None) -> Ended:
    """Run the command in its own process group (in `cwd`, else gpudiag's) and wait (calling
    `on_tick` meanwhile); then stop what it left running."""
    forwarder = _Forwarder()
    # Handlers (not SIG_IGN) before the child starts: a caught signal is reset to its default
    # in the child at exec, an ignored one would stay ignored there.
    previous = {s: signal.signal(s, forwarder) for s in FORWARDED}
    try:
        with job_processes() as job:
            process = _start(command, env, cwd)
            job.pid = process.pid
            forwarder.job = job
            code = _wait(process, forwarder, on_tick)
            job.running = False
            left = _stop_the_rest(job, forwarder)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return Ended(code, forwarder.received[0] if forwarder.received else None, left)


def _wait(process: subprocess.Popen[bytes], forwarder: _Forwarder,
          on_tick: Callable[[], None] | None) -> int:
    while True:
        try:
            return process.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            if forwarder.overdue() and forwarder.job is not None:
                forwarder.job.kill()
            if on_tick is not None:
                on_tick()


def _stop_the_rest(job: JobProcesses, forwarder: _Forwarder) -> str | None:
    """After the command's exit: the job's other processes end within the stop's grace, or
    are killed. Those it left running when it ended on its own (a daemon) get SIGTERM and the
    same grace; the line returned names them."""
    left = job.others()
    if not left:
        return None
    if forwarder.first_at is not None:  # stopped: they had the signal with the command
        _end_within_grace(job, forwarder, forwarder.first_at)
        return None
    left = _once_helpers_end(job, left)
    if not left:
        return None
    named = [describe(p.pid) for p in left]
    job.terminate()
    how = (f"killed (SIGKILL) after {STOP_GRACE_S:.0f} s without exiting on SIGTERM"
           if _end_within_grace(job, forwarder, time.monotonic()) else "stopped with SIGTERM")
    return (f"the command left {len(named)} process{'es' if len(named) > 1 else ''} running "
            f"({', '.join(named)}): {how}")


def _once_helpers_end(job: JobProcesses, left: list[Process]) -> list[Process]:
    """What is left once Python's own multiprocessing helpers had the grace to end: a spawn
    Pool's resource tracker (or a forkserver) outlives its script by a moment, cleaning up,
    and ends when it sees its pipe close; stopping it would leak the semaphores it was about
    to remove, and it was never the script's to leave running."""
    deadline = time.monotonic() + STOP_GRACE_S
    while left and all(python_helper(p.pid) for p in left) and time.monotonic() < deadline:
        time.sleep(POLL_S / 5)
        left = job.others()
    return left


def _end_within_grace(job: JobProcesses, forwarder: _Forwarder, since: float) -> bool:
    """Wait for the job's processes, signalled at `since`, to end; kill them after
    STOP_GRACE_S (or a second signal's kill). Whether they had to be killed."""
    killed = False
    while job.others() and time.monotonic() - since < STOP_GRACE_S + KILL_WAIT_S:
        if not killed and (time.monotonic() - since > STOP_GRACE_S or forwarder.overdue()):
            job.kill()
            killed = True
        time.sleep(POLL_S / 5)
    return killed


@dataclass
class Collected:
    """What the processes recorded: a stage each, their messages, the first rank's machine,
    the stages of processes that never wrote their final part, and what a crash printed."""

    stages: list[StageResult] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    env: Env | None = None
    unfinished: list[StageResult] = field(default_factory=list)
    crash: str | None = None  # a process's traceback tail, when it raised before any step


def collect(parts_dir: Path) -> Collected:
    """Read every process's part. A part that cannot be read (parts are written atomically, so
    only a damaged file) is reported and the others are still used."""
    found = Collected()
    envs = []
    for path in sorted(parts_dir.glob(protocol.PART_GLOB)):
        try:
            part = protocol.read_part(path)
        except RunFileError as exc:
            found.messages.append(f"{path.name}: unreadable, left out ({exc})")
            continue
        if part.error:
            found.messages.append(f"{' '.join(part.argv)}: {part.error}")
        if part.stage is not None:
            if part.window is not None:
                found.messages += _read_window(parts_dir, part.pid, part.window, part.stage)
            found.stages.append(part.stage)
            if not part.final:
                found.unfinished.append(part.stage)
        elif part.crash:
            found.crash = part.crash
        if part.env is not None:
            # A process that trained (rank 0 first) over a helper: torchrun's agent writes a
            # part too, before any rank's pid, from a process that never touched the GPU.
            envs.append(((part.stage is None, part.rank is None, part.rank or 0), part.env))
    found.stages.sort(key=lambda s: s.name)
    found.env = min(envs, key=lambda e: e[0])[1] if envs else None
    return found


def _read_window(parts_dir: Path, pid: int, window: WindowTrace, stage: StageResult,
                 ) -> list[str]:
    """The stage's evidence from its process's window (windows.py); where it cannot be read,
    the stage says so, as a failed window in the script said before. What to tell the user:
    a trace that could not be kept."""
    try:
        stage.evidence, not_kept = window_evidence(parts_dir, pid, window)
    except Exception as exc:  # a trace torch wrote wrong, a full disk: the timings stand
        stage.facts.evidence_missing = (f"the profiler window could not be read: "
                                        f"{type(exc).__name__}: {exc}")
        return []
    return [f"the profiler trace {not_kept}"] if not_kept else []


def bootstrap_failures(parts_dir: Path) -> list[str]:
    """One line per interpreter that could not load gpudiag's recorder."""
    lines = []
    for path in sorted(parts_dir.glob(protocol.BOOTSTRAP_ERROR_GLOB)):
        try:
            failure = protocol.read_bootstrap_error(path)
        except RunFileError:
            continue
        lines.append(f"{failure.python} cannot load gpudiag's recorder ({failure.error})")
    return list(dict.fromkeys(lines))


def _clear(parts_dir: Path) -> None:
    own_folder(parts_dir)  # an earlier confined run of this run folder may have linked it
    for pattern in (protocol.PART_GLOB, protocol.BOOTSTRAP_ERROR_GLOB,
                    protocol.WINDOW_DONE_GLOB, protocol.WINDOW_FILES_GLOB,
                    protocol.WRITES_GLOB, protocol.WINDOW_VOTE_GLOB):
        for old in parts_dir.glob(pattern):
            old.unlink()


@dataclass(frozen=True)
class ProfileRequest:
    config: ProfileConfig  # the command and what the recorder does in it
    out: Path  # the run directory
    rerun: bool = True  # re-run a script too short for the schedule once, with one that fits
    # A re-run's label (a fix's): run in a scratch copy of the working directory, out/cwd.
    # A diagnosis run gpudiag stops early (--stop-after-window) runs in one too (DIAGNOSIS_RUN).
    isolate: str | None = None
    policy: ConfinementPolicy = DEFAULT_POLICY


def profile_command(request: ProfileRequest,
                    on_window: Callable[[ProfileOutput], None] | None = None,
                    on_rerun: Callable[[str], None] | None = None) -> ProfileOutput:
    """Run the command under the recorder. `on_window` hears the run as soon as a process's
    profiler window closed (the script may still be running); `on_rerun` hears why a short
    script runs again, before it does (in a scratch copy: the first run was the user's own).
    A diagnosis stopped after its window runs in a scratch copy itself."""
    started = time.perf_counter()
    asked = request.config
    label = request.isolate or (DIAGNOSIS_RUN if asked.stop_after_window else None)
    output = (_profile_once(request.out, asked, on_window) if label is None else
              _isolated(request.out, request.out / SCRATCH_DIR, label, asked, on_window,
                        request.policy))
    made = max((s.facts.script.steps for s in output.run.stages if s.facts.script), default=0)
    fitted = asked.fitted(made)
    ran = output.run.config  # the asked schedule, or the one fitted to the script's plan
    assert isinstance(ran, ProfileConfig)
    # A window its budget closed after fewer steps than asked met the schedule: the script
    # (or --stop-after-window) ending soon after is no reason to run it again.
    met = any(s.facts.script.timeline.window_whole for s in output.run.stages
              if s.facts.script and s.facts.script.timeline)
    if (request.rerun and output.exit_code == 0 and made and not met
            and made < ran.steps_needed and fitted is not None):
        short = (f"the script made {made} steps, fewer than the {asked.steps_needed} "
                 f"gpudiag's schedule needs (warm-up {asked.warmup}, timed {asked.timed}, "
                 f"profiled {asked.evidence_steps})")
        refused = confinement_refusal(
            request.policy, "it would run once more in a scratch copy of this folder")
        note = (f"{short}; it is run once more with warm-up {fitted.warmup}, timed "
                f"{fitted.timed}, profiled {fitted.evidence_steps}, in a scratch copy of its "
                f"working directory ({RERUN_DIR}/{SCRATCH_DIR} in the run folder; --no-rerun "
                "to keep the first run)") if refused is None else f"{short}; {refused}"
        announced = on_rerun is not None
        if on_rerun is not None:
            on_rerun(note)
        try:
            if refused is None:
                output = _kept_run(output, _isolated(
                    request.out, own_folder(request.out / RERUN_DIR) / SCRATCH_DIR, RERUN_DIR,
                    fitted, on_window, request.policy))
        except ScratchError as exc:
            note = f"{short}, too few for a profiler window; {exc}"
            announced = False
        except KeyboardInterrupt as exc:  # while copying, where no child holds the signal
            output.run.interrupted, output.exit_code = True, 128 + signal_of(exc)
        if not announced:
            output.messages.insert(0, note)
        output.run.notes.insert(0, note)
    scheduling = scheduling_note()
    if scheduling is not None:
        output.run.notes.append(scheduling)
    output.run.duration_s = time.perf_counter() - started
    return output


AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")
BUSY_LOAD_PER_CPU = 0.5  # runnable processes per CPU (1-minute load) that other work adds


def scheduling_note() -> str | None:
    """How the script's CPU share may have differed from the user's own run: it runs in a
    session of its own (so gpudiag can stop all it starts), and where the kernel schedules
    each session as a group (autogroup, on by default in many distributions), a busy CPU
    shares out per group, not per process. Said only when the CPU was busy."""
    try:
        autogroup = AUTOGROUP.read_text().strip() == "1"
        load = os.getloadavg()[0]
    except OSError:
        return None
    cpus = os.cpu_count() or 1
    if not autogroup or load < BUSY_LOAD_PER_CPU * cpus:
        return None
    return (f"The CPU was busy (load {load:.1f} on {cpus} CPUs) and this kernel schedules "
            "each session as a group (autogroup): the script ran in a session of its own, "
            "so its share of the CPU, and its host-bound steps, may differ from a run in "
            "your terminal's session; compare step times with the machine otherwise idle.")


def _isolated(out: Path, top: Path, label: str, config: ProfileConfig,
              on_window: Callable[[ProfileOutput], None] | None,
              policy: ConfinementPolicy) -> ProfileOutput:
    """A run in a scratch copy of gpudiag's working directory (in `top`), its writes confined
    where the kernel can; the run records it (RunResult.reruns), with what it wrote, or tried
    to write, outside the copy. ScratchError when the copy cannot be made."""
    scratch = make_scratch(Path.cwd(), top, leave_out=out, written_since=policy.written_since,
                           confined=policy.confined)
    try:
        output = _profile_once(out, config, on_window, scratch, policy)
    finally:
        rerun = scratch.finish(label, out / PARTS_DIR)
    output.run.reruns.append(rerun)
    if output.exit_code != 0 and not output.run.interrupted:
        output.refused = refused_writes(rerun, scratch.why_linked)
    if output.refused is not None:
        refused = f"it {output.refused.what}; {output.refused.advice}"
        output.messages.append(f"{label}: {refused}")
        output.run.notes.append(f"The run {label} failed: {refused}.")
    return output


def _kept_run(first: ProfileOutput, second: ProfileOutput) -> ProfileOutput:
    """A short script's re-run's output; or, where the re-run failed on its own (most often a
    write its confinement refused: a log in /tmp), the first run's, which succeeded and is the
    user's own: it stands, with its exit code, the re-run's record and a line saying why the
    re-run does not count."""
    if second.exit_code == 0 or second.run.interrupted:
        return second
    refused = second.refused
    line = (f"the re-run {refused.what if refused else f'exited with code {second.exit_code}'}"
            "; the first run's results stand" + (f"; {refused.advice}" if refused else ""))
    first.run.reruns += second.run.reruns
    first.run.notes.append(f"{line[0].upper()}{line[1:]}.")
    first.messages.append(line)
    return first


def refused_writes(rerun: Rerun, why_linked: Callable[[str], str | None]) -> Refused | None:
    """Why a confined re-run failed, where it was refused a write: what it could not write,
    and the advice that applies: a file of the working directory the copy only links
    (`why_linked` says why, and what to do), else the folder --rerun-writable would allow
    where that flag may name it. None when nothing was refused."""
    if not (rerun.confined and rerun.wrote_outside):
        return None
    first = rerun.wrote_outside[0]
    more = " and more" if len(rerun.wrote_outside) > 1 or rerun.more_outside else ""
    said = (f"could not write {first}{more}: refused by confinement (a run in a copy may "
            "write only there, so no file of yours changes)")
    return Refused(said, why_linked(first) or _where_instead(Path(first).parent, rerun.source))


def _where_instead(folder: Path, source: str) -> str:
    """What to do about a refused write into `folder`, which the copy does not link: only a
    folder outside the working directory (`source`) can be allowed (--rerun-writable)."""
    if folder.is_relative_to(source):
        return ("that path is your folder's own, not the copy's: have the script write by a "
                "path relative to its working directory")
    if Path(source).is_relative_to(folder):
        return (f"{folder} holds the working directory, which no run in a copy may write: "
                "have the script write in a folder of its own and allow that one with "
                "--rerun-writable FOLDER")
    return f"if {folder} holds nothing of yours, --rerun-writable {folder} lets the runs write it"


def _profile_once(out: Path, config: ProfileConfig,
                  on_window: Callable[[ProfileOutput], None] | None,
                  scratch: Scratch | None = None,
                  policy: ConfinementPolicy = DEFAULT_POLICY) -> ProfileOutput:
    parts_dir = out / PARTS_DIR
    _clear(parts_dir)
    env = child_env(parts_dir, out, config)
    command = list(config.command)
    writable: list[str] | None = None
    with contextlib.ExitStack() as cleanup:
        if scratch is not None:
            env.update(scratch.env())
            command = scratch.command(command)
            if scratch.confined:
                writable = cleanup.enter_context(confined([out], scratch.source, env, policy))
        windows_closed = [0]

        def tick() -> None:
            # A window that closed is read now, while the script goes on (windows.py); the
            # first one's early report, when asked for.
            closed = sum(1 for _ in parts_dir.glob(protocol.WINDOW_DONE_GLOB))
            if closed == windows_closed[0]:
                return
            first, windows_closed[0] = windows_closed[0] == 0, closed
            output = _output(config, parts_dir, ended=None)
            if first and on_window is not None:
                on_window(output)

        ended = run_command(child_command(command, writable), env, on_tick=tick,
                            cwd=scratch.root if scratch is not None else None)
    # The ranks' votes served while they ran; a stale one would be read as a rank's by a
    # later run in this folder (--force): same steps, same ranks.
    for vote in parts_dir.glob(protocol.WINDOW_VOTE_GLOB):
        vote.unlink(missing_ok=True)
    output = _output(config, parts_dir, ended=ended)
    if not any(s.facts.script for s in output.run.stages):  # no process recorded a step
        failures = bootstrap_failures(parts_dir)
        if failures:
            raise BadInput(f"{failures[0]}: install gpudiag into that interpreter, or run the "
                           "command with the Python gpudiag runs under")
    return output


def _output(config: ProfileConfig, parts_dir: Path, ended: Ended | None) -> ProfileOutput:
    """The run so far (`ended` None: the command still runs) or as the command left it."""
    found = collect(parts_dir)
    fitted = _fitted_to_plan(config, found.stages)
    run = RunResult(
        tool_version=__version__, env=found.env or _no_environment(), config=fitted or config,
        created_utc=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        stages=found.stages, interrupted=ended is not None and ended.interrupted)
    messages = found.messages
    if fitted is not None:
        timeline = next(s.facts.script.timeline for s in found.stages
                        if s.facts.script is not None and s.facts.script.timeline is not None)
        run.notes.append(
            f"The script plans {timeline.planned_steps} steps ({timeline.planned_from}), fewer "
            f"than the {config.steps_needed} gpudiag's schedule needs (warm-up "
            f"{config.warmup}, timed {config.timed}, profiled {config.evidence_steps}): it was "
            f"profiled in one run with warm-up {fitted.warmup}, timed {fitted.timed}, "
            f"profiled {fitted.evidence_steps}.")
    if ended is not None and ended.failed:
        _mark_failure(run, found, ended, config.command)
        messages.append(f"the command {ended.describe()}")
        run.notes.append(f"The command {ended.describe()}.")
    if ended is not None and ended.left_running:
        messages.append(ended.left_running)
        run.notes.append(f"{ended.left_running[0].upper()}{ended.left_running[1:]}.")
    if not run.stages:
        messages.append(NO_STEPS_HELP)
        run.notes.append(NO_STEPS_HELP)
    return ProfileOutput(run=run, exit_code=ended.code if ended is not None else 0,
                         messages=messages)


def _fitted_to_plan(config: ProfileConfig, stages: Sequence[StageResult],
                    ) -> ProfileConfig | None:
    """The schedule the script's processes ran, where their recorders fitted it to the steps
    the script planned (recorder.py); None where they ran the asked one."""
    for stage in stages:
        script = stage.facts.script
        if script is not None and script.fitted_schedule is not None \
                and script.timeline is not None:
            warmup, timed, profiled = script.fitted_schedule
            return dataclasses.replace(config, warmup=warmup, timed=timed,
                                       evidence_steps=profiled)
    return None


def _mark_failure(run: RunResult, found: Collected, ended: Ended,
                  command: Sequence[str]) -> None:
    """A command that failed on its own: processes that died without Python's shutdown
    (os._exit, SIGKILL, a crash in native code) are marked so on their stage; a command that
    failed before any step recorded gets a stage that says how it ended."""
    for stage in found.unfinished:
        stage.status = "error"
        stage.error = (f"the process ended without Python's shutdown (the command "
                       f"{ended.describe()}): os._exit, a kill or a native crash; steps up to "
                       "its last report are kept")
        _mark_killed(stage, ended)
    if not run.stages:
        run.stages.append(StageResult(
            name=_command_name(command), status="error", title=" ".join(command),
            error=(f"the command {ended.describe()} before its first step was recorded"
                   + (f": {found.crash.strip().splitlines()[-1]}" if found.crash else "")),
            traceback=found.crash))


def _mark_killed(stage: StageResult, ended: Ended) -> None:
    """A process that ended without Python's shutdown died of SIGKILL where the command did
    (exit 137), or where the kernel counted an out-of-memory kill in the cgroup whose limit
    applies to it over the run (a torchrun rank: its agent exits 1); its memory says so, with
    that count read again now (the rules tell the kernel's out-of-memory killer from a kill
    from elsewhere). The machine's count is any process's: never read as this one's death."""
    memory = stage.facts.script.memory if stage.facts.script else None
    if memory is None:
        return
    limit = memory.host_limit
    if limit is not None and limit.oom_kill_file is not None:
        limit.oom_kills_after = oom_kills(Path(limit.oom_kill_file))
    counted = (limit is not None and limit.source != "machine"
               and limit.oom_kills_after is not None and limit.oom_kills is not None
               and limit.oom_kills_after > limit.oom_kills)
    if ended.code == 128 + signal.SIGKILL or counted:
        memory.killed = "process"


def _command_name(command: Sequence[str]) -> str:
    """`train.py` for `python train.py ...`; the program's name otherwise."""
    script = next((Path(a).name for a in command[1:] if a.endswith(".py")), None)
    return script or Path(command[0]).name


def _no_environment() -> Env:
    """When no process reported its machine (nothing ran): what the parent knows without
    importing torch."""
    return Env(device="unknown", python_version=platform.python_version(),
               platform=platform.platform(), hostname=socket.gethostname(),
               nvml="unavailable: no profiled process reported")
