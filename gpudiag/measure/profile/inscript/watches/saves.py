"""The script's checkpoints: each blocking torch.save, and safetensors' savers (transformers'
save_pretrained writes model weights with them), timed; the file's size read after. The
timeline lists every save; the timed steps' saves are the stage's checkpoint facts. A re-run's
write watch (writewatch.py) hears of each file: native code wrote it, no audit event saw it."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from gpudiag.measure.evidence.source import display_path
from gpudiag.measure.profile.inscript import writewatch
from gpudiag.measure.profile.inscript.watches import StageDraft, StepClock, Watch, patch
from gpudiag.model.facts import CheckpointFacts, SaveRecord


class SavesWatch(Watch):
    """torch.save and safetensors.torch's save_file and save_model, patched."""

    label = "saves"

    def __init__(self, clock: StepClock) -> None:
        super().__init__(clock)
        self.saves: list[SaveRecord] = []

    def install(self) -> None:
        _hook_saves(self)

    def saved(self, blocking_ms: float, path: Any, stack: list[str]) -> None:
        """A blocking save returned (the script's own saves are synchronous), called from
        `stack`."""
        size = None
        if isinstance(path, (str, os.PathLike)) and Path(path).is_file():
            size = Path(path).stat().st_size
        self.saves.append(SaveRecord(
            step=self.clock.steps, blocking_ms=blocking_ms,
            total_ms=blocking_ms, bytes=size, stack=stack,
            write_gbps=size / blocking_ms / 1e6 if size and blocking_ms else None))

    def fill(self, draft: StageDraft) -> None:
        listed = len(draft.timeline.step_ms)
        draft.timeline.saves = [s for s in self.saves if s.step < listed]
        first = draft.timed.start
        saves = _checkpoints([dataclasses.replace(s, step=s.step - first) for s in self.saves
                              if s.step in draft.timed])
        if saves:
            gaps = [b.step - a.step for a, b in itertools.pairwise(saves)]
            draft.facts.checkpoint = CheckpointFacts(
                mode="sync", every=statistics.mode(gaps) if gaps else None, saves=saves)


WATCH = SavesWatch


def _hook_saves(watch: SavesWatch) -> None:
    def timed_save(original: Callable[..., Any]) -> Callable[..., Any]:
        def save(*args: Any, **kwargs: Any) -> Any:
            stack = _callers(sys._getframe(1))
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                target = args[1] if len(args) > 1 else kwargs.get("f", kwargs.get("filename"))
                watch.saved((time.perf_counter() - start) * 1e3, target, stack)
                writewatch.written(target)  # native code wrote it: no audit event saw it
        return save

    patch(torch, "save", timed_save)
    # Model weights are often written with safetensors (transformers' save_pretrained); hooked
    # here, before the script imports the names it binds (from safetensors.torch import ...).
    if importlib.util.find_spec("safetensors") is not None:
        import safetensors.torch  # noqa: PLC0415 (only where installed)

        for name in ("save_file", "save_model"):
            patch(safetensors.torch, name, timed_save)


# Deep enough for HF Trainer's save (its training loop's line is ~10 frames above torch.save).
MAX_FRAMES = 40


def _callers(frame: FrameType | None) -> list[str]:
    """file:line of each frame from `frame` out, innermost first (a save is rare: the walk
    costs microseconds against its milliseconds)."""
    stack: list[str] = []
    while frame is not None and len(stack) < MAX_FRAMES:
        stack.append(f"{display_path(frame.f_code.co_filename)}:{frame.f_lineno}")
        frame = frame.f_back
    return stack


def _checkpoints(saves: list[SaveRecord]) -> list[SaveRecord]:
    """One checkpoint per step: the files saved within one step (HF Trainer writes model,
    optimizer, scheduler and RNG state as four torch.save calls) are one save, blocking for
    their sum."""
    by_step: dict[int, list[SaveRecord]] = defaultdict(list)
    for save in saves:
        by_step[save.step].append(save)
    merged = []
    for step, group in sorted(by_step.items()):
        blocking = sum(s.blocking_ms for s in group)
        sizes = [s.bytes for s in group if s.bytes]
        total = sum(sizes) if sizes else None
        merged.append(SaveRecord(step=step, blocking_ms=blocking, total_ms=blocking,
                                 bytes=total, files=len(group),
                                 stack=list(dict.fromkeys(f for s in group for f in s.stack)),
                                 write_gbps=total / blocking / 1e6 if total and blocking
                                 else None))
    return merged
