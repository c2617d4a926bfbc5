"""gpudiag's own temporary folders (gpudiag/measure/ownedtemp.py): what a killed job left is
removed by the next one, and nothing a live job holds, nor anything not gpudiag's."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from gpudiag.measure import ownedtemp
from gpudiag.measure.ownedtemp import owned_folder, remove_stale

# Above Linux's largest pid_max (PID_MAX_LIMIT, 2**22): no process ever has it.
NO_SUCH_PID = 2**22 + 1


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_dead_jobs_folder_goes_and_a_live_ones_stays(temp_dir: Path) -> None:
    dead = temp_dir / f"gpudiag-bytecode-{NO_SUCH_PID}-x1"
    (dead / "torch").mkdir(parents=True)
    live = temp_dir / f"gpudiag-bytecode-{os.getppid()}-x2"  # the parent process: alive
    other_kind = temp_dir / f"gpudiag-gate-{NO_SUCH_PID}-x3"
    not_ours = temp_dir / "gpudiag-bytecode-abc"
    for folder in (live, other_kind, not_ours):
        folder.mkdir()
    assert remove_stale("bytecode") == [dead]
    assert not dead.exists() and live.is_dir() and other_kind.is_dir() and not_ours.is_dir()


def test_a_locked_folder_stays_though_its_pid_looks_dead(temp_dir: Path) -> None:
    """A job in another pid namespace sharing /tmp (a container's): its pid means nothing
    here, its lock does."""
    held = temp_dir / f"gpudiag-bytecode-{NO_SUCH_PID}-x1"
    held.mkdir()
    fd = ownedtemp._lock(held)
    assert fd is not None
    try:
        assert remove_stale("bytecode") == [] and held.is_dir()
    finally:
        os.close(fd)
    assert remove_stale("bytecode") == [held]


def test_an_owned_folder_is_named_locked_and_removed(temp_dir: Path) -> None:
    with owned_folder("bytecode") as folder:
        assert folder.parent == temp_dir
        assert folder.name.startswith(f"gpudiag-bytecode-{os.getpid()}-")
        assert ownedtemp._lock(folder) is None  # held by this job
        assert remove_stale("bytecode") == []
    assert not folder.exists()
