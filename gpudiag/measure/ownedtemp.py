"""Temporary folders a gpudiag process owns while it runs, and those a killed one left behind.

A gate's worktrees and a job's shared bytecode (~100 MB) live in folders of the temporary
directory that gpudiag removes when it ends; a SIGKILL (the OOM killer, a CI runner's hard
stop) leaves them. Each is named `gpudiag-KIND-PID-...` by the process that made it and holds
an exclusive lock on itself while that process lives (the kernel drops it when the process
dies, however it dies). The next job of the same kind removes a folder of its kind whose
process is gone and whose lock is free: both, because a pid says nothing across pid
namespaces sharing one /tmp (a container's gate looks dead from the host) and a lock taken
just after the folder was made is not there yet.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _name_pattern(kind: str) -> re.Pattern[str]:
    return re.compile(rf"gpudiag-{re.escape(kind)}-(\d+)-")


def owner_pid(folder: Path, kind: str) -> int | None:
    """The pid in the name of an owned folder of `kind`; None for any other name."""
    match = _name_pattern(kind).match(folder.name)
    return int(match.group(1)) if match else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _lock(folder: Path) -> int | None:
    """A descriptor holding `folder`'s exclusive lock; None if another process holds it."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def is_stale(folder: Path, kind: str) -> bool:
    """Whether `folder` is an owned folder of `kind` whose process is gone (its pid dead, its
    lock free, or the folder itself gone): what a killed job left."""
    pid = owner_pid(folder, kind)
    if pid is None or pid == os.getpid() or _alive(pid):
        return False
    if not folder.exists():  # removed already (a reboot's clean /tmp): nothing holds it
        return True
    try:
        fd = _lock(folder)
    except OSError:  # gone meanwhile, or not a folder
        return False
    if fd is None:
        return False
    os.close(fd)
    return True


def stale_folders(kind: str) -> list[Path]:
    """The folders of `kind` killed jobs left in the temporary directory (only this user's)."""
    try:
        entries = list(Path(tempfile.gettempdir()).iterdir())
    except OSError:
        return []
    uid = os.getuid()
    return [p for p in entries if owner_pid(p, kind) is not None and not p.is_symlink()
            and p.is_dir() and p.stat().st_uid == uid and is_stale(p, kind)]


def remove_stale(kind: str) -> list[Path]:
    """Removes the folders of `kind` killed jobs left; returns them."""
    found = stale_folders(kind)
    for folder in found:
        shutil.rmtree(folder, ignore_errors=True)
    return found


@contextmanager
def owned_folder(kind: str) -> Iterator[Path]:
    """A fresh temporary folder `gpudiag-KIND-PID-...`, locked while it lasts, removed at the
    end."""
    folder = Path(tempfile.mkdtemp(prefix=f"gpudiag-{kind}-{os.getpid()}-"))
    fd = _lock(folder)  # fresh: nobody else holds it
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if fd is not None:
            os.close(fd)
