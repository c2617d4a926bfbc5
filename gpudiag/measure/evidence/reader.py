"""Closed profiler windows read (their trace parsed, analysed, gzipped where it is kept) away
from the process that profiles: `gpudiag profile`'s own process reads a script's window while
the script goes on (profile/launching/windows.py); the ladder hands its windows to a reader
process of its own while it records the next stage's window. Parsing and analysing were ~40%
of a window on an H100 (reports/examples/benchmarks/h100-window-phases-after.json). No torch.

`python -m gpudiag.measure.evidence.reader`: the reader process. One JSON request a line on
stdin (a trace's path and its WindowTrace), one JSON answer a line on stdout, in order; it
ends at the end of its input (gpudiag closed the pipe, or died)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpudiag.measure.evidence.trace import analyze
from gpudiag.measure.evidence.tracefile import collector_paused, parse_trace, save_trace
from gpudiag.model.errors import first_line
from gpudiag.model.profilepart import WindowTrace
from gpudiag.model.results import Evidence
from gpudiag.model.runfile import from_jsonable, to_jsonable

# A smaller trace is read where it was recorded: ~0.3 s at most of parsing and analysis (the
# dgca windows on an H100: ~13 MB a second), less than the reader process takes to start.
READ_HERE_BYTES = 4 * 2**20


@dataclass
class WindowRead:
    """A window's evidence, or why it could not be had; and why its gzipped trace was not
    kept where it was to be (the evidence stands without it)."""

    evidence: Evidence | None
    error: str | None = None
    not_kept: str | None = None


def read_window(trace: Path, window: WindowTrace) -> tuple[Evidence, str | None]:
    """The evidence of the window whose exported trace is at `trace`, and why its gzipped copy
    (`window.save_as`) was not written, where it was not. OSError where the trace cannot be
    read; a malformed trace raises what its parse raises."""
    exported = trace.read_bytes()
    events = parse_trace(exported)
    with collector_paused():
        evidence = analyze(events, steps=window.steps, step_ms=window.step_ms,
                           backend=window.backend, timed_step_ms=window.timed_step_ms,
                           kernel_lines=window.kernel_lines,
                           roots=tuple(Path(root) for root in window.roots if root))
    del events
    evidence.attribution_note = window.attribution_note
    if window.save_as is not None:
        try:
            save_trace(exported, Path(window.save_as))
        except OSError as exc:  # a full disk: the evidence stands, the missing file is said
            return evidence, f"{Path(window.save_as).name} not written: {exc}"
    return evidence, None


def _read_safely(trace: Path, window: WindowTrace) -> WindowRead:
    try:
        evidence, not_kept = read_window(trace, window)
    except Exception as exc:
        return WindowRead(None, error=f"{type(exc).__name__}: {first_line(str(exc))}")
    return WindowRead(evidence, not_kept=not_kept)


class Reading:
    """One window being read: `done()` without waiting, `result()` waits. The reader process's
    answer is decoded here, by the caller, not in the thread that receives it: that thread
    runs beside the next window's profiled steps."""

    def __init__(self, future: Future[WindowRead | bytes]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> WindowRead:
        found = self._future.result()
        if isinstance(found, WindowRead):
            return found
        try:
            return _answer(json.loads(found))
        except Exception as exc:  # a garbled answer
            return WindowRead(None, error=f"the reader's answer: {type(exc).__name__}: {exc}")


class WindowReader:
    """Windows read in the order they closed: a large trace by the reader process (started at
    the first one), a small one, or the last, at once, here. Where the reader process cannot
    start or dies, what it had not answered is read here. `close` waits for every reading;
    `abandon` (a stop) does not: what was not read says so."""

    def __init__(self, read_here_bytes: int | None = None) -> None:
        self.read_here_bytes = READ_HERE_BYTES if read_here_bytes is None else read_here_bytes
        self._folder: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._broken = False  # the process could not start, or died: read here from now on
        self._waiting: collections.deque[tuple[Future[WindowRead | bytes], Path, WindowTrace]] = (
            collections.deque())
        self._lock = threading.Lock()
        self._answers: threading.Thread | None = None

    @property
    def folder(self) -> Path:
        """Where the windows' traces are exported to be read (made at the first one)."""
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="gpudiag-windows-"))
        return self._folder

    def read(self, trace: Path, window: WindowTrace, *, last: bool = False) -> Reading:
        """The window's reading; the `last` one is read here: nothing comes after it to
        overlap with (a one-stage run starts no reader), and the reader may be busy."""
        future: Future[WindowRead | bytes] = Future()
        if not last and trace.stat().st_size >= self.read_here_bytes and self._started():
            assert self._process is not None and self._process.stdin is not None
            request = json.dumps({"trace": str(trace), "window": to_jsonable(window)})
            with self._lock:
                self._waiting.append((future, trace, window))
            try:
                self._process.stdin.write(request.encode() + b"\n")
                self._process.stdin.flush()
            except OSError:  # it died: this window is read here, unless its answers thread
                self._broken = True  # (still at its end) took it to read there
                with self._lock:
                    ours = [w for w in self._waiting if w[0] is future]
                    for waiting in ours:
                        self._waiting.remove(waiting)
                if ours:
                    future.set_result(_read_safely(trace, window))
            return Reading(future)
        future.set_result(_read_safely(trace, window))
        return Reading(future)

    def _started(self) -> bool:
        if self._process is None and not self._broken:
            try:
                self._process = subprocess.Popen(
                    [sys.executable, "-m", "gpudiag.measure.evidence.reader"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            except OSError:
                self._broken = True
                return False
            self._answers = threading.Thread(target=self._take_answers, daemon=True,
                                             name="gpudiag-window-answers")
            self._answers.start()
        return self._process is not None and not self._broken

    def _take_answers(self) -> None:
        """Each answer to the window waiting longest; at the process's end, what it left
        unanswered is read here, in this thread."""
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            with self._lock:
                if not self._waiting:
                    continue
                future, _, _ = self._waiting.popleft()
            future.set_result(line)
        self._broken = True
        with self._lock:
            left, self._waiting = list(self._waiting), collections.deque()
        for future, trace, window in left:
            future.set_result(_read_safely(trace, window))

    def close(self) -> None:
        """Wait for every window's reading, then end the reader process and its folder."""
        if self._process is not None:
            if self._process.stdin is not None:
                with contextlib.suppress(OSError):  # it died: its answers thread has ended
                    self._process.stdin.close()
            if self._answers is not None:
                self._answers.join()
            self._process.wait()
        self._remove_folder()

    def abandon(self, why: str) -> None:
        """A stop: the reader process ends now; each window it had not answered says `why`."""
        with self._lock:
            left, self._waiting = list(self._waiting), collections.deque()
        for future, _, _ in left:
            future.set_result(WindowRead(None, error=why))
        if self._process is not None:
            self._process.kill()
            self._process.wait()
        self._remove_folder()

    def _remove_folder(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


def _answer(data: dict[str, Any]) -> WindowRead:
    evidence = data.get("evidence")
    return WindowRead(None if evidence is None else from_jsonable(Evidence, evidence),
                      error=data.get("error"), not_kept=data.get("not_kept"))


def main() -> int:
    """The reader process: a request a line, an answer a line, until its input ends."""
    # A Ctrl-C reaches the whole process group: gpudiag decides what a stop does to its reader.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(sys.stdout.fileno(), "wb", closefd=False)
    for line in sys.stdin.buffer:
        request = json.loads(line)
        read = _read_safely(Path(request["trace"]),
                            from_jsonable(WindowTrace, request["window"]))
        answer = {"evidence": None if read.evidence is None else to_jsonable(read.evidence),
                  "error": read.error, "not_kept": read.not_kept}
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
