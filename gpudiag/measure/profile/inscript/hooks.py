"""What the recorder patches in the script's interpreter to see its steps and work: a global
optimizer step post-hook (the step clock), the optimizer's constructor (the script's line that
builds each one), backward() (a micro-step each), DataLoader construction and iteration (its
settings, the data wait, where each loop is, each pass's start and end), torch.save and
safetensors' savers (blocking saves; the write watch hears of them), and
DistributedDataParallel's constructor (the bytes it all-reduces, and where), and FSDP2's
parameter groups (each fully_shard(...) unit, where, how large). Each patch calls one of the
Recorder's methods (recorder.py); each is made once, however often installed."""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import record_function
from torch.utils.data.dataloader import DataLoader, _BaseDataLoaderIter

from gpudiag.measure.evidence.trace import LOADER_RANGES, MICROSTEP_RANGE
from gpudiag.measure.profile.inscript import writewatch
from gpudiag.measure.profile.inscript.afterimport import when_fsdp_imported

if TYPE_CHECKING:
    from gpudiag.measure.profile.inscript.recorder import Recorder


def install(recorder: Recorder) -> None:
    """Every patch, calling into `recorder`."""
    register_optimizer_step_post_hook(recorder.optimizer_stepped)
    _hook_optimizers(recorder)
    _hook_backward(recorder)
    _hook_loader(recorder)
    _hook_saves(recorder)
    _hook_ddp(recorder)
    _hook_fsdp(recorder)


def _wrap(owner: Any, name: str, around: Callable[[Callable[..., Any]], Callable[..., Any]],
          ) -> None:
    original = getattr(owner, name)
    if getattr(original, "__gpudiag__", False):
        return
    wrapped = around(original)
    wrapped.__gpudiag__ = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapped)


def _hook_optimizers(recorder: Recorder) -> None:
    # Every torch.optim optimizer's constructor calls Optimizer.__init__ (a subclass's own
    # through super()): the frame above is the class's constructor, called from the script.
    def noted_init(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            recorder.optimizer_built(self, sys._getframe(1))
        return __init__

    _wrap(torch.optim.Optimizer, "__init__", noted_init)


def _hook_backward(recorder: Recorder) -> None:
    # Each backward() is a micro-step: under gradient accumulation several make one optimizer
    # step, and whether DDP all-reduced in each (no_sync) is read from the window's ranges
    # (gpudiag/measure/evidence/trace.py). Tensor.backward calls torch.autograd.backward.
    def marked(original: Callable[..., Any]) -> Callable[..., Any]:
        def backward(*args: Any, **kwargs: Any) -> Any:
            recorder.backward_called(sys._getframe(1))
            with record_function(MICROSTEP_RANGE):
                return original(*args, **kwargs)
        return backward

    _wrap(torch.autograd, "backward", marked)


def _hook_loader(recorder: Recorder) -> None:
    # A pass's start (worker processes spawned, or persistent ones reset), each batch's wait,
    # and the call that finds the pass over (workers shut down) all hold the training thread.
    def timed_next(original: Callable[..., Any]) -> Callable[..., Any]:
        def __next__(self: Any) -> Any:
            start = time.perf_counter()
            try:
                batch = original(self)
            except StopIteration:
                recorder.loader_exhausted(self, (time.perf_counter() - start) * 1e3)
                raise
            recorder.data_waited((time.perf_counter() - start) * 1e3, batch, self)
            return batch
        return __next__

    def sited_iter(original: Callable[..., Any]) -> Callable[..., Any]:
        def __iter__(self: Any) -> Any:
            start = time.perf_counter()
            with record_function(LOADER_RANGES[1]):  # (its seeds' .item() are no syncs)
                iterator = original(self)
            recorder.loader_iterated(iterator, sys._getframe(1), loader=self,
                                     ms=(time.perf_counter() - start) * 1e3)
            return iterator
        return __iter__

    def noted_init(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            recorder.loader_built(self, sys._getframe(1))
        return __init__

    _wrap(_BaseDataLoaderIter, "__next__", timed_next)
    _wrap(DataLoader, "__iter__", sited_iter)
    _wrap(DataLoader, "__init__", noted_init)


def _hook_saves(recorder: Recorder) -> None:
    def timed_save(original: Callable[..., Any]) -> Callable[..., Any]:
        def save(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                target = args[1] if len(args) > 1 else kwargs.get("f", kwargs.get("filename"))
                recorder.saved((time.perf_counter() - start) * 1e3, target)
                writewatch.written(target)  # native code wrote it: no audit event saw it
        return save

    _wrap(torch, "save", timed_save)
    # Model weights are often written with safetensors (transformers' save_pretrained); hooked
    # here, before the script imports the names it binds (from safetensors.torch import ...).
    if importlib.util.find_spec("safetensors") is not None:
        import safetensors.torch  # noqa: PLC0415 (only where installed)

        for name in ("save_file", "save_model"):
            _wrap(safetensors.torch, name, timed_save)


def _hook_ddp(recorder: Recorder) -> None:
    def noted_ddp(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            recorder.ddp_wrapped(self, sys._getframe(1))
        return __init__

    _wrap(DistributedDataParallel, "__init__", noted_ddp)


def _hook_fsdp(recorder: Recorder) -> None:
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
            recorder.fsdp_grouped(self, sys._getframe(1), param_bytes)
        return __init__

    when_fsdp_imported(lambda group: _wrap(group, "__init__", noted_group))
