"""DistributedDataParallel as the script built it: the gradient bytes it all-reduces per step,
its buckets, where the script wraps its model and calls backward() (where gradient
accumulation's knob goes), and the link's bandwidth for this job, probed by every rank at the
profiler window's close. Each backward() is marked a micro-step: under gradient accumulation
several make one optimizer step, and whether DDP all-reduced in each (no_sync) is read from
the window's ranges (gpudiag/measure/evidence/trace.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function

from gpudiag.measure.evidence.source import call_site
from gpudiag.measure.evidence.trace import MICROSTEP_RANGE
from gpudiag.measure.profile.inscript.watches import StageDraft, StepClock, Watch, patch
from gpudiag.measure.stages.ddp.probe import allreduce_probe
from gpudiag.model.facts import DdpJobFacts, LinkProbe


class DdpWatch(Watch):
    """DistributedDataParallel's constructor and torch.autograd.backward, patched."""

    label = "DDP"

    def __init__(self, clock: StepClock) -> None:
        super().__init__(clock)
        self.job: DdpJobFacts | None = None  # what a DistributedDataParallel wrap told us
        self.backward_site: str | None = None
        self.backward_seen = False

    def install(self) -> None:
        _hook_ddp(self)
        _hook_backward(self)

    def wrapped(self, model: Any, frame: FrameType | None = None) -> None:
        """A DistributedDataParallel was built: note the bytes it all-reduces per step, and
        where."""
        params = [p for p in model.module.parameters() if p.requires_grad]
        cap = getattr(model, "bucket_bytes_cap", None)
        site = call_site(frame)
        self.job = DdpJobFacts(grad_bytes=sum(p.numel() * p.element_size() for p in params),
                               bucket_mb=cap / 2**20 if cap else None,
                               world_size=dist.get_world_size(),
                               backend=str(dist.get_backend()),
                               built_at=site.location if site is not None else None,
                               backward_at=self.backward_site)

    def backward_called(self, frame: FrameType) -> None:
        """The script's first backward() call: where gradient accumulation's knob goes (looked
        for once: every backward() comes here)."""
        if not self.backward_seen:
            self.backward_seen = True
            site = call_site(frame)
            self.backward_site = site.location if site is not None else None
            if self.job is not None:
                self.job.backward_at = self.backward_site

    def window_closed(self) -> None:
        """Every rank closes its window at the same optimizer step (DDP keeps them in step),
        so each can join one all-reduce probe there: the link's bandwidth for this job."""
        if self.job is None or self.job.world_size < 2:
            return
        device = (torch.device("cuda", torch.cuda.current_device())
                  if self.job.backend == "nccl" else torch.device("cpu"))
        probe = allreduce_probe(self.job.grad_bytes, device)
        # The probe reports a plain dict (it also goes into the DDP worker's JSON part): the
        # same fields as LinkProbe, so facts hold it as one (and serialise it the same).
        self.job.allreduce_probe = None if probe is None else LinkProbe(**probe)

    def fill(self, draft: StageDraft) -> None:
        draft.facts.ddp_job = self.job


WATCH = DdpWatch


def _hook_ddp(watch: DdpWatch) -> None:
    def noted_ddp(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            watch.wrapped(self, sys._getframe(1))
        return __init__

    patch(DistributedDataParallel, "__init__", noted_ddp)


def _hook_backward(watch: DdpWatch) -> None:
    # Tensor.backward calls torch.autograd.backward.
    def marked(original: Callable[..., Any]) -> Callable[..., Any]:
        def backward(*args: Any, **kwargs: Any) -> Any:
            watch.backward_called(sys._getframe(1))
            with record_function(MICROSTEP_RANGE):
                return original(*args, **kwargs)
        return backward

    patch(torch.autograd, "backward", marked)
