"""The parent side of `gpudiag profile`: run the user's command with the recorder injected, then
turn what each process recorded into an ordinary run (one stage per script, or per rank).

Injection: a bootstrap folder holding a sitecustomize.py leads PYTHONPATH, so every Python
process the command starts (the script, torchrun's ranks) installs the recorder before the
user's code runs; nothing in the script changes. Output passes through; the command's exit code
is kept. Whatever the processes recorded is read even when the command failed or was stopped.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gpudiag
from gpudiag._version import __version__
from gpudiag.measure.profile import recorder
from gpudiag.model.errors import EXIT_INTERRUPTED, BadInput
from gpudiag.model.results import RunResult, StageResult, from_jsonable

BOOTSTRAP = Path(__file__).resolve().parent / "bootstrap"
PARTS_DIR = "parts"
NO_STEPS_HELP = (
    "no training steps detected: gpudiag counts optimizer.step() calls. For a loop without "
    "an optimizer, call gpudiag.step() once per step, or wrap the loop body in "
    "`with gpudiag.watch():`")


@dataclass
class ProfileOutput:
    run: RunResult
    exit_code: int  # the command's
    messages: list[str]


def child_env(out: Path, *, warmup: int, timed: int, steps: int,
              telemetry: str = "full") -> dict[str, str]:
    env = dict(os.environ)
    package_root = str(Path(gpudiag.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(BOOTSTRAP), package_root, env.get("PYTHONPATH", "")) if p)
    env.update({recorder.ENV_OUT: str(out), recorder.ENV_WARMUP: str(warmup),
                recorder.ENV_TIMED: str(timed), recorder.ENV_STEPS: str(steps),
                recorder.ENV_PARENT: str(os.getpid()), recorder.ENV_TELEMETRY: telemetry})
    return env


def run_command(command: Sequence[str], env: dict[str, str]) -> int:
    # A Python handler (not SIG_IGN, which children would inherit) so that Ctrl-C reaches the
    # command with its default behaviour and interrupts our wait.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(list(command), env=env)
    except FileNotFoundError:

        raise BadInput(f"command not found: {command[0]}") from None
    try:
        code = process.wait()
        # Killed by a signal (an unhandled Ctrl-C re-raises SIGINT): report it as a shell would.
        return 128 - code if code < 0 else code
    except KeyboardInterrupt:  # the command got Ctrl-C too: let it write what it has
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        return EXIT_INTERRUPTED


def collect(parts_dir: Path) -> tuple[list[StageResult], list[str]]:
    stages, messages = [], []
    for path in sorted(parts_dir.glob("part-*.json")):
        part = json.loads(path.read_text())
        if part.get("error"):
            messages.append(f"{' '.join(part['argv'])}: {part['error']}")
        if part.get("stage"):
            stages.append(from_jsonable(StageResult, part["stage"]))
    stages.sort(key=lambda s: s.name)
    return stages, messages


def profile_command(command: Sequence[str], out: Path, *, warmup: int, timed: int,
                    steps: int, telemetry: str = "full") -> ProfileOutput:
    from gpudiag.measure.env import collect_env  # noqa: PLC0415 (the parent starts the script before importing torch)

    parts_dir = out / PARTS_DIR
    for old in parts_dir.glob("part-*.json"):
        old.unlink()
    started = time.perf_counter()
    code = run_command(command, child_env(parts_dir, warmup=warmup, timed=timed, steps=steps,
                                          telemetry=telemetry))
    stages, messages = collect(parts_dir)
    import torch  # noqa: PLC0415 (the parent starts the script before importing torch)

    cuda = any(s.timer == "cuda-events" for s in stages)
    device = torch.device("cuda", 0) if cuda and torch.cuda.is_available() else \
        torch.device("cpu")
    run = RunResult(
        tool_version=__version__,
        env=collect_env(device, None, "telemetry is sampled inside the profiled processes"),
        config={"command": list(command), "warmup": warmup, "timed": timed,
                "evidence_steps": steps, "telemetry": telemetry, "mode": "profile"},
        created_utc=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        stages=stages, interrupted=code == EXIT_INTERRUPTED,
    )
    if not stages:
        messages.append(NO_STEPS_HELP)
        run.notes.append(NO_STEPS_HELP)
    run.duration_s = time.perf_counter() - started
    return ProfileOutput(run=run, exit_code=code, messages=messages)
