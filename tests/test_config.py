"""Presets, defaults and validation of the run configuration."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
from typer.testing import CliRunner

from gpudiag.cli.flags import options_from_params
from gpudiag.cli.program import app
from gpudiag.diagnose.counters import COUNTER_NAMES
from gpudiag.measure.plan import build_config, cpu_bf16_native
from gpudiag.measure.profile.protocol import ENV_CONFIG, config_env, config_from_env
from gpudiag.measure.stages import DEFAULT_LADDER
from gpudiag.model.config import (
    PRESETS,
    TIMED_PRECISION,
    WINDOW_BUDGET_S,
    ProfileConfig,
    RunConfig,
)
from gpudiag.model.errors import BadInput
from gpudiag.model.options import (
    ConfineOptions,
    GateOptions,
    GateRequest,
    ProfileOptions,
    RunOptions,
    check_calibrate_options,
    check_gate_options,
    check_ranges,
    option_fields,
    options_of,
    profile_config,
    to_argv,
)
from gpudiag.model.runfile import RunFileError


def test_cpu_defaults_to_tiny_and_says_so() -> None:
    config, notes = build_config(model="dgca", device="cpu")
    assert config.preset == "tiny" and config.amp_dtype == ("bf16" if cpu_bf16_native()
                                                           else "fp32")
    assert config.stages == DEFAULT_LADDER
    assert any("tiny" in n for n in notes)


@pytest.mark.parametrize("native", [True, False])
def test_cpu_mixed_precision_follows_native_bf16(monkeypatch: pytest.MonkeyPatch,
                                                 native: bool) -> None:
    """Each branch forced, whatever CPU runs the tests."""
    monkeypatch.setattr("gpudiag.measure.plan.cpu_bf16_native", lambda: native)
    config, notes = build_config(model="dgca", device="cpu")
    assert config.amp_dtype == ("bf16" if native else "fp32")
    assert any("no native bf16" in n for n in notes) != native


@pytest.mark.parametrize(("cpuinfo", "native"), [
    ("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n", False),  # AVX2-only EPYC, laptops
    ("flags\t\t: avx2 avx512f avx512bw\n", False),  # AVX-512 without BF16
    ("flags\t\t: avx2 avx512f avx512_bf16\n", True),  # Cooper Lake, Zen 4
    ("flags\t\t: avx512f amx_bf16 amx_tile\n", True),  # Sapphire Rapids
    ("Features\t: fp asimd sve bf16\n", True),  # Arm Neoverse V1
    ("Features\t: fp asimd\n", False),
])
def test_cpu_bf16_native_reads_the_cpu_flags(tmp_path: Path, cpuinfo: str, native: bool) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert cpu_bf16_native(path) is native


def test_cpu_bf16_without_cpuinfo_asks_onednn(tmp_path: Path) -> None:
    expected = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert cpu_bf16_native(tmp_path / "missing") is expected


def test_full_preset_is_the_seed_setting() -> None:
    full = PRESETS["full"]
    assert (full.batch_size, full.seq_len) == (128, 128)
    assert (full.shape.vocab_size, full.shape.hidden_size, full.shape.num_layers,
            full.shape.num_heads, full.shape.intermediate_size) == (21128, 768, 12, 12, 3072)


def test_overrides_apply() -> None:
    config, _ = build_config(model="bert", device="cpu", preset="tiny", batch_size=3,
                             seq_len=32, iters=7, warmup=0, amp_dtype="fp16",
                             stages=["train", "train", "infer"])
    assert (config.batch_size, config.seq_len, config.iters, config.warmup) == (3, 32, 7, 0)
    assert config.amp_dtype == "fp16"
    assert config.stages == ("train", "infer")  # duplicates dropped, order kept


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"model": "nope"}, "unknown model"),
    ({"stages": ["warp-speed"]}, "unknown stage 'warp-speed'"),
    ({"batch_size": 0}, "--batch-size must be positive"),
    ({"iters": -3}, "--iters must be positive"),
    ({"warmup": -1}, "--warmup must be zero or more"),
    ({"amp_dtype": "fp8"}, "--amp-dtype must be one of fp16, bf16, fp32"),
    ({"preset": "huge"}, "unknown preset 'huge'"),
    ({"seq_len": 4096}, "exceeds the model's"),
    ({"device": "tpu"}, "expected cpu, cuda or cuda:N"),
])
def test_bad_input(kwargs: dict[str, object], message: str) -> None:
    options: dict[str, object] = {"model": "dgca", "device": "cpu"}
    options.update(kwargs)
    with pytest.raises(BadInput, match=message):
        build_config(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [RunOptions, ProfileOptions, GateOptions])
def test_every_number_option_is_bounded_above(cls: type[Any]) -> None:
    """`run --iters 99999999999999999999` and `--min-seconds 1e300` were accepted and ran
    until killed (issue 56): every number any command takes has a most a real job could need,
    and a value past it (an int of hundreds of digits, 1e300) is one line naming the limit.
    --host-sample-hz has its own most, with its reason (profile_config)."""
    for f, spec, hint in option_fields(cls):
        if not any(t in (int, float) for t in typing.get_args(hint) or (hint,)) \
                or hint is bool or f.name == "host_sample_hz":
            continue
        assert spec.most is not None, f"{spec.flag} has no most"
        huge = 10 ** 400 if int in (typing.get_args(hint) or (hint,)) else 1e300
        with pytest.raises(BadInput, match=f"^{spec.flag} must be at most [0-9,]+ "):
            check_ranges(cls(**{f.name: huge}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_bad_input() -> None:
    with pytest.raises(BadInput, match="no CUDA device"):
        build_config(model="dgca", device="cuda")


def _parse_run(argv: list[str]) -> RunOptions:
    """`gpudiag run ARGV` parsed by the real command line, as the options it would run."""
    command = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    with command.make_context("run", list(argv)) as ctx:
        return options_from_params(RunOptions, ctx.params)


@pytest.mark.parametrize("overrides", [
    {},
    {"model": "bert", "stages": ["train", "ddp"], "batch_size": 3, "seq_len": 32, "iters": 7,
     "warmup": 0, "min_seconds": 0.25, "amp_dtype": "fp16", "loader_workers": 0,
     "prompt_length": 2, "evidence_steps": 0, "checkpoint_every": 4, "checkpoint_dir": "c d",
     "keep_checkpoints": True, "nproc": 3, "nnodes": 2, "node_rank": 1,
     "rdzv_endpoint": "host:29400", "ddp_sweep": True, "ddp_accum": 4,
     "ddp_no_sync": "backward-only"},
])
def test_run_options_round_trip_through_the_command_line(overrides: dict[str, Any]) -> None:
    """A config -> the argv a --trials child gets -> parsed by `gpudiag run` -> the same
    config, for every option (a new RunOptions field is covered by the first case)."""
    config, _ = build_config(**{"model": "dgca", "device": "cpu", "preset": "tiny",
                                **overrides})
    argv = to_argv(options_of(config))
    assert build_config(_parse_run(argv))[0] == config
    # Every option has its flag on `run`, and only one spelling.
    flags = [spec.flag for _, spec, _ in option_fields()]
    assert len(set(flags)) == len(flags)
    help_text = " ".join(CliRunner().invoke(app, ["run", "--help"], terminal_width=200)
                         .output.split())
    assert all(flag in help_text for flag in flags)


def test_every_config_field_is_an_option_or_derived() -> None:
    """RunConfig fields the user cannot set are derived from ones they can (shape from the
    preset) or fixed by gpudiag (telemetry periods, seed, the dgca candidate count): listed
    here on purpose, so a new setting is either an option or a decision."""
    options = {f.name for f, _, _ in option_fields()}
    derived = {"shape", "sample_period_s", "gpm_period_s", "seed", "candidates", "mode",
               "evidence_budget_s",  # gpudiag's, unless --evidence-steps is given
               "timed_precision"}  # gpudiag's, unless --iters is given
    assert {f.name for f in dataclasses.fields(RunConfig)} - options == derived


def test_profile_options_make_the_profile_config() -> None:
    """ProfileConfig is what a profile measured: its schedule and telemetry are options of the
    same name; the command is the argument; remedies, losses, the seed and the larger batch's
    ask are --try-fixes'. Where runs in a scratch copy may write is not a measured setting
    (ConfineOptions)."""
    options = {f.name for f, _, _ in option_fields(ProfileOptions)}
    fields = {f.name for f in dataclasses.fields(ProfileConfig)}
    assert fields - options == {"command", "remedies", "losses", "seed", "mode",
                                "evidence_budget_s", "batch_factor", "batch_site"}
    assert options - fields == {"rerun", "try_fixes", "fixes"}
    config = profile_config(ProfileOptions(warmup=2, timed=6, evidence_steps=1,
                                           telemetry="off", try_fixes=True, fixes=("tf32",)),
                            ["python", "train.py"])
    assert (config.command, config.warmup, config.timed, config.evidence_steps,
            config.telemetry) == (("python", "train.py"), 2, 6, 1, "off")
    assert config.stop_after_window and config.losses == 2 and config.seed is not None
    # A number of profiled steps asked for is profiled whole; by default a budget may cut it.
    assert config.evidence_budget_s is None
    default = profile_config(ProfileOptions(), ["python", "train.py"])
    assert (default.evidence_steps, default.evidence_budget_s) == (3, WINDOW_BUDGET_S)
    ladder, _ = build_config(model="dgca", device="cpu", preset="tiny")
    assert (ladder.evidence_steps, ladder.evidence_budget_s) == (2, WINDOW_BUDGET_S)
    asked, _ = build_config(model="dgca", device="cpu", preset="tiny", evidence_steps=2)
    assert asked.evidence_budget_s is None
    # Timed steps alike: the preset's count, which a precise median may end early, or the
    # user's, timed whole; a trial's argv keeps the difference.
    full, _ = build_config(model="dgca", device="cpu", preset="full")
    assert (full.iters, full.timed_precision) == (30, TIMED_PRECISION)
    assert "--iters" not in to_argv(options_of(full))
    pinned, _ = build_config(model="dgca", device="cpu", preset="full", iters=30)
    assert pinned.timed_precision is None and "--iters" in to_argv(options_of(pinned))
    with pytest.raises(BadInput, match="--fix goes with --try-fixes"):
        profile_config(ProfileOptions(fixes=("tf32",)), ["true"])
    with pytest.raises(BadInput, match="--telemetry must be one of full, basic, off"):
        profile_config(ProfileOptions(telemetry="loud"), ["true"])


def _parse_gate(argv: list[str]) -> tuple[RunOptions, GateOptions]:
    """`gpudiag gate ARGV` parsed by the real command line: its run options and its own."""
    command = typer.main.get_command(app).commands["gate"]  # type: ignore[attr-defined]
    with command.make_context("gate", list(argv)) as ctx:
        return (options_from_params(RunOptions, ctx.params),
                options_from_params(GateOptions, ctx.params))


def test_gate_options_come_from_the_command_line() -> None:
    """Every GateOptions field is a flag of `gate`; --max-regression repeats and is never split
    on commas; the run options stay RunOptions."""
    assert _parse_gate(["a", "b"]) == (RunOptions(), GateOptions())
    run, own = _parse_gate([
        "--base-ref", "origin/main", "--model", "bert", "--trials", "2", "--max-trials", "4",
        "--on-inconclusive", "fail", "--max-regression", "10", "--max-regression",
        "syncs=0,flops=2", "--min-iters", "5", "--allow-mismatch", "--calibration", "c.json"])
    assert run == RunOptions(model="bert")
    assert own == GateOptions(base_ref="origin/main", trials=2, max_trials=4,
                              on_inconclusive="fail", max_regression=("10", "syncs=0,flops=2"),
                              min_iters=5, allow_mismatch=True, calibration=Path("c.json"))
    help_text = " ".join(CliRunner().invoke(app, ["gate", "--help"], terminal_width=200)
                         .output.split())
    assert all(spec.flag.split("/")[0] in help_text
               for _, spec, _ in option_fields(GateOptions))


def test_gate_limit_help_names_every_counter() -> None:
    """The model cannot import the diagnosis' counters: their names are spelled out in the
    help, and this keeps them the same."""
    spec = next(s for f, s, _ in option_fields(GateOptions) if f.name == "max_regression")
    assert f"({', '.join(COUNTER_NAMES)}; 0 = no increase)" in spec.help


@pytest.mark.parametrize(("own", "given", "run", "confine", "message"), [
    (GateOptions(on_inconclusive="maybe"), ["a", "b"], RunOptions(), ConfineOptions(),
     "--on-inconclusive 'maybe': expected pass or fail"),
    (GateOptions(min_iters=0), ["a", "b"], RunOptions(), ConfineOptions(),
     "--min-iters must be positive"),
    (GateOptions(base_ref="x", trials=3, max_trials=2), [], RunOptions(), ConfineOptions(),
     "--trials 3 and --max-trials 2: need 1 <= trials <= max-trials"),
    (GateOptions(trials=0), ["a", "b"], RunOptions(), ConfineOptions(), "need 1 <= trials"),
    (GateOptions(), ["a"], RunOptions(), ConfineOptions(), "give BASELINE and CURRENT"),
    (GateOptions(), ["a", "b", "c"], RunOptions(), ConfineOptions(),
     "expected BASELINE and CURRENT, got 3 paths"),
    (GateOptions(), ["a", "b"], RunOptions(iters=5), ConfineOptions(),
     "only apply with --base-ref"),
    (GateOptions(base_ref="x"), ["python", "t.py"], RunOptions(iters=5), ConfineOptions(),
     "a command after -- is measured with gpudiag profile's defaults"),
    (GateOptions(base_ref="x", share=("data",)), [], RunOptions(), ConfineOptions(),
     "--share and --samples-per-step go with --base-ref REF -- COMMAND"),
    (GateOptions(), ["a", "b"], RunOptions(), ConfineOptions(unconfined_reruns=True),
     "--rerun-writable and --unconfined-reruns go with a COMMAND"),
])
def test_gate_options_are_checked_in_one_place(own: GateOptions, given: list[str],
                                               run: RunOptions, confine: ConfineOptions,
                                               message: str) -> None:
    with pytest.raises(BadInput, match=re.escape(message)):
        check_gate_options(own, given, run, confine)


def test_a_checked_gate_says_what_it_compares(tmp_path: Path) -> None:
    """Two runs, or with --base-ref gpudiag's workload or the user's command; two runs given
    with --base-ref are a mistake, not a command."""
    runs = check_gate_options(GateOptions(on_inconclusive="fail"), ["a/", "b"])
    assert runs == GateRequest((Path("a"), Path("b")), None, (), "fail")
    assert runs.labels == ("a", "b")
    workload = check_gate_options(GateOptions(base_ref="x"), [], RunOptions(model="bert"))
    assert workload == GateRequest(None, "x", (), "pass")
    assert workload.labels == ("x", "this checkout")
    command = check_gate_options(GateOptions(base_ref="x", share=("data",)),
                                 ["python", "t.py"], RunOptions(),
                                 ConfineOptions(unconfined_reruns=True))
    assert command.command == ("python", "t.py") and command.runs is None
    (tmp_path / "before").mkdir()
    (tmp_path / "after.json").write_text("{}")
    with pytest.raises(BadInput, match=re.escape("not both (a command to measure goes after "
                                                 "--)")):
        check_gate_options(GateOptions(base_ref="x"),
                           [str(tmp_path / "before"), str(tmp_path / "after.json")])


@pytest.mark.parametrize(("run", "confine", "command", "kwargs", "message"), [
    (RunOptions(iters=5), ConfineOptions(), ["python", "t.py"], {},
     "a command is profiled with its defaults"),
    (RunOptions(), ConfineOptions(), [], {"share": ["data"]}, "--share goes with a COMMAND"),
    (RunOptions(), ConfineOptions(rerun_writable=("/tmp",)), [], {},
     "--rerun-writable and --unconfined-reruns go with a COMMAND"),
    (RunOptions(), ConfineOptions(), [], {"trials": 2},
     "--trials 2: a spread needs at least 3 trials"),
    (RunOptions(), ConfineOptions(), [], {"from_run": Path("r"), "out": Path("o")},
     "run options, a command and --out only apply without --from"),
    (RunOptions(), ConfineOptions(), ["python", "t.py"], {"from_run": Path("r")},
     "run options, a command and --out only apply without --from"),
])
def test_calibrate_options_are_checked_in_one_place(run: RunOptions, confine: ConfineOptions,
                                                    command: list[str], kwargs: dict[str, Any],
                                                    message: str) -> None:
    asked: dict[str, Any] = {"share": [], "trials": 8, "from_run": None, "out": None, **kwargs}
    with pytest.raises(BadInput, match=re.escape(message)):
        check_calibrate_options(run, confine, command, **asked)
    check_calibrate_options(RunOptions(model="bert"), ConfineOptions(), [], share=[],
                            trials=3, from_run=None, out=Path("o"))
    check_calibrate_options(RunOptions(), ConfineOptions(unconfined_reruns=True),
                            ["python", "t.py"], share=["data"], trials=3, from_run=None,
                            out=None)
    check_calibrate_options(RunOptions(), ConfineOptions(), [], share=[], trials=1,
                            from_run=Path("r"), out=None)


def test_profile_config_round_trips_through_run_json_and_the_child_env() -> None:
    """The parent hands the recorder its config in one variable, validated like run.json."""
    config = ProfileConfig(command=("python", "t.py"), warmup=1, timed=4, evidence_steps=2,
                           telemetry="basic", remedies=("tf32",), losses=3, seed=7)
    assert config_from_env(config_env(config)) == config
    assert config_from_env({}) == ProfileConfig()
    with pytest.raises(RunFileError, match="telemetry"):
        config_from_env({ENV_CONFIG: '{"telemetry": "loud"}'})


def test_a_profile_schedule_fits_a_short_script() -> None:
    asked = ProfileConfig(command=("x",))
    assert asked.fitted(3) is None
    fitted = asked.fitted(20)
    assert fitted is not None and fitted.steps_needed <= 20
    assert (fitted.warmup, fitted.evidence_steps, fitted.command) == (4, 3, ("x",))
