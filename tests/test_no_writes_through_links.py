"""gpudiag is not confined; a confined re-run, a profiled script or whoever made a run folder
(a CI artifact) may have written it. Every file gpudiag writes there is made under a fresh name
and renamed over the final one (gpudiag/model/atomic.py): a link planted at the name, or at the
old predictable temporary name, is replaced and the file it points at is left byte for byte;
a folder that is a link is written into not at all (issue 56)."""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
from conftest import invoke, ladder_config, ladder_run

from gpudiag.measure.profile.launching import session
from gpudiag.model.atomic import (
    LINKED_FOLDER,
    atomic_file,
    fresh_stream,
    own_folder,
    write_bytes_atomic,
    write_text_atomic,
)
from gpudiag.model.results import StageResult, TelemetrySummary
from gpudiag.model.runfile import save_run
from gpudiag.present import files, rerender_run_dir, write_output_file, write_run_dir
from gpudiag.present.files import prepare_run_dir

USERS = b"the user's checkpoint\x00\x01"


def _user_file(tmp_path: Path, name: str = "ckpt.pt") -> Path:
    user = tmp_path / "project" / name
    user.parent.mkdir(exist_ok=True)
    user.write_bytes(USERS)
    return user


def _plant(at: Path, target: Path) -> None:
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(target)


def _replaced(at: Path, user: Path) -> None:
    """The link at `at` is now gpudiag's own file, and the user's file is as it was."""
    assert user.read_bytes() == USERS
    assert not at.is_symlink() and at.is_file(), at


def _run() -> object:
    stage = StageResult(name="train-fp32", status="ok", title="t", samples_per_step=8,
                        iter_ms=[10.0, 11.0, 10.5, 30.0],
                        telemetry=TelemetrySummary(available=True, power_mean_w=200.0))
    return ladder_run(stage, device="cuda", gpu="H100", config=ladder_config())


def _samples() -> pd.DataFrame:
    return pd.DataFrame({"t_s": [0.0, 0.1, 0.2], "power_instant_w": [100.0, 150.0, 140.0],
                         "stage": ["train-fp32"] * 3})


def _through_atomic_file(path: Path) -> None:
    with atomic_file(path) as fh:
        pd.DataFrame({"a": [1]}).to_csv(fh, index=False)


def _through_fresh_stream(path: Path) -> None:
    with fresh_stream(path) as fh:
        fh.write(b"log line\n")


WRITERS: dict[str, Callable[[Path], None]] = {
    "text": lambda p: write_text_atomic(p, "text"),
    "bytes": lambda p: write_bytes_atomic(p, b"bytes"),
    "atomic_file": _through_atomic_file,
    "fresh_stream": _through_fresh_stream,
}


@pytest.mark.parametrize("writer", WRITERS)
def test_each_writer_replaces_a_planted_link(tmp_path: Path, writer: str) -> None:
    user = _user_file(tmp_path)
    run = tmp_path / "run"
    _plant(run / "samples.csv", user)
    _plant(run / ".samples.csv.tmp", user)  # the old predictable temporary name
    WRITERS[writer](run / "samples.csv")
    _replaced(run / "samples.csv", user)
    assert (run / ".samples.csv.tmp").is_symlink()  # not used, not followed
    assert sorted(p.name for p in run.iterdir()) == [".samples.csv.tmp", "samples.csv"]


def test_a_failed_write_leaves_the_link_and_the_users_file(tmp_path: Path) -> None:
    user = _user_file(tmp_path)
    _plant(tmp_path / "run" / "report.md", user)
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "run" / "report.md") as fh:
        fh.write(b"half")
        raise RuntimeError
    assert user.read_bytes() == USERS
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["report.md"]  # no temporary


def test_no_writer_writes_into_a_folder_that_is_a_link(tmp_path: Path) -> None:
    """`parts -> ~/project`: gpudiag writes nothing there (a file of the same name there would
    be replaced), and the error names the folder and says why."""
    user = _user_file(tmp_path, "part-1.json")
    _plant(tmp_path / "run" / "parts", user.parent)
    for writer in WRITERS.values():
        with pytest.raises(OSError) as caught:
            writer(tmp_path / "run" / "parts" / "part-1.json")
        assert caught.value.errno == errno.ELOOP
        assert LINKED_FOLDER in str(caught.value)
    assert user.read_bytes() == USERS
    assert [p.name for p in user.parent.iterdir()] == ["part-1.json"]


def test_a_run_folder_as_a_confined_rerun_left_it(tmp_path: Path) -> None:
    """Every file of a run folder planted as a link to a user's file, and the plots' old
    temporary names too: write_run_dir replaces the links and changes none of the files."""
    pytest.importorskip("matplotlib")
    run_dir = tmp_path / "run"
    names = ["run.json", "samples.csv", "trace.json", "report.md", "throughput.png",
             "timeline.png", "step-times.png", ".step-times.png.tmp", ".timeline.png.tmp",
             ".throughput.png.tmp", ".gpudiag-run"]
    users = {name: _user_file(tmp_path, f"user-{name.strip('.')}") for name in names}
    for name, user in users.items():
        _plant(run_dir / name, user)
    write_run_dir(run_dir, _run(), _samples())  # type: ignore[arg-type]
    for name in ("run.json", "samples.csv", "trace.json", "report.md", "throughput.png",
                 "timeline.png", "step-times.png"):
        _replaced(run_dir / name, users[name])
    assert all(u.read_bytes() == USERS for u in users.values())


def test_report_on_a_run_folder_from_elsewhere(tmp_path: Path) -> None:
    """`gpudiag report RUN` where RUN (a CI artifact) holds `trace.json -> ~/.bashrc`."""
    run_dir = tmp_path / "artifact"
    run_dir.mkdir()
    save_run(_run(), run_dir / "run.json")  # type: ignore[arg-type]
    bashrc = _user_file(tmp_path, ".bashrc")
    for name in ("trace.json", "report.md", "step-times.png"):
        _plant(run_dir / name, bashrc)
    result = invoke(["report", run_dir])
    assert result.exit_code == 0, result.stderr
    assert bashrc.read_bytes() == USERS
    assert not (run_dir / "trace.json").is_symlink()


def test_a_linked_folder_the_user_names_is_theirs(tmp_path: Path) -> None:
    """`--out latest` / `report latest` where the user made `latest -> runs/7`: resolved once,
    then written as any run folder; links inside it are still never followed."""
    real = tmp_path / "runs" / "7"
    real.mkdir(parents=True)
    (tmp_path / "latest").symlink_to(real)
    assert prepare_run_dir(tmp_path / "latest", tmp_path / "unused") == real
    assert (real / ".gpudiag-run").is_file()
    save_run(_run(), real / "run.json")  # type: ignore[arg-type]
    rerender_run_dir(tmp_path / "latest", _run())  # type: ignore[arg-type]
    assert (real / "report.md").is_file()


def test_a_file_the_user_names_in_a_linked_folder_is_written(tmp_path: Path) -> None:
    """`--markdown shared/gate.md` where the user made `shared -> /data/reports`: their
    link, resolved; the refusal is for links inside folders gpudiag writes."""
    real = tmp_path / "data"
    real.mkdir()
    (tmp_path / "shared").symlink_to(real)
    write_output_file(tmp_path / "shared" / "gate.md", "# gate\n", "--markdown")
    assert (real / "gate.md").read_text() == "# gate\n"


def test_a_linked_folder_inside_a_run_folder_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line's answer to the writer's refusal: one line naming the file, exit 2
    (a run folder's writer pointed into a subfolder a re-run replaced with a link)."""
    user = _user_file(tmp_path, "trace.json")
    run_dir = tmp_path / "artifact"
    run_dir.mkdir()
    save_run(_run(), run_dir / "run.json")  # type: ignore[arg-type]
    (run_dir / "inner").symlink_to(user.parent)
    monkeypatch.setattr(files, "TRACE_FILE", "inner/trace.json")
    result = invoke(["report", run_dir])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"gpudiag: error: {run_dir / 'inner' / 'trace.json'}: {LINKED_FOLDER}"]
    assert user.read_bytes() == USERS


def test_a_parts_folder_planted_as_a_link_is_replaced_not_emptied(tmp_path: Path) -> None:
    """An earlier confined run of the same run folder left `parts -> ~/project`: the next
    run's clean-up of old parts removes the link, not the user's part-*.json."""
    user = _user_file(tmp_path, "part-12.json")
    parts = tmp_path / "run" / "parts"
    _plant(parts, user.parent)
    session._clear(parts)
    assert user.read_bytes() == USERS
    assert parts.is_dir() and not parts.is_symlink()
    assert list(parts.iterdir()) == []


def test_gpudiags_own_subfolders_replace_a_planted_link(tmp_path: Path) -> None:
    """fixes/ -> ~/project left by a diagnosis run (it could write the run folder): the fix
    runs' folder fixes/<label>/ is made in a folder of gpudiag's, not in the user's."""
    user = _user_file(tmp_path)
    run_dir = tmp_path / "run"
    _plant(run_dir / "fixes", user.parent)
    made = own_folder(own_folder(run_dir / "fixes") / "compile")
    assert made == run_dir / "fixes" / "compile" and made.is_dir()
    assert not (run_dir / "fixes").is_symlink()
    assert [p.name for p in user.parent.iterdir()] == ["ckpt.pt"]
    assert user.read_bytes() == USERS
