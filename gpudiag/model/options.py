"""Every option of `gpudiag run`, `gpudiag profile`, `gpudiag gate` and `calibrate`, defined once.

`RunOptions`, `ProfileOptions`, `GateOptions` (the gate's own; `gate --base-ref` takes the
run options too) and `ConfineOptions` (what runs away from the user's folder may write) are
what the user asked for, field by field, with the flag, help, range and choices beside each.
The command line's options are generated from them (gpudiag/cli/flags.py); `build_config`
validates a RunOptions into a `RunConfig` (gpudiag/measure/plan.py), `profile_config` a
ProfileOptions into a `ProfileConfig`, `check_gate_options` a gate's options and arguments into
a `GateRequest` and `check_calibrate_options` a calibration's; and `to_argv(options_of(config))`
turns a ladder config back into the arguments that rebuild it, for `--trials` children: one
spelling of each option, and tests/test_config.py checks the round trip.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from gpudiag.model.calibration import DEFAULT_CALIBRATION, MIN_CALIBRATION_TRIALS
from gpudiag.model.config import (
    AMP_DTYPES,
    DDP_NO_SYNC,
    HOST_SAMPLE_HZ,
    PRECISE_AFTER_STEPS,
    PROFILE_EVIDENCE_STEPS,
    PROFILE_TELEMETRY,
    TIMED_PRECISION,
    ProfileConfig,
    ProfileTelemetry,
    RunConfig,
    evidence_window,
)
from gpudiag.model.errors import BadInput
from gpudiag.model.remedies import FIX_SEED, REMEDIES

Check = Literal["", "positive", "non-negative"]
MAX_HOST_SAMPLE_HZ = 1000.0
# The most any option asks for, as a real job could need it; past these a run would only run
# until it is killed (`--iters 99999999999999999999`, `--min-seconds 1e300`), so they are bad
# input, said with the limit.
MAX_STEPS = 10_000_000  # timed, warm-up or steady steps: days of training at a millisecond
MAX_PROFILED_STEPS = 1_000  # a profiler window's: each step's trace is megabytes
MAX_SECONDS = 7 * 24 * 3600.0  # a week of timing a stage
MAX_TRIALS = 1_000  # fresh processes a side
MAX_PROCESSES = 1_024  # ranks or DataLoader workers on one node
MAX_NODES = 65_536
MAX_SAMPLES = 1_000_000_000  # samples a step trains on
MAX_TOKENS = 100_000_000  # a sample's
OnInconclusive = Literal["pass", "fail"]  # what an undecided gate exits with
ON_INCONCLUSIVE: tuple[OnInconclusive, ...] = ("pass", "fail")


@dataclass(frozen=True)
class OptionSpec:
    flag: str  # a boolean's may be "--on/--off"
    help: str
    aliases: tuple[str, ...] = ()  # other spellings: a short flag, an older name
    check: Check = ""
    choices: tuple[str, ...] = ()  # the values allowed (each element, for a tuple option)
    commas: bool = True  # a tuple option: each flag's value may list several, comma-separated
    most: float | None = None  # the largest value a number may take


def _option(default: Any, flag: str, help: str, *, aliases: tuple[str, ...] = (),
            check: Check = "", choices: tuple[str, ...] = (), commas: bool = True,
            most: float | None = None) -> Any:
    return field(default=default, metadata={
        "spec": OptionSpec(flag, help, aliases, check, choices, commas, most)})


@dataclass(frozen=True)
class RunOptions:
    """A `gpudiag run` as asked for. None means the preset's or this machine's default; field
    names are RunConfig's, so a config maps back onto options one to one."""

    model: str = _option("dgca", "--model", "Model name (gpudiag models) or "
                         "path/to/file.py:factory.", aliases=("-m",))
    preset: str | None = _option(None, "--preset", "full or tiny (default: full on CUDA, tiny "
                                 "on CPU).")
    device: str | None = _option(None, "--device", "cpu, cuda or cuda:N (default: cuda if "
                                 "available).")
    stages: tuple[str, ...] | None = _option(None, "--stages", "Comma-separated stages "
                                             "(default: the whole ladder).")
    batch_size: int | None = _option(None, "--batch-size", "Samples per step.",
                                     check="positive", most=MAX_SAMPLES)
    seq_len: int | None = _option(None, "--seq-len", "Tokens per sample.", check="positive",
                                  most=MAX_TOKENS)
    iters: int | None = _option(None, "--iters", "Timed steps per stage (at least), every "
                                "one timed; by default the preset's, ending from "
                                f"{PRECISE_AFTER_STEPS} once their median is known within "
                                f"+-{TIMED_PRECISION:.1%}.", check="positive",
                                most=MAX_STEPS)
    warmup: int | None = _option(None, "--warmup", "Untimed warm-up steps per stage.",
                                 check="non-negative", most=MAX_STEPS)
    min_seconds: float | None = _option(None, "--min-seconds", "Keep timing each stage at "
                                        "least this long (a stage without device work at "
                                        "most 1 s of it).", check="non-negative",
                                        most=MAX_SECONDS)
    amp_dtype: str | None = _option(None, "--amp-dtype", "Mixed-precision dtype (default: "
                                    "fp16 on CUDA; on a CPU bf16 where native, else fp32).",
                                    choices=AMP_DTYPES)
    loader_workers: int | None = _option(None, "--workers", "DataLoader workers (default: "
                                         "min(4, CPUs)).", check="non-negative",
                                         most=MAX_PROCESSES)
    prompt_length: int = _option(3, "--prompt-length", "dgca: prompt slots on each side of "
                                 "the sentence.", check="positive", most=MAX_TOKENS)
    evidence_steps: int | None = _option(None, "--evidence-steps", "Profiled steps per stage, "
                                         "run after all timing (0: none; default: 2, or 1 "
                                         "where a profiled step takes over 0.25 s).",
                                         check="non-negative",
                                         most=MAX_PROFILED_STEPS)
    checkpoint_every: int = _option(10, "--checkpoint-every", "Steps between saves in the "
                                    "checkpoint-* stages.", check="positive",
                                    most=MAX_STEPS)
    checkpoint_dir: str | None = _option(None, "--checkpoint-dir", "Where checkpoint-* "
                                         "stages save (default: <out>/checkpoints).")
    keep_checkpoints: bool = _option(False, "--keep-checkpoints", "Leave the checkpoint "
                                     "files in place.")
    nproc: int | None = _option(None, "--nproc", "ddp stage: processes on this node "
                                "(default: every visible GPU; 2 on a CPU).", check="positive",
                                most=MAX_PROCESSES)
    nnodes: int = _option(1, "--nnodes", "ddp stage: nodes taking part.", check="positive",
                          most=MAX_NODES)
    node_rank: int = _option(0, "--node-rank", "ddp stage: this node's rank.",
                             check="non-negative", most=MAX_NODES - 1)
    rdzv_endpoint: str | None = _option(None, "--rdzv-endpoint", "ddp stage: HOST:PORT of "
                                        "the rendezvous (several nodes).")
    ddp_sweep: bool = _option(False, "--ddp-sweep", "ddp stage: also try bucket size, "
                              "accumulation with no_sync, bucket views, static graph.")
    ddp_accum: int = _option(1, "--ddp-accum", "ddp stage: micro-steps per optimizer step.",
                             check="positive", most=MAX_STEPS)
    ddp_no_sync: str = _option("correct", "--ddp-no-sync", "ddp stage: 'correct' (forward "
                               "and backward under no_sync) or 'backward-only' (the common "
                               "mistake, to see what it costs).", choices=DDP_NO_SYNC)


@dataclass(frozen=True)
class ProfileOptions:
    """A `gpudiag profile` as asked for (the command itself is its argument, not an option)."""

    warmup: int = _option(5, "--warmup", "Steps before timing starts.", check="non-negative",
                          most=MAX_STEPS)
    timed: int = _option(30, "--timed", "Timed steps, before the profiler window.",
                         check="positive", most=MAX_STEPS)
    evidence_steps: int | None = _option(None, "--evidence-steps", "Profiled steps (the "
                                         "evidence window; 0: none; default: 3, fewer once "
                                         "they took 0.25 s).", aliases=("--steps",),
                                         check="non-negative",
                                         most=MAX_PROFILED_STEPS)
    telemetry: str = _option("full", "--telemetry", "GPU telemetry in the script: full (NVML "
                             "and GPM), basic (NVML only) or off.", choices=PROFILE_TELEMETRY)
    host_sample_hz: float = _option(HOST_SAMPLE_HZ, "--host-sample-hz", "How often the "
                                    "training thread's Python stack is sampled, for host time "
                                    "by line, at least (short steps raise it so the timed "
                                    "steps get ~200 samples, up to 400 Hz; 0: not sampled).",
                                    check="non-negative")
    samples_per_step: int | None = _option(None, "--samples-per-step", "Samples one step "
                                           "trains on (in each process, under torchrun), for "
                                           "throughput; default: the first DataLoader batch's "
                                           "size, else throughput is steps per second.",
                                           check="positive", most=MAX_SAMPLES)
    compile_lines: bool = _option(False, "--compile-lines", "Under torch.compile, charge "
                                  "Inductor's fused kernels to the source lines of the ops they "
                                  "fused (Inductor's provenance tracking: ~5% more compile "
                                  "time, and Inductor's cache entries made without it are not "
                                  "reused).")
    stop_after_window: bool = _option(False, "--stop-after-window", "End the script once the "
                                      "profiler window has closed and the diagnosis is "
                                      "written (a long job answers in minutes).")
    rerun: bool = _option(True, "--rerun/--no-rerun", "When the script ends before the "
                          "profiler window, run it once more with a schedule that fits its "
                          "length.")
    try_fixes: bool = _option(False, "--try-fixes", "After the diagnosis, run the script "
                              "again with each fix its findings call for applied (no file "
                              "edited) and report what each buys, measured, and whether the "
                              "losses stay the same. Every run stops after its profiler "
                              "window.")
    fixes: tuple[str, ...] = _option((), "--fix", "With --try-fixes, also try this fix "
                                     "whatever the findings say. Repeat, or separate with "
                                     "commas.", choices=tuple(REMEDIES))


@dataclass(frozen=True)
class ConfineOptions:
    """Where gpudiag runs the user's command away from its folder (a short script's second
    run, --try-fixes' runs, the trials of `gate --base-ref REF -- COMMAND` and of
    `calibrate -- COMMAND`), what those runs may write besides their own place
    (gpudiag/measure/confine.py)."""

    rerun_writable: tuple[str, ...] = _option((), "--rerun-writable", "A folder outside the "
                                              "working directory that runs gpudiag makes in a "
                                              "copy or a temporary checkout may write (an "
                                              "absolute output path of the script's that "
                                              "holds nothing of yours). Repeat.", commas=False)
    unconfined_reruns: bool = _option(False, "--unconfined-reruns", "Where the kernel cannot "
                                      "confine those runs to their copy or checkout (no Linux "
                                      "Landlock), run them anyway: a file of yours they write "
                                      "changes (a profile's re-runs list those afterwards).")


@dataclass(frozen=True)
class GateOptions:
    """A `gpudiag gate`'s own options: what it reads or measures, its limits, and what an
    undecided gate exits with. The counters --max-regression names are
    gpudiag.diagnose.counters.COUNTER_NAMES (tests/test_config.py checks the help lists them)."""

    base_ref: str | None = _option(None, "--base-ref", "Measure this git ref (a temporary "
                                   "worktree) and this checkout here, interleaved, instead of "
                                   "reading two runs: gpudiag's workload (the run options), or "
                                   "your command after -- (each trial a gpudiag profile of "
                                   "it).")
    share: tuple[str, ...] = _option((), "--share", "With --base-ref -- COMMAND: a path "
                                     "under the working directory that git does not hold "
                                     "(data, a tokenizer), linked into both sides' checkouts "
                                     "for the command to read. Repeat.", commas=False)
    samples_per_step: int | None = _option(None, "--samples-per-step", "With --base-ref -- "
                                           "COMMAND: samples one step trains on, for "
                                           "throughput (default: the first DataLoader batch's "
                                           "size, else steps per second).", check="positive",
                                           most=MAX_SAMPLES)
    trials: int = _option(1, "--trials", "With --base-ref: trials a side to start with.",
                          most=MAX_TRIALS)
    max_trials: int = _option(5, "--max-trials", "With --base-ref: add trials while the gate "
                              "is inconclusive, up to this many a side.", most=MAX_TRIALS)
    on_inconclusive: str = _option("pass", "--on-inconclusive", "What an undecided gate exits "
                                   "with: pass (0, the summary says what it could not see) or "
                                   "fail (3).")
    max_regression: tuple[str, ...] = _option(
        (), "--max-regression", "Allowed loss in percent: PCT (wall time, all stages), "
        "STAGE=PCT, METRIC=PCT or STAGE:METRIC=PCT; METRIC: wall, device, energy, or an exact "
        "counter (ops, launches, kernels, syncs, copies, copy-bytes, flops, memory, graphs, "
        "graph-breaks; 0 = no increase). Repeat.", commas=False)
    min_iters: int = _option(10, "--min-iters", "Steady-state steps a side needs per stage.",
                             check="positive", most=MAX_STEPS)
    allow_mismatch: bool = _option(False, "--allow-mismatch/--no-allow-mismatch", "Gate runs "
                                   "of different model, preset, batch, precision, stages, GPU, "
                                   "driver or torch anyway.")
    # RUF009: ruff knows str and int for immutable, not Path; `_option` is a field() anyway.
    calibration: Path | None = _option(  # noqa: RUF009
        None, "--calibration", "This machine's between-process spread (`gpudiag calibrate`); "
        f"default {DEFAULT_CALIBRATION} when it exists, else the device kind's built-in "
        "floors.")


@dataclass(frozen=True)
class GateRequest:
    """What a checked `gpudiag gate` compares, and what it exits with undecided: two recorded
    runs (BASELINE and CURRENT), or, with --base-ref, trials of both sides measured here
    (gpudiag's workload, or the user's command)."""

    runs: tuple[Path, Path] | None  # BASELINE and CURRENT; None with --base-ref
    base_ref: str | None
    command: tuple[str, ...]  # with --base-ref: the user's command; () for gpudiag's workload
    on_inconclusive: OnInconclusive

    @property
    def labels(self) -> tuple[str, str]:
        """The two sides as the gate's output names them."""
        if self.runs is None:
            return str(self.base_ref), "this checkout"
        return str(self.runs[0]), str(self.runs[1])


def check_gate_options(options: GateOptions, given: Sequence[str],
                       run_options: RunOptions = RunOptions(),
                       confine: ConfineOptions = ConfineOptions()) -> GateRequest:
    """A gate's options and arguments checked, each error one line naming its flag: what it
    compares (`given`: BASELINE and CURRENT, or with --base-ref the user's command, none for
    gpudiag's workload with `run_options`), the options' ranges, and the options that go with
    one of those alone. (The limits' grammar is checked where the metrics are known:
    gpudiag.diagnose.gate.parse_limits.)"""
    _check_gate_arguments(options.base_ref, given)
    if options.on_inconclusive not in ON_INCONCLUSIVE:
        raise BadInput(f"--on-inconclusive {options.on_inconclusive!r}: expected pass or fail")
    check_ranges(options)
    if not 1 <= options.trials <= options.max_trials:
        raise BadInput(f"--trials {options.trials} and --max-trials {options.max_trials}: need "
                       "1 <= trials <= max-trials")
    runs = None
    if options.base_ref is None:
        if len(given) < 2:
            raise BadInput("give BASELINE and CURRENT (two runs), or --base-ref REF to measure "
                           "both")
        if run_options != RunOptions():
            raise BadInput("run options (--model, --stages, ...) only apply with --base-ref")
        runs = (Path(given[0]), Path(given[1]))
    command = tuple(given) if options.base_ref is not None else ()
    if command and run_options != RunOptions():
        raise BadInput("run options (--model, --stages, ...) measure gpudiag's workload; a "
                       "command after -- is measured with gpudiag profile's defaults")
    if not command and (options.share or options.samples_per_step is not None):
        raise BadInput("--share and --samples-per-step go with --base-ref REF -- COMMAND")
    check_confine_options(confine, command)
    return GateRequest(runs, options.base_ref, command,
                       "pass" if options.on_inconclusive == "pass" else "fail")


def _check_gate_arguments(base_ref: str | None, given: Sequence[str]) -> None:
    """A gate's arguments are two runs, or with --base-ref a command: neither both nor more."""
    if base_ref is not None and len(given) == 2 and all(_a_run(Path(g)) for g in given):
        raise BadInput("give either BASELINE and CURRENT or --base-ref, not both (a command "
                       "to measure goes after --)")
    if base_ref is None and len(given) > 2:
        raise BadInput(f"expected BASELINE and CURRENT, got {len(given)} paths; a command to "
                       "measure goes after --base-ref REF --")


def _a_run(path: Path) -> bool:
    """Whether a gate's argument names a run (a directory or a .json file), not a command."""
    return path.is_dir() or (path.suffix == ".json" and path.is_file())


def check_confine_options(confine: ConfineOptions, command: Sequence[str]) -> None:
    """What runs of the user's command may write is said only where there is a command."""
    if not command and confine != ConfineOptions():
        raise BadInput("--rerun-writable and --unconfined-reruns go with a COMMAND")


def check_calibrate_options(run_options: RunOptions, confine: ConfineOptions,
                            command: Sequence[str], *, share: Sequence[str], trials: int,
                            from_run: Path | None, out: Path | None) -> None:
    """`gpudiag calibrate`'s arguments checked, each error one line: what it measures
    (gpudiag's workload with `run_options`, the user's `command`, or nothing: the trials of an
    earlier run, `from_run`) and the options that go with each."""
    if command and run_options != RunOptions():
        raise BadInput("run options (--model, ...) measure gpudiag's workload; a command is "
                       "profiled with its defaults")
    if share and not command:
        raise BadInput("--share goes with a COMMAND")
    check_confine_options(confine, command)
    check_most("--trials", trials, MAX_TRIALS)
    if from_run is None and trials < MIN_CALIBRATION_TRIALS:
        raise BadInput(f"--trials {trials}: a spread needs at least {MIN_CALIBRATION_TRIALS} "
                       "trials")
    if from_run is not None and (run_options != RunOptions() or out is not None or command):
        raise BadInput("run options, a command and --out only apply without --from")


def profile_config(options: ProfileOptions, command: Sequence[str]) -> ProfileConfig:
    """The config a `gpudiag profile` runs `command` with, its options checked. Every run of
    a --try-fixes stops after its window, shares a seed and records its first losses."""
    check_ranges(options)
    if options.fixes and not options.try_fixes:
        raise BadInput("--fix goes with --try-fixes")
    if options.host_sample_hz > MAX_HOST_SAMPLE_HZ:
        raise BadInput(f"--host-sample-hz must be at most {MAX_HOST_SAMPLE_HZ:.0f} (the "
                       f"sampler would cost the script its own time); got "
                       f"{options.host_sample_hz:g}")
    steps, budget = evidence_window(options.evidence_steps, PROFILE_EVIDENCE_STEPS)
    return ProfileConfig(
        command=tuple(command), warmup=options.warmup, timed=options.timed,
        evidence_steps=steps, evidence_budget_s=budget,
        telemetry=typing.cast(ProfileTelemetry, options.telemetry),  # its choices are checked
        host_sample_hz=options.host_sample_hz, compile_lines=options.compile_lines,
        samples_per_step=options.samples_per_step,
        stop_after_window=options.stop_after_window or options.try_fixes,
        losses=max(1, options.warmup) if options.try_fixes else 0,
        seed=FIX_SEED if options.try_fixes else None)


Options = RunOptions | ProfileOptions | GateOptions | ConfineOptions
OptionsT = TypeVar("OptionsT", RunOptions, ProfileOptions, GateOptions, ConfineOptions)


def option_fields(cls: type[Options] = RunOptions
                  ) -> list[tuple[dataclasses.Field[Any], OptionSpec, Any]]:
    """(field, spec, type hint) of every option of `cls`, in declaration order."""
    hints = typing.get_type_hints(cls)
    return [(f, f.metadata["spec"], hints[f.name]) for f in dataclasses.fields(cls)]


def check_ranges(options: Options) -> None:
    """Each option's declared range and choices, as a one-line BadInput naming its flag."""
    for f, spec, _ in option_fields(type(options)):
        value = getattr(options, f.name)
        if value is None or isinstance(value, bool):
            continue
        _check_choices(spec, value)
        if isinstance(value, float) and not math.isfinite(value):
            raise BadInput(f"{spec.flag} must be a finite number (got {value})")
        if spec.check == "positive" and value <= 0:
            raise BadInput(f"{spec.flag} must be positive (got {value})")
        if spec.check == "non-negative" and value < 0:
            raise BadInput(f"{spec.flag} must be zero or more (got {value})")
        check_most(spec.flag, value, spec.most)


MAX_SAID_DIGITS = 40  # a longer number is said by its length


def check_most(flag: str, value: float, most: float | None) -> None:
    """A number past the most a real job could ask for, as a one-line BadInput."""
    if most is not None and value > most:
        said = f"{int(most):,}" if float(most).is_integer() else f"{most:,}"
        got = str(value) if len(str(value)) <= MAX_SAID_DIGITS else f"{len(str(value))} digits"
        raise BadInput(f"{flag} must be at most {said} (got {got})")


def _check_choices(spec: OptionSpec, value: Any) -> None:
    if not spec.choices:
        return
    for item in value if isinstance(value, tuple) else (value,):
        if item not in spec.choices:
            raise BadInput(f"{spec.flag} must be one of {', '.join(spec.choices)} "
                           f"(got {item!r})")


def options_of(config: RunConfig) -> RunOptions:
    """The options that rebuild `config`: every one pinned to the value it resolved to, but
    the window's steps where a budget may cut them and the timed steps where a precise median
    may (pinned, they would be run whole)."""
    options = RunOptions(**{f.name: getattr(config, f.name)
                            for f in dataclasses.fields(RunOptions)})
    if config.evidence_budget_s is not None:
        options = dataclasses.replace(options, evidence_steps=None)
    if config.timed_precision is not None:
        options = dataclasses.replace(options, iters=None)
    return options


def to_argv(options: RunOptions) -> list[str]:
    """`gpudiag run` arguments for `options` (defaults left out)."""
    argv: list[str] = []
    for f, spec, _ in option_fields():
        value = getattr(options, f.name)
        if value is None or value == f.default:
            continue
        if isinstance(value, bool):
            argv.append(spec.flag)
        elif isinstance(value, tuple):
            argv += [spec.flag, ",".join(value)]
        else:
            argv += [spec.flag, str(value)]
    return argv
