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
