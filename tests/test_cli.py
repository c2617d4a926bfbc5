"""The command line: bad input is one line and exit 2, a bug one line and exit 70 (its traceback
in a file); a tiny run writes its directory; README's exit codes are the enum's."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import EXAMPLES, invoke

from gpudiag.measure.interrupts import HungUp, Terminated
from gpudiag.model.errors import INTERNAL_ERROR_PREFIX, ExitCode
from gpudiag.present import exit_codes_markdown
from gpudiag.present.files import RUN_MARKER

TINY = ["--device", "cpu", "--preset", "tiny", "--iters", "2", "--warmup", "0"]
README = Path(__file__).resolve().parent.parent / "README.md"
# Two recorded runs of the same workload, on the same machine: a pair the gate judges.
BASE, HEAD = EXAMPLES / "h100-dgca-earlier-commit", EXAMPLES / "h100-dgca"


def _one_line_error(result: object, contains: str) -> None:
    assert result.exit_code == ExitCode.BAD_INPUT, result.output  # type: ignore[attr-defined]
    err = result.stderr.strip()  # type: ignore[attr-defined]
    assert contains in err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in result.output  # type: ignore[attr-defined]


@pytest.mark.parametrize(("args", "contains"), [
    (["--model", "nope"], "unknown model 'nope'"),
    (["--stages", "infer,warp"], "unknown stage 'warp'"),
    (["--batch-size", "0"], "--batch-size must be positive"),
    (["--batch-size", "lots"], "Invalid value for '--batch-size'"),
    (["--seq-len", "100000"], "exceeds the model's"),
    (["--amp-dtype", "fp8"], "--amp-dtype must be one of fp16, bf16, fp32"),
    (["--device", "tpu:0"], "expected cpu, cuda or cuda:N"),
    (["--nonsense"], "No such option"),
])
def test_run_rejects_bad_input(args: list[str], contains: str) -> None:
    _one_line_error(invoke(["run", *args]), contains)


def test_out_must_be_a_directory(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    _one_line_error(invoke(["run", *TINY, "--out", str(file)]),
                    "exists and is not a directory")
    _one_line_error(invoke(["run", *TINY, "--out", str(file / "sub")]),
                    "cannot create it")


def test_tiny_run_writes_the_run_directory(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = invoke(["run", *TINY, "--stages", "infer,train", "--out", str(out),
                                 "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [s["name"] for s in data["stages"]] == ["infer", "train"]
    files = {p.name for p in out.iterdir()}
    assert {"run.json", "samples.csv", "report.md", "trace.json", "throughput.png"} <= files
    assert all(p.endswith((".json", ".json.gz", ".csv", ".md", ".png")) or p == RUN_MARKER
               for p in files)
    assert json.loads((out / "run.json").read_text())["stages"] == data["stages"]


def test_tiny_run_prints_the_table(tmp_path: Path) -> None:
    result = invoke(["run", "--no-plots", *TINY, "--stages", "infer,full-loop",
                                 "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "full-loop" in result.stdout and "ms/iter" in result.stdout
    assert "report.md" in result.stderr


def test_env_and_models() -> None:
    env = invoke(["env", "--device", "cpu", "--json"])
    assert env.exit_code == 0
    facts = json.loads(env.stdout)
    assert facts["device"] == "cpu" and facts["torch_version"] and facts["cpu_count"] >= 1
    models = invoke(["models"])
    assert models.exit_code == 0 and "dgca" in models.stdout and "vectorized" in models.stdout


def test_no_arguments_shows_help() -> None:
    result = invoke([])
    assert "run" in result.output and "Usage" in result.output


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["profile", "--help"],
                                  ["gate", "--help"]])
def test_help_starts_without_torch_scipy_or_pandas(argv: list[str]) -> None:
    """The commands' imports of torch (measure), scipy (statistics) and pandas (reports) wait
    until a command runs: help is instant, and reading runs needs no torch."""
    code = ("import sys\nfrom gpudiag.cli.program import app\n"
            f"try:\n    app({argv!r})\nexcept SystemExit:\n    pass\n"
            "print('imported:', [m for m in ('torch', 'scipy', 'pandas') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert "Usage" in done.stdout
    assert done.stdout.splitlines()[-1] == "imported: []", done.stdout[-300:]


# The signal a case sends itself while gpudiag.cli is imported (a second or two).
_WHILE_IMPORTING = ("import os, signal\n"
                    "class Stop:\n"
                    "    def find_spec(self, name, path=None, target=None):\n"
                    "        if name == 'gpudiag.cli':\n"
                    "            os.kill(os.getpid(), signal.{})\n"
                    "sys.meta_path.insert(0, Stop())\n")
_APP_STOPPED = ("import gpudiag.cli.program\n"
                "def app():\n"
                "    raise KeyboardInterrupt\n"
                "gpudiag.cli.program.app = app\n")


@pytest.mark.slow
@pytest.mark.parametrize(("raising", "code", "said"), [
    (_WHILE_IMPORTING.format("SIGINT"), 130, "SIGINT (Ctrl-C)"),
    (_WHILE_IMPORTING.format("SIGTERM"), 143, "SIGTERM"),
    (_WHILE_IMPORTING.format("SIGHUP"), 129, "SIGHUP"),
    (_APP_STOPPED, 130, "SIGINT (Ctrl-C)"),
    # A second Ctrl-C as Python shuts down (issue 56: a gate's double Ctrl-C exited -2).
    ("import atexit, os, signal, time\n"
     "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2)))\n"
     + _APP_STOPPED, 130, "SIGINT (Ctrl-C)"),
], ids=["sigint-import", "sigterm-import", "sighup-import", "command", "twice"])
def test_a_stop_while_gpudiag_loads_or_stops_is_its_code_in_one_line(
        raising: str, code: int, said: str) -> None:
    """A stop while gpudiag.cli is imported, or one that escapes a command already stopping
    (a second Ctrl-C), ends with its code and one line, not the signal's default action (-2,
    or SIGTERM's and SIGHUP's silent kill; issue 56) and a traceback; a second one while
    Python shuts down changes nothing. Made certain here: the case signals itself there."""
    program = f"import sys\n{raising}from gpudiag.launch import main\nmain()\n"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          check=False)
    assert done.returncode == code, (done.returncode, done.stderr)
    assert done.stderr == f"gpudiag: stopped by {said}\n"


@pytest.mark.parametrize(("stop", "code", "name"), [
    (KeyboardInterrupt, 130, "SIGINT"), (Terminated, 143, "SIGTERM"), (HungUp, 129, "SIGHUP")])
def test_a_stop_that_leaves_a_command_is_its_own_code_in_one_line(
        monkeypatch: pytest.MonkeyPatch, stop: type[KeyboardInterrupt], code: int,
        name: str) -> None:
    """A stop that leaves a command before it wrote anything (torch still loading): Typer
    0.29 turned every one into a silent 130, a SIGTERM's included (`run --trials`' trial
    then read as a Ctrl-C)."""
    import gpudiag.present

    def stopped(*_: object) -> str:
        raise stop

    monkeypatch.setattr(gpudiag.present, "rules_markdown", stopped)
    result = invoke(["rules", "--markdown"])
    assert result.exit_code == code, result.output
    assert result.stderr == f"gpudiag: stopped by {name}\n"


def test_readme_exit_codes_are_generated_from_the_enum() -> None:
    text = README.read_text()
    start = text.index("## Exit codes and guarantees\n\n") + len("## Exit codes and guarantees\n\n")
    table = text[start:text.index("\n\n", start) + 1]
    assert table == exit_codes_markdown(), (
        "README's exit code table is stale: regenerate it with `gpudiag exit-codes --markdown`")
    assert [int(line.split("|")[1]) for line in table.splitlines()[2:]] == list(ExitCode)


def test_exit_codes_command_prints_the_table() -> None:
    markdown = invoke(["exit-codes", "--markdown"])
    assert markdown.exit_code == 0 and markdown.stdout == exit_codes_markdown()
    table = invoke(["exit-codes"], terminal_width=200)
    assert table.exit_code == 0
    assert all(code.name in table.stdout for code in ExitCode)


def _internal_error(result: object, tmp: Path, exception: str) -> str:
    """The one line a bug ends with, exit 70; the file it names holds the traceback."""
    assert result.exit_code == ExitCode.INTERNAL_ERROR == 70, result.output  # type: ignore[attr-defined]
    err = result.stderr  # type: ignore[attr-defined]
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert "Traceback" not in result.output  # type: ignore[attr-defined]
    assert err.startswith(f"gpudiag: internal error: {exception} (a bug in gpudiag; "
                          "traceback written to "), err
    files = list(tmp.glob(f"{INTERNAL_ERROR_PREFIX}*.txt"))
    assert len(files) == 1 and f"traceback written to {files[0]})" in err, (err, files)
    text = files[0].read_text()
    assert "Traceback (most recent call last)" in text and exception.partition(":")[0] in text
    return text


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tempfile's directory for this test: the tracebacks a test provokes stay in it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_bug_in_gate_is_one_line_and_exit_70_with_the_traceback_in_a_file(
        temp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gpudiag.diagnose.gate

    def judge(*_: object, **__: object) -> None:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(gpudiag.diagnose.gate, "judge", judge)
    result = invoke(["gate", str(BASE), str(HEAD)])
    text = _internal_error(result, temp_dir, "RuntimeError: boom second line")
    assert "in judge" in text and "RuntimeError: boom\nsecond line" in text
    assert f"command: gpudiag gate {BASE} {HEAD}" in text


def test_a_bug_in_any_command_is_one_line_and_exit_70(
        temp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gpudiag.present

    def broken(*_: object) -> str:
        raise KeyError("GD101")

    monkeypatch.setattr(gpudiag.present, "rules_markdown", broken)
    _internal_error(invoke(["rules", "--markdown"]), temp_dir, "KeyError: 'GD101'")


@pytest.mark.parametrize(("escaped", "said"), [
    (SystemExit(3), "SystemExit: 3"), (SystemExit(), "SystemExit"),
    (GeneratorExit(), "GeneratorExit")], ids=["systemexit-3", "systemexit", "generatorexit"])
def test_a_systemexit_or_generatorexit_from_inside_is_a_bug_not_an_outcome(
        temp_dir: Path, monkeypatch: pytest.MonkeyPatch, escaped: BaseException,
        said: str) -> None:
    """A library's SystemExit(3) inside a command exited 3, which reads "the gate is
    undecided", in silence; a GeneratorExit printed a 44-line traceback and exited 1 (issue
    56). Both are bugs: one line, 70, the traceback in its file."""
    import gpudiag.present

    def raising(*_: object) -> str:
        raise escaped

    monkeypatch.setattr(gpudiag.present, "rules_markdown", raising)
    _internal_error(invoke(["rules", "--markdown"]), temp_dir, said)


def test_a_working_directory_removed_under_gpudiag_is_one_line_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        ) -> None:
    """Started from a folder removed under the shell, `profile` and `gate` ended in an
    internal error (70), `run` in oneMKL's "FATAL ERROR" (issue 56): it is said, exit 2."""
    from gpudiag import launch

    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert launch._outcome() == ExitCode.BAD_INPUT
    assert capsys.readouterr().err == (
        "gpudiag: error: the working directory no longer exists (it was removed after this "
        "shell entered it): cd to a folder that exists\n")


def test_an_oserror_naming_no_path_is_a_bug_but_one_naming_a_path_is_bad_input(
        temp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gpudiag.present

    def no_space(*_: object) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gpudiag.present, "rules_markdown", no_space)
    _internal_error(invoke(["rules", "--markdown"]), temp_dir,
                    "OSError: [Errno 28] No space left on device")
    missing = invoke(["report", str(temp_dir / "nowhere")])
    _one_line_error(missing, "nowhere: no run.json there")


def test_a_traceback_that_cannot_be_written_is_said_on_the_same_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gpudiag.present

    def broken(*_: object) -> str:
        raise ValueError("boom")

    monkeypatch.setattr(gpudiag.present, "rules_markdown", broken)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    result = invoke(["rules", "--markdown"])
    assert result.exit_code == ExitCode.INTERNAL_ERROR
    err = result.stderr
    assert err.startswith(
        "gpudiag: internal error: ValueError: boom (a bug in gpudiag; its traceback could not "
        f"be written: {tmp_path / 'gone' / INTERNAL_ERROR_PREFIX}"), err
    assert err.endswith(": No such file or directory)\n") and len(err.splitlines()) == 1, err


def test_a_bad_run_json_is_bad_input_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "run.json"
    bad.write_text('{"schema_version": 3, "stages": "none"}')
    for argv in (["gate", str(bad), str(HEAD)], ["report", str(tmp_path)],
                 ["compare", str(HEAD), str(bad)]):
        _one_line_error(invoke(argv), f"{bad}: ")


@pytest.mark.parametrize("command", ["run", "profile", "calibrate"])
def test_help_at_80_columns_keeps_option_names_whole(command: str) -> None:
    """At 80 columns the type column ("<list[str]>") once squeezed the option names until
    `profile --help` showed "--evidence-steps,--st…" (issue 38)."""
    result = invoke([command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    names = [line.split()[1] for line in result.stdout.splitlines()
             if line.startswith("│ --")]
    assert names and not [n for n in names if "…" in n], names
    if command == "profile":
        assert "--evidence-steps,--steps" in names
