"""Hostile input to every subcommand: each case is refused with its documented exit code and one
line naming what is wrong, no traceback, and every file that was there before the command is
byte for byte the same after it (and nothing new appears).

The workspace of each case holds two valid runs (`a`, `b`), a saved baseline, a foreign
directory of the user's, and whatever the case adds; the command runs with the workspace as
its working directory, so a default `reports/` folder would show up as a new file.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import invoke, ladder_config, ladder_run

from gpudiag.model.errors import ExitCode
from gpudiag.model.results import RunResult, StageResult
from gpudiag.model.runfile import save_run, to_jsonable

Setup = Callable[[Path], None]


def _valid_run(model: str = "dgca", batch: int = 8, device: str = "cpu",
               gpu: str | None = None, shift: int = 0) -> RunResult:
    """A valid run; another `shift` is another measurement of the same thing."""
    times = [10.0 + 0.01 * ((i + shift) % 7) for i in range(40)]
    stage = StageResult(name="train-fp16", status="ok", title="t", iter_ms=times,
                        samples_per_step=batch)
    return ladder_run(stage, device=device, gpu=gpu,
                      config=ladder_config(model=model, batch_size=batch, seq_len=64,
                                           device=device))


def _valid_dict() -> dict[str, Any]:
    return to_jsonable(_valid_run())


def _write_json(relative: str, mutate: Callable[[dict[str, Any]], Any]) -> Setup:
    """A run.json at `relative` (a run directory) built from a valid run by `mutate`."""
    def setup(ws: Path) -> None:
        data = _valid_dict()
        mutate(data)
        (ws / relative).mkdir(parents=True, exist_ok=True)
        (ws / relative / "run.json").write_text(json.dumps(data))
    return setup


def _write_text(relative: str, text: str | bytes) -> Setup:
    def setup(ws: Path) -> None:
        target = ws / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            target.write_bytes(text)
        else:
            target.write_text(text)
    return setup


def _sparse(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        handle.truncate(size)


def _calibration(wall_sd: float) -> Setup:
    def setup(ws: Path) -> None:
        record = {"device": "cpu", "gpu_name": None, "workload": {"model": "dgca"},
                  "stages": [{"stage": "train-fp16", "trials": 5, "wall_sd": wall_sd}]}
        (ws / "cal.json").write_text(json.dumps({"schema_version": 1, "records": [record]}))
    return setup


def _step(value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(data: dict[str, Any]) -> None:
        data["stages"][0]["iter_ms"][3] = value
    return mutate


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(data: dict[str, Any]) -> None:
        target = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return mutate


def _raw_run(relative: str, replace: tuple[str, str]) -> Setup:
    """A run.json whose text is edited after serialising: what json.dumps cannot write."""
    def setup(ws: Path) -> None:
        text = json.dumps(_valid_dict()).replace(*replace, 1)
        _write_text(f"{relative}/run.json", text)(ws)
    return setup


def _trials(relative: str, second: RunResult) -> Setup:
    """A folder of two trial runs, the second differing from the first."""
    def setup(ws: Path) -> None:
        save_run(_valid_run(), ws / relative / "trial-1" / "run.json")
        save_run(second, ws / relative / "trial-2" / "run.json")
    return setup


def _directory(relative: str) -> Setup:
    def setup(ws: Path) -> None:
        (ws / relative).mkdir(parents=True)
    return setup


def _git_repository(ws: Path) -> None:
    for command in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t",
                                                     "commit", "-qm", "base"]):
        subprocess.run(["git", *command], cwd=ws, check=True, capture_output=True)


def _mode(relative: str, mode: int) -> Setup:
    def setup(ws: Path) -> None:
        (ws / relative).chmod(mode)
    return setup


@dataclass
class Case:
    id: str
    argv: list[str]  # "{ws}" stands for the workspace
    message: str  # a part of the one line the command must print
    setup: list[Setup] = field(default_factory=list)
    code: int = ExitCode.BAD_INPUT
    slow: bool = False  # it runs git: a real subprocess


DEEP = "[" * 200_000 + "]" * 200_000
TINY = ["--device", "cpu", "--preset", "tiny"]
A, B = "{ws}/a", "{ws}/b"
RUN_CASES = [
    Case("run-iters-zero", ["run", *TINY, "--iters", "0"], "--iters must be positive"),
    Case("run-iters-negative", ["run", *TINY, "--iters", "-5"], "--iters must be positive"),
    Case("run-batch-zero", ["run", *TINY, "--batch-size", "0"], "--batch-size must be positive"),
    Case("run-batch-cannot-fit", ["run", *TINY, "--batch-size", "100000000"],
         "needs at least"),
    Case("run-seq-too-long", ["run", *TINY, "--seq-len", "100000"], "exceeds the model's"),
    Case("run-seq-too-short", ["run", *TINY, "--seq-len", "3"], "leaves no room"),
    Case("run-min-seconds-nan", ["run", *TINY, "--min-seconds", "nan"], "finite number"),
    Case("run-min-seconds-inf", ["run", *TINY, "--min-seconds", "inf"], "finite number"),
    Case("run-min-seconds-negative", ["run", *TINY, "--min-seconds", "-1"], "zero or more"),
    Case("run-warmup-negative", ["run", *TINY, "--warmup", "-1"], "zero or more"),
    Case("run-iters-not-a-number", ["run", *TINY, "--iters", "many"], "--iters"),
    Case("run-unknown-stage", ["run", *TINY, "--stages", "nope"], "unknown stage 'nope'"),
    Case("run-unknown-model", ["run", *TINY, "--model", "nope"], "unknown model 'nope'"),
    Case("run-unknown-preset", ["run", "--device", "cpu", "--preset", "huge"],
         "unknown preset"),
    Case("run-amp-dtype", ["run", *TINY, "--amp-dtype", "fp8"], "--amp-dtype"),
    Case("run-device-tpu", ["run", "--device", "tpu"], "--device tpu"),
    Case("run-device-missing-gpu", ["run", "--device", "cuda:99"], "--device cuda:99"),
    Case("run-trials-zero", ["run", *TINY, "--trials", "0"], "--trials must be positive"),
    # Accepted, they ran until killed (issue 56): bounded, the limit said.
    Case("run-iters-huge", ["run", *TINY, "--iters", "99999999999999999999"],
         "--iters must be at most 10,000,000"),
    Case("run-min-seconds-huge", ["run", *TINY, "--min-seconds", "1e300"],
         "--min-seconds must be at most 604,800"),
    Case("run-batch-hundreds-of-digits", ["run", *TINY, "--batch-size", "9" * 400],
         "--batch-size must be at most 1,000,000,000 (got 400 digits)"),
    Case("run-trials-huge", ["run", *TINY, "--trials", "99999999999"],
         "--trials must be at most 1,000"),
    Case("run-nnodes-no-endpoint", ["run", *TINY, "--nnodes", "2"], "--rdzv-endpoint"),
    Case("run-node-rank", ["run", *TINY, "--node-rank", "3"], "--node-rank 3"),
    Case("run-ddp-no-sync", ["run", *TINY, "--ddp-no-sync", "sometimes"], "--ddp-no-sync"),
    Case("run-model-file-missing", ["run", *TINY, "--model", "{ws}/none.py:f"],
         "no such file"),
    Case("run-model-file-exits", ["run", *TINY, "--model", "{ws}/exits.py:f"],
         "exits.py failed: SystemExit: 3",
         [_write_text("exits.py", "import sys\nsys.exit(3)\n")]),
    Case("run-model-file-interrupts", ["run", *TINY, "--model", "{ws}/kbd.py:f"],
         "kbd.py failed: KeyboardInterrupt", [_write_text("kbd.py", "raise KeyboardInterrupt\n")]),
    Case("run-model-file-syntax", ["run", *TINY, "--model", "{ws}/syn.py:f"],
         "syn.py failed: SyntaxError", [_write_text("syn.py", "def f(:\n")]),
    Case("run-model-file-no-factory", ["run", *TINY, "--model", "{ws}/ok.py:missing"],
         "defines no 'missing'", [_write_text("ok.py", "x = 1\n")]),
    Case("run-out-is-a-file", ["run", *TINY, "--out", "{ws}/notes.txt"],
         "exists and is not a directory"),
    Case("run-out-not-empty", ["run", *TINY, "--out", "{ws}/mine"], "not empty; pass --force"),
    Case("run-out-foreign-with-force", ["run", *TINY, "--out", "{ws}/mine", "--force"],
         "not a directory gpudiag made for a run"),
    Case("run-out-earlier-run-no-force", ["run", *TINY, "--out", A], "not empty; pass --force"),
    Case("run-out-under-a-file", ["run", *TINY, "--out", "{ws}/notes.txt/sub"],
         "cannot create it"),
    Case("run-out-name-too-long", ["run", *TINY, "--out", "{ws}/" + "x" * 300],
         "cannot create it"),
]

COMPARE_CASES = [
    # Reads are bounded: a device never ends (/dev/zero grew to 5.5 GB in 20 s), a FIFO
    # blocks forever, a sparse 300 MiB file is no gpudiag file.
    Case("gate-calibration-device", ["gate", A, B, "--calibration", "/dev/zero"],
         "/dev/zero: not a regular file"),
    Case("gate-calibration-fifo", ["gate", A, B, "--calibration", "{ws}/pipe"],
         "pipe: not a regular file", [lambda ws: os.mkfifo(ws / "pipe")]),
    Case("compare-huge-file", ["compare", "{ws}/huge/run.json", B], "larger than 256 MiB",
         [lambda ws: _sparse(ws / "huge" / "run.json", 300 * 2**20)]),
    # A calibration's spreads are bounded: a 5,000% one passed every regression, 1e308
    # overflowed into a traceback with exit 1.
    Case("gate-calibration-spread-5000pct", ["gate", A, B, "--calibration", "{ws}/cal.json"],
         "less than or equal to 0.5", [_calibration(3.9)]),
    Case("gate-calibration-spread-1e308", ["gate", A, B, "--calibration", "{ws}/cal.json"],
         "less than or equal to 0.5", [_calibration(1e308)]),
    # An interpreter that will not load the recorder (-I, -E, -S) is refused before it runs.
    Case("profile-python-isolated", ["profile", "--", sys.executable, "-I", "train.py"],
         "-I: isolated mode ignores PYTHONPATH"),
    Case("profile-python-no-site", ["profile", "--", sys.executable, "-u", "-Su", "train.py"],
         "-Su: it skips the site module"),
    Case("compare-missing", ["compare", "{ws}/none", B], "{ws}/none"),
    Case("compare-not-json", ["compare", "{ws}/bad", B], "not valid JSON",
         [_write_text("bad/run.json", "{not json")]),
    Case("compare-empty-file", ["compare", "{ws}/bad", B], "not valid JSON",
         [_write_text("bad/run.json", "")]),
    Case("compare-binary", ["compare", "{ws}/bad", B], "cannot read",
         [_write_text("bad/run.json", b"\xff\xfe\x00garbage")]),
    Case("compare-top-level-list", ["compare", "{ws}/bad", B], "top level is not an object",
         [_write_text("bad/run.json", "[1, 2]")]),
    Case("compare-deep-nesting", ["compare", "{ws}/bad", B], "nested too deeply",
         [_write_text("bad/run.json", DEEP)]),
    Case("compare-schema-99", ["compare", "{ws}/bad", B], "schema_version 99",
         [_write_json("bad", _set(("schema_version",), 99))]),
    Case("compare-null-stages", ["compare", "{ws}/bad", B], "stages: input should be",
         [_write_json("bad", _set(("stages",), None))]),
    Case("compare-null-env", ["compare", "{ws}/bad", B], "env: input should be",
         [_write_json("bad", _set(("env",), None))]),
    Case("compare-stage-not-object", ["compare", "{ws}/bad", B], "stages[0]",
         [_write_json("bad", _set(("stages", 0), 7))]),
    Case("compare-huge-int", ["compare", "{ws}/bad", B], "stages[0].iter_ms[3]: integer of",
         [_write_json("bad", _step(10**300))]),
    Case("compare-huge-int-in-config", ["compare", "{ws}/bad", B],
         "config.batch_size: integer of", [_write_json("bad", _set(("config", "batch_size"),
                                                                   -(10**200)))]),
    Case("compare-unknown-severity", ["compare", "{ws}/bad", B], "findings[0].severity",
         [_write_json("bad", _set(("findings",), [{
             "id": "GD101", "rule": "x", "severity": "fatal", "stage": None, "title": "t"}]))]),
    Case("compare-impact-out-of-range", ["compare", "{ws}/bad", B], "findings[0].impact",
         [_write_json("bad", _set(("findings",), [{
             "id": "GD101", "rule": "x", "severity": "info", "stage": None, "title": "t",
             "impact": 7}]))]),
    Case("compare-status-unknown", ["compare", "{ws}/bad", B], "stages[0].status",
         [_write_json("bad", _set(("stages", 0, "status"), "great"))]),
    Case("compare-wrong-type-title", ["compare", "{ws}/bad", B], "stages[0].title",
         [_write_json("bad", _set(("stages", 0, "title"), ["a", "list"]))]),
    Case("compare-markdown-exists", ["compare", A, B, "--markdown", "{ws}/notes.txt"],
         "exists; pass --force"),
    Case("compare-markdown-is-dir", ["compare", A, B, "--markdown", "{ws}/mine"],
         "is a directory"),
    Case("compare-markdown-into-run-dir", ["compare", A, B, "--markdown", "{ws}/a/run.json",
                                           "--force"], "belongs to a run directory"),
    Case("compare-markdown-no-parent", ["compare", A, B, "--markdown", "{ws}/no/such/c.md"],
         "does not exist"),
]

GATE_CASES = [
    Case(f"gate-step-{name}", ["gate", "{ws}/bad", B], f"{{ws}}/bad/run.json: {where}",
         [setup])
    for name, where, setup in [
        ("zero", "stages[0].iter_ms[3]", _write_json("bad", _step(0))),
        ("negative", "stages[0].iter_ms[3]", _write_json("bad", _step(-4.2))),
        ("sub-microsecond", "stages[0].iter_ms[3]", _write_json("bad", _step(1e-7))),
        ("bool", "stages[0].iter_ms[3]", _write_json("bad", _step(True))),
        ("string", "stages[0].iter_ms[3]", _write_json("bad", _step("10.5"))),
        ("null", "stages[0].iter_ms[3]", _write_json("bad", _step(None))),
        ("nan", "stages[0].iter_ms[0]", _raw_run("bad", ('"iter_ms": [', '"iter_ms": [NaN, '))),
        ("infinity", "stages[0].iter_ms[0]",
         _raw_run("bad", ('"iter_ms": [', '"iter_ms": [Infinity, '))),
        ("samples-per-step-float", "stages[0].samples_per_step", _write_json(
            "bad", _set(("stages", 0, "samples_per_step"), 8.5))),
        ("duplicate-stage", "stages: 'train-fp16' appears more than once", _write_json(
            "bad", lambda d: d["stages"].append(dict(d["stages"][0], iter_ms=[100.0] * 40)))),
    ]
] + [
    Case(f"gate-trials-differ-{name}", ["gate", "{ws}/mixed", B],
         f"{{ws}}/mixed/trial-2/run.json: {where}", [_trials("mixed", second)])
    for name, where, second in [
        ("model", "config.model 'bert'", _valid_run(model="bert")),
        ("batch", "config.batch_size 16", _valid_run(batch=16)),
        ("device", "env.device 'cuda'", _valid_run(device="cuda")),
        ("gpu", "env.gpu_name 'NVIDIA H100'", _valid_run(gpu="NVIDIA H100")),
    ]
] + [
    Case("gate-one-run", ["gate", A], "give BASELINE and CURRENT"),
    Case("gate-run-options-without-ref", ["gate", A, B, "--iters", "5"], "only apply with"),
    Case("gate-ref-and-runs", ["gate", A, B, "--base-ref", "HEAD"], "not both"),
    Case("gate-trials-over-max", ["gate", "--base-ref", "HEAD", "--trials", "3",
                                  "--max-trials", "2"], "need 1 <= trials"),
    Case("gate-min-iters-zero", ["gate", A, B, "--min-iters", "0"], "--min-iters must be"),
    Case("gate-on-inconclusive", ["gate", A, B, "--on-inconclusive", "maybe"],
         "--on-inconclusive 'maybe'"),
    Case("gate-limit-garbage", ["gate", A, B, "--max-regression", "lots"], "lots"),
    Case("gate-limit-unknown-stage", ["gate", A, B, "--max-regression", "warp:5"], "warp"),
    Case("gate-markdown-exists", ["gate", A, B, "--markdown", "{ws}/notes.txt"],
         "exists; pass --force"),
    Case("gate-ref-unknown-stage", ["gate", "--base-ref", "HEAD", "--device", "cpu", "--stages",
                                    "nosuch"], "unknown stage 'nosuch'"),  # before any checkout
    Case("gate-ref-outside-git", ["gate", "--base-ref", "HEAD"], "not inside a git repository",
         slow=True),
    Case("gate-bad-ref", ["gate", "--base-ref", "no-such-ref-xyz"], "no-such-ref-xyz",
         [_git_repository], slow=True),
]

def _evidence(**fields: Any) -> Callable[[dict[str, Any]], None]:
    """A valid evidence window on the stage, with `fields` replaced."""
    def mutate(data: dict[str, Any]) -> None:
        data["stages"][0]["evidence"] = {"steps": 5, "step_ms": 10.0, "backend": "cpu",
                                         "ops_per_step": 120.0, "syncs_per_step": 1.0,
                                         **fields}
    return mutate


def _facts(**fields: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(data: dict[str, Any]) -> None:
        data["stages"][0]["facts"].update(fields)
    return mutate


def _trial_copies(relative: str, copies: int) -> Setup:
    """One run copied into several trial folders."""
    def setup(ws: Path) -> None:
        for k in range(1, copies + 1):
            save_run(_valid_run(), ws / relative / f"trial-{k}" / "run.json")
    return setup


def _trials_of(relative: str, second: Callable[[dict[str, Any]], None]) -> Setup:
    """Two trials, the second another measurement edited by `second`."""
    def setup(ws: Path) -> None:
        save_run(_valid_run(), ws / relative / "trial-1" / "run.json")
        data = to_jsonable(_valid_run(shift=2))
        second(data)
        (ws / relative / "trial-2").mkdir(parents=True)
        (ws / relative / "trial-2" / "run.json").write_text(json.dumps(data))
    return setup


def _contradicting_trial(data: dict[str, Any]) -> None:
    data["stages"][0]["trials"] = [{"ms_per_iter": 5.0, "iters": 40, "samples_per_step": 8}]


def _huge_steps(data: dict[str, Any]) -> None:
    data["stages"][0]["iter_ms"] = [1e6] * 40
    data["duration_s"] = 60.0


# Valid-looking runs no measurement can produce (issue: the gate passed every one of them).
IMPOSSIBLE_CASES = [
    Case(f"gate-impossible-{name}", ["gate", "{ws}/bad", B], f"{{ws}}/bad/run.json: {where}",
         [_write_json("bad", mutate)])
    for name, where, mutate in [
        ("negative-syncs", "stages[0].evidence.syncs_per_step", _evidence(syncs_per_step=-50)),
        ("negative-ops", "stages[0].evidence.ops_per_step", _evidence(ops_per_step=-3)),
        ("negative-device-ms", "stages[0].evidence.device_ms_per_step",
         _evidence(device_ms_per_step=-1.0)),
        ("negative-flops", "stages[0].facts.flops_per_step", _facts(flops_per_step=-1e9)),
        ("zero-flops-with-matmuls", "stages[0].facts.flops_per_step", lambda d: (
            _evidence(matmul_ms_by_dtype={"fp32": 4.0})(d), _facts(flops_per_step=0)(d))),
        ("empty-window", "stages[0].evidence.steps", _evidence(steps=0)),
        ("1e12-syncs", "stages[0].evidence.syncs_per_step", _evidence(syncs_per_step=1e12)),
        ("steps-longer-than-the-run", "stages[0].iter_ms", _huge_steps),
        ("step-1e308", "stages[0].iter_ms[3]", _step(1e308)),
        ("samples-per-step-vs-batch", "stages[0].samples_per_step",
         _set(("stages", 0, "samples_per_step"), 64)),
        ("trials-vs-steps", "stages[0].trials", _contradicting_trial),
        # Warm-up's microseconds saved as the timed steps: fewer than the events counted.
        ("steps-shorter-than-their-events", "stages[0].iter_ms: a mean step of 0.002 ms",
         lambda d: (_evidence()(d), d["stages"][0].update(iter_ms=[0.002] * 40))),
        ("steps-shorter-than-their-kernels", "stages[0].iter_ms: a mean step of 3 ms is "
         "shorter than the 9.5 ms of device work", lambda d: (
             _evidence(backend="cuda", compute_busy_ms_per_step=9.5)(d),
             d["stages"][0].update(iter_ms=[3.0] * 40))),
        ("trial-samples-per-step", "stages[0].trials[0].samples_per_step", lambda d: d[
            "stages"][0].update(trials=[{"ms_per_iter": 10.03, "iters": 40,
                                         "samples_per_step": 16}])),
        ("copied-trials", "stages[0].trials[1]: a copy of trials[0]", lambda d: d["stages"][0]
         .update(trials=[{"ms_per_iter": 10.03, "iters": 40, "samples_per_step": 8}] * 2)),
    ]
] + [
    Case("gate-trials-copied", ["gate", "{ws}/copies", B],
         "{ws}/copies/trial-2/run.json: a copy of", [_trial_copies("copies", 5)]),
    Case("gate-trials-mixed-precision", ["gate", "{ws}/mixed", B], "config.amp_dtype",
         [_trials_of("mixed", _set(("config", "amp_dtype"), "bf16"))]),
    Case("gate-trials-mixed-torch", ["gate", "{ws}/mixed", B], "env.torch_version",
         [_trials_of("mixed", _set(("env", "torch_version"), "2.99.0"))]),
    Case("gate-same-run-twice", ["gate", A, A], "hold the same measurement"),
    Case("gate-other-torch", ["gate", "{ws}/other", B], "torch: '2.99.0' vs ''",
         [_write_json("other", lambda d: (_step(10.02)(d), _set(("env", "torch_version"),
                                                                "2.99.0")(d)))]),
    Case("gate-other-precision", ["gate", "{ws}/other", B], "amp_dtype",
         [_write_json("other", lambda d: (_step(10.02)(d), _set(("config", "amp_dtype"),
                                                                "bf16")(d)))]),
    Case("gate-base-interrupted", ["gate", "{ws}/cut", B], "base run was interrupted",
         [_write_json("cut", lambda d: (_step(10.02)(d), _set(("interrupted",), True)(d)))]),
]

REPORT_CASES = [
    Case("report-no-run-json", ["report", "{ws}/mine"], "no run.json there"),
    Case("report-corrupt", ["report", "{ws}/bad"], "not valid JSON",
         [_write_text("bad/run.json", '{"schema_version": 2,')]),
    Case("report-wrong-types", ["report", "{ws}/bad"], "stages[0].iter_ms[3]",
         [_write_json("bad", _step("fast"))]),
    Case("report-missing-dir", ["report", "{ws}/none"], "no run.json there"),
]

BASELINE_CASES = [
    Case("baseline-name-path", ["baseline", "save", A, "--name", "../x", "--dir", "{ws}/bl"],
         "use a plain file name"),
    Case("baseline-name-hidden", ["baseline", "save", A, "--name", ".x", "--dir", "{ws}/bl"],
         "use a plain file name"),
    Case("baseline-different-exists", ["baseline", "save", B, "--name", "main", "--dir",
                                       "{ws}/bl"], "a different baseline is there"),
    Case("baseline-bad-run", ["baseline", "save", "{ws}/bad", "--dir", "{ws}/bl"],
         "stages[0].iter_ms[3]", [_write_json("bad", _step(-1))]),
    Case("baseline-dir-is-a-file", ["baseline", "save", A, "--dir", "{ws}/notes.txt"],
         "notes.txt"),
    Case("baseline-target-is-a-dir", ["baseline", "save", A, "--name", "x", "--dir",
                                      "{ws}/bl"], "is a directory", [_directory("bl/x.json")]),
]

PROFILE_CASES = [
    Case("profile-directory", ["profile", "--out", "{ws}/p", "--", "{ws}/mine"], "cannot run"),
    Case("profile-not-executable", ["profile", "--out", "{ws}/p", "--", "{ws}/script.sh"],
         "cannot run", [_write_text("script.sh", "#!/bin/sh\necho hi\n")]),
    Case("profile-no-interpreter-line", ["profile", "--out", "{ws}/p", "--", "{ws}/plain"],
         "cannot run", [_write_text("plain", "echo hi\n"), _mode("plain", stat.S_IRWXU)]),
    Case("profile-missing-command", ["profile", "--out", "{ws}/p", "--", "gpudiag-no-such"],
         "command not found"),
    Case("profile-steps-negative", ["profile", "--steps", "-1", "--", "true"],
         "--evidence-steps"),
    Case("profile-timed-zero", ["profile", "--timed", "0", "--", "true"], "--timed"),
    Case("profile-timed-huge", ["profile", "--timed", "99999999999", "--", "true"],
         "--timed must be at most 10,000,000"),
    Case("profile-steps-huge", ["profile", "--steps", "99999", "--", "true"],
         "--evidence-steps must be at most 1,000"),
    Case("profile-telemetry", ["profile", "--telemetry", "loud", "--", "true"], "--telemetry"),
    Case("profile-out-is-a-file", ["profile", "--out", "{ws}/notes.txt", "--", "true"],
         "exists and is not a directory"),
    Case("profile-out-not-empty", ["profile", "--out", "{ws}/mine", "--", "true"],
         "not empty; pass --force"),
    Case("profile-unknown-fix", ["profile", "--try-fixes", "--fix", "magic", "--", "true"],
         "--fix must be one of tf32, bf16-autocast"),
    Case("profile-fix-without-try", ["profile", "--fix", "tf32", "--", "true"],
         "--fix goes with --try-fixes"),
]

CASES = [*RUN_CASES, *COMPARE_CASES, *GATE_CASES, *IMPOSSIBLE_CASES, *REPORT_CASES,
         *BASELINE_CASES, *PROFILE_CASES]


def _workspace(root: Path) -> Path:
    from gpudiag.diagnose.trials import baseline_of

    ws = root / "ws"
    save_run(_valid_run(), ws / "a" / "run.json")
    save_run(_valid_run(shift=3), ws / "b" / "run.json")
    (ws / "mine").mkdir()
    (ws / "mine" / "thesis.tex").write_text("the user's own work\n")
    (ws / "notes.txt").write_text("keep me\n")
    save_run(baseline_of(_valid_run(batch=16)), ws / "bl" / "main.json")
    return ws


def _snapshot(root: Path) -> dict[str, bytes | None]:
    files: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        files[str(path.relative_to(root))] = (None if path.is_dir() else path.read_bytes()
                                              if path.is_file() else b"(not a regular file)")
    return files


def test_there_are_enough_cases() -> None:
    commands = {c.argv[0] for c in CASES}
    assert len(CASES) >= 60 and commands == {"run", "compare", "gate", "report", "baseline",
                                             "profile"}
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=pytest.mark.slow if c.slow else ())
                                  for c in CASES])
def test_hostile_input_is_refused_cleanly(case: Case, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    ws = _workspace(tmp_path)
    for setup in case.setup:
        setup(ws)
    monkeypatch.chdir(ws)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    before = _snapshot(ws)
    result = invoke([arg.replace("{ws}", str(ws)) for arg in case.argv])
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        result.exception
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == case.code, result.output
    assert len(lines) == 1, result.stderr
    assert case.message.replace("{ws}", str(ws)) in lines[0], lines[0]
    assert "Traceback" not in result.output
    assert _snapshot(ws) == before


def test_steps_near_their_evidence_are_no_contradiction() -> None:
    """Near misses of the steps-against-evidence checks load: a window whose one heavy step
    (an evaluation) lifts its mean device time past the timed steps, collectives that spin
    past the step, a CPU window's operators (their times inflated by the profiler)."""
    from gpudiag.model.runfile import run_from_dict

    for evidence, step_ms in [
        (_evidence(backend="cuda", compute_busy_ms_per_step=8.0,
                   device_ms_by_step=[2.0, 2.0, 20.0]), 3.0),
        (_evidence(backend="cuda", device_busy_ms_per_step=140.0,
                   collective_ms_per_step=130.0, compute_busy_ms_per_step=9.0), 12.0),
        (_evidence(backend="cpu", compute_busy_ms_per_step=50.0), 3.0),
        (_evidence(ops_per_step=120.0), 0.013),  # 9.2 operators a microsecond
    ]:
        data = _valid_dict()
        evidence(data)
        data["stages"][0]["iter_ms"] = [step_ms] * 40
        assert run_from_dict(data).stages[0].evidence is not None


def test_unwritable_step_summary_is_a_warning_not_a_regression(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GITHUB_STEP_SUMMARY pointing at a directory: the gate's own verdict (0 here) stands,
    with a one-line warning."""
    ws = _workspace(tmp_path)
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(ws / "mine"))
    result = invoke(["gate", str(ws / "a"), str(ws / "b")])
    assert result.exit_code == 0, result.output
    assert "warning: GITHUB_STEP_SUMMARY" in result.stderr


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0,
                    reason="root ignores file modes; /proc is read-only for everyone")
def test_unwritable_out_is_one_line(tmp_path: Path) -> None:
    result = invoke(["run", *TINY, "--out", "/proc/gpudiag-run"])
    assert result.exit_code == ExitCode.BAD_INPUT and "cannot create it" in result.stderr


def test_force_replaces_an_earlier_run_whole(tmp_path: Path) -> None:
    """--force on a directory gpudiag made replaces it whole: no file of the earlier run (a
    stale plot, a trace) is mixed into the new one."""
    from gpudiag.present.files import RUN_MARKER, prepare_run_dir

    old = prepare_run_dir(tmp_path / "run", tmp_path / "unused")
    (old / "stale.png").write_bytes(b"old plot")
    again = prepare_run_dir(tmp_path / "run", tmp_path / "unused", force=True)
    assert sorted(p.name for p in again.iterdir()) == [RUN_MARKER]


def test_default_run_directories_never_collide(tmp_path: Path) -> None:
    from gpudiag.present.files import prepare_run_dir

    same = tmp_path / "20261124T120000Z-dgca"
    made = [prepare_run_dir(None, same) for _ in range(3)]
    assert [p.name for p in made] == [same.name, f"{same.name}-2", f"{same.name}-3"]


def test_saving_the_same_baseline_again_is_fine(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    for _ in range(2):
        result = invoke(["baseline", "save", str(ws / "a"), "--name", "new",
                                     "--dir", str(ws / "bl")])
        assert result.exit_code == 0, result.output
    forced = invoke(["baseline", "save", str(ws / "a"), "--name", "main",
                                 "--dir", str(ws / "bl"), "--force"])
    assert forced.exit_code == 0, forced.output
    assert (ws / "bl" / "main.json").read_bytes() == (ws / "bl" / "new.json").read_bytes()


@pytest.mark.parametrize("setup", ["users-run-json", "marked-with-users-files"])
def test_force_never_deletes_a_directory_holding_the_users_files(
        tmp_path: Path, setup: str) -> None:
    """--force on a project directory that has its own run.json and src/ (or a marked run
    directory the user put files into): refused in one line, every file left as it was."""
    from gpudiag.present.files import RUN_MARKER

    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "run.json").write_text('{"mine": true}')
    (proj / "src" / "train.py").write_text("print('mine')\n")
    if setup == "marked-with-users-files":
        (proj / RUN_MARKER).write_text("made by gpudiag\n")
    before = {p.relative_to(proj): p.read_bytes() for p in proj.rglob("*") if p.is_file()}
    for command in (["run", *TINY], ["profile", "--", sys.executable, "-c", "pass"]):
        result = invoke([*command[:1], "--out", str(proj), "--force",
                                     *command[1:]])
        assert result.exit_code == ExitCode.BAD_INPUT, result.output
        assert "not a directory gpudiag made for a run" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    after = {p.relative_to(proj): p.read_bytes() for p in proj.rglob("*") if p.is_file()}
    assert after == before
