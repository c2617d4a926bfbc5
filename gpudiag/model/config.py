"""RunConfig and the presets: what decides what a run measures. Serialised into run.json."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

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
    ddp_no_sync: str = "correct"  # or "backward-only", the seed's misuse (forward outside)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def to_dict(self) -> dict[str, Any]:
        """JSON-native (tuples as lists), so a config survives a run.json round trip."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """The inverse of to_dict (for child processes such as DDP ranks)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["shape"] = ModelShape(**values["shape"])
        values["stages"] = tuple(values["stages"])
        return cls(**values)
