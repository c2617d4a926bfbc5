"""Atomic file writes: a reader (or a Ctrl-C) sees the old file or the new one, never half."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path` (rename is
    atomic within a file system: POSIX rename(2))."""
    write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """write_text_atomic's bytes."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file 0600; a report is as readable as any file the user writes
        # (a team's shared folder, CI artifacts): 0666 less the umask, as open() would.
        if hasattr(os, "fchmod"):  # POSIX
            os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        Path(tmp).replace(path)
    except OSError as exc:  # a full disk, a quota: say which file could not be written
        Path(tmp).unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)  # the only portable read of the umask sets it: put it back at once
    os.umask(mask)
    return mask
