"""FSDP2 as the script sharded: each fully_shard(...) unit (its parameter group), where the script
made it, its parameter bytes, and whether it reshards after forward. FSDP2's modules take ~1.5 s
to import: they are patched once the script imports them (afterimport.py), here and by the
remedy that keeps units gathered (remedies.py), never imported by gpudiag."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from gpudiag.measure.evidence.source import call_site
from gpudiag.measure.profile.inscript.afterimport import when_imported
from gpudiag.measure.profile.inscript.watches import StageDraft, StepClock, Watch, patch
from gpudiag.model.facts import FsdpFacts, FsdpUnits

# FSDP2's parameter group, one per fully_shard(...) call (torch 2.6 moved it from _composable).
FSDP_PARAM_GROUP_MODULES = ("torch.distributed.fsdp._fully_shard._fsdp_param_group",
                            "torch.distributed._composable.fsdp._fsdp_param_group")
MAX_FSDP_UNITS = 4096  # FSDP2 units followed; a model sharded finer is described by these


class FsdpWatch(Watch):
    """FSDP2's units (its parameter group's constructor, which each fully_shard(...) call makes
    one of, patched): where the script sharded, and each unit's parameter bytes, noted as
    built; whether each reshards after forward is read at the next optimizer step, after
    FSDP's lazy init at the first forward has kept the root unit gathered."""

    label = "FSDP"

    def __init__(self, clock: StepClock) -> None:
        super().__init__(clock)
        self._units: list[tuple[weakref.ref[Any], str | None, int]] = []
        self._facts: FsdpFacts | None = None
        self._settled = 0  # units described in _facts

    def install(self) -> None:
        _hook_fsdp(self)
        register_optimizer_step_post_hook(lambda *_: self.settle())

    def built(self, group: Any, frame: FrameType | None, param_bytes: int) -> None:
        if len(self._units) < MAX_FSDP_UNITS:
            site = call_site(frame)
            self._units.append((weakref.ref(group), site.location if site is not None else None,
                                param_bytes))

    def settle(self) -> None:
        """The units built since the last optimizer step, described."""
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

    def fill(self, draft: StageDraft) -> None:
        self.settle()  # units built after the last optimizer step (gpudiag.step() clocks)
        draft.script.fsdp = self._facts


WATCH = FsdpWatch


def _hook_fsdp(watch: FsdpWatch) -> None:
    def noted_group(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            # Counted before the constructor shards them: full tensors still (a torch whose
            # constructor takes other arguments first gets no count, and FSDP its own error).
            params = args[0] if args else kwargs.get("params", ())
            try:
                param_bytes = sum(p.numel() * p.element_size() for p in params)
            except (TypeError, AttributeError):
                param_bytes = 0
            original(self, *args, **kwargs)
            watch.built(self, sys._getframe(1), param_bytes)
        return __init__

    when_fsdp_imported(lambda group: patch(group, "__init__", noted_group))


def when_fsdp_imported(callback: Callable[[type], None]) -> None:
    """`callback(FSDPParamGroup)` once FSDP2 is imported, under whichever name this torch has
    it (each class once, where both modules hold it)."""
    seen: set[int] = set()

    def found(module: ModuleType) -> None:
        group = getattr(module, "FSDPParamGroup", None)
        if isinstance(group, type) and id(group) not in seen:
            seen.add(id(group))
            callback(group)

    when_imported(FSDP_PARAM_GROUP_MODULES, found)
