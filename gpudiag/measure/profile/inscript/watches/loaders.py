"""The DataLoaders a script builds and iterates: each one's settings and what built it (a
framework: frameworks.py), each pass over it (what starting one, its first batch and its end
held the training thread: the worker lifecycle), the training thread's wait for each batch,
and which loader feeds training: the steps' data wait, their batch size, and the other loops
(evaluation) with the steps they ran on.

Which loader feeds training is told from when it serves batches: the training loader serves
(nearly) every step of its life; an evaluation loop serves all its batches between two steps,
and, when its iterator is reused (persistent workers), only every N-th step.
"""

from __future__ import annotations

import itertools
import sys
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

import torch
from torch.profiler import record_function
from torch.utils.data import IterableDataset
from torch.utils.data.dataloader import DataLoader, _BaseDataLoaderIter

from gpudiag.measure.evidence.source import call_site, caller_site
from gpudiag.measure.evidence.trace import LOADER_RANGES
from gpudiag.measure.profile.inscript.frameworks import loader_origin
from gpudiag.measure.profile.inscript.watches import StageDraft, StepClock, Watch, patch
from gpudiag.model.facts import LoaderEpoch, LoaderFacts, LoaderUse, OtherLoop

MAX_LOADERS = 16  # DataLoaders described; a script building more (per epoch) repeats
MAX_EPOCHS_KEPT = 256  # passes kept one by one per loader; later ones only counted
MAX_LOOP_SITES = 10_000  # DataLoader iterations whose line is looked up (one per epoch or eval)
# An iterator that served batches on less than half the steps between its first and last is
# not the training loader (which serves every step), and neither is one that served more than
# two batches all on one step.
TRAINING_COVERAGE = 0.5
ONE_STEP_BATCHES = 2

Site = tuple[str, str, str | None]  # (location, function, caller)


class LoadersWatch(Watch):
    """DataLoader construction and iteration (its __init__ and __iter__, its iterators'
    __next__), patched: the time each batch, each pass's start and its end held the training
    thread, by step and iterator, and where each is iterated; the loaders themselves
    (`LoaderUses`)."""

    label = "DataLoaders"

    def __init__(self, clock: StepClock) -> None:
        super().__init__(clock)
        # Waits by (step, iterator): the training loader's are the step's data wait; an
        # evaluation loop's loaders are told apart (training_loaders).
        self.waits: dict[tuple[int, int], float] = defaultdict(float)
        self.calls: dict[int, list[int]] = defaultdict(list)  # iterator -> steps it served
        self.sites: dict[int, Site] = {}  # iterator -> the script's line that iterates it
        self.batch_size: int | None = None
        self.uses = LoaderUses()
        # Iterators are told apart by a number of their own, not id(): a loader without
        # persistent workers makes a new iterator each pass, which may take the address of
        # the last one, and the training loader's passes then read as another loop's.
        self._serials: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
        self._made = itertools.count()

    def install(self) -> None:
        _hook_loader(self)

    def key(self, iterator: object) -> int:
        """The iterator's own number, for as long as it lives."""
        try:
            serial = self._serials.get(iterator)
            if serial is None:
                serial = self._serials[iterator] = next(self._made)
        except TypeError:  # an iterator that takes no weak reference: its address
            return id(iterator)
        return serial

    def waited(self, ms: float, batch: Any, iterator: object) -> None:
        key, step = self.key(iterator), self.clock.steps
        self.waits[(step, key)] += ms
        self.calls[key].append(step)
        self.uses.waited(key, ms, batch)
        if self.batch_size is None:
            self.batch_size = _batch_size(batch)

    def exhausted(self, iterator: object, ms: float) -> None:
        """A pass ended (its workers shut down, unless persistent): the loader's time too."""
        key = self.key(iterator)
        self.waits[(self.clock.steps, key)] += ms
        self.uses.exhausted(key, ms)

    def iterated(self, iterator: object, frame: FrameType | None, loader: Any,
                 ms: float) -> None:
        """A DataLoader was iterated (`for batch in loader`, once per epoch or evaluation),
        taking `ms` to start (its workers): where, in the script, for the loops that are not
        training's; the start is the loader's time, as its batches' waits are."""
        key = self.key(iterator)
        self.waits[(self.clock.steps, key)] += ms
        self.uses.iterated(loader, key, self.clock.steps, ms, frame)
        if key not in self.sites and len(self.sites) < MAX_LOOP_SITES:
            site = call_site(frame)
            if site is not None:
                self.sites[key] = (site.location, site.function, caller_site(frame))

    def fill(self, draft: StageDraft) -> None:
        """The timeline's data wait and other loops, the timed steps' data wait (where the
        script iterated a loader at all) and batch size, the loaders seen; the training one's
        settings are the stage's loader facts, which the input rules read, as the ladder's
        data stages give them."""
        training = training_loaders(self.calls)
        listed = len(draft.timeline.step_ms)
        draft.timeline.data_wait_ms = training_waits(self.waits, training, listed)
        draft.timeline.loops = other_loops(self.calls, training, self.sites, listed)
        if self.waits:
            draft.phases_ms["data_wait"] = training_waits(
                self.waits, training, draft.timed.stop)[draft.timed.start:]
        draft.samples_per_step = self.batch_size
        draft.script.loaders = self.uses.facts(training)
        feeding = [use for use in draft.script.loaders if use.training]
        if feeding:
            draft.facts.loader = feeding[0].settings


WATCH = LoadersWatch


def _hook_loader(watch: LoadersWatch) -> None:
    # A pass's start (worker processes spawned, or persistent ones reset), each batch's wait,
    # and the call that finds the pass over (workers shut down) all hold the training thread.
    def timed_next(original: Callable[..., Any]) -> Callable[..., Any]:
        def __next__(self: Any) -> Any:
            start = time.perf_counter()
            try:
                batch = original(self)
            except StopIteration:
                watch.exhausted(self, (time.perf_counter() - start) * 1e3)
                raise
            watch.waited((time.perf_counter() - start) * 1e3, batch, self)
            return batch
        return __next__

    def sited_iter(original: Callable[..., Any]) -> Callable[..., Any]:
        def __iter__(self: Any) -> Any:
            start = time.perf_counter()
            with record_function(LOADER_RANGES[1]):  # (its seeds' .item() are no syncs)
                iterator = original(self)
            watch.iterated(iterator, sys._getframe(1), loader=self,
                           ms=(time.perf_counter() - start) * 1e3)
            return iterator
        return __iter__

    def noted_init(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            watch.uses.built(self, sys._getframe(1))
        return __init__

    patch(_BaseDataLoaderIter, "__next__", timed_next)
    patch(DataLoader, "__iter__", sited_iter)
    patch(DataLoader, "__init__", noted_init)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class LoaderUses:
    """The DataLoaders a script builds and iterates, by loader: each one's settings, read when
    it is first iterated, and each pass over it."""

    def __init__(self) -> None:
        self._built: weakref.WeakKeyDictionary[Any, tuple[str | None, dict[str, str]]] = \
            weakref.WeakKeyDictionary()
        self._uses: weakref.WeakKeyDictionary[Any, LoaderUse] = weakref.WeakKeyDictionary()
        self._all: list[LoaderUse] = []
        self._keys: dict[int, set[int]] = {}  # id(use) -> its iterators' keys
        self._current: dict[int, LoaderEpoch] = {}  # an iterator's key -> its pass now
        self._batch_bytes: dict[int, int] = {}  # an iterator's key -> its first batch's bytes

    def built(self, loader: Any, frame: FrameType | None) -> None:
        if len(self._built) < MAX_LOADERS * 4:
            site = call_site(frame)
            self._built[loader] = (site.location if site is not None else None,
                                   loader_origin(frame, loader))

    def iterated(self, loader: Any, iterator: int, step: int, ms: float,
                 frame: FrameType | None) -> None:
        """`loader` iterated: `iterator`, the key of the iterator it made (LoadersWatch.key)."""
        use = self._uses.get(loader)
        if use is None:
            if len(self._all) >= MAX_LOADERS:
                return
            site, origin = self._built.get(loader, (None, {}))
            at = call_site(frame)
            use = self._uses[loader] = LoaderUse(
                site=site, batch_size=_int(getattr(loader, "batch_size", None)),
                iterable=isinstance(getattr(loader, "dataset", None), IterableDataset),
                iterated_at=at.location if at is not None else None,
                settings=LoaderFacts(
                    num_workers=_int(getattr(loader, "num_workers", 0)) or 0,
                    pin_memory=bool(getattr(loader, "pin_memory", False)),
                    prefetch_factor=_int(getattr(loader, "prefetch_factor", None)),
                    persistent_workers=bool(getattr(loader, "persistent_workers", False))),
                framework=origin.get("framework"), edit_at=origin.get("edit_at"),
                hook=origin.get("hook"))
            self._all.append(use)
        use.passes += 1
        epoch = LoaderEpoch(step=step, start_ms=ms)
        if len(use.epochs) < MAX_EPOCHS_KEPT:
            use.epochs.append(epoch)
        self._keys.setdefault(id(use), set()).add(iterator)
        self._current[iterator] = epoch

    def waited(self, iterator: int, ms: float, batch: Any) -> None:
        epoch = self._current.get(iterator)
        if epoch is not None:
            if epoch.batches == 0:
                epoch.first_batch_ms = ms
                self._batch_bytes[iterator] = _batch_bytes(batch)
            epoch.batches += 1

    def exhausted(self, iterator: int, ms: float) -> None:
        # The pass is over: a long run's thousands of epochs keep no iterator here.
        epoch = self._current.pop(iterator, None)
        if epoch is not None:
            epoch.end_ms += ms

    def facts(self, training: set[int]) -> list[LoaderUse]:
        """Every loader seen; `training`: the iterators (by key) that fed the steps."""
        for use in self._all:
            keys = self._keys.get(id(use), set())
            use.training = bool(keys & training)
            use.batch_bytes = next((self._batch_bytes[k] for k in sorted(keys)
                                    if k in self._batch_bytes), None)
        return list(self._all)


def training_loaders(calls: Mapping[int, Sequence[int]]) -> set[int]:
    """The iterators (by key) that feed training, from the step each of their batches came on."""
    training = set()
    for key, served in calls.items():
        steps = set(served)
        span = max(steps) - min(steps) + 1
        one_step_loop = len(steps) == 1 and len(served) > ONE_STEP_BATCHES
        if not one_step_loop and len(steps) >= TRAINING_COVERAGE * span:
            training.add(key)
    return training


def training_waits(waits: Mapping[tuple[int, int], float], training: set[int],
                   steps: int) -> list[float]:
    """Per step (0..steps-1), the time spent waiting for the training loaders' batches."""
    per_step = [0.0] * steps
    for (step, key), ms in waits.items():
        if key in training and 0 <= step < steps:
            per_step[step] += ms
    return per_step


def other_loops(calls: Mapping[int, Sequence[int]], training: set[int],
                sites: Mapping[int, Site], steps: int) -> list[OtherLoop]:
    """The loaders that are not training's, one per line of the script that iterates them (an
    evaluation makes a new iterator each time: they are one loop)."""
    loops: dict[Site, OtherLoop] = {}
    for key, served in calls.items():
        if key in training:
            continue
        site = sites.get(key, ("unknown", "?", None))
        loop = loops.setdefault(site, OtherLoop(location=site[0], function=site[1],
                                                caller=site[2]))
        loop.batches += len(served)
        loop.steps = sorted({*loop.steps, *(s for s in served if s < steps)})
    return sorted(loops.values(), key=lambda loop: -loop.batches)


def _batch_size(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = _batch_size(item)
            if size:
                return size
    return None


def _batch_bytes(batch: Any, depth: int = 0) -> int:
    """What a batch's tensors hold (a tensor, or those in its tuple, list or dict)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)) and depth < 2:
        return sum(_batch_bytes(item, depth + 1) for item in batch)
    return 0
