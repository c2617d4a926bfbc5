"""What a re-run changed of the user's files that its confinement cannot refuse, told and,
where gpudiag can, put back.

Landlock has no right for a file's attributes: through a link into its scratch copy, or by
absolute path, a confined re-run may still change a file's mode (`chmod 000`), owner, times
and extended attributes; and where it has no /dev/shm of its own (measure/childexec.py), it
may write and delete the files of the machine's, a tmpfs of ordinary files. So before a
re-run gpudiag records each of the user's files it walked (the working directory's, scratch.py)
and those in /dev/shm: mode, owner, size, times, inode, extended attributes; after it, any
difference is data touched, said file by file ("changed the mode of X from 0644 to 0000"),
and the mode, times, owner and extended attributes of a file still there are put back (the
owner and `trusted.*`/`security.*` attributes only where gpudiag may set them, as root).
Contents are not: what a re-run wrote is said, never guessed back; nor are a file's times
put back when its size changed, which would hide that it changed.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from gpudiag.measure.childexec import SHM

MAX_SHM = 10_000  # /dev/shm's files recorded; past them the rest are not compared


@dataclass(frozen=True)
class FileState:
    """One file's state as a re-run could change it without opening it for writing."""

    inode: int
    size: int
    mode: int
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int
    xattrs: tuple[tuple[str, bytes], ...]


def file_state(path: Path) -> FileState | None:
    """`path`'s state (the file itself, not a link's target); None when it is gone."""
    try:
        found = path.lstat()
    except OSError:
        return None
    return FileState(found.st_ino, found.st_size, found.st_mode, found.st_uid, found.st_gid,
                     found.st_atime_ns, found.st_mtime_ns, _xattrs(path))


def _xattrs(path: Path) -> tuple[tuple[str, bytes], ...]:
    """Its extended attributes, where the filesystem has them (not on every one, nor on
    every platform: os.listxattr is Linux's)."""
    if not hasattr(os, "listxattr"):
        return ()
    found = []
    with contextlib.suppress(OSError):
        for name in sorted(os.listxattr(path, follow_symlinks=False)):
            with contextlib.suppress(OSError):
                found.append((name, os.getxattr(path, name, follow_symlinks=False)))
    return tuple(found)


def shm_files() -> list[Path]:
    """The files in /dev/shm (the machine's), the first MAX_SHM."""
    found: list[Path] = []
    for folder, _, names in os.walk(SHM):
        found += [Path(folder) / name for name in names]
        if len(found) >= MAX_SHM:
            break
    return found[:MAX_SHM]


def record(paths: Iterable[Path]) -> dict[Path, FileState]:
    """The state of each of `paths` now (those gone meanwhile left out)."""
    states = {path: file_state(path) for path in paths}
    return {path: state for path, state in states.items() if state is not None}


def touched(before: dict[Path, FileState], *, contents_said: Iterable[Path] = ()) -> list[str]:
    """What changed of the files `before` recorded, one line each, and what of it was put
    back ("PATH: the mode from 0644 to 0000 (the mode put back)"); a file whose contents are
    said elsewhere (`contents_said`: a linked file that changed) is told only for what else
    changed."""
    said = set(contents_said)
    lines = []
    for path, was in before.items():
        now = file_state(path)
        if now is None:
            lines.append(f"{_shown(path)}: deleted")
            continue
        if now.inode != was.inode:
            lines.append(f"{_shown(path)}: replaced")
            continue
        changes = _changes(was, now, contents=path not in said)
        if changes:
            restored = _restore(path, was, now)
            lines.append(f"{_shown(path)}: {', '.join(changes)}"
                         + (f" ({', '.join(restored)} put back)" if restored else ""))
    return lines


def _changes(was: FileState, now: FileState, *, contents: bool) -> list[str]:
    changes = []
    if contents and now.size != was.size:
        changes.append(f"the size from {was.size:,} to {now.size:,} bytes")
    if contents and now.mtime_ns != was.mtime_ns:
        changes.append("the modification time")
    if stat.S_IMODE(now.mode) != stat.S_IMODE(was.mode):
        changes.append(f"the mode from {stat.S_IMODE(was.mode):04o} to "
                       f"{stat.S_IMODE(now.mode):04o}")
    if (now.uid, now.gid) != (was.uid, was.gid):
        changes.append(f"the owner from {was.uid}:{was.gid} to {now.uid}:{now.gid}")
    if now.xattrs != was.xattrs:
        before, after = dict(was.xattrs), dict(now.xattrs)
        names = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
        changes.append(f"the extended attributes ({', '.join(names)})")
    return changes


def _restore(path: Path, was: FileState, now: FileState) -> list[str]:
    """Put back what of `was` gpudiag can set on the file still there: the words for what
    it put back."""
    restored = []
    if (now.uid, now.gid) != (was.uid, was.gid) and _done(
            lambda: os.chown(path, was.uid, was.gid, follow_symlinks=False)):
        restored.append("the owner")  # before the mode: chown clears setuid bits
    if stat.S_IMODE(now.mode) != stat.S_IMODE(was.mode) and _done(
            lambda: path.chmod(stat.S_IMODE(was.mode))):
        restored.append("the mode")
    if now.xattrs != was.xattrs and _done(lambda: _set_xattrs(path, was.xattrs, now.xattrs)):
        restored.append("the extended attributes")
    if now.mtime_ns != was.mtime_ns and now.size == was.size and _done(
            lambda: os.utime(path, ns=(was.atime_ns, was.mtime_ns), follow_symlinks=False)):
        restored.append("the times")
    return restored


def _set_xattrs(path: Path, was: tuple[tuple[str, bytes], ...],
                now: tuple[tuple[str, bytes], ...]) -> None:
    for name in set(dict(now)) - set(dict(was)):
        os.removexattr(path, name, follow_symlinks=False)
    for name, value in was:
        if dict(now).get(name) != value:
            os.setxattr(path, name, value, follow_symlinks=False)


def _done(action: Callable[[], object]) -> bool:
    try:
        action()
    except OSError:  # not ours to set (an owner, as another user), or gone meanwhile
        return False
    return True


def _shown(path: Path) -> str:
    return os.fsencode(path).decode("utf-8", "backslashreplace")
