"""Every file gpudiag writes goes through here (tests/test_architecture.py holds the rest of
gpudiag to it, and lists the few exceptions with why). A file is made under a fresh name
nobody could have planted (O_CREAT|O_EXCL|O_NOFOLLOW in its folder) and renamed over its final
name: a reader (or a Ctrl-C) sees the old file or the new one, never half; and a symbolic link
at the name is replaced, never written through (rename(2) replaces the link itself). A run
folder may hold what a confined re-run, a profiled script or whoever made it (a CI artifact)
put there, and gpudiag is not confined: a link `samples.csv -> ~/project/ckpt.pt` must not
make it truncate the user's checkpoint.

The folder itself is opened without following a link either: gpudiag writes into no folder
that is a symbolic link (`parts -> ~/project`). That is ELOOP, an OSError naming the file,
which the command line says in one line with exit 2 (a path it cannot write). A link the user
names (`--out latest`, `report latest`, a `--markdown` file in a linked folder, a linked
`.gpudiag/`) is theirs: `named_by_user` resolves it before anything is written."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

# Not inherited by a child process, and never through a link, where the platform has the flags.
_NEW_FILE = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
_FOLDER = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) \
    | getattr(os, "O_CLOEXEC", 0)
# Relative to an open folder where the platform can (POSIX): the folder cannot be swapped for a
# link between the check and the write.
_AT_FOLDER = {os.open, os.replace, os.unlink} <= os.supports_dir_fd
LINKED_FOLDER = "a symbolic link: gpudiag writes into no folder through a link"


def named_by_user(path: Path) -> Path:
    """`path` with the link the user named resolved, once, now: the folder they typed, or
    the folder of a file they typed. Inside it, nothing is followed."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def own_folder(path: Path) -> Path:
    """`path`, a folder gpudiag makes in a run folder (parts/, fixes/<label>/, rerun/), made
    where missing. A link there is none of gpudiag's (a run that could write the run folder
    planted it): it is removed, so nothing is written, or cleared, where it points."""
    if path.is_symlink():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to a new file beside `path`, then rename it over `path`."""
    write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """write_text_atomic's bytes."""
    with atomic_file(path) as fh:
        fh.write(data)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A new, empty file beside `path` to write to (what pandas or matplotlib write into an
    open file), renamed over `path` when the block ends without an exception; removed when it
    raises. An OSError names `path` (a full disk, a quota, a linked folder)."""
    try:
        with _folder(path.parent) as folder:
            temporary, fd = _create_fresh(folder, path)
            try:
                with os.fdopen(fd, "wb") as fh:
                    yield fh
                os.replace(temporary, _in(folder, path.name, path.parent),
                           src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary, dir_fd=folder)
                raise
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None


@contextlib.contextmanager
def fresh_stream(path: Path) -> Iterator[BinaryIO]:
    """`path` made anew for a stream that cannot wait for a rename (a child process's log):
    whatever is at the name (a file, a link) is removed first, never followed. (An OSError of
    the block itself is its own, not this file's.)"""
    try:
        with _folder(path.parent) as folder:
            name = _in(folder, path.name, path.parent)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=folder)
            fd = _open_new(name, folder)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    with os.fdopen(fd, "wb") as fh:
        yield fh


@contextlib.contextmanager
def _folder(path: Path) -> Iterator[int | None]:
    """`path` opened as a folder, not through a link (None where there is no dir_fd)."""
    if path.is_symlink():  # O_NOFOLLOW alone says only ELOOP: say why
        raise OSError(errno.ELOOP, LINKED_FOLDER, str(path))
    if not _AT_FOLDER:
        yield None
        return
    fd = os.open(path, _FOLDER)
    try:
        yield fd
    finally:
        os.close(fd)


def _in(folder: int | None, name: str, parent: Path) -> str:
    """`name` as the calls take it: relative to the open folder, else a path."""
    return name if folder is not None else str(parent / name)


def _create_fresh(folder: int | None, path: Path) -> tuple[str, int]:
    """A name no one could have guessed (`.NAME.<random>.tmp`, which --force's list of
    gpudiag's own entries knows), created exclusively: never one that was there."""
    for _ in range(100):
        name = _in(folder, f".{path.name}.{secrets.token_hex(6)}.tmp", path.parent)
        try:
            return name, _open_new(name, folder)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path))


def _open_new(name: str, folder: int | None) -> int:
    # 0o666 less the umask (the kernel applies it), as open() makes a file: a report is as
    # readable as any file the user writes (a team's shared folder, CI artifacts).
    return os.open(name, _NEW_FILE, 0o666, dir_fd=folder)
