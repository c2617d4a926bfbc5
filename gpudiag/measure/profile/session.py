"""The parent side of `gpudiag profile`: run the user's command with the recorder injected, then
turn what each process recorded into an ordinary run (one stage per script, or per rank).

Injection: a bootstrap folder holding a sitecustomize.py leads PYTHONPATH, so every Python
process the command starts (the script, torchrun's ranks) installs the recorder before the
user's code runs; nothing in the script changes. Output passes through; the command's exit code
is kept. The command runs in its own process group: SIGINT and SIGTERM sent to gpudiag are
passed to all of it, and whatever the processes recorded is read even when the command failed
or was stopped. This module never imports torch: the recorder in each process reports its
machine and settings.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import gpudiag
from gpudiag._version import __version__
from gpudiag.measure.profile import protocol
from gpudiag.measure.profile.protocol import Schedule
from gpudiag.model.errors import EXIT_INTERRUPTED, BadInput
from gpudiag.model.results import Env, RunResult, StageResult, from_jsonable

BOOTSTRAP = Path(__file__).resolve().parent / "bootstrap"
PARTS_DIR = "parts"
STOP_GRACE_S = 30.0  # after a forwarded signal, before the command's process group is killed
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


def child_env(parts: Path, schedule: Schedule, *, telemetry: str = "full",
              stop_after_window: bool = False, trace_dir: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    package_root = str(Path(gpudiag.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(BOOTSTRAP), package_root, env.get("PYTHONPATH", "")) if p)
    env.update(schedule.env())
    # Absolute: a script that changes directory (Hydra's job.chdir) must still find them.
    env.update({protocol.ENV_OUT: str(parts.resolve()), protocol.ENV_PARENT: str(os.getpid()),
                protocol.ENV_TELEMETRY: telemetry,
                protocol.ENV_STOP: "1" if stop_after_window else "0"})
    if trace_dir is not None:
        env[protocol.ENV_TRACE_DIR] = str(trace_dir.resolve())
    return env


class _Forwarder:
    """SIGINT/SIGTERM to gpudiag, passed to the command's process group; a second signal, or
    STOP_GRACE_S without an exit, kills the group."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.first_at: float | None = None
        self.pid: int | None = None

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        if self.first_at is None:
            self.first_at = time.monotonic()
        self.received.append(signum)
        if self.pid is not None:
            _signal_group(self.pid, signal.SIGKILL if len(self.received) > 1 else signum)

    def overdue(self) -> bool:
        return self.first_at is not None and time.monotonic() - self.first_at > STOP_GRACE_S


def _start(command: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(list(command), env=env, start_new_session=True)
    except FileNotFoundError:
        raise BadInput(f"command not found: {command[0]}") from None
    except OSError as exc:  # a directory, no execute permission, no interpreter line
        raise BadInput(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None


def run_command(command: Sequence[str], env: dict[str, str],
                on_tick: Callable[[], None] | None = None) -> int:
    """Run the command in its own process group and wait (calling `on_tick` meanwhile).
    Returns the command's exit code as a shell reports it (128 + signal when a signal ended
    it), or 128 + the signal gpudiag received when it was stopped."""
    forwarder = _Forwarder()
    # Handlers (not SIG_IGN) before the child starts: a caught signal is reset to its default
    # in the child at exec, an ignored one would stay ignored there.
    previous = {s: signal.signal(s, forwarder) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        process = _start(command, env)
        forwarder.pid = process.pid
        while True:
            try:
                code = process.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                if forwarder.overdue():
                    _signal_group(process.pid, signal.SIGKILL)
                if on_tick is not None:
                    on_tick()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if forwarder.received:
        return 128 + forwarder.received[0]
    return 128 - code if code < 0 else code


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pid, signum)


def collect(parts_dir: Path) -> tuple[list[StageResult], list[str], Env | None]:
    """Every process's stage, its messages, and the environment the first rank reported."""
    stages, messages, envs = [], [], []
    for path in sorted(parts_dir.glob(protocol.PART_GLOB)):
        try:
            part = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a part being rewritten right now: the final read gets it
        if part.get("error"):
            messages.append(f"{' '.join(part['argv'])}: {part['error']}")
        if part.get("stage"):
            stages.append(from_jsonable(StageResult, part["stage"]))
        if part.get("env"):
            envs.append((int(part.get("rank") or 0), from_jsonable(Env, part["env"])))
    stages.sort(key=lambda s: s.name)
    return stages, messages, min(envs, key=lambda e: e[0])[1] if envs else None


def bootstrap_failures(parts_dir: Path) -> list[str]:
    """One line per interpreter that could not load gpudiag's recorder."""
    lines = []
    for path in sorted(parts_dir.glob(protocol.BOOTSTRAP_ERROR_GLOB)):
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        lines.append(f"{info.get('python')} cannot load gpudiag's recorder ({info.get('error')})")
    return list(dict.fromkeys(lines))


def _clear(parts_dir: Path) -> None:
    parts_dir.mkdir(parents=True, exist_ok=True)
    for pattern in (protocol.PART_GLOB, protocol.BOOTSTRAP_ERROR_GLOB,
                    protocol.WINDOW_DONE_GLOB):
        for old in parts_dir.glob(pattern):
            old.unlink()


@dataclass
class ProfileRequest:
    command: Sequence[str]
    out: Path  # the run directory
    schedule: Schedule = field(default_factory=Schedule)
    telemetry: str = "full"
    stop_after_window: bool = False
    rerun: bool = True  # re-run a script too short for the schedule once, with one that fits


def profile_command(request: ProfileRequest,
                    on_window: Callable[[ProfileOutput], None] | None = None) -> ProfileOutput:
    """Run the command under the recorder. `on_window` hears the run as soon as a process's
    profiler window closed (the script may still be running)."""
    started = time.perf_counter()
    output = _profile_once(request, request.schedule, on_window)
    made = max((s.facts.script.steps for s in output.run.stages if s.facts.script), default=0)
    fitted = request.schedule.fitted(made)
    if (request.rerun and output.exit_code == 0 and made
            and made < request.schedule.steps_needed and fitted is not None):
        note = (f"the script made {made} steps, fewer than the {request.schedule.steps_needed} "
                f"gpudiag's schedule needs (warm-up {request.schedule.warmup}, timed "
                f"{request.schedule.timed}, profiled {request.schedule.profiled}); ran it once "
                f"more with warm-up {fitted.warmup}, timed {fitted.timed}, profiled "
                f"{fitted.profiled} (--no-rerun to keep the first run)")
        output = _profile_once(request, fitted, on_window)
        output.messages.insert(0, note)
        output.run.notes.insert(0, note)
    output.run.duration_s = time.perf_counter() - started
    return output


def _profile_once(request: ProfileRequest, schedule: Schedule,
                  on_window: Callable[[ProfileOutput], None] | None) -> ProfileOutput:
    parts_dir = request.out / PARTS_DIR
    _clear(parts_dir)
    env = child_env(parts_dir, schedule, telemetry=request.telemetry,
                    stop_after_window=request.stop_after_window, trace_dir=request.out)
    announced: list[bool] = []

    def tick() -> None:
        if on_window is not None and not announced and any(
                parts_dir.glob(protocol.WINDOW_DONE_GLOB)):
            announced.append(True)
            on_window(_output(request, schedule, parts_dir, code=0, interrupted=False))

    code = run_command(request.command, env, on_tick=tick)
    interrupted = code in (EXIT_INTERRUPTED, 128 + signal.SIGTERM)
    output = _output(request, schedule, parts_dir, code=code, interrupted=interrupted)
    if not output.run.stages:
        failures = bootstrap_failures(parts_dir)
        if failures:
            raise BadInput(f"{failures[0]}: install gpudiag into that interpreter, or run the "
                           "command with the Python gpudiag runs under")
    return output


def _output(request: ProfileRequest, schedule: Schedule, parts_dir: Path, *, code: int,
            interrupted: bool) -> ProfileOutput:
    stages, messages, env = collect(parts_dir)
    run = RunResult(
        tool_version=__version__, env=env or _no_environment(),
        config={"command": list(request.command), "warmup": schedule.warmup,
                "timed": schedule.timed, "evidence_steps": schedule.profiled,
                "telemetry": request.telemetry, "mode": "profile",
                "stop_after_window": request.stop_after_window},
        created_utc=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        stages=stages, interrupted=interrupted)
    if not stages:
        messages.append(NO_STEPS_HELP)
        run.notes.append(NO_STEPS_HELP)
    return ProfileOutput(run=run, exit_code=code, messages=messages)


def _no_environment() -> Env:
    """When no process reported its machine (nothing ran): what the parent knows without
    importing torch."""
    return Env(device="unknown", python_version=platform.python_version(),
               platform=platform.platform(), hostname=socket.gethostname(),
               nvml="unavailable: no profiled process reported")
