"""Inside a re-run of a profiled script, which runs in a scratch copy of its working directory
(gpudiag/measure/profile/launching/scratch.py): the paths the process writes outside that
copy, for the report to list.

An audit hook (PEP 578) sees what the process does to files through Python: a file opened for
writing, removed, renamed, truncated, a folder made or removed; torch.save and safetensors,
which write from native code, are noted by the recorder's save hooks (`written`). Each new
path outside is appended to writes-<pid>.jsonl in the parts folder at once, so a forked worker
or a killed process keeps what it reported. Not seen: native code that bypasses Python's file
functions, and programs that are not Python (a shell, git).

Left out, as nobody's results: the scratch copy and gpudiag's run folder; /dev, /proc, /sys;
bytecode caches; the caches of compilers and hubs (~/.cache, ~/.triton, Inductor's, and those
their variables name); the temporary files and folders the process makes with tempfile.
Standard library only: installed before the script's first line, torch or not.
"""
# Paths as strings, not pathlib: the hook sees every file the process opens.
# ruff: noqa: PTH100, PTH111, PTH112, PTH118

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterable
from typing import Any

from gpudiag.measure.confine import CACHE_VARIABLES, ENV_WRITABLE, HOME_CACHES
from gpudiag.measure.profile.protocol import (
    ENV_OUT,
    ENV_SCRATCH,
    ENV_TRACE_DIR,
    WRITES_MORE,
    writes_name,
)

MAX_PATHS = 50  # listed per process; past them one WRITES_MORE line says there were others
MAX_TEMPORARIES = 1_000  # tempfile's paths remembered, to leave out writes under them
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# Events on a name (not following a link there): where the path arguments and the dir_fd
# arguments are. A path relative to a dir_fd is one shutil.rmtree walks: its own event has
# the folder already.
_NAME_EVENTS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)),
    "os.rename": ((0, 1), (2, 3)), "os.link": ((1,), (2, 3)), "os.symlink": ((1,), (2,)),
    "shutil.rmtree": ((0,), (1,)),
}
_WATCHED = frozenset({"open", "os.truncate", "tempfile.mkstemp", "tempfile.mkdtemp",
                      *_NAME_EVENTS})

class WriteWatch:
    """The paths written outside `allowed` (real paths of folders), reported to `parts`."""

    def __init__(self, parts: str, allowed: Iterable[str], prefixes: Iterable[str] = ()) -> None:
        self.parts = parts
        self.roots = tuple(os.path.join(os.path.realpath(p), "") for p in allowed)
        # ... and plain string prefixes (Inductor's <tmp>/torchinductor_<user>)
        self.prefixes = self.roots + tuple(prefixes)
        self.temporary_files: set[str] = set()
        self.temporary_dirs: list[str] = []
        self.seen: set[str] = set()

    def audit(self, event: str, args: tuple[Any, ...]) -> None:
        if event not in _WATCHED:
            return
        try:
            self._event(event, args)
        except Exception:  # an audit hook that raises would fail the script's own call
            return

    def _event(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = args
            writes = (any(c in mode for c in "wax+") if isinstance(mode, str)
                      else bool(flags & _WRITE_FLAGS))
            if writes:
                self._target(path, follow=True)
        elif event == "os.truncate":
            self._target(args[0], follow=True)
        elif event == "tempfile.mkstemp":  # raised before the file is made: a new name
            if len(self.temporary_files) < MAX_TEMPORARIES:
                self.temporary_files.add(os.path.realpath(args[0]))
        elif event == "tempfile.mkdtemp":
            if len(self.temporary_dirs) < MAX_TEMPORARIES:
                self.temporary_dirs.append(os.path.join(os.path.realpath(args[0]), ""))
        else:
            paths, dir_fds = _NAME_EVENTS[event]
            if any(args[i] not in (None, -1) for i in dir_fds if i < len(args)):
                return
            for i in paths:
                self._target(args[i], follow=False, making=event == "os.mkdir")

    def _target(self, path: Any, *, follow: bool, making: bool = False) -> None:
        if isinstance(path, int) or path is None:  # a file descriptor: opened earlier
            return
        name = os.fsdecode(os.fspath(path))
        # A folder: os.makedirs(exist_ok=True) changes nothing; opened "for writing" it is an
        # unnamed file's (O_TMPFILE) or tempfile's opener's, which names its own file.
        if (making or follow) and os.path.isdir(name):
            return
        if follow:
            real = os.path.realpath(name)
        else:  # the name itself (removing a link removes the link)
            head, tail = os.path.split(os.path.abspath(name))
            real = os.path.join(os.path.realpath(head), tail)
        self.written(real)

    def written(self, path: str) -> None:
        """`path` (absolute, links resolved) was written: reported once, unless left out."""
        if path in self.seen or self._left_out(path):
            return
        over = len(self.seen) >= MAX_PATHS
        if over and WRITES_MORE in self.seen:
            return
        self.seen.add(WRITES_MORE if over else path)
        line = json.dumps(WRITES_MORE if over else path) + "\n"
        fd = os.open(os.path.join(self.parts, writes_name(os.getpid())),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode("utf-8", "surrogateescape"))
        finally:
            os.close(fd)

    def _left_out(self, path: str) -> bool:
        below = path + os.sep  # a folder left out is itself left out
        return ("/__pycache__/" in below or path in self.temporary_files
                or below.startswith(self.prefixes)
                or any(below.startswith(d) for d in self.temporary_dirs))


WATCH: WriteWatch | None = None


def install() -> WriteWatch | None:
    """Watch this process's writes, in a re-run (its scratch copy named in the environment);
    None elsewhere. Idempotent."""
    global WATCH  # noqa: PLW0603  (one hook per interpreter: audit hooks cannot be removed)
    scratch = os.environ.get(ENV_SCRATCH)
    if WATCH is not None or not scratch:
        return WATCH
    # tempfile probes the temporary folder with a file of its own the first time: done here,
    # before the hook, so that probe is not the script's write.
    temporary = tempfile.gettempdir()
    home = os.path.expanduser("~")
    allowed = [scratch, os.environ.get(ENV_TRACE_DIR) or scratch, os.environ[ENV_OUT],
               "/dev", "/proc", "/sys", *(os.path.join(home, name) for name in HOME_CACHES),
               *(os.environ[v] for v in CACHE_VARIABLES if os.environ.get(v)),
               *(p for p in os.environ.get(ENV_WRITABLE, "").split(os.pathsep) if p)]
    WATCH = WriteWatch(os.environ[ENV_OUT], allowed,
                       prefixes=(os.path.join(os.path.realpath(temporary), "torchinductor_"),))
    sys.addaudithook(WATCH.audit)
    return WATCH


def written(path: object) -> None:
    """A file native code wrote (torch.save, safetensors), noted by the recorder's hooks."""
    if WATCH is not None and isinstance(path, (str, os.PathLike)):
        WATCH.audit("open", (path, "w", 0))
