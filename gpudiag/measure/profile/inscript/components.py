"""Framework components the recorder reads in the script's process, as the script built them:
each optimizer's implementation (torch.optim's `foreach`/`fused`, resolved the way its step()
resolves them), its parameter tensors, and the script's lines that build and step it; each
DataLoader's settings and its passes (what starting one, its first batch and its end held the
training thread: the worker lifecycle); FSDP2's units, by the line that made them. Read from
the live objects, never changed (the remedies, remedies.py, are what change them, for one
run)."""

from __future__ import annotations

import inspect
import weakref
from types import FrameType
from typing import Any

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach

from gpudiag.measure.evidence.source import call_site
from gpudiag.measure.profile.inscript.frameworks import loader_origin, optimizer_origin
from gpudiag.model.facts import (
    FsdpFacts,
    FsdpUnits,
    LoaderEpoch,
    LoaderFacts,
    LoaderUse,
    OptimizerFacts,
    OptimizerImpl,
)

MAX_OPTIMIZERS = 8  # optimizers described; a script building more (per task, per epoch) repeats
MAX_LOADERS = 16  # DataLoaders described, likewise
MAX_EPOCHS_KEPT = 256  # passes kept one by one per loader; later ones only counted


def implementation(optimizer: torch.optim.Optimizer) -> tuple[OptimizerImpl, str]:
    """How `optimizer` steps, and what decided it (the argument as the script passed it, or
    torch's default for these tensors). An optimizer whose step is not torch.optim's (apex,
    DeepSpeed, bitsandbytes) is "unknown": its flags, if any, mean something else."""
    step = getattr(type(optimizer), "step", None)
    group = next((g for g in optimizer.param_groups if g.get("params")), None)
    if group is None or not getattr(step, "__module__", "").startswith("torch.optim") \
            or "foreach" not in group:
        return "unknown", "unknown"
    if group.get("fused"):
        return "fused", "fused=True"
    if group["foreach"]:
        return "foreach", "foreach=True"
    if group["foreach"] is False:
        return "single-tensor", "foreach=False"
    # Both unset: torch.optim's functional step picks foreach when every tensor allows it
    # (torch/optim/adam.py, `if fused is None and foreach is None`), never fused.
    _, foreach = _default_to_fused_or_foreach(
        list(group["params"]), bool(group.get("differentiable")), use_fused=False)
    return ("foreach" if foreach else "single-tensor"), "default"


def _takes(optimizer: torch.optim.Optimizer, argument: str) -> bool:
    """Whether a torch.optim class of `optimizer`'s takes `argument` (a script's subclass
    passes its own arguments on to one)."""
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and cls is not torch.optim.Optimizer:
            return argument in inspect.signature(cls).parameters
    return False


def describe(optimizer: torch.optim.Optimizer, site: str | None,
             origin: dict[str, str]) -> OptimizerFacts:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    impl, chosen = implementation(optimizer)
    differentiable = any(g.get("differentiable") for g in optimizer.param_groups)
    fused_ok, _ = _default_to_fused_or_foreach(params, differentiable, use_fused=True)
    _, foreach_ok = _default_to_fused_or_foreach(params, differentiable, use_fused=False)
    return OptimizerFacts(
        name=type(optimizer).__name__, module=type(optimizer).__module__,
        implementation=impl, chosen=chosen, parameters=len(params),
        numel=sum(p.numel() for p in params), site=site,
        fused_supported=fused_ok and _takes(optimizer, "fused"),
        foreach_supported=foreach_ok and _takes(optimizer, "foreach"),
        devices=sorted({str(p.device) for p in params}),
        framework=origin.get("framework"), edit_at=origin.get("edit_at"))


class OptimizerWatch:
    """The optimizers a script builds (hooks.py wraps Optimizer.__init__) and steps (the
    recorder's step post-hook): each described at its first step, when its tensors are where
    training puts them; its steps counted."""

    def __init__(self) -> None:
        self._built: weakref.WeakKeyDictionary[Any, tuple[str | None, dict[str, str]]] = \
            weakref.WeakKeyDictionary()
        self._seen: weakref.WeakKeyDictionary[Any, OptimizerFacts] = \
            weakref.WeakKeyDictionary()
        self._facts: list[OptimizerFacts] = []

    def built(self, optimizer: torch.optim.Optimizer, frame: FrameType | None) -> None:
        if len(self._built) < MAX_OPTIMIZERS * 4:
            site = call_site(frame)
            self._built[optimizer] = (site.location if site is not None else None,
                                      optimizer_origin(frame))

    def stepped(self, optimizer: torch.optim.Optimizer, frame: FrameType | None) -> None:
        facts = self._seen.get(optimizer)
        if facts is None:
            if len(self._facts) >= MAX_OPTIMIZERS:
                return
            site, origin = self._built.get(optimizer, (None, {}))
            try:
                facts = describe(optimizer, site, origin)
            except Exception:  # a third-party optimizer's groups: unreadable is not an error
                return
            step_site = call_site(frame)
            facts.step_site = step_site.location if step_site is not None else None
            self._seen[optimizer] = facts
            self._facts.append(facts)
        facts.steps += 1

    def facts(self) -> list[OptimizerFacts]:
        return list(self._facts)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class LoaderWatch:
    """The DataLoaders a script builds (hooks.py wraps DataLoader.__init__) and iterates
    (__iter__ and its iterators' __next__): each one's settings, read when it is first
    iterated, and each pass over it."""

    def __init__(self) -> None:
        self._built: weakref.WeakKeyDictionary[Any, tuple[str | None, dict[str, str]]] = \
            weakref.WeakKeyDictionary()
        self._uses: weakref.WeakKeyDictionary[Any, LoaderUse] = weakref.WeakKeyDictionary()
        self._all: list[LoaderUse] = []
        self._keys: dict[int, set[int]] = {}  # id(use) -> id() of its iterators
        self._current: dict[int, LoaderEpoch] = {}  # id(iterator) -> its pass now

    def built(self, loader: Any, frame: FrameType | None) -> None:
        if len(self._built) < MAX_LOADERS * 4:
            site = call_site(frame)
            self._built[loader] = (site.location if site is not None else None,
                                   loader_origin(frame, loader))

    def iterated(self, loader: Any, iterator: object, step: int, ms: float,
                 frame: FrameType | None) -> None:
        use = self._uses.get(loader)
        if use is None:
            if len(self._all) >= MAX_LOADERS:
                return
            site, origin = self._built.get(loader, (None, {}))
            at = call_site(frame)
            use = self._uses[loader] = LoaderUse(
                site=site, batch_size=_int(getattr(loader, "batch_size", None)),
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
        self._keys.setdefault(id(use), set()).add(id(iterator))
        self._current[id(iterator)] = epoch

    def waited(self, iterator: object, ms: float) -> None:
        epoch = self._current.get(id(iterator))
        if epoch is not None:
            if epoch.batches == 0:
                epoch.first_batch_ms = ms
            epoch.batches += 1

    def exhausted(self, iterator: object, ms: float) -> None:
        # The pass is over: a long run's thousands of epochs keep no iterator here.
        epoch = self._current.pop(id(iterator), None)
        if epoch is not None:
            epoch.end_ms += ms

    def facts(self, training: set[int]) -> list[LoaderUse]:
        """Every loader seen; `training`: the iterators (by id) that fed the steps."""
        for use in self._all:
            use.training = bool(self._keys.get(id(use), set()) & training)
        return list(self._all)


MAX_FSDP_UNITS = 4096  # FSDP2 units followed; a model sharded finer is described by these


class FsdpWatch:
    """FSDP2's units (hooks.py wraps its parameter group's constructor, which each
    fully_shard(...) call makes one of): where the script sharded, and each unit's parameter
    bytes, noted as built; whether each reshards after forward is read at the next optimizer
    step, after FSDP's lazy init at the first forward has kept the root unit gathered."""

    def __init__(self) -> None:
        self._units: list[tuple[weakref.ref[Any], str | None, int]] = []
        self._facts: FsdpFacts | None = None
        self._settled = 0  # units described in _facts

    def built(self, group: Any, frame: FrameType | None, param_bytes: int) -> None:
        if len(self._units) < MAX_FSDP_UNITS:
            site = call_site(frame)
            self._units.append((weakref.ref(group), site.location if site is not None else None,
                                param_bytes))

    def stepped(self) -> None:
        if self._settled == len(self._units):
            return
        self._settled = len(self._units)
        sites: dict[str | None, FsdpUnits] = {}
        shard_size = 1
        for ref, site, param_bytes in self._units:
            group = ref()
            if group is None:
                continue
            resharding = getattr(group, "post_forward_mesh_info", None) is not None
            shard_size = max(shard_size, int(getattr(getattr(group, "mesh_info", None),
                                                     "shard_mesh_size", 1) or 1))
            units = sites.setdefault(site, FsdpUnits(site, 0, 0, 0, 0))
            units.units += 1
            units.param_bytes += param_bytes
            if resharding:
                units.resharding += 1
                units.resharding_bytes += param_bytes
        self._facts = FsdpFacts(shard_size=shard_size, sites=list(sites.values()))

    def facts(self) -> FsdpFacts | None:
        return self._facts
