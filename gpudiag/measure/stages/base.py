"""A stage is a named function that builds a workload; the runner owns timing and telemetry."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from gpudiag.measure.interrupts import STOP_SIGNALS
from gpudiag.measure.models import Example, ModelBundle, ModelOptions, ModelSpec
from gpudiag.measure.timing import PhaseRecorder
from gpudiag.model.config import RunConfig
from gpudiag.model.facts import StageFacts
from gpudiag.model.results import StageResult, StageRole

# Enough examples that no stage runs out (a map-style dataset of this length allocates nothing).
DATASET_LENGTH = 10_000_000
PREFETCH_FACTOR = 2
POOL_BATCHES = 4  # distinct batches a preloaded dataset holds


class StageSkipped(Exception):
    """Raised by a stage that does not apply to this model or machine; the message says why."""


@dataclass
class Workload:
    """One step function and what a step processes."""

    step: Callable[[], None]
    samples_per_step: int
    tokens_per_step: int
    description: str
    host_only: bool = False  # no device work: time with the host clock
    facts: StageFacts = field(default_factory=StageFacts)  # bursty steps, precision, loader...
    # Stages whose steps run the same operators on the same shapes share one FLOP count
    # (the runner's), whatever their precision or the batch's source: train, train-fp16 and
    # data-train counted 10,273,092,009,984 each on an H100 (reports/examples/h100-dgca-schema3).
    flops_key: tuple[str, ...] | None = None
    close: Callable[[], None] = lambda: None
    min_iters: int = 0  # timed steps the stage needs whatever --iters says (e.g. several saves)
    # Called once warm-up is over, and after the timed steps to add what they recorded to the
    # stage's facts: per-step records that only the timed window should hold.
    on_timed_start: Callable[[], None] = lambda: None
    record_timed: Callable[[StageFacts], None] = lambda facts: None


@dataclass
class StageContext:
    config: RunConfig
    device: torch.device
    spec: ModelSpec
    phases: PhaseRecorder
    # FLOPs per step by Workload.flops_key, counted once a run.
    flops_counted: dict[tuple[str, ...], int] = field(default_factory=dict)

    @property
    def options(self) -> ModelOptions:
        c = self.config
        return ModelOptions(shape=c.shape, seq_len=c.seq_len, prompt_length=c.prompt_length,
                            candidates=c.candidates, seed=c.seed)

    @property
    def amp_dtype(self) -> torch.dtype:
        return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.config.amp_dtype,
                                                                   torch.float32)

    def bundle(self, variant: str | None = None, *, weights: bool = True) -> ModelBundle:
        """Build the model (a variant of it, for the full-* stages) with reproducible weights.

        `weights=False` builds on the meta device: for stages that only need the data.
        """
        if variant is None:
            factory = self.spec.build
        elif variant in self.spec.variants:
            factory = self.spec.variants[variant]
        else:
            raise StageSkipped(f"model {self.spec.name!r} has no {variant!r} variant")
        torch.manual_seed(self.config.seed)
        with torch.device(self.device if weights else "meta"):
            bundle = factory(self.options)
        if weights:
            bundle.model.to(self.device)
        return bundle

    def batch(self, bundle: ModelBundle, keys: tuple[str, ...] | None = None) -> Example:
        """One synthetic batch on the device, reused by every step (no data-loading cost)."""
        batch = bundle.rows(0, self.config.batch_size)
        return {k: v.to(self.device) for k, v in batch.items() if keys is None or k in keys}

    def loader(self, bundle: ModelBundle) -> DataLoader[Example]:
        """A real DataLoader over the model's synthetic examples, configured as we advise."""
        workers = self.config.loader_workers
        return _WorkersStartQuietly(
            _PreloadedDataset(bundle.rows(0, POOL_BATCHES * self.config.batch_size)),
            batch_size=self.config.batch_size,
            num_workers=workers,
            pin_memory=self.device.type == "cuda",
            drop_last=True,
            persistent_workers=workers > 0,
            prefetch_factor=PREFETCH_FACTOR if workers > 0 else None,
            worker_init_fn=_leave_stopping_to_the_main_process if workers > 0 else None,
        )

    def autocast(self, enabled: bool = True) -> AbstractContextManager[Any]:
        if not enabled or self.config.amp_dtype == "fp32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def to_device(self, batch: Example) -> Example:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}


class _PreloadedDataset(Dataset[Example]):
    """Tokenised examples held in memory, as the seed's `--preload_data` fix did: items are row
    views, so the loader's cost is batching, collation and pinning, not example generation."""

    def __init__(self, pool: Example) -> None:
        self.pool = pool
        self.pool_size = len(next(iter(pool.values())))

    def __len__(self) -> int:
        return DATASET_LENGTH

    def __getitem__(self, index: int) -> Example:
        row = index % self.pool_size
        return {k: v[row] for k, v in self.pool.items()}


class _WorkersStartQuietly(DataLoader[Example]):
    """Its workers are forked with SIGINT and SIGTERM blocked, until their worker_init_fn
    ignores them: a stop to the process group that lands between a worker's fork and its
    init (the moment a stage starts) raised KeyboardInterrupt in multiprocessing's
    _after_fork, a traceback on the terminal (seen on a loaded CI machine). The main process
    gets a stop held meanwhile as soon as its workers are started."""

    def _get_iterator(self) -> Any:  # DataLoader's one place that starts workers
        if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks (nor fork)
            return super()._get_iterator()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            return super()._get_iterator()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _leave_stopping_to_the_main_process(_worker_id: int) -> None:
    # Ctrl-C (and a SIGTERM to the process group) reaches the workers too; the main process
    # shuts them down, so workers must neither raise KeyboardInterrupt (the traceback storm of
    # docs/field-cases.md#case-5) nor die first (the main process would then raise "DataLoader
    # worker killed by signal" in the middle of writing its partial results). A worker whose
    # main process is gone exits by itself (torch's worker watchdog). Started with both
    # blocked (_WorkersStartQuietly): ignored first, then unblocked, so one that came
    # meanwhile is dropped.
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


StageFunction = Callable[[StageContext], Workload]
# A stage that runs itself elsewhere (the ddp stage's ranks) and returns its finished result.
LaunchFunction = Callable[[StageContext], StageResult]


@dataclass(frozen=True)
class StageDef:
    name: str
    title: str
    build: StageFunction | None = None
    launch: LaunchFunction | None = None
    role: StageRole = "step"  # copied onto the stage's result (gpudiag.model.results)


_STAGES: dict[str, StageDef] = {}


def stage(name: str, title: str, *, role: StageRole = "step",
          ) -> Callable[[StageFunction], StageFunction]:
    """Register a stage under `name`, playing `role` for the others."""

    def register(fn: StageFunction) -> StageFunction:
        _STAGES[name] = StageDef(name=name, title=title, build=fn, role=role)
        return fn

    return register


def launched_stage(name: str, title: str, *, role: StageRole = "step",
                   ) -> Callable[[LaunchFunction], LaunchFunction]:
    """Register a stage that runs in its own processes and times itself (see StageDef)."""

    def register(fn: LaunchFunction) -> LaunchFunction:
        _STAGES[name] = StageDef(name=name, title=title, launch=fn, role=role)
        return fn

    return register


def registered_stages() -> Iterator[StageDef]:
    return iter(_STAGES.values())
