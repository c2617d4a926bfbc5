"""Shared fixtures: tiny CPU configs, runs and stages built in a test, one recorded tiny ladder
run, a fake GPU, and the tests' two doors to the tool: `invoke(argv)` runs a command in this
process (typer's CliRunner), `profile_script(...)` runs `gpudiag profile` on a script as a user
does: gpudiag's side in this process, the script in processes of its own (the recorder lives in
the script's interpreter; its exit code and output are the real ones). Tests of signals start
`gpudiag` itself."""

from __future__ import annotations

import os

# One intra-op thread in this process and every script a test profiles (they inherit it), as
# torchrun does for each of its ranks: the suite runs one test per core (pytest-xdist), and
# tiny ops on two OpenMP threads each, on a loaded machine, wait for each other's spinning
# threads (steps of 8 ms measured at 92 ms with two tests at once), which no test is about.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import contextlib
import fcntl
import hashlib
import multiprocessing.process
import multiprocessing.util
import pickle
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpudiag.cli.program import app
from gpudiag.measure.evidence import reader
from gpudiag.measure.plan import build_config
from gpudiag.measure.runner import RunOutput, run_stages
from gpudiag.measure.stages import DEFAULT_LADDER
from gpudiag.measure.telemetry.fake import fake_spec
from gpudiag.model.config import PRESETS, ProfileConfig, RunConfig
from gpudiag.model.facts import ScriptFacts, StageFacts
from gpudiag.model.results import Env, Evidence, RunResult, StageResult
from gpudiag.model.runfile import load_run

EXAMPLES = Path(__file__).resolve().parent.parent / "reports" / "examples"


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that reads `tiny_ladder` is slow, marked here once for all of them: the first of
    a process builds a whole ladder (15 s, processes of its own). The heavy tests (many
    processes, or long ones: 15-55 s each) first, then the other slow ones (a real process,
    5-15 s), then the rest, each group in file order; dealt out among pytest-xdist's workers
    like cards, since its worksteal scheduler hands each worker a block of the list in order
    (xdist/scheduler/worksteal.py, `_send_tests`) and a worker that runs out steals from the
    end of another's: each block then starts with its heavy tests and ends with fast ones, and
    no 15 s test starts last while the other core idles."""
    for item in items:
        if "tiny_ladder" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: (item.get_closest_marker("heavy") is None,
                                 item.get_closest_marker("slow") is None))
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    items[:] = [item for first in range(workers) for item in items[first::workers]]


# The fast tier, `-m "not slow and not heavy"`, is a developer's loop of seconds: a test that
# starts a process (a second interpreter costs 1-5 s on a loaded 2-core machine) must say so
# with its mark. Held by what it does, not by a timer: every door to a new process refuses
# while an unmarked test, or a fixture set up for one, runs.
FAST_TIER_MESSAGE = ("started a process ({door}) in a test marked neither slow nor heavy: mark "
                     "it @pytest.mark.slow (heavy: many processes, or 15 s or more), which keeps "
                     "it out of the fast tier, -m \"not slow and not heavy\"")


# Python's own one-off `uname -p`, run once a process and cached (platform.uname().processor,
# which platform.platform() reads too: gpudiag's environment and bug reports do), run here before
# any test, so that no test of the fast tier is held to have started it.
platform.uname().processor  # noqa: B018  (run for its cache)


_POPEN = subprocess.Popen  # the class, whatever a test puts in its place meanwhile


def _in_fast_tier(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is None and item.get_closest_marker("heavy") is None


def refuse_processes(patch: pytest.MonkeyPatch, started: list[str]) -> None:
    """subprocess (os.popen too), multiprocessing's processes (DataLoader workers, pools) and
    its helpers (resource tracker, forkserver), and os's own forks and spawns, each recorded in
    `started` as it refuses, in case the code under test catches the failure and goes on."""
    def refuser(door: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            started.append(door)
            pytest.fail(FAST_TIER_MESSAGE.format(door=door))
        return refuse

    patch.setattr(_POPEN, "_execute_child", refuser("subprocess"))
    patch.setattr(multiprocessing.process.BaseProcess, "start", refuser("multiprocessing"))
    patch.setattr(multiprocessing.util, "spawnv_passfds", refuser("multiprocessing's helper"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        patch.setattr(os, name, refuser(f"os.{name}"))


def _fast_tier_guard(item: pytest.Item) -> Generator[None, object, object]:
    if not _in_fast_tier(item):
        return (yield)
    started: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        refuse_processes(patch, started)
        result = yield
    if started:  # refused, caught by the code under test, and the test went on
        pytest.fail(FAST_TIER_MESSAGE.format(door=", ".join(started)))
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _fast_tier_guard(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _fast_tier_guard(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _fast_tier_guard(item))


def tiny_config(model: str = "dgca", **overrides: Any) -> RunConfig:
    """The tiny preset on the CPU, with few steps so a whole ladder takes seconds: one
    profiled step a stage (the evidence's counts are per step; a whole ladder: 8 s, 14 s at
    three)."""
    options: dict[str, Any] = {"preset": "tiny", "device": "cpu", "iters": 4, "warmup": 1,
                               "loader_workers": 1, "evidence_steps": 1}
    options.update(overrides)
    config, _ = build_config(model=model, **options)
    return config


def ladder_config(**fields: Any) -> RunConfig:
    """A recorded ladder run's config without building one (no device query): the tiny preset
    on the CPU, with `fields` replaced."""
    tiny = PRESETS["tiny"]
    values: dict[str, Any] = {
        "model": "dgca", "preset": "tiny", "device": "cpu", "stages": (), "shape": tiny.shape,
        "batch_size": tiny.batch_size, "seq_len": tiny.seq_len, "iters": tiny.iters,
        "warmup": tiny.warmup, "min_seconds": tiny.min_seconds}
    return RunConfig(**{**values, **fields})


def ladder_run(*stages: StageResult, device: str = "cuda", gpu: str | None = None,
               env: Env | None = None, config: RunConfig | None = None,
               **fields: Any) -> RunResult:
    """A recorded `gpudiag run` of `stages`, built in the test: on `device` (a GPU named `gpu`;
    `env`: a whole machine instead), with `ladder_config()` unless `config` is given; `fields`:
    RunResult's others (findings, created_utc, ...)."""
    return RunResult(tool_version="t", env=env or Env(device=device, gpu_name=gpu),
                     config=config or ladder_config(), stages=list(stages), **fields)


def script_run(*stages: StageResult, device: str = "cpu", config: ProfileConfig | None = None,
               **fields: Any) -> RunResult:
    """A recorded `gpudiag profile` of a script, built in the test: on `device`, with a default
    ProfileConfig unless `config` is given; `fields`: RunResult's others."""
    return RunResult(tool_version="t", env=Env(device=device), config=config or ProfileConfig(),
                     stages=list(stages), **fields)


def script_stage(iter_ms: Sequence[float], *, evidence: Evidence | None = None,
                 **script: Any) -> StageResult:
    """A profiled script's stage (train.py) that timed `iter_ms`: its script ran 100 steps, 5 of
    warm-up and 30 timed, each ended by optimizer.step(); `script`: ScriptFacts' fields to
    replace or add (host samples, compiles, remedies)."""
    facts = {"steps": 100, "warmup": 5, "timed": 30, "step_clock": "optimizer.step()", **script}
    return StageResult(name="train.py", status="ok", iter_ms=list(iter_ms), evidence=evidence,
                       facts=StageFacts(script=ScriptFacts(**facts)))


@pytest.fixture(scope="session")
def tiny_ladder(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> RunOutput:
    """The whole default ladder of the dgca model on the CPU, with a fake GPU's telemetry.
    Built once a suite (15 s): under pytest-xdist every worker would build its own, so the
    first builds it and the others read its pickle (xdist's recipe for a session fixture that
    runs once: a lock in the folder all workers' temporary folders share). Its windows are
    read by the reader process, as a GPU's larger ones are (their tiny traces would be read in
    the run's own process otherwise: evidence/reader.py)."""
    def build() -> RunOutput:
        config = tiny_config(stages=list(DEFAULT_LADDER))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(reader, "READ_HERE_BYTES", 0)
            return run_stages(config, telemetry_spec=fake_spec([(0.0, 250.0)]))

    if worker_id == "master":  # one process: no other to share it with
        return build()
    shared = tmp_path_factory.getbasetemp().parent
    with (shared / "tiny-ladder.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = shared / "tiny-ladder.pickle"
        if cached.is_file():
            return pickle.loads(cached.read_bytes())  # this suite's own file
        output = build()
        cached.write_bytes(pickle.dumps(output))
        return output


@pytest.fixture(scope="session")
def inductor_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One Inductor cache for every test that compiles with Inductor, in this session's own
    temporary folder: the C++ kernels one test compiled serve the next, and none are read from
    (or left in) the machine's shared /tmp/torchinductor_<user>, whose graphs keep the source
    paths of whatever run compiled them. Compiled in the script's own process: the pool of
    compile workers Inductor starts otherwise is one more torch process (2.5 s of CPU) for
    the few kernels a test compiles."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor")),
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
            # Scalar C++ kernels: no probe of the CPU's vector extensions (two more builds, 3.5
            # s here), and the kernels are the same on an AVX2-only CPU and an AVX-512 one.
            "TORCHINDUCTOR_VEC_ISA_OK": "0"}


@dataclass
class Invoked:
    """What one gpudiag command did: its exit code and what it wrote on each stream."""

    exit_code: int
    stdout: str
    stderr: str
    exception: BaseException | None = None  # one that escaped the command (SystemExit: none)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


_runner = CliRunner()


def invoke(argv: Sequence[str | Path], **options: Any) -> Invoked:
    """`gpudiag ARGV...` in this process, as the console script runs it (`options`: CliRunner's
    own options, such as env or terminal_width)."""
    result = _runner.invoke(app, [str(a) for a in argv], **options)
    return Invoked(result.exit_code, result.stdout, result.stderr, result.exception)


GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "init.defaultBranch=main"]


def gpudiag_repo(tmp: Path, files: dict[str, Path] | None = None) -> Path:
    """A git repository at tmp/repo holding gpudiag's package (and `files`: name -> a file to
    copy), committed as its base: what `gate --base-ref` checks out. The caller commits the
    head on top (git(repo, ...))."""
    repo = tmp / "repo"
    shutil.copytree(Path(__file__).resolve().parent.parent / "gpudiag", repo / "gpudiag",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name, source in (files or {}).items():
        shutil.copy(source, repo / name)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        git(repo, *args)
    return repo


def git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout


def write_script(path: Path, body: str) -> Path:
    """A script for a test (`body` dedented), its folder made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


def line_of(script: Path, statement: str) -> int:
    """The number of the first line that is `statement` (stripped), else that contains it."""
    lines = script.read_text().splitlines()
    exact = [n for n, line in enumerate(lines, 1) if line.strip() == statement]
    return (exact or [n for n, line in enumerate(lines, 1) if statement in line])[0]


def script_line(script: Path, statement: str) -> str:
    """`name:N`, as findings name a line of the script."""
    return f"{script.name}:{line_of(script, statement)}"


def tree_hashes(folder: Path, leave_out: str = "//") -> dict[str, str]:
    """Every file and link under `folder` (but `leave_out`): a link by its target, a file by
    its bytes."""
    found = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if rel.startswith(leave_out):
            continue
        if path.is_symlink():
            found[rel] = f"-> {path.readlink()}"
        elif path.is_file():
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@dataclass
class Profiled:
    """A `gpudiag profile` of a script: its exit code, the run it wrote (None when it wrote
    none), and what both processes printed."""

    exit_code: int
    run: RunResult | None
    output: str
    out: Path

    def ok(self) -> RunResult:
        """The run, once the profile exited 0 (the output shown when it did not)."""
        assert self.exit_code == 0 and self.run is not None, self.output
        return self.run


def profile_script(tmp_path: Path, script: Path, *options: str,
                   env: dict[str, str] | None = None) -> Profiled:
    """`gpudiag profile --out tmp_path/run --no-plots OPTIONS -- python SCRIPT`, run from
    `tmp_path`, with `env` over this process's environment."""
    return profile_command(tmp_path, [sys.executable, str(script)], *options, env=env)


def profile_command(tmp_path: Path, command: Sequence[str], *options: str,
                    env: dict[str, str] | None = None) -> Profiled:
    """`gpudiag profile --out tmp_path/run --no-plots OPTIONS -- COMMAND` (torchrun, a
    module), as profile_script runs a script: gpudiag's side in this process (`invoke`: what
    a process of its own would import, 1-2 s a profile, is loaded already), the command in
    processes of its own, started from `tmp_path`, its output (written to the file
    descriptors it inherits) read back into `output` after gpudiag's. No plots (1-1.5 s of
    matplotlib a profile, on a 2-core CI machine; test_report_files.py draws them from
    recorded runs)."""
    out = tmp_path / "run"
    # What `gpudiag`'s console script sets before the app runs (cli.main): kineto's own lines
    # stay out of the script's output.
    env = {"KINETO_LOG_LEVEL": os.environ.get("KINETO_LOG_LEVEL", "9"), **(env or {})}
    with in_folder(tmp_path), _descriptors_to_file() as commands_output:
        result = invoke(["profile", "--out", out, "--force", "--no-plots", *options, "--",
                         *command], env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        result.output, result.exception)
    run = load_run(out) if (out / "run.json").is_file() else None
    return Profiled(result.exit_code, run, result.output + commands_output(), out)


@contextlib.contextmanager
def in_folder(path: Path) -> Iterator[None]:
    """`path` as the working directory meanwhile (contextlib.chdir, which Python 3.10 lacks)."""
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def _descriptors_to_file() -> Iterator[Callable[[], str]]:
    """File descriptors 1 and 2 (what child processes inherit) point to a temporary file
    meanwhile; the function yielded returns what was written there, once they are restored."""
    written: list[str] = []
    with tempfile.TemporaryFile() as sink:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield lambda: "".join(written)
        finally:
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)
            sink.seek(0)
            written.append(sink.read().decode(errors="replace"))
