"""Every option of `gpudiag run`, defined once.

`RunOptions` is what the user asked for, field by field, with its flag, help and range beside
it. The command line's `run` options are generated from it (gpudiag/cli.py), `build_config`
validates it into a `RunConfig` (gpudiag/measure/plan.py), and `to_argv(options_of(config))`
turns a config back into the arguments that rebuild it, for `--trials` children: one spelling
of each option, and tests/test_config.py checks the round trip.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from gpudiag.model.config import RunConfig
from gpudiag.model.errors import BadInput

Check = Literal["", "positive", "non-negative"]


@dataclass(frozen=True)
class OptionSpec:
    flag: str
    help: str
    short: str | None = None
    check: Check = ""


def _option(default: Any, flag: str, help: str, *, short: str | None = None,
            check: Check = "") -> Any:
    return field(default=default, metadata={"spec": OptionSpec(flag, help, short, check)})


@dataclass(frozen=True)
class RunOptions:
    """A `gpudiag run` as asked for. None means the preset's or this machine's default; field
    names are RunConfig's, so a config maps back onto options one to one."""

    model: str = _option("dgca", "--model", "Model name (gpudiag models) or "
                         "path/to/file.py:factory.", short="-m")
    preset: str | None = _option(None, "--preset", "full or tiny (default: full on CUDA, tiny "
                                 "on CPU).")
    device: str | None = _option(None, "--device", "cpu, cuda or cuda:N (default: cuda if "
                                 "available).")
    stages: tuple[str, ...] | None = _option(None, "--stages", "Comma-separated stages "
                                             "(default: the whole ladder).")
    batch_size: int | None = _option(None, "--batch-size", "Samples per step.",
                                     check="positive")
    seq_len: int | None = _option(None, "--seq-len", "Tokens per sample.", check="positive")
    iters: int | None = _option(None, "--iters", "Timed steps per stage (at least).",
                                check="positive")
    warmup: int | None = _option(None, "--warmup", "Untimed warm-up steps per stage.",
                                 check="non-negative")
    min_seconds: float | None = _option(None, "--min-seconds", "Keep timing each stage at "
                                        "least this long.", check="non-negative")
    amp_dtype: str | None = _option(None, "--amp-dtype", "Mixed-precision dtype: fp16, bf16 "
                                    "or fp32 (default: fp16 on CUDA; on a CPU bf16 where "
                                    "native, else fp32).")
    loader_workers: int | None = _option(None, "--workers", "DataLoader workers (default: "
                                         "min(4, CPUs)).", check="non-negative")
    prompt_length: int = _option(3, "--prompt-length", "dgca: prompt slots on each side of "
                                 "the sentence.", check="positive")
    evidence_steps: int | None = _option(None, "--evidence-steps", "Profiled steps per stage, "
                                         "run after all timing (0: none; default 2).",
                                         check="non-negative")
    checkpoint_every: int = _option(10, "--checkpoint-every", "Steps between saves in the "
                                    "checkpoint-* stages.", check="positive")
    checkpoint_dir: str | None = _option(None, "--checkpoint-dir", "Where checkpoint-* "
                                         "stages save (default: <out>/checkpoints).")
    keep_checkpoints: bool = _option(False, "--keep-checkpoints", "Leave the checkpoint "
                                     "files in place.")
    nproc: int | None = _option(None, "--nproc", "ddp stage: processes on this node "
                                "(default: every visible GPU; 2 on a CPU).", check="positive")
    nnodes: int = _option(1, "--nnodes", "ddp stage: nodes taking part.", check="positive")
    node_rank: int = _option(0, "--node-rank", "ddp stage: this node's rank.",
                             check="non-negative")
    rdzv_endpoint: str | None = _option(None, "--rdzv-endpoint", "ddp stage: HOST:PORT of "
                                        "the rendezvous (several nodes).")
    ddp_sweep: bool = _option(False, "--ddp-sweep", "ddp stage: also try bucket size, "
                              "accumulation with no_sync, bucket views, static graph.")
    ddp_accum: int = _option(1, "--ddp-accum", "ddp stage: micro-steps per optimizer step.",
                             check="positive")
    ddp_no_sync: str = _option("correct", "--ddp-no-sync", "ddp stage: 'correct' (forward "
                               "and backward under no_sync) or 'backward-only' (the common "
                               "mistake, to see what it costs).")


def option_fields() -> list[tuple[dataclasses.Field[Any], OptionSpec, Any]]:
    """(field, spec, type hint) of every option, in declaration order."""
    hints = typing.get_type_hints(RunOptions)
    return [(f, f.metadata["spec"], hints[f.name]) for f in dataclasses.fields(RunOptions)]


def check_ranges(options: RunOptions) -> None:
    """Each option's declared range, as a one-line BadInput naming its flag."""
    for f, spec, _ in option_fields():
        value = getattr(options, f.name)
        if value is None or isinstance(value, bool) or not spec.check:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise BadInput(f"{spec.flag} must be a finite number (got {value})")
        if spec.check == "positive" and value <= 0:
            raise BadInput(f"{spec.flag} must be positive (got {value})")
        if spec.check == "non-negative" and value < 0:
            raise BadInput(f"{spec.flag} must be zero or more (got {value})")


def options_of(config: RunConfig) -> RunOptions:
    """The options that rebuild `config`: every one pinned to the value it resolved to."""
    return RunOptions(**{f.name: getattr(config, f.name) for f in dataclasses.fields(RunOptions)})


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
