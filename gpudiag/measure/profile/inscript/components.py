"""Framework components the recorder reads in the script's process, as the script built them:
each optimizer's implementation (torch.optim's `foreach`/`fused`, resolved the way its step()
resolves them), its parameter tensors, and the script's lines that build and step it. Read
from the live objects, never changed (the fused-optimizer remedy, remedies.py, is what
changes them, for one run)."""

from __future__ import annotations

import inspect
import weakref
from types import FrameType
from typing import Any

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach

from gpudiag.measure.evidence.source import call_site
from gpudiag.measure.profile.inscript.frameworks import optimizer_origin
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
