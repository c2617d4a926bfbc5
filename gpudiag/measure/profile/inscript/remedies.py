"""Remedies applied inside a profiled script, for one run (`gpudiag profile --try-fixes`).

Each is applied at start-up, before the script's first line, by replacing or wrapping what the
script will call (torch.save, DataLoader.__init__, torch.cuda.empty_cache, ...), and records
what it saw in the script (its record in a `RemedyEvidence`: a DataLoader's workers before and
after, calls skipped, saves written in the background), so the report shows the fix took
effect. The catalog (what each remedy is, which findings call for it, the permanent change) and
the records are gpudiag/model/remedies.py.

Also here: the first steps' losses, recorded for the equivalence check (the value every
backward() starts from, up to a count), and the seed every run of one --try-fixes shares.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import torch
import torch.autograd.profiler as autograd_profiler
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import _default_to_fused_or_foreach, register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.data import DataLoader, IterableDataset

from gpudiag.measure.evidence.source import call_site
from gpudiag.measure.profile.inscript.frameworks import loader_origin
from gpudiag.measure.profile.inscript.memoryremedies import MEMORY_APPLIERS
from gpudiag.measure.profile.inscript.watches.debug import LAUNCH_BLOCKING, launch_blocking
from gpudiag.measure.profile.inscript.watches.fsdp import when_fsdp_imported
from gpudiag.model.remedies import (
    REMEDIES,
    AllocatorConfRecord,
    AsyncSaveRecord,
    BatchSeen,
    Bf16AutocastRecord,
    ChannelsLastRecord,
    CompileModelRecord,
    DdpNoSyncRecord,
    DebugOff,
    DebugOffRecord,
    FsdpKeepGatheredRecord,
    FusedOptimizerRecord,
    LargerBatchRecord,
    LoaderRecord,
    LoaderSeen,
    LoaderSettings,
    NoEmptyCacheRecord,
    OptimizerSeen,
    PinnedRecord,
    RemedyEvidence,
    Tf32Overruled,
    Tf32Record,
)

MAX_LOADER_WORKERS = 8
LOADER_PREFETCH = 4


def _site(depth: int = 2) -> str | None:
    """The script's line that called into what a remedy wraps (`depth` frames up)."""
    site = call_site(sys._getframe(depth))
    return site.location if site is not None else None


def _wrap(owner: Any, name: str, around: Callable[[Callable[..., Any]], Callable[..., Any]],
          ) -> None:
    # Not the watches' patch, which wraps once: remedies stack (loader and pinned both wrap
    # DataLoader.__init__ in a combined run), and the watches then wrap what they made.
    # The wrapper names what it wraps (__wrapped__): inspect.signature of the stack is then
    # DataLoader's own, which the next wrapper binds its arguments to.
    original = getattr(owner, name)
    setattr(owner, name, functools.update_wrapper(around(original), original))


# --- tf32 ---------------------------------------------------------------------------------

def _tf32(seen: RemedyEvidence) -> Callable[[], None]:
    """TF32 on, and kept on: a script that switches it off itself (the usual cause of the
    finding) is overruled for this run, and the line that did it is noted (the one to edit)."""
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    record = seen.tf32 = Tf32Record()

    def overruled(what: str) -> None:
        record.kept_on.append(Tf32Overruled(site=_site(depth=3), set=what))

    def guard(original: Callable[[object, str, object], None]) -> Callable[..., None]:
        def __setattr__(self: object, name: str, value: object) -> None:
            if (name == "allow_tf32" and value is False) or (
                    name == "fp32_precision" and value == "ieee"):
                overruled(f"{name} = {value!r}")
                return
            original(self, name, value)
        return __setattr__

    _wrap(type(torch.backends.cuda.matmul), "__setattr__", guard)
    _wrap(type(torch.backends.cudnn), "__setattr__", guard)

    def around(original: Callable[[str], None]) -> Callable[[str], None]:
        def set_float32_matmul_precision(precision: str) -> None:
            if precision == "highest":
                overruled(f"set_float32_matmul_precision({precision!r})")
                return
            original(precision)
        return set_float32_matmul_precision

    _wrap(torch, "set_float32_matmul_precision", around)

    def observe() -> None:
        record.matmul_precision = torch.get_float32_matmul_precision()
        record.cudnn_allow_tf32 = bool(torch.backends.cudnn.allow_tf32)
    return observe


# --- bf16 autocast around the outermost module call ----------------------------------------

def _bf16_autocast(seen: RemedyEvidence) -> Callable[[], None]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = threading.local()
    record = seen.bf16_autocast = Bf16AutocastRecord(device=device)

    def enter(module: torch.nn.Module, _args: Any) -> None:
        depth = getattr(state, "depth", 0)
        if depth == 0:
            state.context = torch.autocast(device, dtype=torch.bfloat16)
            state.context.__enter__()
            record.forwards += 1
            record.module = record.module or type(module).__name__
        state.depth = depth + 1

    def leave(_module: torch.nn.Module, args: Any, output: Any) -> Any:
        state.depth = getattr(state, "depth", 1) - 1
        if state.depth != 0:
            return None
        state.context.__exit__(None, None, None)
        # What leaves the autocast region comes back in the caller's dtype (as Accelerate's
        # convert_outputs_to_fp32 does): `F.mse_loss(model(x), x)` would otherwise mix a
        # bf16 output with the caller's fp32 tensors.
        floats = [a.dtype for a in tree_leaves(args)
                  if isinstance(a, torch.Tensor) and a.is_floating_point()]
        caller = floats[0] if floats else torch.get_default_dtype()
        if caller == torch.bfloat16:
            return None
        return tree_map_only(torch.Tensor, lambda t: t.to(caller) if t.dtype == torch.bfloat16
                             else t, output)

    torch.nn.modules.module.register_module_forward_pre_hook(enter)
    torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)
    return lambda: None


# --- the model compiled --------------------------------------------------------------------

MAX_COMPILED = 4  # outermost modules compiled: a model, perhaps an EMA copy or a critic


def _compile_model(seen: RemedyEvidence) -> Callable[[], None]:
    """Each outermost module with parameters compiled in place at its first call
    (nn.Module.compile: its later calls run the compiled forward; the first runs eager). The
    hooks step aside while Dynamo traces (it inlines global hooks into the compiled code)."""
    record = seen.compile_model = CompileModelRecord()
    state = threading.local()
    done: set[int] = set()

    def enter(module: torch.nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        depth = getattr(state, "depth", 0)
        state.depth = depth + 1
        if depth or id(module) in done or len(record.modules) >= MAX_COMPILED:
            return
        done.add(id(module))
        if getattr(module, "_compiled_call_impl", None) is None and \
                next(module.parameters(), None) is not None:
            module.compile()
            record.modules.append(type(module).__name__)
            record.site = record.site or _site(depth=3)

    def leave(_module: torch.nn.Module, _args: Any, _output: Any) -> None:
        if not torch.compiler.is_compiling():
            state.depth = max(0, getattr(state, "depth", 1) - 1)

    torch.nn.modules.module.register_module_forward_pre_hook(enter)
    torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)
    return lambda: None


# --- convolutions in channels_last --------------------------------------------------------

def _to_channels_last(value: Any) -> Any:
    """A 4-D floating-point tensor in channels_last (others as they are)."""
    if isinstance(value, torch.Tensor) and value.dim() == 4 and value.is_floating_point() \
            and not value.is_contiguous(memory_format=torch.channels_last):
        return value.to(memory_format=torch.channels_last)
    return value


def _converts(module: torch.nn.Module, record: ChannelsLastRecord) -> bool:
    """Whether `module`'s calls get channels_last inputs: it holds a Conv2d, converted here
    (in place) unless all its convolutions' weights were channels_last already."""
    convs = [m for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    if not convs:
        return False
    if all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs):
        record.kept.append(type(module).__name__)
        return True
    # nn.Module.to takes memory_format (torch/nn/modules/module.py); its stubs do not say so.
    module.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    record.modules.append(type(module).__name__)
    record.site = record.site or _site(depth=4)
    return True


def _channels_last(seen: RemedyEvidence) -> Callable[[], None]:
    """Each outermost module holding an nn.Conv2d converted to channels_last at its first
    call (nn.Module.to converts its parameters in place: the optimizer keeps them), and the
    4-D floating-point inputs of every call of those modules. The hooks step aside while
    Dynamo traces, as the compile remedy's do."""
    record = seen.channels_last = ChannelsLastRecord()
    state = threading.local()
    converted: dict[int, bool] = {}  # id(module) -> whether its inputs are converted

    def enter(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if torch.compiler.is_compiling():
            return None
        depth = getattr(state, "depth", 0)
        state.depth = depth + 1
        if depth:
            return None
        if id(module) not in converted:
            converted[id(module)] = _converts(module, record)
        if not converted[id(module)]:
            return None
        new = tuple(_to_channels_last(a) for a in args)
        record.inputs += sum(a is not b for a, b in zip(new, args, strict=True))
        return new

    def leave(_module: torch.nn.Module, _args: Any, _output: Any) -> None:
        if not torch.compiler.is_compiling():
            state.depth = max(0, getattr(state, "depth", 1) - 1)

    # A pre-hook may return its module's new arguments (torch's docs); the stub says None.
    torch.nn.modules.module.register_module_forward_pre_hook(cast(Callable[..., None], enter))
    torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)
    return lambda: None


# --- DataLoader settings --------------------------------------------------------------------

_LOADER_SIGNATURE = inspect.signature(DataLoader.__init__)


def _loader_arguments(loader: DataLoader[Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> dict[str, Any]:
    """A DataLoader(...) call's arguments by name, its defaults filled in (the remedies that
    change them rebuild the call from these)."""
    bound = _LOADER_SIGNATURE.bind(loader, *args, **kwargs)
    bound.apply_defaults()
    given = dict(bound.arguments)
    given.pop("self")
    return given


def _loader_options(loaders: list[LoaderSeen],
                    change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Rewrite each map-style DataLoader's arguments with `change`; note every loader, and what
    built it (a framework, from the script's line: frameworks.py, beside this one)."""
    def around(original: Callable[..., None]) -> Callable[..., None]:
        def __init__(self: DataLoader[Any], *args: Any, **kwargs: Any) -> None:
            given = _loader_arguments(self, args, kwargs)
            note = LoaderSeen.of(_site(), loader_origin(sys._getframe(1), self))
            if isinstance(given["dataset"], IterableDataset):
                # More workers would each iterate the whole dataset: not the same training.
                note.kept = "an IterableDataset: worker count left as it was"
            else:
                note.before = LoaderSettings.of(given)
                given = change(given)
                note.after = LoaderSettings.of(given)
            loaders.append(note)
            original(self, **given)
        return __init__

    _wrap(DataLoader, "__init__", around)


def _more_workers(given: dict[str, Any]) -> dict[str, Any]:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = max(given["num_workers"], min(MAX_LOADER_WORKERS, cpus or 1))
    given.update(num_workers=workers, pin_memory=given["pin_memory"] or torch.cuda.is_available())
    if workers > 0:
        given.update(persistent_workers=True, prefetch_factor=max(
            LOADER_PREFETCH, given.get("prefetch_factor") or 0))
    return given


def _loader(seen: RemedyEvidence) -> Callable[[], None]:
    seen.loader = LoaderRecord()
    _loader_options(seen.loader.loaders, _more_workers)
    return lambda: None


def _persistent_workers(seen: RemedyEvidence) -> Callable[[], None]:
    seen.persistent_workers = LoaderRecord()
    _loader_options(seen.persistent_workers.loaders, lambda given: {
        **given, "persistent_workers": given["persistent_workers"] or given["num_workers"] > 0})
    return lambda: None


def _pinned(seen: RemedyEvidence) -> Callable[[], None]:
    record = seen.pinned = PinnedRecord()
    _loader_options(record.loaders, lambda given: {**given, "pin_memory": True})

    def around(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            # Positional non_blocking (to(device, dtype, non_blocking)) is left as written.
            if (self.device.type == "cpu" and "non_blocking" not in kwargs and len(args) < 3
                    and self.is_pinned()):
                kwargs["non_blocking"] = True
                record.non_blocking_copies += 1
            return original(self, *args, **kwargs)
        return to

    _wrap(torch.Tensor, "to", around)
    _wrap(torch.Tensor, "cuda", around)
    return lambda: None


# --- a larger training batch ---------------------------------------------------------------

def _batch_kept(given: dict[str, Any], site: str | None, training: str | None,
                origin: dict[str, str]) -> str | None:
    """Why the larger-batch remedy leaves the DataLoader built at `site` with `given`
    arguments as it was (`training`: the diagnosis run's training loader's line; `origin`:
    what built it, frameworks.loader_origin)."""
    if training is not None and site != training:
        return f"not the training DataLoader (built at {training})"
    if "rebuilt_by" in origin:  # from a loader built here: scaled already
        return f"rebuilt by {origin['rebuilt_by']} from a loader with the larger batch"
    if isinstance(given["dataset"], IterableDataset):
        return "an IterableDataset: its own code decides what a pass holds"
    if given["batch_sampler"] is not None or not isinstance(given["batch_size"], int):
        return "a batch_sampler (or batch_size=None) makes its batches"
    return None


def _larger_batch(seen: RemedyEvidence) -> Callable[[], None]:
    """The training DataLoader built with its batch_size times the plan's factor: the one
    built at the diagnosis run's training loader's line (any map-style one where the plan
    named none); its record arrives with the plan's ask (Applied)."""
    record = seen.larger_batch = seen.larger_batch or LargerBatchRecord()
    def around(original: Callable[..., None]) -> Callable[..., None]:
        def __init__(self: DataLoader[Any], *args: Any, **kwargs: Any) -> None:
            given = _loader_arguments(self, args, kwargs)
            note = BatchSeen(site=_site())
            note.kept = _batch_kept(given, note.site, record.training_site,
                                    loader_origin(sys._getframe(1), self))
            if note.kept is None:
                note.before = given["batch_size"]
                given["batch_size"] = note.after = note.before * record.factor
            record.loaders.append(note)
            original(self, **given)
        return __init__

    _wrap(DataLoader, "__init__", around)
    return lambda: None


# --- empty_cache ---------------------------------------------------------------------------

def _no_empty_cache(seen: RemedyEvidence) -> Callable[[], None]:
    record = seen.no_empty_cache = NoEmptyCacheRecord()

    def around(_original: Callable[[], None]) -> Callable[[], None]:
        def empty_cache() -> None:
            record.calls_skipped += 1
        return empty_cache

    _wrap(torch.cuda, "empty_cache", around)
    _wrap(torch.cuda.memory, "empty_cache", around)
    return lambda: None


# --- fused optimizer -----------------------------------------------------------------------

def _torch_optimizers() -> list[type[torch.optim.Optimizer]]:
    """torch.optim's optimizer classes that take foreach= (fused= too, some of them)."""
    return [cls for cls in vars(torch.optim).values()
            if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
            and "foreach" in inspect.signature(cls).parameters]


def _tensors(params: list[Any]) -> list[torch.Tensor]:
    """The parameter tensors of an optimizer's `params`: tensors, (name, tensor) pairs, or
    parameter groups (dicts) of either."""
    found: list[torch.Tensor] = []
    for item in params:
        inner = item["params"] if isinstance(item, dict) else [item]
        found += [p[1] if isinstance(p, tuple) else p for p in inner]
    return found


def _faster(cls: type[Any], given: dict[str, Any], note: OptimizerSeen) -> None:
    """`given` (the constructor's bound arguments) with fused=True where `cls` and the tensors
    take it, else foreach=True where they take that; `note` says which, or why neither."""
    if isinstance(given["params"], torch.Tensor):  # torch.optim refuses it: left to say so
        note.kept = "params is one tensor, not an iterable of them"
        return
    # Iterables (generators of parameters, groups of them) are read once: kept as lists.
    params = [{**g, "params": list(g["params"])} if isinstance(g, dict) else g
              for g in given["params"]]
    given["params"] = params
    tensors = _tensors(params)
    differentiable = bool(given.get("differentiable"))
    fused, _ = _default_to_fused_or_foreach(tensors, differentiable, use_fused=True)
    _, foreach = _default_to_fused_or_foreach(tensors, differentiable, use_fused=False)
    if given.get("fused"):
        note.kept = "built fused already"
    elif fused and "fused" in inspect.signature(cls).parameters:
        given.update(fused=True, foreach=None)
        note.after = "fused=True"
    elif given.get("foreach"):
        note.kept = "built with foreach=True, and no fused step for these tensors"
    elif foreach:
        given.update(foreach=True)
        note.after = "foreach=True"
    else:
        note.kept = "no fused or foreach step for these tensors' devices"


def _fused_optimizer(seen: RemedyEvidence) -> Callable[[], None]:
    record = seen.fused_optimizer = FusedOptimizerRecord()
    building = threading.local()  # AdamW's constructor calls Adam's: the outermost decides

    def around(cls: type[Any]) -> Callable[[Callable[..., None]], Callable[..., None]]:
        signature = inspect.signature(cls)

        def wrap(original: Callable[..., None]) -> Callable[..., None]:
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                if getattr(building, "active", False):
                    return original(self, *args, **kwargs)
                bound = signature.bind(*args, **kwargs)
                given = dict(bound.arguments)
                chosen = ("fused=True" if given.get("fused") else
                          f"foreach={given['foreach']}" if given.get("foreach") is not None
                          else "default")
                note = OptimizerSeen(site=_site(), name=type(self).__name__, before=chosen)
                _faster(cls, given, note)
                record.optimizers.append(note)
                building.active = True
                try:
                    original(self, **given)
                finally:
                    building.active = False
            return __init__
        return wrap

    for cls in _torch_optimizers():
        _wrap(cls, "__init__", around(cls))
    return lambda: None


# --- asynchronous torch.save ---------------------------------------------------------------

class _BackgroundSaver:
    """torch.save to a path: a snapshot of the tensors on the host now, the file written by one
    background thread; a save waits for the one before it (at most one snapshot is held), and
    the process waits for the last one before it exits."""

    def __init__(self, original: Callable[..., Any], record: AsyncSaveRecord) -> None:
        self.original, self.record = original, record
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="gpudiag-save")
        self.pending: Future[Any] | None = None
        atexit.register(self.flush)

    def __call__(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(f, (str, os.PathLike)):  # a buffer the script reads right after
            self.record.kept_blocking += 1
            return self.original(obj, f, *args, **kwargs)
        self.flush()
        snapshot = _snapshot(obj, {})
        self.pending = self.executor.submit(self.original, snapshot, f, *args, **kwargs)
        self.record.saves += 1
        if self.record.saves == 1:
            self.record.site = _site()
        return None

    def flush(self) -> None:
        if self.pending is None:
            return
        start = time.perf_counter()
        try:
            self.pending.result()
        except Exception as exc:  # the file the script asked for was not written: say so
            self.record.errors.append(f"{type(exc).__name__}: {exc}")
            print(f"gpudiag profile: a background torch.save failed: {exc}", file=sys.stderr)
        self.record.waited_ms += (time.perf_counter() - start) * 1e3
        self.pending = None


def _snapshot(value: Any, seen: dict[tuple[Any, ...], torch.Tensor]) -> Any:
    """`value` with every tensor copied to the host (tied tensors stay tied)."""
    if isinstance(value, torch.Tensor):
        key = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(),
               tuple(value.shape), value.stride(), value.dtype)
        if key not in seen:
            seen[key] = value.detach().to("cpu", copy=True)
        return seen[key]
    if isinstance(value, dict):
        return type(value)((k, _snapshot(v, seen)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_snapshot(v, seen) for v in value)
    return value


def _async_save(seen: RemedyEvidence) -> Callable[[], None]:
    seen.async_save = AsyncSaveRecord()
    saver = _BackgroundSaver(torch.save, seen.async_save)

    def around(_original: Callable[..., None]) -> Callable[..., None]:
        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            saver(obj, f, *args, **kwargs)
        return save  # a function, as torch.save is, that names it (_wrap)

    _wrap(torch, "save", around)
    return saver.flush


# --- FSDP2 without resharding after forward ---------------------------------------------------

def _fsdp_keep_gathered(seen: RemedyEvidence) -> Callable[[], None]:
    """Each FSDP2 parameter group built without a post-forward mesh: what
    FSDPModule.set_reshard_after_forward(False) sets, from the start (its lazy init then keeps
    it: the root's default is the same)."""
    record = seen.fsdp_keep_gathered = FsdpKeepGatheredRecord()

    def around(original: Callable[..., None]) -> Callable[..., None]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            if getattr(self, "post_forward_mesh_info", None) is None:
                record.kept += 1
                return
            self.post_forward_mesh_info = None
            record.units += 1
            record.site = record.site or _site()
        return __init__

    when_fsdp_imported(lambda group: _wrap(group, "__init__", around))
    return lambda: None


# --- DDP gradient accumulation under no_sync ---------------------------------------------------

def _bucketed(grads: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """`grads` in buckets of one device and dtype, each up to `cap` bytes (DDP's own sizes)."""
    buckets: list[list[torch.Tensor]] = []
    open_: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]] = {}
    for grad in grads:
        bucket, size = open_.get((grad.device, grad.dtype), ([], [0]))
        if bucket and size[0] + grad.numel() * grad.element_size() > cap:
            bucket, size = [], [0]
        if not bucket:
            buckets.append(bucket)
            open_[(grad.device, grad.dtype)] = (bucket, size)
        bucket.append(grad)
        size[0] += grad.numel() * grad.element_size()
    return buckets


def _average(model: Any) -> None:
    """What DDP's reducer does at the last micro-step, once: each gradient divided by the
    world size and all-reduced (summed), bucket by bucket."""
    group = getattr(model, "process_group", None)
    world = dist.get_world_size(group)
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    for bucket in _bucketed(grads, int(getattr(model, "bucket_bytes_cap", 25 * 2**20))):
        flat = _flatten_dense_tensors(bucket)
        flat.div_(world)
        dist.all_reduce(flat, group=group)
        for grad, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            grad.copy_(reduced)


class _DeferredReduction:
    """DDP models that ran a forward as under no_sync() since the last averaging."""

    def __init__(self, record: DdpNoSyncRecord) -> None:
        self.record = record
        self.pending: dict[int, Any] = {}  # id -> model whose gradients are not averaged yet
        self.known: set[int] = set()

    def deferred(self, model: Any) -> None:
        if model.require_backward_grad_sync:  # not inside the script's own no_sync()
            self.record.deferred_forwards += 1
            self.record.site = self.record.site or _site(depth=4)
        self.pending[id(model)] = model
        if id(model) not in self.known:
            self.known.add(id(model))
            self.record.models += 1

    def flush(self, *_: Any) -> None:
        if self.pending:
            for model in self.pending.values():
                _average(model)
            self.pending.clear()
            self.record.reductions += 1


def _ddp_no_sync(seen: RemedyEvidence) -> Callable[[], None]:
    """Every DDP forward as under no_sync(); the gradients averaged once, before the first
    thing that reads them: the optimizer's step, gradient clipping, a GradScaler's unscale_
    (each rank must clip and check for infs on the averaged gradients, as DDP gives them)."""
    seen.ddp_no_sync = DdpNoSyncRecord()
    reduction = _DeferredReduction(seen.ddp_no_sync)

    def around_forward(original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return original(self, *args, **kwargs)
            # DDP reads the flag in forward only (its _pre_forward), as no_sync() sets it.
            reduction.deferred(self)
            syncs, self.require_backward_grad_sync = self.require_backward_grad_sync, False
            try:
                return original(self, *args, **kwargs)
            finally:
                self.require_backward_grad_sync = syncs
        return forward

    def flushed_first(original: Callable[..., Any]) -> Callable[..., Any]:
        def read_grads(*args: Any, **kwargs: Any) -> Any:
            reduction.flush()
            return original(*args, **kwargs)
        return read_grads

    _wrap(DistributedDataParallel, "forward", around_forward)
    register_optimizer_step_pre_hook(reduction.flush)
    for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
        _wrap(owner, "clip_grad_norm_", flushed_first)
        _wrap(owner, "clip_grad_value_", flushed_first)
    _wrap(torch.amp.GradScaler, "unscale_", flushed_first)
    return lambda: None


# --- debug settings off --------------------------------------------------------------------

def _kept_off(record: DebugOffRecord, set_by: str) -> None:
    site = call_site(sys._getframe(2))  # the caller of the wrapper that kept it off
    record.kept_off.append(DebugOff(set_by, site.location if site is not None else None))


def _no_debug(seen: RemedyEvidence) -> Callable[[], None]:
    """Anomaly detection kept off (every way in goes through torch.set_anomaly_enabled),
    CUDA_LAUNCH_BLOCKING unset before CUDA reads it (at its first call, after start-up),
    emit_nvtx() disabled as it is entered. A profiler the script runs is left alone: the
    script reads its results (key_averages, a trace handler), which a disabled one lacks."""
    record = seen.no_debug = DebugOffRecord()
    if launch_blocking():
        record.kept_off.append(DebugOff(f"{LAUNCH_BLOCKING}={os.environ.pop(LAUNCH_BLOCKING)}"))

    def anomaly(original: Callable[..., Any]) -> Callable[..., Any]:
        def set_anomaly_enabled(enabled: bool, *args: Any, **kwargs: Any) -> Any:
            if enabled:
                _kept_off(record, "anomaly detection")
            return original(False, *args, **kwargs)
        return set_anomaly_enabled

    def nvtx(original: Callable[..., Any]) -> Callable[..., Any]:
        def __enter__(self: Any) -> Any:
            if self.enabled:
                _kept_off(record, "torch.autograd.profiler.emit_nvtx()")
                self.enabled = False  # its __exit__ then does nothing either
            return original(self)
        return __enter__

    _wrap(torch, "set_anomaly_enabled", anomaly)
    _wrap(autograd_profiler.emit_nvtx, "__enter__", nvtx)
    return lambda: None


def _nondeterministic(seen: RemedyEvidence) -> Callable[[], None]:
    """torch.use_deterministic_algorithms(True) and cudnn.deterministic = True skipped."""
    record = seen.nondeterministic = DebugOffRecord()

    def algorithms(original: Callable[..., Any]) -> Callable[..., Any]:
        def use_deterministic_algorithms(mode: bool, *args: Any, **kwargs: Any) -> Any:
            if mode:
                _kept_off(record, "torch.use_deterministic_algorithms(True)")
                return None
            return original(mode, *args, **kwargs)
        return use_deterministic_algorithms

    def guard(original: Callable[[object, str, object], None]) -> Callable[..., None]:
        def __setattr__(self: object, name: str, value: object) -> None:
            if name == "deterministic" and value:
                _kept_off(record, "torch.backends.cudnn.deterministic = True")
                return
            original(self, name, value)
        return __setattr__

    _wrap(type(torch.backends.cudnn), "__setattr__", guard)
    _wrap(torch, "use_deterministic_algorithms", algorithms)
    return lambda: None


# --- the CUDA allocator's expandable segments -----------------------------------------------

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"


def _expandable_segments(seen: RemedyEvidence) -> Callable[[], None]:
    """PYTORCH_CUDA_ALLOC_CONF given expandable_segments:True before CUDA's allocator reads
    it (its first allocation): appended to what the environment had, replacing an
    expandable_segments:False there."""
    before = os.environ.get(ALLOC_CONF)
    record = seen.expandable_segments = AllocatorConfRecord(before=before)
    if torch.cuda.is_initialized():
        record.late = True
        return lambda: None
    kept = [o for o in (before or "").split(",") if o and not o.startswith("expandable_segments")]
    os.environ[ALLOC_CONF] = ",".join([*kept, EXPANDABLE])
    record.after = os.environ[ALLOC_CONF]
    return lambda: None


APPLIERS: dict[str, Callable[[RemedyEvidence], Callable[[], None]]] = {
    "tf32": _tf32, "bf16-autocast": _bf16_autocast, "loader": _loader,
    "persistent-workers": _persistent_workers, "pinned": _pinned,
    "no-empty-cache": _no_empty_cache, "fused-optimizer": _fused_optimizer,
    "async-save": _async_save, "fsdp-keep-gathered": _fsdp_keep_gathered,
    "ddp-no-sync": _ddp_no_sync, "compile-model": _compile_model,
    "no-debug": _no_debug, "nondeterministic": _nondeterministic,
    "channels-last": _channels_last, "expandable-segments": _expandable_segments,
    **MEMORY_APPLIERS,
    "larger-batch": _larger_batch,
}
assert set(APPLIERS) == set(REMEDIES), "every declared remedy has an applier"


class Applied:
    """The remedies applied in this process and what each saw; `observe()` at the end."""

    def __init__(self, names: Sequence[str], batch: LargerBatchRecord | None = None) -> None:
        unknown = [n for n in names if n not in APPLIERS]
        if unknown:
            raise ValueError(f"unknown remedy {unknown[0]!r}")
        # The larger batch's record arrives with the plan's ask (its factor, the training
        # loader's line), kept beside what the remedy saw.
        self.evidence = RemedyEvidence(larger_batch=batch if "larger-batch" in names else None)
        self.observers = [APPLIERS[name](self.evidence) for name in names]

    def observe(self) -> RemedyEvidence:
        for observe in self.observers:
            with contextlib.suppress(Exception):
                observe()
        return self.evidence


# --- losses and seed -----------------------------------------------------------------------

class LossLog:
    """The value each backward() starts from, for the first `limit` calls (a scalar loss; a
    GradScaler's scaled loss is the same scale in every run). Reading it is a host sync, so
    only the first calls are read: they fall in the warm-up, before any timed step."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.values: list[float] = []
        if limit > 0:
            _wrap(torch.Tensor, "backward", self._around)

    def _around(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if len(self.values) < self.limit and tensor.numel() == 1:
                self.values.append(float(tensor.detach().float()))
            return original(tensor, *args, **kwargs)
        return backward


def seed_everything(seed: int) -> None:
    """One seed for every run of a --try-fixes (a script that seeds itself overrides it)."""
    random.seed(seed)
    torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)


