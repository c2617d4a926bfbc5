"""The optimizers a script builds and steps, as it built them: each one's implementation
(torch.optim's `foreach`/`fused`, resolved the way its step() resolves them), its parameter
tensors, the script's lines that build and step it, and what built it (transformers' Trainer:
frameworks.py). Read from the live objects, never changed (the remedies, remedies.py, are what
change them, for one run). Their steps are also the recorder's step clock, its own hook."""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch.optim.optimizer import (
    _default_to_fused_or_foreach,
    register_optimizer_step_post_hook,
)

from gpudiag.measure.evidence.source import call_site
from gpudiag.measure.profile.inscript.frameworks import optimizer_origin
from gpudiag.measure.profile.inscript.watches import StageDraft, StepClock, Watch, patch
from gpudiag.model.facts import OptimizerFacts, OptimizerImpl

MAX_OPTIMIZERS = 8  # optimizers described; a script building more (per task, per epoch) repeats


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


class OptimizersWatch(Watch):
    """The optimizers a script builds (Optimizer.__init__, patched) and steps (a global step
    post-hook, run before the recorder's step clock): each described at its first step, when
    its tensors are where training puts them; its steps counted."""

    label = "optimizers"

    def __init__(self, clock: StepClock) -> None:
        super().__init__(clock)
        self._built: weakref.WeakKeyDictionary[Any, tuple[str | None, dict[str, str]]] = \
            weakref.WeakKeyDictionary()
        self._seen: weakref.WeakKeyDictionary[Any, OptimizerFacts] = \
            weakref.WeakKeyDictionary()
        self._facts: list[OptimizerFacts] = []

    def install(self) -> None:
        _hook_optimizers(self)
        register_optimizer_step_post_hook(self._stepped)

    def built(self, optimizer: torch.optim.Optimizer, frame: FrameType | None) -> None:
        if len(self._built) < MAX_OPTIMIZERS * 4:
            site = call_site(frame)
            self._built[optimizer] = (site.location if site is not None else None,
                                      optimizer_origin(frame))

    def _stepped(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.stepped(optimizer, sys._getframe(1))

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

    def fill(self, draft: StageDraft) -> None:
        draft.script.optimizers = list(self._facts)


WATCH = OptimizersWatch


def _hook_optimizers(watch: OptimizersWatch) -> None:
    # Every torch.optim optimizer's constructor calls Optimizer.__init__ (a subclass's own
    # through super()): the frame above is the class's constructor, called from the script.
    def noted_init(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            watch.built(self, sys._getframe(1))
        return __init__

    patch(torch.optim.Optimizer, "__init__", noted_init)
