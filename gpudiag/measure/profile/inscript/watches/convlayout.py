"""The memory format a script's convolutions run in: the first nn.Conv2d call's, with the
script's lines that built the model holding it and called that model (GD306 names the format
there). Cheap: Conv2d.__init__ and Conv2d.forward are wrapped until the first of each, then
given back, so a script's later convolutions (and a script with none but its first build)
run torch's own code."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import nn

from gpudiag.measure.evidence.source import call_site
from gpudiag.measure.profile.inscript.watches import StageDraft, StepClock, Watch
from gpudiag.model.facts import ConvLayout, MemoryFormat

_MODULE_CALL = ("_call_impl", "_wrapped_call_impl")


def memory_format(x: torch.Tensor, weight: torch.Tensor) -> MemoryFormat:
    """The format a convolution of `x` by `weight` runs in: channels_last where either is
    (torch's cudnn_conv_suggest_memory_format), else NCHW where `x` is contiguous."""
    if x.dim() != 4:
        return "other"
    if any(t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
           for t in (x, weight)):
        return "channels_last"
    return "channels_first" if x.is_contiguous() else "other"


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _outermost(frame: FrameType | None, is_it: Callable[[FrameType], bool]) -> FrameType | None:
    found = None
    while frame is not None:
        if is_it(frame):
            found = frame
        frame = frame.f_back
    return found


def _module_init(frame: FrameType) -> bool:
    return frame.f_code.co_name == "__init__" and \
        isinstance(frame.f_locals.get("self"), nn.Module)


def _module_call(frame: FrameType) -> bool:
    return frame.f_code.co_name in _MODULE_CALL and \
        frame.f_code.co_filename.endswith("module.py")


def _line_above(frame: FrameType | None) -> str | None:
    """The script's line that led to `frame` (the outermost module built or called)."""
    site = call_site(frame.f_back) if frame is not None else None
    return site.location if site is not None else None


class ConvLayoutWatch(Watch):
    """nn.Conv2d's first construction and first forward, watched once each."""

    label = "convolution layout"

    def __init__(self, clock: StepClock) -> None:
        super().__init__(clock)
        self.built_at: str | None = None
        self.layout: ConvLayout | None = None

    def install(self) -> None:
        init, forward = nn.Conv2d.__init__, nn.Conv2d.forward

        def first_init(conv: nn.Conv2d, *args: Any, **kwargs: Any) -> None:
            setattr(nn.Conv2d, "__init__", init)  # noqa: B010  (mypy refuses a method's assignment)
            self.built_at = _line_above(_outermost(sys._getframe(1), _module_init))
            init(conv, *args, **kwargs)

        def first_forward(conv: nn.Conv2d, *args: Any, **kwargs: Any) -> torch.Tensor:
            x = args[0] if args else kwargs.get("input")  # forward(input): by keyword too
            if isinstance(x, torch.Tensor) and not torch.compiler.is_compiling():
                setattr(nn.Conv2d, "forward", forward)  # noqa: B010  (as above)
                self.layout = ConvLayout(
                    memory_format=memory_format(x, conv.weight), device=x.device.type,
                    dtype=str(_compute_dtype(x)), built_at=self.built_at,
                    called_at=_line_above(_outermost(sys._getframe(1), _module_call)))
            return forward(conv, *args, **kwargs)

        # Wrapped for one call each, not by watches.patch (which wraps for good); as patch's,
        # the wrappers keep the originals' signatures and names (frameworks read them).
        functools.update_wrapper(first_init, init)
        functools.update_wrapper(first_forward, forward)
        setattr(nn.Conv2d, "__init__", first_init)  # noqa: B010  (as above)
        setattr(nn.Conv2d, "forward", first_forward)  # noqa: B010  (as above)

    def fill(self, draft: StageDraft) -> None:
        draft.script.conv_layout = self.layout


WATCH = ConvLayoutWatch
