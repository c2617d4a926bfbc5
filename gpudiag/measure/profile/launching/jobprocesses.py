"""Every process of a profiled command, wherever it went.

A process the command starts may leave the command's process group (setpgid: some launchers
move their trainer to its own) or its session (a daemon's setsid), and a process whose parent
exits is handed to init: signalling the command's process group misses it, so it trains on after
Ctrl-C, or outlives the run. On Linux, gpudiag is a child subreaper while the command runs
(prctl PR_SET_CHILD_SUBREAPER), so the command's orphans are handed to gpudiag instead of init,
and the job is every process below the command or handed to gpudiag meanwhile, whatever its
group or session (read from /proc). Elsewhere the job is the command's process group, as
gpudiag had it before.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
TRACKS_DESCENDANTS = sys.platform.startswith("linux") and (PROC / "self" / "stat").is_file()
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
PR_GET_CHILD_SUBREAPER = 37
SHOWN_CHARS = 60  # of a left-over process's command line, in the one line that names it


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    pgid: int
    zombie: bool  # ended, not yet reaped by its parent


def _process_table() -> dict[int, Process]:
    table = {}
    for entry in os.scandir(PROC):
        if not entry.name.isdigit():
            continue
        try:  # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        pid = int(entry.name)
        table[pid] = Process(pid, int(fields[1]), int(fields[2]), fields[0] in ("Z", "X"))
    return table


def describe(pid: int) -> str:
    """`pid 4242 (python serve.py --port 80)`: a process, as its command line names it."""
    try:
        argv = Path(PROC, str(pid), "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return f"pid {pid}"
    line = " ".join(a.decode(errors="replace") for a in argv)
    return f"pid {pid} ({line[:SHOWN_CHARS]}{'...' if len(line) > SHOWN_CHARS else ''})"


# Python's multiprocessing helpers, by the code their interpreter runs (`python -c "from
# multiprocessing.resource_tracker import main;main(5)"`, Lib/multiprocessing/resource_tracker.py
# and forkserver.py).
_HELPERS = (b"from multiprocessing.resource_tracker import main",
            b"from multiprocessing.forkserver import main")


def python_helper(pid: int) -> bool:
    """Whether `pid` is Python's multiprocessing resource tracker or forkserver, or a process
    already exiting: its command line reads empty once its memory is released, before it is a
    zombie (the tracker was caught so in a clean-clone test run, and called left running)."""
    try:
        cmdline = Path(PROC, str(pid), "cmdline").read_bytes()
    except OSError:
        return False
    return not cmdline or any(helper in cmdline for helper in _HELPERS)


def _prctl(option: int, value: int | ctypes.c_int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        arg = ctypes.byref(value) if isinstance(value, ctypes.c_int) else value
        return bool(libc.prctl(option, arg, 0, 0, 0) == 0)
    except (OSError, AttributeError):  # no C library to load, or no prctl in it
        return False


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.kill(pid, signum)


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pgid, signum)


@dataclass
class JobProcesses:
    """The command (started in its own session: its pid is its process group's id) and, where
    gpudiag tracks descendants, every other process of its job."""

    tracked: bool
    adopter: int = field(default_factory=os.getpid)  # the subreaper: gpudiag
    before: frozenset[int] = frozenset()  # gpudiag's children before the command: not its
    pid: int = 0  # the command's
    # Until its exit was reaped: then its pid (and its group's id, once empty) may be reused,
    # so it is signalled no more.
    running: bool = True

    def others(self) -> list[Process]:
        """The job's live processes other than the command; reaps those handed to gpudiag
        that ended."""
        if not self.tracked or not self.pid:
            return []
        table = _process_table()
        below: dict[int, list[Process]] = {}
        for process in table.values():
            below.setdefault(process.ppid, []).append(process)
        todo = [p for p in below.get(self.adopter, []) if p.pid not in self.before]
        found = []
        while todo:
            process = todo.pop()
            todo += below.get(process.pid, [])
            if process.pid == self.pid:
                continue  # Popen reaps the command itself
            if not process.zombie:
                found.append(process)
            elif process.ppid == self.adopter:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(process.pid, os.WNOHANG)
        return found

    def interrupt(self) -> None:
        """SIGINT to every process of the job, as a terminal's Ctrl-C to each of its groups
        (DataLoader workers ignore it)."""
        if self.running:
            _signal_group(self.pid, signal.SIGINT)
        for process in self.others():
            if not self.running or process.pgid != self.pid:  # not one the line above reached
                _signal(process.pid, signal.SIGINT)

    def terminate(self) -> None:
        """SIGTERM to the command and to each process heading a part of the job that left
        the command's group or lost its parent; not to the processes those started (a
        DataLoader worker takes SIGTERM from anyone but its parent as a crash)."""
        if self.running:
            _signal(self.pid, signal.SIGTERM)
        for process in self.heads():
            _signal(process.pid, signal.SIGTERM)

    def heads(self) -> list[Process]:
        """The job's processes whose parent is not in the job (handed to gpudiag), or in
        another process group than theirs."""
        others = self.others()
        groups = {self.pid: self.pid} | {p.pid: p.pgid for p in others}
        return [p for p in others if groups.get(p.ppid) != p.pgid]

    def kill(self) -> None:
        if self.running:
            _signal_group(self.pid, signal.SIGKILL)
        for process in self.others():
            _signal(process.pid, signal.SIGKILL)


@contextlib.contextmanager
def job_processes() -> Iterator[JobProcesses]:
    """Tracks the job of the command started inside (set its `pid`): on Linux, gpudiag is a
    child subreaper meanwhile; elsewhere, or where prctl fails, the job is the command's
    process group."""
    was = ctypes.c_int(0)
    tracked = (TRACKS_DESCENDANTS and _prctl(PR_GET_CHILD_SUBREAPER, was)
               and _prctl(PR_SET_CHILD_SUBREAPER, 1))
    me = os.getpid()
    before = frozenset(p.pid for p in _process_table().values() if p.ppid == me) if tracked \
        else frozenset()
    try:
        yield JobProcesses(tracked, me, before)
    finally:
        if tracked:
            _prctl(PR_SET_CHILD_SUBREAPER, was.value)
