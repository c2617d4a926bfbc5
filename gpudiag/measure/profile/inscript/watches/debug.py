"""Debug settings a script leaves on while it trains: autograd's anomaly detection, deterministic
algorithms (torch's and cuDNN's flag), CUDA_LAUNCH_BLOCKING=1, a profiler the script runs
itself, autograd's NVTX ranges. Each slows every step it is on for; the setters are wrapped to
note the script's line that turned each on, and each step boundary notes which were on, read
from torch's own state (what was switched off again costs nothing)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.autograd.profiler as autograd_profiler

from gpudiag.measure.evidence.source import call_site, frame_role
from gpudiag.measure.profile.inscript.watches import StageDraft, StepClock, Watch, patch
from gpudiag.model.facts import DebugKind, DebugSetting

LAUNCH_BLOCKING = "CUDA_LAUNCH_BLOCKING"


def launch_blocking() -> bool:
    """Whether the environment turns CUDA's launch queue off (any value but empty and 0)."""
    return os.environ.get(LAUNCH_BLOCKING, "").strip() not in ("", "0")


def site_of(frame: FrameType | None) -> str | None:
    site = call_site(frame)
    return site.location if site is not None else None


def started_by_gpudiag(frame: FrameType | None) -> bool:
    """Whether the code that called into torch at `frame` (torch's own frames passed) is
    gpudiag's: its own profiler window, never the script's setting."""
    while frame is not None and frame_role(frame.f_code.co_filename) == "torch":
        frame = frame.f_back
    return frame is not None and frame_role(frame.f_code.co_filename) == "gpudiag"


@dataclass
class _Seen:
    """One setting: what last turned it on, and the steps it was on at the end of."""

    set_by: str
    site: str | None
    steps: set[int]


class DebugWatch(Watch):
    """The debug settings' setters wrapped (each notes its caller's line when it turns one on),
    and at each step boundary which were on."""

    label = "debug settings"

    def __init__(self, clock: StepClock) -> None:
        super().__init__(clock)
        self._seen: dict[DebugKind, _Seen] = {}
        self._profilers: dict[int, tuple[DebugKind, str, str | None]] = {}  # open ones, by id

    def turned_on(self, kind: DebugKind, set_by: str, frame: FrameType | None) -> None:
        """`kind` switched from off to on at `frame`'s line: on for the step in progress too
        (a `with detect_anomaly():` around the forward is off again at the step's end)."""
        seen = self._seen.get(kind)
        site = site_of(frame)
        if seen is None:
            seen = self._seen[kind] = _Seen(set_by, site, set())
        else:
            seen.set_by, seen.site = set_by, site
        seen.steps.add(self.clock.steps)

    def opened(self, profiler: object, kind: DebugKind, set_by: str,
               frame: FrameType | None) -> None:
        if not started_by_gpudiag(frame):
            self._profilers[id(profiler)] = (kind, set_by, site_of(frame))
            self.turned_on(kind, set_by, frame)

    def closed(self, profiler: object) -> None:
        self._profilers.pop(id(profiler), None)

    def install(self) -> None:
        if launch_blocking():
            self._seen["launch-blocking"] = _Seen(
                f"{LAUNCH_BLOCKING}={os.environ[LAUNCH_BLOCKING]}", None, set())
        _hook_setters(self)
        _hook_profilers(self)

    def on_now(self) -> list[DebugKind]:
        on: list[DebugKind] = []
        if torch.is_anomaly_enabled():
            on.append("anomaly-detection")
        if torch.are_deterministic_algorithms_enabled():
            on.append("deterministic-algorithms")
        if torch.backends.cudnn.deterministic:
            on.append("cudnn-deterministic")
        if "launch-blocking" in self._seen:
            on.append("launch-blocking")
        on += [kind for kind, _, _ in self._profilers.values()]
        return on

    def step_ended(self) -> None:
        step = self.clock.steps - 1
        for kind in self.on_now():
            seen = self._seen.get(kind)
            if seen is None:  # on before the watch installed (a library's default): unnamed
                seen = self._seen[kind] = _Seen(kind, None, set())
            seen.steps.add(step)

    def fill(self, draft: StageDraft) -> None:
        draft.script.debug = [
            DebugSetting(kind=kind, set_by=seen.set_by, site=seen.site,
                         steps_on=len(seen.steps),
                         timed_steps_on=sum(1 for s in seen.steps if s in draft.timed))
            for kind, seen in self._seen.items() if seen.steps]


WATCH = DebugWatch


def _hook_setters(watch: DebugWatch) -> None:
    # Each setter runs first: what it set is read back from torch, so a setting a remedy keeps
    # off (--try-fixes, whose wrapper this one wraps) is not reported on.
    # set_detect_anomaly(True) and detect_anomaly() both call torch.set_anomaly_enabled
    # (torch/autograd/anomaly_mode.py): the frame above it is theirs, or the script's.
    def anomaly(original: Callable[..., Any]) -> Callable[..., Any]:
        def set_anomaly_enabled(enabled: bool, *args: Any, **kwargs: Any) -> Any:
            was = torch.is_anomaly_enabled()
            result = original(enabled, *args, **kwargs)
            if torch.is_anomaly_enabled() and not was:
                frame = sys._getframe(1)
                how = ("torch.autograd.detect_anomaly()"
                       if frame.f_code.co_name == "__enter__"
                       else "torch.autograd.set_detect_anomaly(True)")
                watch.turned_on("anomaly-detection", how, frame)
            return result
        return set_anomaly_enabled

    def deterministic(original: Callable[..., Any]) -> Callable[..., Any]:
        def use_deterministic_algorithms(mode: bool, *args: Any, **kwargs: Any) -> Any:
            was = torch.are_deterministic_algorithms_enabled()
            result = original(mode, *args, **kwargs)
            if torch.are_deterministic_algorithms_enabled() and not was:
                watch.turned_on("deterministic-algorithms",
                                "torch.use_deterministic_algorithms(True)", sys._getframe(1))
            return result
        return use_deterministic_algorithms

    def cudnn(original: Callable[..., Any]) -> Callable[..., Any]:
        def __setattr__(self: object, name: str, value: object) -> None:
            was = torch.backends.cudnn.deterministic
            original(self, name, value)
            if name == "deterministic" and torch.backends.cudnn.deterministic and not was:
                watch.turned_on("cudnn-deterministic",
                                "torch.backends.cudnn.deterministic = True", sys._getframe(1))
        return __setattr__

    patch(torch, "set_anomaly_enabled", anomaly)
    patch(torch, "use_deterministic_algorithms", deterministic)
    patch(type(torch.backends.cudnn), "__setattr__", cudnn)


def _hook_profilers(watch: DebugWatch) -> None:
    """torch.profiler.profile (start/stop, which its `with` calls), the legacy
    torch.autograd.profiler.profile and emit_nvtx (their `with`)."""
    def opening(kind: DebugKind, set_by: str) -> Callable[[Callable[..., Any]],
                                                          Callable[..., Any]]:
        def around(original: Callable[..., Any]) -> Callable[..., Any]:
            def opened(self: Any, *args: Any, **kwargs: Any) -> Any:
                result = original(self, *args, **kwargs)
                if getattr(self, "enabled", True):  # a remedy may have disabled it
                    watch.opened(self, kind, set_by, sys._getframe(1))
                return result
            return opened
        return around

    def closing(original: Callable[..., Any]) -> Callable[..., Any]:
        def closed(self: Any, *args: Any, **kwargs: Any) -> Any:
            watch.closed(self)
            return original(self, *args, **kwargs)
        return closed

    patch(torch.profiler.profile, "start", opening("profiler", "torch.profiler.profile(...)"))
    patch(torch.profiler.profile, "stop", closing)
    patch(autograd_profiler.profile, "__enter__",
          opening("profiler", "torch.autograd.profiler.profile(...)"))
    patch(autograd_profiler.profile, "__exit__", closing)
    patch(autograd_profiler.emit_nvtx, "__enter__",
          opening("emit-nvtx", "torch.autograd.profiler.emit_nvtx()"))
    patch(autograd_profiler.emit_nvtx, "__exit__", closing)
