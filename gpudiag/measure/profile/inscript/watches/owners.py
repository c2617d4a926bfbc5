"""Who holds the script's memory, and what keeps growing tensors.

Owners, over the profiler window's first step: the tensors autograd saves for backward are
counted as the script's forward saves them (a `saved_tensors_hooks` pack hook: each storage
once, the parameters left out, the lines that saved the largest), and at the step's end the
parameters, their gradients and the optimizers' state (the optimizers that stepped, the
modules in the loop's namespaces); the training loader's batch and the allocator's peak (CUDA)
complete it when the part is written. One step only: the hook costs host time in the step it
counts (`MemoryOwners.hook_ms` says how much), and the window's first step is where gpudiag's
own instruments are already at work.

What keeps growing tensors: two looks at the training loop's namespaces (heldtensors.py), at the
last warm-up step's start and at the first step after the window (never among the timed or
profiled steps: a look costs a walk of the script's containers), compared.
"""

from __future__ import annotations

import contextlib
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from types import CodeType, FrameType
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from gpudiag.measure.evidence.source import call_site, code_role, display_path
from gpudiag.measure.profile.inscript.frameworks import compiled
from gpudiag.measure.profile.inscript.heldtensors import (
    Held,
    StorageKey,
    bytes_once,
    kept_between,
    look,
    loop_namespaces,
    storage_bytes,
    storage_key,
)
from gpudiag.measure.profile.inscript.memoryremedies import repeated_blocks
from gpudiag.measure.profile.inscript.outofmemory import oom_device
from gpudiag.measure.profile.inscript.watches import StageDraft, StepClock, Watch
from gpudiag.model.facts import KeptTensors, LoaderUse, MemoryOwners, SavedSite

SITES_KEPT = 5  # lines that saved the most for backward, kept
# The user's line is looked up (a walk of the stack, which also makes Python keep its frames as
# objects: 10-30 us a tensor in all) only for a tensor at least 1/SITE_SHARE of the largest
# saved so far, SITE_LOOKUPS times a step at most: the largest are named, the cost bounded.
SITE_SHARE, SITE_LOOKUPS = 8, 64
FIRST_LOOK_AFTER = 2  # the optimizer makes its state at its first step: look after it
LOOKS_APART = 5  # steps between the two looks at least: a rate a step, not one step's noise
CPU_NOTE = ("on a CPU torch's allocator keeps no peak: the temporaries (the peak less the "
            "owners) are unknown")
COMPILED_NOTE = ("torch.compile'd code: its saved tensors are not counted (hooking them would "
                 "make Dynamo recompile)")


class SavedCounter:
    """The pack hook's tally: bytes and tensors saved for backward, each storage once, by the
    user's line that saved them, and the time the hook took."""

    def __init__(self, skip: set[StorageKey]) -> None:
        self.seen = skip  # the parameters' storages: saved, but not activations
        self.bytes = 0
        self.tensors = 0
        self.sites: dict[str, list[int]] = {}
        self.seconds = 0.0
        self.largest_saved = 0
        self.lookups = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        with contextlib.suppress(Exception):  # never an error in the script's forward
            self.saved(tensor, sys._getframe)
        self.seconds += time.perf_counter() - start
        return tensor

    def saved(self, tensor: torch.Tensor, frames: Callable[[int], FrameType]) -> None:
        """One saved tensor; `frames` (sys._getframe) gives its stack, only where its line is
        looked up."""
        key = storage_key(tensor)
        if key is not None and key in self.seen:
            return
        if key is not None:
            self.seen.add(key)
        size = storage_bytes(tensor)
        self.bytes += size
        self.tensors += 1
        if size * SITE_SHARE < self.largest_saved or self.lookups >= SITE_LOOKUPS:
            return
        self.largest_saved = max(self.largest_saved, size)
        self.lookups += 1
        site = call_site(frames(2))  # above pack() and this
        if site is not None:
            tally = self.sites.setdefault(site.location, [0, 0])
            tally[0] += size
            tally[1] += 1

    def largest(self) -> list[SavedSite]:
        ranked = sorted(self.sites.items(), key=lambda s: -s[1][0])[:SITES_KEPT]
        return [SavedSite(location=where, bytes=b, tensors=n) for where, (b, n) in ranked]


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class OwnersWatch(Watch):
    """The owners of memory over one profiled step, and two looks for growing tensors."""

    label = "memory owners"

    def __init__(self, clock: StepClock) -> None:
        super().__init__(clock)
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.counter: SavedCounter | None = None
        self.hooks: Any = None  # the saved_tensors_hooks context, entered for one step
        self.owners: MemoryOwners | None = None
        self.first_look: tuple[int, dict[str, Held]] | None = None
        self.looked_in: CodeType | None = None  # the first look's frame's code, and line
        self.looked_at = 0
        self.kept: list[KeptTensors] = []
        self.failed: str | None = None  # what stopped it, named in the part at the end
        self.uncounted = ""  # why the saved tensors were not counted

    def install(self) -> None:
        register_optimizer_step_post_hook(self._stepped)

    def _stepped(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.optimizers.add(optimizer)

    def step_ended(self) -> None:
        if self.failed is not None:
            return
        try:
            self._at_boundary(self.clock.steps)
        except Exception as exc:  # never an error in the script's step: named at the end
            self._close_hooks()
            self.failed = f"{type(exc).__name__}: {exc}"

    def _at_boundary(self, done: int) -> None:
        schedule = self.clock.schedule
        counted = schedule.warmup + schedule.timed  # the window's first step (or the first after)
        if done == counted:
            self._start_counting()
        elif done == counted + 1:
            self._stop_counting(done - 1)
        first = schedule.warmup - 1 if schedule.warmup - 1 >= FIRST_LOOK_AFTER else \
            schedule.end + 1
        if done == first and self.first_look is None:
            frame = self._loop_frame()
            if frame is not None:
                self.first_look = (done, look(loop_namespaces(frame)))
                self.looked_in, self.looked_at = frame.f_code, frame.f_lineno
        elif self.first_look is not None and \
                done >= max(schedule.end + 1, self.first_look[0] + LOOKS_APART):
            self._second_look(done)

    def crashed(self, exc: BaseException) -> None:
        """A script that died of out-of-memory before the second look: that look made in the
        failure's traceback, in the frame of the first (what it keeps is the knob GD404 names
        first)."""
        if self.first_look is None or self.failed is not None or oom_device(exc) is None:
            return
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code is not self.looked_in:
            tb = tb.tb_next
        if tb is not None:
            # The looks are made at a step's boundary: a failure earlier in the loop's body
            # than that line came after the last step's additions, as the next boundary would.
            done = self.clock.steps + (tb.tb_lineno < self.looked_at)
            with contextlib.suppress(Exception):  # never hides the script's own error
                self._second_look(done, tb.tb_frame)

    def _second_look(self, done: int, frame: FrameType | None = None) -> None:
        frame = frame or self._loop_frame()
        assert self.first_look is not None
        if frame is None:
            return
        at, before = self.first_look
        loop_line = f"{display_path(frame.f_code.co_filename)}:{frame.f_lineno}"
        self.kept = kept_between(before, look(loop_namespaces(frame)), (at, done),
                                 frame.f_code, loop_line)
        self.first_look = None  # its containers' counts only: nothing held

    def _loop_frame(self) -> FrameType | None:
        """The training loop's frame: the recorder's where it found it (the host sampler's),
        else the innermost frame of the user's code."""
        loop_code = self.clock.loop_code
        frame: FrameType | None = sys._getframe(1)
        user = None
        while frame is not None:
            if loop_code is not None and frame.f_code is loop_code:
                return frame
            if user is None and code_role(frame.f_code) == "user":
                user = frame
            frame = frame.f_back
        return user

    def _start_counting(self) -> None:
        if compiled():  # Dynamo guards on the saved-tensor hooks: it would recompile
            self.uncounted = COMPILED_NOTE
            return
        skip: set[StorageKey] = set()
        bytes_once(self._parameters(), skip)
        counter = SavedCounter(skip)
        hooks = torch.autograd.graph.saved_tensors_hooks(counter.pack, _unpack)
        try:
            hooks.__enter__()
        except RuntimeError as exc:  # a framework disabled saved-tensor hooks here
            self.uncounted = f"saved tensors not counted: {exc}"
            return
        self.counter, self.hooks = counter, hooks

    def _stop_counting(self, step: int) -> None:
        """The counted step ended: its saved tensors, and what the parameters, gradients and
        optimizer state hold now (the optimizer stepped: its state exists, the gradients too)."""
        self._close_hooks()
        counter, self.counter = self.counter, None
        params = list(self._parameters())
        cuda = any(p.device.type == "cuda" for p in params)
        seen: set[StorageKey] = set()
        notes = [] if cuda else [CPU_NOTE]
        if counter is None:
            notes.append(self.uncounted)
        self.owners = MemoryOwners(
            device="cuda" if cuda else "cpu", step=step,
            parameters=bytes_once(params, seen),
            gradients=bytes_once((p.grad for p in params if p.grad is not None), seen),
            optimizer_state=bytes_once(self._optimizer_state(), seen),
            activations=counter.bytes if counter else None,
            activation_sites=counter.largest() if counter else [],
            hook_ms=round(counter.seconds * 1e3, 3) if counter else 0.0,
            peak=torch.cuda.max_memory_allocated() if cuda else None,
            note="; ".join(notes))
        self._blocks(self.owners)

    def _blocks(self, owners: MemoryOwners) -> None:
        """The repeated blocks of the models in the loop's namespaces (the first found)."""
        frame = self._loop_frame()
        models = [v for names in (loop_namespaces(frame).values() if frame else ())
                  for v in list(names.values()) if isinstance(v, torch.nn.Module)
                  and next(v.parameters(), None) is not None]
        owners.models_looked = len(models)
        for model in models:
            found = repeated_blocks(model)
            if found is not None:
                where, blocks = found
                owners.blocks = (f"{len(blocks)} `{type(blocks[0]).__name__}` blocks in "
                                 f"`{where}`")
                return

    def _close_hooks(self) -> None:
        if self.hooks is not None:
            hooks, self.hooks = self.hooks, None
            hooks.__exit__(None, None, None)

    def _parameters(self) -> Iterator[torch.Tensor]:
        """The optimizers' parameters, and those of the modules in the loop's namespaces (a
        frozen base model's too)."""
        for optimizer in list(self.optimizers):
            for group in optimizer.param_groups:
                yield from group["params"]
        frame = self._loop_frame()
        if frame is None:
            return
        for names in loop_namespaces(frame).values():
            for value in list(names.values()):
                if isinstance(value, torch.nn.Module):
                    yield from value.parameters()

    def _optimizer_state(self) -> Iterator[torch.Tensor]:
        for optimizer in list(self.optimizers):
            for state in list(optimizer.state.values()):
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def finish(self) -> None:
        self._close_hooks()
        if self.failed is not None:
            raise RuntimeError(self.failed)

    def fill(self, draft: StageDraft) -> None:
        draft.script.kept = list(self.kept)
        if self.owners is not None:
            draft.script.owners = settled(self.owners, draft.script.loaders, self.kept)


def settled(owners: MemoryOwners, loaders: list[LoaderUse],
            kept: list[KeptTensors]) -> MemoryOwners:
    """The owners made whole: the training loader's batch, the bytes of the growing
    containers on the owners' device, and (where the allocator has a peak) the temporaries,
    the peak less all of them."""
    feeding = [use.batch_bytes for use in loaders if use.training and use.batch_bytes]
    inputs = feeding[0] if feeding else None
    held = sum(k.bytes for k in kept if k.kind != "tensor with its graph"
               and k.device == owners.device) if kept else None
    known = (owners.parameters + owners.gradients + owners.optimizer_state
             + (owners.activations or 0) + (inputs or 0) + (held or 0))
    rest = None if owners.peak is None else max(0, owners.peak - known)
    return replace(owners, inputs=inputs, kept=held, temporaries=rest)


WATCH = OwnersWatch
