"""The bytecode a job's fresh processes share (gpudiag/measure/bytecode.py): each branch of
`bytecode_is_kept` forced, and real interpreters writing beneath the job's folder only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpudiag.measure import bytecode
from gpudiag.measure.bytecode import DONT_WRITE, PREFIX, bytecode_is_kept, shared_bytecode


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An importable package `probepkg` with no bytecode, and the environment without either
    variable."""
    source = tmp_path / "src" / "probepkg"
    source.mkdir(parents=True)
    (source / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(source.parent))
    monkeypatch.delenv(PREFIX, raising=False)
    monkeypatch.delenv(DONT_WRITE, raising=False)
    return source


@pytest.mark.slow
def test_bytecode_is_kept_where_cached_writable_or_elsewhere(package: Path) -> None:
    env: dict[str, str] = {}
    assert bytecode_is_kept(env, "probepkg")  # not cached, but the next process writes it
    assert not bytecode_is_kept({DONT_WRITE: "1"}, "probepkg")  # each process compiles
    assert bytecode_is_kept({DONT_WRITE: "1", PREFIX: "/somewhere"}, "probepkg")  # the user's
    subprocess.run([sys.executable, "-c", "import probepkg"], check=True,
                   env={**os.environ, "PYTHONPATH": str(package.parent)})
    assert bytecode_is_kept({DONT_WRITE: "1"}, "probepkg")  # cached now
    assert bytecode_is_kept({DONT_WRITE: "1"}, "no_such_package_here")  # cannot tell


def test_bytecode_is_not_kept_where_its_folder_cannot_be_written(
        package: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A system package's read-only folder (os.access, as root sees every folder writable).
    monkeypatch.setattr(bytecode.os, "access", lambda path, mode: False)
    assert not bytecode_is_kept({}, "probepkg")


@pytest.mark.slow
def test_the_jobs_processes_compile_once_beneath_its_folder(package: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.setenv(DONT_WRITE, "1")
    monkeypatch.setattr(bytecode.bytecode_is_kept, "__defaults__", ("probepkg",))
    child = [sys.executable, "-c", "import probepkg, sys; print(probepkg.__cached__)"]
    with shared_bytecode() as folder:
        assert folder is not None and folder.is_dir()
        assert os.environ[PREFIX] == str(folder) and DONT_WRITE not in os.environ
        env = {**os.environ, "PYTHONPATH": str(package.parent)}
        cached = subprocess.run(child, check=True, env=env, capture_output=True,
                                text=True).stdout.strip()
        assert Path(cached).is_relative_to(folder) and Path(cached).is_file()
        written = Path(cached).stat().st_mtime_ns
        subprocess.run(child, check=True, env=env, capture_output=True)
        assert Path(cached).stat().st_mtime_ns == written  # the second read it
    assert not folder.exists()
    assert os.environ[DONT_WRITE] == "1" and PREFIX not in os.environ
    assert not (package / "__pycache__").exists()  # nothing beside the user's sources


def test_nothing_changes_where_bytecode_is_kept(package: Path) -> None:
    before = dict(os.environ)
    with shared_bytecode() as folder:
        assert folder is None
        assert dict(os.environ) == before


def test_a_trial_loop_shares_it_as_a_decorator(package: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """gatejob's and trialrun's loops are decorated: the folder exists while each call runs,
    a new one for each call, gone after."""
    monkeypatch.setenv(DONT_WRITE, "1")
    monkeypatch.setattr(bytecode.bytecode_is_kept, "__defaults__", ("probepkg",))
    seen: list[str] = []

    @shared_bytecode()
    def loop() -> None:
        seen.append(os.environ[PREFIX])
        assert Path(seen[-1]).is_dir()

    loop()
    loop()
    assert len(set(seen)) == 2 and not any(Path(p).exists() for p in seen)
