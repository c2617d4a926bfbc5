"""Atomic writes (gpudiag/model/atomic.py): a report is as readable as any file the user
writes, not mkstemp's 0600."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from gpudiag.model.atomic import write_text_atomic


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file modes")
@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_written_files_follow_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    old = os.umask(umask)
    try:
        write_text_atomic(tmp_path / "report.md", "# report\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "report.md").stat().st_mode) == mode
    assert (tmp_path / "report.md").read_text() == "# report\n"
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]  # no temporary left


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_full_disk_names_the_file_and_leaves_no_partial_one(tmp_path: Path) -> None:
    """`ulimit -f` (a full disk, a quota) while writing: the error names the file, and
    neither the file nor a temporary is left behind."""
    import resource
    import signal

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        with pytest.raises(OSError) as caught:
            write_text_atomic(tmp_path / "run.json", "x" * 10_000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert caught.value.filename == str(tmp_path / "run.json")
    assert list(tmp_path.iterdir()) == []
