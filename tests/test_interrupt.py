"""Ctrl-C on a real run: exit 130, partial run.json, no traceback storm from DataLoader workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_mlp import MODEL as TINY_MLP

from gpudiag.model.errors import ExitCode

pytestmark = pytest.mark.slow


def test_ctrl_c_writes_partial_results_and_exits_130(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # infer is short; data-train runs long enough to be interrupted with its workers alive.
    command = [sys.executable, "-m", "gpudiag", "run", "--device", "cpu", "--preset", "tiny",
               "--model", TINY_MLP, "--stages", "infer,data-train,train", "--iters", "150",
               "--warmup", "1", "--workers", "2", "--out", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # A process group of its own, as a shell gives a foreground job: Ctrl-C reaches every
    # process in it, DataLoader workers included.
    # A background job (CI, a tool's shell) starts with SIGINT ignored, and an ignored signal
    # stays ignored across exec, so Python would install no KeyboardInterrupt handler. A
    # handler (not SIG_IGN) here becomes the default in the child, as in a terminal.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        _wait_for_first_stage(out / "run.json", proc)
        # Stretch data-train: it is running now; interrupt it shortly after it starts.
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = stdout.decode() + stderr.decode()
    assert proc.returncode == ExitCode.INTERRUPTED, text
    assert "Traceback" not in text, text
    run = json.loads((out / "run.json").read_text())
    assert run["interrupted"] is True
    statuses = {s["name"]: s["status"] for s in run["stages"]}
    assert statuses["infer"] == "ok"
    assert statuses["train"] == "skipped"
    assert (out / "report.md").read_text().count("Interrupted") == 1


def _wait_for_first_stage(run_file: Path, proc: subprocess.Popen[bytes]) -> None:
    # A deadline, not a measurement: a 2-core CI machine under load took over 90 s.
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        if run_file.exists():
            stages = json.loads(run_file.read_text())["stages"]
            if stages:
                return
        time.sleep(0.05)
    raise AssertionError("the first stage never finished")


def test_a_stop_silences_the_fd_sharers_lost_peer_in_both_hooks() -> None:
    """DataLoader workers killed mid-handshake make multiprocessing's resource sharer report a
    broken pipe through sys.excepthook (its thread catches its own errors): while a stop is
    open that report is the stop, not a failure; any other error still reaches the hook."""
    import sys

    from gpudiag.measure.interrupts import stop_on_signals

    seen: list[type[BaseException]] = []
    previous = sys.excepthook
    sys.excepthook = lambda t, e, tb: seen.append(t)
    try:
        with stop_on_signals():
            for filename in ("/x/multiprocessing/resource_sharer.py", "/x/train.py"):
                try:
                    exec(compile("raise BrokenPipeError(32, 'Broken pipe')", filename, "exec"))
                except BrokenPipeError:
                    sys.excepthook(*sys.exc_info())
    finally:
        sys.excepthook = previous
    assert seen == [BrokenPipeError]
