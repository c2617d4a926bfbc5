"""What decides what a run measures, per mode: `RunConfig` (the ladder of `gpudiag run`) and
`ProfileConfig` (`gpudiag profile` of a user's command), and the ladder's presets. Serialised
into run.json as `config`; `AnyConfig` tells the two apart on load by their `mode`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Tag

# The ddp stage's no_sync use: "correct" (forward and backward under no_sync) or
# "backward-only", the seed's misuse (forward outside).
DdpNoSync = Literal["correct", "backward-only"]
DDP_NO_SYNC = ("correct", "backward-only")
# profile: GPU telemetry inside the script, NVML and GPM, NVML only, or none.
ProfileTelemetry = Literal["full", "basic", "off"]
PROFILE_TELEMETRY = ("full", "basic", "off")

# "fp32": no autocast, for CPUs without native bf16 (and by request).
AmpDtype = Literal["fp16", "bf16", "fp32"]
AMP_DTYPES = ("fp16", "bf16", "fp32")


# Stages that others refer to by name: the ladder's compute-bound rung, which other training
# stages are held against (rules, the terminal's "vs" column), and the device-ceiling stage.
REFERENCE_STAGE = "train-fp16"
PEAK_STAGE = "peak"

# Telemetry sampling: fast NVML metrics every 50 ms, GPM every 200 ms (GPM needs a window of
# at least 100 ms: gpudiag/measure/telemetry/sampler.py).
SAMPLE_PERIOD_S = 0.05
GPM_PERIOD_S = 0.2
DEFAULT_EVIDENCE_STEPS = 2  # profiled steps per stage, after all timing (0: no evidence)
PROFILE_EVIDENCE_STEPS = 3  # a profiled script's window, at most
# A window profiles no further step once its steps took this long on the host (it profiles at
# least one). What the rules read are per-step means, which one long step gives as well as
# three, and a window costs ~5x its steps' host time afterwards (torch's collection and
# export, the parse and analysis: per-tensor optimizer on an H100, 1.8 s of steps in an 8.7 s
# window, reports/examples/benchmarks/h100-window-phases-after.json). At 0.5 s that script's
# first profiled step (8,205 kernels) was under budget on the host, its kernels still queued,
# and it profiled two (h100-window-budget.json). A number of steps the user asks for is
# profiled whole (budget None), as every window was before this budget.
WINDOW_BUDGET_S = 0.25


# A stage's timed steps end before its preset's count, at PRECISE_AFTER_STEPS or later (and
# after --min-seconds), once their median is known within +-TIMED_PRECISION at 95%: the
# distribution-free interval between the median's order statistics (measure/timing.py). The
# ladder's fp32 training rung on an H100 (240 ms steps, interquartile range 0.1-0.6%) is known
# to +-0.3% after 15 steps and ran 30, 7.2 s of the ladder's ~60; its noisier rungs (IQR 3-10%)
# run their 30 as before. 15 is below the reference ladder's 20-25 steps only where the
# interval says the median no longer moves. An --iters the user gives is run whole.
TIMED_PRECISION = 0.005
PRECISE_AFTER_STEPS = 15


def timed_steps(asked: int | None, default: int) -> tuple[int, float | None]:
    """A stage's timed steps and the precision that may end them early: the preset's count
    with TIMED_PRECISION, or the number the user asked for (--iters), timed whole."""
    return (default, TIMED_PRECISION) if asked is None else (asked, None)


def evidence_window(asked: int | None, default: int) -> tuple[int, float | None]:
    """A window's steps and budget: the default number, cut by the budget, or the number the
    user asked for (--evidence-steps), profiled whole."""
    return (default, WINDOW_BUDGET_S) if asked is None else (asked, None)


@dataclass(frozen=True)
class ModelShape:
    """Transformer dimensions shared by the built-in models."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int = 512


# bert-base-chinese, the backbone of DGCA-ReLM (docs/field-cases.md#case-1;
# https://huggingface.co/google-bert/bert-base-chinese).
BERT_BASE_CHINESE = ModelShape(
    vocab_size=21128, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072
)
# Small enough that the whole ladder runs in seconds on two CPU cores, large enough that every
# code path (LSTM prompt encoder, K candidates, vocabulary fusion) is exercised.
TINY_SHAPE = ModelShape(
    vocab_size=1000, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=256,
    max_positions=128,
)


@dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    shape: ModelShape
    batch_size: int
    seq_len: int
    iters: int
    warmup: int
    # Stages also run until this much time has passed: NVML's energy counter refreshes every
    # ~100 ms, so a window of several seconds keeps the energy quantum to a few percent.
    min_seconds: float


PRESETS: dict[str, Preset] = {
    "full": Preset(
        name="full",
        summary="bert-base-chinese shape, batch 128, seq 128 (the seed's setting)",
        shape=BERT_BASE_CHINESE, batch_size=128, seq_len=128, iters=30, warmup=5, min_seconds=3.0,
    ),
    "tiny": Preset(
        name="tiny",
        summary="2 layers, hidden 64, batch 8, seq 64: the whole ladder in seconds on a CPU",
        shape=TINY_SHAPE, batch_size=8, seq_len=64, iters=10, warmup=2, min_seconds=0.0,
    ),
}


@dataclass(frozen=True)
class RunConfig:
    """Everything that decides what a run measures. Serialised into run.json as `config`."""

    model: str
    preset: str
    device: str
    stages: tuple[str, ...]
    shape: ModelShape
    batch_size: int
    seq_len: int
    iters: int
    warmup: int
    min_seconds: float
    amp_dtype: AmpDtype = "fp16"
    loader_workers: int = 4
    prompt_length: int = 3
    candidates: int = 16
    evidence_steps: int = DEFAULT_EVIDENCE_STEPS  # profiled steps per stage, after all timing
    # Fewer steps once they took this long; None (runs from before it): all of them.
    evidence_budget_s: float | None = None
    # Fewer timed steps than `iters` once their median is known this well (TIMED_PRECISION);
    # None (runs from before it, or --iters given): every one of them.
    timed_precision: float | None = None
    sample_period_s: float = SAMPLE_PERIOD_S
    gpm_period_s: float = GPM_PERIOD_S
    seed: int = 0
    checkpoint_every: int = 10  # steps between saves in the checkpoint-* stages
    checkpoint_dir: str | None = None  # None: <run dir>/checkpoints
    keep_checkpoints: bool = False
    # The ddp stage: processes per node (None: every visible GPU, or 2 on a CPU), rendezvous
    # for several nodes, and the optional sweep of DDP knobs.
    nproc: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    ddp_sweep: bool = False
    ddp_accum: int = 1  # micro-steps per optimizer step
    ddp_no_sync: DdpNoSync = "correct"
    mode: Literal["ladder"] = "ladder"

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def batch(self) -> int | None:
        """Samples per step the config asks for (a profiled script's are its own)."""
        return self.batch_size

    def identity(self) -> dict[str, object]:
        """What two runs must share to be compared or merged as trials: the work measured."""
        return {"mode": self.mode, "model": self.model, "preset": self.preset,
                "batch_size": self.batch_size, "seq_len": self.seq_len}

    def settings(self) -> dict[str, object]:
        """The identity and the settings a comparison should mention when they differ."""
        return {**self.identity(), "amp_dtype": self.amp_dtype,
                "loader_workers": self.loader_workers}


# Host samples per second in a profiled script (gpudiag/measure/profile/inscript/hostsampler.py). A
# sample costs the training thread ~90 us on an H100 host (signal, handler, cold caches; its
# handler 57 us median): at 50 Hz ~0.35% of a 2 ms host-bound step, measured side by side at
# 0.7% (95% CI -0.4% .. 1.6%) (benchmarks/host_sampler.py,
# reports/examples/h100-host/README.md).
HOST_SAMPLE_HZ = 50.0
MIN_FITTED_STEPS = 4  # a script this short still gets warm-up 1, timed 2, profiled 1


@dataclass(frozen=True)
class ProfileConfig:
    """A `gpudiag profile` of a user's command, as measured. Serialised into run.json as
    `config`, and handed to the recorder inside the script (gpudiag/measure/profile/).

    The schedule: steps [0, warmup) warm up, [warmup, warmup + timed) are timed, the next
    `evidence_steps` are the profiler window."""

    command: tuple[str, ...] = ()
    warmup: int = 5
    timed: int = 30
    evidence_steps: int = PROFILE_EVIDENCE_STEPS
    # Fewer steps once they took this long; None (runs from before it): all of them.
    evidence_budget_s: float | None = None
    telemetry: ProfileTelemetry = "full"
    host_sample_hz: float = HOST_SAMPLE_HZ  # the training thread's stack; 0: not sampled
    compile_lines: bool = False  # Inductor's provenance on: compiled kernels by source line
    stop_after_window: bool = False  # end the script once its window has closed
    # Samples per step as the user declared them (--samples-per-step); else the first batch a
    # DataLoader yields says, and without one the step itself is the unit.
    samples_per_step: int | None = None
    # --try-fixes: remedies applied in the script (gpudiag.model.remedies names), the first
    # backward() losses to record, and a seed set before the script runs (its own wins).
    remedies: tuple[str, ...] = ()
    losses: int = 0
    seed: int | None = None
    # The larger-batch remedy's ask: the training DataLoader's batch_size times this, that
    # loader known by the line that built it in the diagnosis run (None: any map-style one).
    batch_factor: int = 2
    batch_site: str | None = None
    mode: Literal["profile"] = "profile"

    @property
    def batch(self) -> int | None:
        return None

    @property
    def steps_needed(self) -> int:
        return self.warmup + self.timed + self.evidence_steps

    def identity(self) -> dict[str, object]:
        return {"mode": self.mode}

    def settings(self) -> dict[str, object]:
        return {**self.identity(), "command": " ".join(self.command), "warmup": self.warmup,
                "timed": self.timed, "evidence_steps": self.evidence_steps}

    def fitted(self, made: int) -> ProfileConfig | None:
        """This schedule shrunk to fit a script that made `made` steps, or None when it is too
        short to time and profile at all. Warm-up keeps a fifth of the steps (at least one, for
        first-step costs), the window up to this schedule's size and a sixth, the rest is timed;
        one step is left spare for scripts whose step count varies a little."""
        if made < MIN_FITTED_STEPS:
            return None
        spare = 1 if made >= 2 * MIN_FITTED_STEPS else 0
        evidence = max(1, min(self.evidence_steps, made // 6))
        warmup = max(1, min(self.warmup, math.floor(made / 5)))
        timed = made - spare - warmup - evidence
        if timed < 2:
            return None
        return dataclasses.replace(self, warmup=warmup, timed=timed, evidence_steps=evidence)


def _mode(data: Any) -> str:
    """A config's mode; run.json files from before `mode` was written hold ladder configs."""
    mode = data.get("mode") if isinstance(data, dict) else getattr(data, "mode", None)
    return "profile" if mode == "profile" else "ladder"


# run.json's `config`: either mode, told apart by `mode` when validated (gpudiag.model.schema).
AnyConfig = Annotated[
    Annotated[RunConfig, Tag("ladder")] | Annotated[ProfileConfig, Tag("profile")],
    Discriminator(_mode),
]
