"""Checkpoint stages: the fp16 training step with a full save every N steps, blocking or not.

docs/field-cases.md#case-4: a "faster" checkpointer made training slower because its saves blocked,
queued behind each other and ran too often. These stages price both ways of saving:

- `checkpoint-sync`: plain `torch.save` of model, optimizer, scaler and step. The device-to-host
  copies and the file write all happen on the training thread, so the step that saves stalls.
- `checkpoint-async`: the state is copied into pinned host buffers (one per dtype, allocated
  once) on a side CUDA stream, and a background thread writes them: a small torch.save header
  (the state's layout) and then the buffers' raw bytes. Raw writes release the GIL; torch.save
  of the same buffers held it long enough to stall the training thread for up to 420 ms per
  save on an H100 host (benchmarks/async_write_stalls.py). The training
  thread only enqueues the copies; the next optimizer update waits on the copy event, so the
  parameters it overwrites have been copied first. At most one save is in flight: a save that
  finds the previous one still writing waits for it, and that wait is recorded.

Every save is recorded (timed step, time blocking the training thread, time until the file was
written, bytes, write bandwidth, wait for the previous save) into the stage's facts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from gpudiag.measure.stages.base import StageContext, Workload, stage
from gpudiag.measure.stages.ladder import amp_facts, amp_label, tokens, train_step
from gpudiag.model.facts import CheckpointFacts, SaveRecord, StageFacts

SAVES_NEEDED = 6  # timed saves per stage: enough to see the period in the step times
FILES_KEPT = 2  # saves alternate between two files, so disk use stays at two checkpoints
FLAT_FORMAT = "gpudiag-flat-checkpoint-v1"
FLAT_MAGIC = b"GDFLAT01"
FLAT_SLOT = "__gpudiag_flat__"  # marks where a tensor was: [dtype, offset, shape]


def _write_gbps(record: SaveRecord) -> float | None:
    if not record.bytes or not record.write_ms:
        return None
    return record.bytes / (record.write_ms / 1e3) / 1e9


def _rounded(record: SaveRecord) -> SaveRecord:
    # Field names chosen at run time: the values' types vary by field, so the mapping is Any.
    rounded: dict[str, Any] = {
        f.name: round(v, 3) for f in dataclasses.fields(record)
        if isinstance(v := getattr(record, f.name), float)}
    return dataclasses.replace(record, **rounded)


def _map_tensors(value: Any, fn: Any) -> Any:
    """`value` with every tensor in its dicts/lists/tuples replaced by fn(tensor)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _alias_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            t.stride(), t.dtype)


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_tensors(value, found.append)
    return found


class Checkpointer:
    """Saves the training state every `every` steps; subclasses decide how."""

    mode = ""

    def __init__(self, directory: Path, every: int, name: str, keep: bool) -> None:
        self.every, self.name, self.keep = every, name, keep
        self.parent, self.created = directory, not directory.exists()
        directory.mkdir(parents=True, exist_ok=True)
        # Saves go to a folder of this run's own inside the directory: close() deletes that
        # folder, never a file the user had there.
        self.directory = Path(tempfile.mkdtemp(prefix=f"gpudiag-{name}-", dir=directory))
        self.records: list[SaveRecord] = []
        self.steps = 0
        self.saves = 0
        self.logging = False
        self.state: dict[str, Any] | None = None

    # StepHooks
    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler) -> None:
        self.model, self.optimizer, self.scaler = model, optimizer, scaler

    def before_update(self) -> None:
        pass

    def after_step(self) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            self.save()

    def training_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(), "step": self.steps}

    def next_path(self) -> Path:
        self.saves += 1
        return self.directory / f"{self.name}-{self.saves % FILES_KEPT}.pt"

    def save(self) -> None:
        raise NotImplementedError

    def record(self, record: SaveRecord) -> None:
        if self.logging:
            self.records.append(record)

    def start_timed(self) -> None:
        """Warm-up is over: count steps from here and log saves from here."""
        self.finish()
        self.steps, self.logging, self.records = 0, True, []

    def finish(self) -> None:
        """Wait for any save in flight."""

    def record_timed(self, facts: StageFacts) -> None:
        """The timed steps' saves, on the stage's facts."""
        self.finish()
        sizes = [r.bytes for r in self.records if r.bytes]
        facts.checkpoint = CheckpointFacts(
            mode=self.mode, every=self.every, directory=str(self.directory),
            bytes_per_save=max(sizes) if sizes else None,
            saves=[_rounded(dataclasses.replace(r, write_gbps=_write_gbps(r)))
                   for r in self.records])

    def close(self) -> None:
        self.finish()
        if self.keep:
            return
        shutil.rmtree(self.directory, ignore_errors=True)
        if self.created:
            with contextlib.suppress(OSError):  # only if nothing else was put there meanwhile
                self.parent.rmdir()


class SyncCheckpointer(Checkpointer):
    """`torch.save` on the training thread: copies and write block the step."""

    mode = "sync"

    def save(self) -> None:
        step = self.steps - 1
        path = self.next_path()
        start = time.perf_counter()
        torch.save(self.training_state(), path)
        ms = (time.perf_counter() - start) * 1e3
        self.record(SaveRecord(step=step, blocking_ms=ms, waited_ms=0.0, total_ms=ms,
                               write_ms=ms, bytes=path.stat().st_size))


class AsyncCheckpointer(Checkpointer):
    """Pinned host staging on a side stream and a background writer; one save in flight."""

    mode = "async"

    def __init__(self, directory: Path, every: int, name: str, keep: bool,
                 device: torch.device) -> None:
        super().__init__(directory, every, name, keep)
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpudiag-ckpt")
        self.pending: Future[None] | None = None
        self.copied: torch.cuda.Event | None = None
        self.staging: dict[str, Any] | None = None  # the state as views into `flats`
        self.flats: dict[str, torch.Tensor] = {}  # one host buffer per dtype
        self.layout: dict[str, Any] = {}  # the state with tensors replaced by their slots

    def stage_buffers(self) -> None:
        """Allocate the host copies once (pinned on CUDA): pinning is slow and must not land
        inside a timed save. Called at the start of the timed window, or by the first save.
        Tensors that share storage (tied embeddings) share one slot, as torch.save would."""
        state = self.training_state()
        unique: dict[tuple[Any, ...], torch.Tensor] = {}
        for t in _tensors(state):
            unique.setdefault(_alias_key(t), t)
        sizes: dict[torch.dtype, int] = {}
        slots: dict[tuple[Any, ...], tuple[str, int, tuple[int, ...]]] = {}
        for key, t in unique.items():
            offset = sizes.get(t.dtype, 0)
            slots[key] = (str(t.dtype).removeprefix("torch."), offset, tuple(t.shape))
            sizes[t.dtype] = offset + t.numel()
        self.flats = {str(dtype).removeprefix("torch."): torch.empty(
            n, dtype=dtype, device="cpu", pin_memory=self.cuda) for dtype, n in sizes.items()}
        self.staging = _map_tensors(state, lambda t: self._view(slots[_alias_key(t)]))
        self.layout = _map_tensors(state, lambda t: {FLAT_SLOT: list(slots[_alias_key(t)])})

    def _view(self, slot: tuple[str, int, tuple[int, ...]]) -> torch.Tensor:
        dtype, offset, shape = slot
        numel = math.prod(shape)
        return self.flats[dtype][offset:offset + numel].view(shape)

    def start_timed(self) -> None:
        super().start_timed()
        if self.staging is None:
            self.stage_buffers()

    def before_update(self) -> None:
        # The update overwrites parameters and optimizer state: the copies must be done first.
        if self.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied)
            self.copied = None

    def save(self) -> None:
        step = self.steps - 1
        start = time.perf_counter()
        waited = 0.0
        if self.pending is not None:
            if not self.pending.done():
                self.pending.result()
                waited = (time.perf_counter() - start) * 1e3
            self.pending.result()  # re-raises a failed write here, on the training thread
        state = self.training_state()
        if self.staging is None or len(_tensors(self.staging)) != len(_tensors(state)):
            self.stage_buffers()
        staging = self.staging
        pairs = {id(target): (source, target)
                 for source, target in zip(_tensors(state), _tensors(staging), strict=True)}
        if self.cuda and self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for source, target in pairs.values():
                    target.copy_(source, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.stream)
            self.copied = copied
        else:
            copied = None
            for source, target in pairs.values():
                target.copy_(source)
        layout = {**self.layout, "step": state["step"]}
        flats = self.flats
        record = SaveRecord(step=step, blocking_ms=0.0, waited_ms=waited)
        path = self.next_path()

        def write() -> None:
            if copied is not None:
                copied.synchronize()
            begin = time.perf_counter()
            write_flat_checkpoint(path, layout, flats)
            end = time.perf_counter()
            record.write_ms = (end - begin) * 1e3
            record.total_ms = (end - start) * 1e3
            record.bytes = path.stat().st_size

        self.pending = self.writer.submit(write)
        record.blocking_ms = (time.perf_counter() - start) * 1e3
        self.record(record)

    def finish(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.writer.shutdown(wait=True)


def write_flat_checkpoint(path: Path, layout: dict[str, Any],
                          flats: dict[str, torch.Tensor]) -> None:
    """MAGIC, the header's length (8 bytes, little-endian), a torch.save header (layout and
    buffer sizes), then each buffer's raw bytes in header order."""
    header = io.BytesIO()
    torch.save({"format": FLAT_FORMAT, "layout": layout,
                "buffers": [(name, t.numel()) for name, t in flats.items()]}, header)
    with path.open("wb") as f:
        f.write(FLAT_MAGIC)
        f.write(len(header.getbuffer()).to_bytes(8, "little"))
        f.write(header.getbuffer())
        for flat in flats.values():
            # ndarray.data is memoryview(array); numpy's stubs declare __buffer__ only on 3.12+.
            f.write(flat.view(torch.uint8).numpy().data)


def load_flat_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint-async file back into the usual nested state (model, optimizer,
    scaler, step) of CPU tensors: each tensor a view into its dtype's buffer."""
    with Path(path).open("rb") as f:
        if f.read(len(FLAT_MAGIC)) != FLAT_MAGIC:
            raise ValueError(f"{path}: not a {FLAT_FORMAT} checkpoint")
        size = int.from_bytes(f.read(8), "little")
        header = torch.load(io.BytesIO(f.read(size)), weights_only=True)
        buffers = {}
        for name, numel in header["buffers"]:
            dtype = getattr(torch, name)
            raw = bytearray(f.read(numel * dtype.itemsize))
            buffers[name] = torch.frombuffer(raw, dtype=torch.uint8).view(dtype)

    def restore(value: Any) -> Any:
        if isinstance(value, dict) and FLAT_SLOT in value:
            dtype, offset, shape = value[FLAT_SLOT]
            return buffers[dtype][offset:offset + math.prod(shape)].view(tuple(shape))
        if isinstance(value, dict):
            return {k: restore(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(restore(v) for v in value)
        return value

    return restore(header["layout"])


def _checkpoint_stage(ctx: StageContext, saver: Checkpointer, how: str) -> Workload:
    bundle = ctx.bundle()
    batch = ctx.batch(bundle)
    every = ctx.config.checkpoint_every
    return Workload(
        step=train_step(ctx, bundle, lambda: batch, amp=True, hooks=saver),
        samples_per_step=ctx.config.batch_size, tokens_per_step=tokens(ctx),
        description=f"{bundle.description}, {amp_label(ctx)}, {how} every {every} steps",
        # Saves make a few steps long: throughput is total time over steps, not the median.
        facts=dataclasses.replace(amp_facts(ctx), bursty=True), min_iters=SAVES_NEEDED * every,
        on_timed_start=saver.start_timed, record_timed=saver.record_timed, close=saver.close)


def _directory(ctx: StageContext) -> Path:
    return Path(ctx.config.checkpoint_dir or "checkpoints")


@stage("checkpoint-sync", "mixed-precision training, blocking torch.save every N steps")
def checkpoint_sync(ctx: StageContext) -> Workload:
    saver = SyncCheckpointer(_directory(ctx), ctx.config.checkpoint_every, "checkpoint-sync",
                             ctx.config.keep_checkpoints)
    return _checkpoint_stage(ctx, saver, "torch.save")


@stage("checkpoint-async", "mixed-precision training, async save (pinned staging) every N steps")
def checkpoint_async(ctx: StageContext) -> Workload:
    saver = AsyncCheckpointer(_directory(ctx), ctx.config.checkpoint_every, "checkpoint-async",
                              ctx.config.keep_checkpoints, ctx.device)
    return _checkpoint_stage(ctx, saver, "async save")
